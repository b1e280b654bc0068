"""Chapter 24: the 8-bit KV cache (kv_cache_dtype="fp8").

The quantization itself; the Triton kernels against the torch reference with the same quantization (in the Triton
interpreter on a CPU, compiled on a GPU); the settings and the KV budget; the engine end to end against
`transformers` whose attention reads the same quantized K/V (chunked prefill, prefix hits, preemption, n > 1 with
copy-on-write, asynchronous scheduling, tensor parallelism over gloo); the provenance fuzz through the real float8
store, copy and gather; and the accuracy on SmolLM2, asserted loosely.
"""

from __future__ import annotations

import importlib
import math
import os
import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported

import nanovllm.layers.triton_attention as ta  # noqa: E402

if not CUDA and not ta.INTERPRETED:  # imported earlier in this process without the interpreter
    ta = importlib.reload(ta)

import nanovllm.engine.model_runner as model_runner  # noqa: E402
import nanovllm.layers.attention as attention_module  # noqa: E402
from nanovllm.book.tiny_models import TINY_VOCAB_SIZE  # noqa: E402
from nanovllm.config import Config, _check_fp8_cache  # noqa: E402
from nanovllm.engine.model_runner import ModelRunner, copy_kv_blocks, kv_block_bytes, kv_cache_summary  # noqa: E402
from nanovllm.layers.attention import TorchBackend  # noqa: E402
from nanovllm.layers.context import reset_context, set_decode_context, set_prefill_context  # noqa: E402
from nanovllm.layers.kv_quant import (  # noqa: E402
    FP8,
    FP8_MAX,
    MIN_SCALE,
    SCALE_BYTES,
    dequantize_kv,
    gather_quantized,
    quantize_kv,
    round_trip,
    values_by_dim,
)
from nanovllm.llm import LLM  # noqa: E402
from nanovllm.sampling_params import SamplingParams  # noqa: E402
from tests.core.test_provenance_fuzz import ProvenanceKV, random_workload  # noqa: E402
from tests.scheduler_sim import RegimesSeen, Violation, simulate  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
REF = TorchBackend()


@pytest.fixture(autouse=True)
def _clean_context():
    reset_context()
    yield
    reset_context()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bytes (float8) or values (scales; NaN, an unwritten scale, equals NaN: no written scale is 0)."""
    return torch.equal(as_bytes(a).nan_to_num(), as_bytes(b).nan_to_num())


def fp8_caches(blocks: int, block_size: int, kv_heads: int, d: int) -> list[torch.Tensor]:
    """k_cache, v_cache (float8, unwritten bytes = 0x7F, e4m3's NaN; values by dimension) and k_scales, v_scales
    (NaN): a kernel that reads an unwritten slot poisons its output. On a CPU only through the scales: the Triton
    interpreter converts the byte 0x7F to 480, not NaN, so the kernels' zeroing of keys read past a slice's end (a
    float8 tile loaded whole) is tested by the GPU runs of these tests."""
    cache = torch.full((blocks, block_size, kv_heads, d), 0x7F, dtype=torch.uint8, device=DEVICE).view(FP8)
    scales = torch.full((blocks, kv_heads, block_size), float("nan"), device=DEVICE)
    return [cache, values_by_dim(cache.clone()), scales, scales.clone()]


# ---------------------------------------------------------------- the quantization


def test_each_row_keeps_its_largest_value_exactly_and_every_value_within_one_e4m3_step() -> None:
    torch.manual_seed(0)
    magnitudes = torch.logspace(-6, 6, 13)[:, None, None]
    x = torch.randn(13, 7, 64) * magnitudes  # rows of very different sizes
    x[0, 0] = 0.0  # an all-zero row
    q, scales = quantize_kv(x)
    assert q.dtype == FP8 and scales.dtype == torch.float32 and scales.shape == x.shape[:-1]
    assert (scales >= MIN_SCALE).all() and q.float().abs().max() <= FP8_MAX
    back = dequantize_kv(q, scales)
    assert torch.equal(back[0, 0], torch.zeros(64)) and scales[0, 0] == MIN_SCALE
    amax = x.abs().amax(-1)
    assert torch.allclose(back.abs().amax(-1), amax, rtol=1e-6, atol=0)  # the largest maps to 448, exactly back
    # e4m3 keeps 3 bits after the leading one: at most half a step, 2^-4 of the value, above the subnormals
    # (values below 2^-6 * scale are rounded to multiples of 2^-9 * scale).
    bound = torch.maximum(x.abs() * 2**-4, scales[..., None] * 2**-10) * (1 + 1e-6)
    assert ((back - x).abs() <= bound).all()
    assert torch.equal(round_trip(back), back)  # what the cache holds survives another trip unchanged
    assert round_trip(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_the_reference_store_writes_rows_and_scales_where_the_slots_say_and_skips_slot_minus_one() -> None:
    torch.manual_seed(1)
    k_cache, v_cache, k_scales, v_scales = fp8_caches(6, 4, 2, 16)
    k, v = torch.randn(5, 2, 16, device=DEVICE) * 9, torch.randn(5, 2, 16, device=DEVICE)
    slots = torch.tensor([13, -1, 2, 23, 8], device=DEVICE)
    REF.store_kvcache(k, v, k_cache, v_cache, slots, k_scales, v_scales)
    qk, sk = quantize_kv(k)
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, 4)
        assert torch.equal(as_bytes(k_cache[block, offset]), as_bytes(qk[row]))
        assert torch.equal(k_scales[block, :, offset], sk[row])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(24) if s not in written]
    assert (as_bytes(k_cache).view(24, -1)[untouched] == 0x7F).all()
    assert k_scales.transpose(1, 2).reshape(24, 2)[untouched].isnan().all()
    # Read back through a block table: position p of the table [3, 0, 5] is slot table[p // 4] * 4 + p % 4.
    table = torch.tensor([3, 0, 5], device=DEVICE)
    got = gather_quantized(k_cache, k_scales, table, 12)
    for position, row in ((1, 0), (11, 3)):  # slot 13 = block 3 offset 1; slot 23 = block 5 offset 3
        assert torch.equal(got[position], dequantize_kv(qk[row], sk[row]))
    assert same(TorchBackend().gather(k_cache, table, 12, k_scales), got)
    # Values are kept by dimension: value i of (slot, head) at v_cache[block, head, i, offset].
    qv, sv = quantize_kv(v)
    assert v_cache.shape == (6, 2, 16, 4)
    assert torch.equal(as_bytes(v_cache[3, :, :, 1]), as_bytes(qv[0])) and torch.equal(v_scales[3, :, 1], sv[0])
    got = gather_quantized(v_cache, v_scales, table, 12, by_dim=True)
    for position, row in ((1, 0), (11, 3)):
        assert torch.equal(got[position], dequantize_kv(qv[row], sv[row]))
    assert same(TorchBackend().gather(v_cache, table, 12, v_scales, by_dim=True), got)


def test_the_kernels_take_the_8_bit_path_when_scales_come_and_refuse_scales_that_do_not_fit_the_cache():
    """The Triton backend knows an 8-bit cache by its scales (it imports nothing of this chapter): scales with a
    16-bit cache, a float8 cache without them, or one scale tensor of the two, are refused."""
    k16 = torch.zeros(3, 4, 2, 16, device=DEVICE)
    k8 = torch.zeros(3, 4, 2, 16, dtype=torch.uint8, device=DEVICE).view(FP8)
    v8 = torch.zeros(3, 2, 16, 4, dtype=torch.uint8, device=DEVICE).view(FP8)
    scales = torch.ones(3, 2, 4, device=DEVICE)
    assert ta._check_cache(k8, v8, scales, scales) is True
    assert ta._check_cache(k16, k16.clone()) is False
    for args in ((k8, v8, None, None), (k16, k16.clone(), scales, scales), (k8, v8, scales, None)):
        with pytest.raises(ValueError, match="only a float8 cache has them"):
            ta._check_cache(*args)


# ---------------------------------------------------------------- the kernels against the reference


def test_the_kernels_round_to_e4m3_exactly_as_torch_converts() -> None:
    """Every finite bfloat16 value up to 460 and random float32 ones: the kernels' rounding gives torch's bytes."""
    import triton
    import triton.language as tl

    @triton.jit
    def convert(x_ptr, y_ptr, N: tl.constexpr):
        offs = tl.program_id(0) * N + tl.arange(0, N)
        tl.store(y_ptr + offs, ta.to_e4m3(tl.load(x_ptr + offs), 1.0))

    every_bf16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    every_bf16 = every_bf16[torch.isfinite(every_bf16) & (every_bf16.abs() <= 460)]
    torch.manual_seed(2)
    randoms = (torch.rand(50_000) - 0.5) * torch.exp2(torch.randint(-24, 10, (50_000,)).float())
    x = torch.cat([every_bf16, randoms, torch.tensor([-0.0, 448.0, -448.0, 455.9, 1e-30, -1e-30])])
    x = torch.cat([x, torch.zeros(-len(x) % 4096)]).to(DEVICE)
    y = torch.empty(len(x), dtype=FP8, device=DEVICE)
    convert[(len(x) // 4096,)](x, y, N=4096)
    assert torch.equal(as_bytes(y), as_bytes(x.to(FP8)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,d", [(1, 16), (3, 24)])
def test_the_round_trip_kernel_gives_the_references_values(dtype: torch.dtype, heads: int, d: int) -> None:
    """What a prefill without a prefix attends to: the Triton round trip equals kv_quant's, bit for bit."""
    torch.manual_seed(7)
    x = (torch.randn(37, heads, d, device=DEVICE) * torch.logspace(-4, 4, 37, device=DEVICE)[:, None, None]).to(dtype)
    x[3] = 0.0  # all-zero rows
    got = ta.round_trip_kv(x)
    assert got.dtype == dtype and torch.equal(got, round_trip(x))
    assert not torch.equal(got, x)  # it did quantize
    assert torch.equal(ta.TritonBackend().round_trip(x[:0]), x[:0])
    with pytest.raises(ValueError, match="tokens, heads, head_dim"):
        ta.round_trip_kv(x[0])


def test_the_float8_kernels_load_their_values_whole_on_an_h200(attention_sass: Callable[..., list[dict]]) -> None:
    """Compiled here for sm_90 (scripts/attention_sass.py): the float8 key loops load no single bytes, from shared
    memory or global memory, and stay near the 16-bit loops' length. With values laid out like the keys the decode
    loaded 128 single bytes from shared memory a thread a tile; with per-key masks and gathers the paged prefill
    loaded 128 from global memory, in a key loop 1.9 times the 16-bit one's. And the float8 decode keeps two buffers
    of each tile, so the next tile loads while this one is used: at 3 stages it kept one."""
    rows = {(row["kernel"], row["cache"]): row for row in attention_sass()}
    assert all(row["one_byte_shared_loads"] == 0 == row["one_byte_global_loads"] for row in rows.values())
    decode, decode16 = rows["decode", "float8"], rows["decode", "16-bit"]
    assert max(decode["loop_instructions"]) < 1.25 * max(decode16["loop_instructions"])
    assert decode["registers"] <= ta.DECODE_MAX_REGISTERS and decode["tile_buffers"] >= 2
    # The prefill's loop over whole tiles (its shorter one; the other masks the diagonal).
    prefill, prefill16 = rows["prefill", "float8"], rows["prefill", "16-bit"]
    assert min(prefill["loop_instructions"]) < 1.5 * min(prefill16["loop_instructions"])


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_heads,d", [(1, 16), (3, 24)])
def test_the_store_kernel_writes_the_references_bytes_and_scales(
    block_size: int, dtype: torch.dtype, kv_heads: int, d: int
) -> None:
    torch.manual_seed(block_size + kv_heads)
    ref, tri = fp8_caches(16, block_size, kv_heads, d), fp8_caches(16, block_size, kv_heads, d)
    n = 10
    # a strided view, as a slice of the fused projection is
    qkv = (torch.randn(n, 3 * kv_heads * d, device=DEVICE) * torch.logspace(-3, 3, n, device=DEVICE)[:, None])
    k, v = (qkv[:, i * kv_heads * d : (i + 1) * kv_heads * d].view(n, kv_heads, d).to(dtype) for i in (1, 2))
    slots = torch.tensor(random.Random(block_size).sample(range(16 * block_size), n), device=DEVICE)
    slots[3] = -1
    REF.store_kvcache(k, v, *ref[:2], slots, *ref[2:])
    ta.store_kvcache(k, v, *tri[:2], slots, *tri[2:])
    assert all(same(a, b) for a, b in zip(ref, tri, strict=True))


def write_sequences(caches: list[torch.Tensor], lengths: dict[str, int], tables: dict[str, list[int]],
                    block_size: int, kv: dict) -> None:
    """Prefill every sequence's tokens into the caches with the reference (the same bytes as the kernel)."""
    for name, n in lengths.items():
        ctx = set_prefill_context([n], [n], [tables[name]], block_size, device=DEVICE)
        REF.store_kvcache(kv[name][0], kv[name][1], *caches[:2], ctx.slot_mapping, *caches[2:])
        reset_context()


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16, 64])  # 64: tiles that start inside a block (the interpreter's are 16)
def test_prefill_over_a_float8_prefix_and_decode_match_the_reference(group: int, block_size: int) -> None:
    torch.manual_seed(group * block_size)
    kv_heads, d = 2, 16
    heads = kv_heads * group
    lengths, new = {"A": 21, "B": 9, "C": 3}, {"A": 5, "B": 9, "C": 1}
    tables = {"A": [7, 2, 5, 0, 9, 11][: -(-21 // block_size)], "B": [3, 8, 1][: -(-9 // block_size)],
              "C": [10]}
    kv = {n: (torch.randn(k, kv_heads, d, device=DEVICE) * 4, torch.randn(k, kv_heads, d, device=DEVICE))
          for n, k in lengths.items()}
    caches = fp8_caches(12, block_size, kv_heads, d)
    write_sequences(caches, lengths, tables, block_size, kv)
    # Prefill: each sequence's last `new` tokens, after a prefix read from the float8 cache (B has none left: paged
    # anyway, since the step has block tables).
    names = list(lengths)
    ctx = set_prefill_context([new[n] for n in names], [lengths[n] for n in names], [tables[n] for n in names],
                              block_size, device=DEVICE)
    q = torch.randn(sum(new.values()), heads, d, device=DEVICE)
    fresh_k = torch.cat([kv[n][0][lengths[n] - new[n]:] for n in names])
    fresh_v = torch.cat([kv[n][1][lengths[n] - new[n]:] for n in names])
    want = REF.prefill(q, fresh_k, fresh_v, *caches[:2], ctx, d**-0.5, *caches[2:])
    got = ta.prefill_attention(q, fresh_k, fresh_v, *caches[:2], ctx, d**-0.5, None, *caches[2:])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    reset_context()
    # Decode, plain and split-K, with a padded row (context 0).
    ctx = set_decode_context([lengths[n] for n in names] + [1], [tables[n] for n in names] + [[4]], block_size,
                             device=DEVICE)
    ctx.context_lens[-1] = 0
    q = torch.randn(4, heads, d, device=DEVICE)
    want = REF.decode(q, *caches[:2], ctx, d**-0.5, *caches[2:])
    for splits in (1, 3):
        got = ta.decode_attention(q, *caches[:2], ctx, d**-0.5, num_splits=splits, k_scales=caches[2],
                                  v_scales=caches[3])
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        assert torch.equal(got[-1], torch.zeros_like(got[-1]))


def test_the_scales_matter_to_the_kernels() -> None:
    """Halving one block's scales changes what the decode kernel computes, as it changes the reference."""
    torch.manual_seed(3)
    caches = fp8_caches(4, 4, 1, 16)
    kv = {"A": (torch.randn(8, 1, 16, device=DEVICE) * 3, torch.randn(8, 1, 16, device=DEVICE))}
    write_sequences(caches, {"A": 8}, {"A": [2, 0]}, 4, kv)
    ctx = set_decode_context([8], [[2, 0]], 4, device=DEVICE)
    q = torch.randn(1, 2, 16, device=DEVICE)
    before = ta.decode_attention(q, *caches[:2], ctx, 16**-0.5, k_scales=caches[2], v_scales=caches[3])
    caches[3][0] /= 2  # V's scales of block 0 (positions 4-7)
    after = ta.decode_attention(q, *caches[:2], ctx, 16**-0.5, k_scales=caches[2], v_scales=caches[3])
    torch.testing.assert_close(after, REF.decode(q, *caches[:2], ctx, 16**-0.5, *caches[2:]), atol=2e-4, rtol=2e-4)
    assert (after - before).abs().max() > 1e-2


def test_a_float8_cache_and_its_scales_go_together() -> None:
    cache, _, scales, _ = fp8_caches(2, 4, 1, 16)
    k = torch.randn(1, 1, 16, device=DEVICE)
    slots = torch.tensor([0], device=DEVICE)
    values = values_by_dim(cache.clone())
    with pytest.raises(ValueError, match="k_scales and v_scales"):
        ta.store_kvcache(k, k, cache, values, slots)
    with pytest.raises(ValueError, match="k_scales and v_scales"):
        ta.store_kvcache(k, k, cache.float(), cache.float(), slots, scales, scales)
    with pytest.raises(ValueError, match=r"float32 \[blocks, kv_heads, block_size\]"):
        ta.store_kvcache(k, k, cache, values, slots, scales.transpose(1, 2), scales.transpose(1, 2))
    # A float8 cache keeps its values by dimension: values laid out like the keys are refused.
    with pytest.raises(ValueError, match=r"the value cache must be \(2, 1, 16, 4\)"):
        ta.store_kvcache(k, k, cache, cache.clone(), slots, scales, scales.clone())
    with pytest.raises(ValueError, match="pass dtype"):
        ta.warm_up_prefill(2, 1, 16, cache, values, 0.25, None, scales, scales.clone())
    caches = fp8_caches(2, 4, 1, 16)
    assert ta.warm_up_prefill(2, 1, 16, *caches[:2], 0.25, torch.float32, *caches[2:]) >= 2


def test_the_fused_qkv_kernel_stores_the_bytes_of_the_separate_store() -> None:
    from nanovllm.layers.fused_qkv import norm_rotate_store
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    from nanovllm.models.qwen3 import Qwen3Attention

    torch.manual_seed(4)
    attention = Qwen3Attention(32, 2, 2, 16, RotaryEmbedding(16, 16, 64, 10000.0)).to(DEVICE)
    fused = fp8_caches(4, 4, 2, 16)
    attention.attn.k_cache, attention.attn.v_cache, attention.attn.k_scales, attention.attn.v_scales = fused
    slots = set_prefill_context([3], [3], [[1, 0]], 4, device=DEVICE).slot_mapping
    qkv = torch.randn(3, 96, device=DEVICE) * 5
    _, k, v = norm_rotate_store(attention, torch.tensor([0, 5, 31], device=DEVICE), qkv)
    separate = fp8_caches(4, 4, 2, 16)
    REF.store_kvcache(k, v, *separate[:2], slots, *separate[2:])
    assert all(same(a, b) for a, b in zip(fused, separate, strict=True))


# ---------------------------------------------------------------- the settings and the budget


def test_kv_cache_dtype_is_checked_and_named(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Config.from_kwargs(tiny, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs attention_backend='triton'"):
        _check_fp8_cache("cuda", "flash-attn")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "an A100")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9.*A100 is 8.0"):
        _check_fp8_cache("cuda", "triton")
    _check_fp8_cache("cpu", "torch")  # the reference runs anywhere
    assert Config.from_kwargs(tiny, kv_cache_dtype="fp8", device="cpu").kv_cache_dtype == "fp8"


def test_the_same_memory_holds_about_twice_the_blocks(tiny: Path) -> None:
    from types import SimpleNamespace

    qwen3_06b = SimpleNamespace(num_key_value_heads=8, num_hidden_layers=28, head_dim=128, hidden_size=1024,
                                num_attention_heads=16)
    bf16, fp8 = kv_block_bytes(qwen3_06b, 256, torch.bfloat16), kv_block_bytes(qwen3_06b, 256, FP8)
    assert bf16 == 2 * 28 * 256 * 8 * 128 * 2 and fp8 == 2 * 28 * 256 * 8 * (128 + SCALE_BYTES)
    assert 1.9 < bf16 / fp8 < 2.0
    # The engine on a CPU budget: float32 K/V against float8 + scales.
    engines = {kv: LLM(str(tiny), kv_cache_dtype=kv, kvcache_block_size=4, kvcache_memory_gb=1 / 1024)
               for kv in ("auto", "fp8")}
    blocks = {kv: llm.config.num_kvcache_blocks for kv, llm in engines.items()}
    hf = engines["auto"].config.hf_config
    for kv, dtype in (("auto", torch.float32), ("fp8", FP8)):
        assert blocks[kv] == 2**20 // kv_block_bytes(hf, 4, dtype)
        runner = engines[kv].model_runner
        assert runner.kv_cache.dtype == dtype and runner.kv_cache.shape[2] == blocks[kv]
        assert (runner.kv_scales is None) == (kv == "auto")
    assert blocks["fp8"] > 3 * blocks["auto"]  # one byte (+ scales) instead of four
    assert engines["fp8"].model_runner.kv_scales.shape == (2, hf.num_hidden_layers, blocks["fp8"],
                                                           hf.num_key_value_heads, 4)
    assert "float8_e4m3fn" in kv_cache_summary(engines["fp8"].config)
    assert f"{blocks['fp8']:,} blocks" in kv_cache_summary(engines["fp8"].config)


# ---------------------------------------------------------------- the engine against transformers


# How far below the reference's best a generated token's logit may be. Quantizing is a step function: a key that
# two correct computations give as x and x(1 + 1e-7) can round to two neighbouring e4m3 values when x sits on a
# rounding boundary, 6 % apart; a tiny random model then moves a logit by up to a few tenths (0.39 seen with
# tensor parallelism, whose all-reduce sums in another order). A missing or misplaced scale moves them by units.
TIE = 0.5


class Fp8Reference:
    """transformers with an attention that reads the K/V an 8-bit cache gives back (round_trip of every key and
    value): the logits a correct engine with kv_cache_dtype="fp8" computes, for any token prefix."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import sdpa_mask

        def fp8_attention(module, query, key, value, attention_mask, **kwargs):
            return sdpa_attention_forward(module, query, round_trip(key), round_trip(value), attention_mask,
                                          **kwargs)

        AttentionInterface.register("nanovllm_fp8", fp8_attention)
        AttentionMaskInterface.register("nanovllm_fp8", sdpa_mask)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="nanovllm_fp8").eval()

    @torch.inference_mode()
    def gaps(self, prompt: list[int], generated: list[int]) -> list[float]:
        """For each generated token: how far its logit is below the best one for its prefix (0: the argmax)."""
        logits = self.model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
        return (logits.max(-1).values - logits[torch.arange(len(generated)), generated]).tolist()

    def misses(self, prompt: list[int], generated: list[int]) -> list[tuple[int, float]]:
        """(step, gap) of each generated token more than TIE below the best one for its prefix."""
        return [(step, round(gap, 3)) for step, gap in enumerate(self.gaps(prompt, generated)) if gap > TIE]

    def check(self, prompts: list[list[int]], generations: list[list[int]]) -> None:
        """Every token near-greedy for its own prefix, and nearly all of them exactly the reference's argmax."""
        gaps = {i: self.gaps(p, g) for i, (p, g) in enumerate(zip(prompts, generations, strict=True))}
        assert {i: [(step, round(x, 3)) for step, x in enumerate(row) if x > TIE] for i, row in gaps.items()
                if max(row, default=0) > TIE} == {}
        every = [x for row in gaps.values() for x in row]
        assert sum(x == 0 for x in every) >= 0.9 * len(every), gaps


@pytest.fixture(scope="module")
def fp8_ref(tiny_arch: Path) -> Fp8Reference:
    return Fp8Reference(tiny_arch)


@pytest.fixture(scope="module")
def fp8_ref_qwen3(tiny: Path) -> Fp8Reference:
    return Fp8Reference(tiny)


def test_the_reference_sees_the_quantization_and_the_check_sees_a_wrong_cache(
    tiny: Path, fp8_ref_qwen3: Fp8Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference is not the unquantized model (its greedy tokens differ from transformers' own), and the
    near-greedy check refuses the tokens of an engine whose cache lost its scales."""
    from transformers import AutoModelForCausalLM

    prompts = prompts_of([10, 9, 11, 6, 12, 1, 17])
    plain = AutoModelForCausalLM.from_pretrained(tiny).eval()
    llm = LLM(str(tiny), kv_cache_dtype="fp8", kvcache_block_size=4, num_kvcache_blocks=64)
    generated = [o["token_ids"] for o in llm.generate(prompts, greedy(10), use_tqdm=False)]
    fp8_ref_qwen3.check(prompts, generated)
    with torch.inference_mode():
        unquantized = [plain.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                      max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, len(p):].tolist()
                       for p in prompts]
    assert unquantized != generated

    def without_scales(cache, scales, block_table, length, by_dim):  # reads float8 values as if every scale were 1
        return gather_quantized(cache, torch.ones_like(scales), block_table, length, by_dim)

    monkeypatch.setattr(attention_module, "gather_quantized", without_scales)
    broken = LLM(str(tiny), kv_cache_dtype="fp8", kvcache_block_size=4, num_kvcache_blocks=64)
    generated = [o["token_ids"] for o in broken.generate(prompts, greedy(10), use_tqdm=False)]
    assert any(fp8_ref_qwen3.misses(p, g) for p, g in zip(prompts, generated, strict=True))


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = 10, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)


def check(llm: LLM, prompts: list[list[int]], fp8_ref: Fp8Reference, max_tokens: int = 10) -> None:
    outputs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    fp8_ref.check(prompts, [o["token_ids"] for o in outputs])


REGIMES = {
    "plain": {"num_kvcache_blocks": 128},
    "chunked prefill": {"num_kvcache_blocks": 128, "max_num_batched_tokens": 7},
    "preemption": {"num_kvcache_blocks": 12},
    "everything": {"num_kvcache_blocks": 24, "max_num_batched_tokens": 9, "max_num_seqs": 3},
}


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("scheduling", [False, True], ids=["sync", "async"])
def test_the_engine_with_an_fp8_cache_follows_transformers_on_the_same_quantized_kv(
    tiny_arch: Path, fp8_ref, regime: str, scheduling: bool
) -> None:
    llm = LLM(str(tiny_arch), kv_cache_dtype="fp8", async_scheduling=scheduling, kvcache_block_size=4,
              **REGIMES[regime])
    seen = RegimesSeen()
    llm.scheduler.observer = seen
    check(llm, prompts_of([10, 9, 11, 6, 12, 1, 17]), fp8_ref)
    assert llm.model_runner.kv_cache.dtype == FP8
    assert (seen.partial > 0) == (regime in ("chunked prefill", "everything"))
    assert (seen.preempted > 0) == (regime in ("preemption", "everything"))


def test_prefix_cache_hits_read_the_float8_blocks_and_their_scales(tiny_arch: Path, fp8_ref) -> None:
    llm = LLM(str(tiny_arch), kv_cache_dtype="fp8", kvcache_block_size=4, num_kvcache_blocks=128)
    shared = prompts_of([12], seed=1)[0]
    check(llm, [shared + tail for tail in prompts_of([3, 6], seed=2)], fp8_ref)
    hits = []
    llm.scheduler.observer = lambda event, data: hits.append(data["cache_hits"]) if event == "schedule" else None
    check(llm, [shared + tail for tail in prompts_of([5, 1, 8], seed=3)] + [shared[:8]], fp8_ref)
    assert any(hits), "the second round must reuse cached prefix blocks"


def test_the_triton_kernels_run_the_engine_like_the_reference(tiny: Path, fp8_ref_qwen3) -> None:
    llm = LLM(str(tiny), kv_cache_dtype="fp8", attention_backend="triton", kvcache_block_size=4,
              num_kvcache_blocks=32, max_num_batched_tokens=8)
    shared = prompts_of([9], seed=4)[0]
    check(llm, [shared, [*shared, 5, 6, 7], prompts_of([3], seed=5)[0]], fp8_ref_qwen3, max_tokens=5)


def samples(outputs: list[dict]) -> list[list[list[int]]]:
    return [[o["token_ids"] for o in output["outputs"]] for output in outputs]


def test_forked_samples_copy_the_scales_with_their_blocks(tiny_arch: Path, fp8_ref,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """n > 1 with copy-on-write: greedy samples follow the reference; seeded samples equal independent requests
    (fork_samples=False); and a copy that leaves the scales behind sends the samples off the reference."""
    settings = {"kv_cache_dtype": "fp8", "kvcache_block_size": 4, "num_kvcache_blocks": 40}
    prompts = prompts_of([10, 7], seed=6)  # prompts that end inside a block: the first write into it copies it
    copies = []
    llm = LLM(str(tiny_arch), **settings)
    llm.scheduler.observer = lambda event, data: copies.extend(
        pair for seq in data["seqs"] for pair in seq.blocks_to_copy) if event == "schedule" else None
    forked = samples(llm.generate(prompts, greedy(9, n=2), use_tqdm=False))
    for prompt, pair in zip(prompts, forked, strict=True):
        assert pair[0] == pair[1]  # two greedy samples read the same blocks
        fp8_ref.check([prompt, prompt], pair)
    assert copies, "the test needs copy-on-write copies"
    seeded = SamplingParams(temperature=0.9, seed=7, n=3, max_tokens=9, ignore_eos=True)
    independent = LLM(str(tiny_arch), fork_samples=False, **settings)
    assert samples(llm.generate(prompts, seeded, use_tqdm=False)) == samples(
        independent.generate(prompts, seeded, use_tqdm=False))

    def copy_without_scales(runner, seqs):
        copy_kv_blocks(runner.kv_cache.view(torch.uint8), [pair for seq in seqs for pair in seq.blocks_to_copy])

    monkeypatch.setattr(model_runner.ModelRunner, "copy_blocks", copy_without_scales)
    broken = LLM(str(tiny_arch), **settings)
    broken.model_runner.kv_scales.fill_(1.0)  # what the copies leave behind: a scale that is not the block's
    forked = samples(broken.generate(prompts, greedy(9, n=2), use_tqdm=False))
    assert any(fp8_ref.misses(p, s) for p, pair in zip(prompts, forked, strict=True) for s in pair)


@pytest.fixture(scope="module")
def tp2_fp8(tiny: Path):
    """One TP=2 engine with an 8-bit cache for both ways of scheduling: a start spawns two ranks, and the engine
    reads async_scheduling at every step (nothing at start-up depends on it)."""
    settings = {"kv_cache_dtype": "fp8", "kvcache_block_size": 4, "num_kvcache_blocks": 12,
                "max_num_batched_tokens": 16}
    with LLM(str(tiny), tensor_parallel_size=2, **settings) as tp2:
        yield tp2


@pytest.mark.parametrize("scheduling", [False, True], ids=["sync", "async"])
def test_tp2_over_gloo_follows_the_reference_with_an_fp8_cache(tp2_fp8: LLM, fp8_ref_qwen3,
                                                                  scheduling: bool) -> None:
    """Each rank quantizes its own heads; a per-(token, head) scale does not depend on how heads are split, so
    TP=2 reads what TP=1 does (up to the all-reduce's rounding): chunked prefill, preemption, prefix hits and forks
    included."""
    shared = prompts_of([11], seed=8)[0]
    prompts = [shared, prompts_of([7], seed=9)[0], [*shared, 9, 10, 11], prompts_of([5], seed=10)[0]]
    seen = RegimesSeen()
    tp2 = tp2_fp8
    assert tp2.is_finished() and tp2.in_flight is None
    tp2.reset_prefix_cache()  # as in a new engine: the first round finds nothing cached
    tp2.config.async_scheduling = scheduling
    tp2.scheduler.observer = seen
    try:
        for _ in range(2):  # the second round finds the first round's blocks in the prefix cache
            outputs = tp2.generate(prompts, greedy(10), use_tqdm=False)
            fp8_ref_qwen3.check(prompts, [o["token_ids"] for o in outputs])
        forked = samples(tp2.generate(prompts[:2], greedy(6, n=2), use_tqdm=False))
        for prompt, pair in zip(prompts[:2], forked, strict=True):
            assert pair[0] == pair[1]
            fp8_ref_qwen3.check([prompt, prompt], pair)
    finally:
        tp2.scheduler.observer = None
    assert seen.partial and seen.preempted and seen.cached, seen


# ---------------------------------------------------------------- provenance through the real float8 cache


def runner_copy(kv: torch.Tensor, scales: torch.Tensor, seqs: list) -> None:
    """The model runner's copy-on-write copies (`ModelRunner.copy_blocks`), on a cache and scales of our own."""
    ModelRunner.copy_blocks(SimpleNamespace(kv_cache=kv, kv_scales=scales), seqs)


class Float8ProvenanceKV(ProvenanceKV):
    """The provenance fuzz with a real float8 cache beside the records: every write stores its record, encoded as a
    K and a V row, through the reference store; every copy-on-write goes through the model runner's copy_blocks;
    every read decodes the records from the cache through the reference gather. A record whose row was copied
    without its scale, or written with another's, decodes to another record."""

    D = 8  # digits 0..3 of the record in base 4 (7 of them), then a marker that sets the row's scale

    def __init__(self, block_size: int, num_blocks: int, copy=runner_copy) -> None:
        super().__init__(block_size)
        shape = (2, 1, num_blocks, block_size, 1, self.D)
        self.kv = torch.zeros(shape, dtype=torch.uint8).view(FP8)
        self.scales = torch.ones(2, 1, num_blocks, 1, block_size)
        self.copy = copy
        self.reads = 0

    def encode(self, record: tuple[int, int]) -> torch.Tensor:
        prefix, position = record
        value = prefix * 64 + position
        assert value < 4**7, "a record beyond the encoding"
        digits = [(value >> (2 * i)) & 3 for i in range(7)]
        return torch.tensor([*digits, 7.0 * 2 ** (value % 9)])  # the marker: the row's largest, 7 * 2^0..8

    def decode(self, rows: torch.Tensor) -> list[tuple[int, int]]:
        digits = rows[:, :7].round().long()
        values = (digits * 4 ** torch.arange(7)).sum(1).tolist()
        markers = torch.log2(rows[:, 7] / 7).round().long().tolist()
        return [(v // 64, v % 64) if m == v % 9 and ((d >= 0) & (d <= 3)).all() else (-1, -1)
                for v, m, d in zip(values, markers, digits, strict=True)]

    def after_schedule(self, sched, seqs, is_prefill: bool) -> None:
        bs = self.bs
        self.copy(self.kv, self.scales, seqs)
        for seq in seqs:  # reads, through the real cache, before this step's writes
            n = seq.num_cached_tokens
            if n:
                table = torch.tensor(seq.block_table)
                rows = TorchBackend().gather(self.kv[0, 0], table, n, self.scales[0, 0])[:, 0]
                self.reads += n
                for pos, got in enumerate(self.decode(rows)):
                    if got != self.record(seq, pos):
                        raise Violation(f"seq {seq.seq_id} reads position {pos} from block {table[pos // bs]}, whose "
                                        f"float8 KV decodes to {got} instead of {self.record(seq, pos)}")
        super().after_schedule(sched, seqs, is_prefill)  # the records, and no write into a shared block
        slots, rows = [], []
        for seq in seqs:
            for pos in range(seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens):
                slots.append(seq.block_table[pos // bs] * bs + pos % bs)
                rows.append(self.encode(self.record(seq, pos)))
        if slots:
            k = torch.stack(rows)[:, None]
            REF.store_kvcache(k, k, self.kv[0, 0], self.kv[1, 0], torch.tensor(slots), self.scales[0, 0],
                              self.scales[1, 0])


def fp8_fuzz(num_workloads: int, seed: int = 20261201, copy=runner_copy) -> tuple[int, int]:
    rng = random.Random(seed)
    reads = copies = 0
    for i in range(num_workloads):
        workload = random_workload(rng)
        kv = Float8ProvenanceKV(workload.block_size, workload.num_blocks, copy)
        try:
            simulate(workload, after_schedule=kv.after_schedule)
        except Violation as error:
            raise Violation(f"workload {i}: {error}\n{workload}") from None
        copies += kv.copies
        reads += kv.reads
    return reads, copies


FP8_WORKLOADS = 500


def test_every_read_of_the_float8_cache_decodes_to_its_own_prefix() -> None:
    reads, copies = fp8_fuzz(FP8_WORKLOADS)
    assert reads > FP8_WORKLOADS and copies > FP8_WORKLOADS // 10


def test_the_fp8_fuzz_detects_a_copy_that_leaves_the_scales_behind() -> None:
    def copy_without_scales(kv, scales, seqs):
        copy_kv_blocks(kv.view(torch.uint8), [pair for seq in seqs for pair in seq.blocks_to_copy])

    with pytest.raises(Violation, match="float8 KV decodes to"):
        fp8_fuzz(FP8_WORKLOADS, copy=copy_without_scales)


# ---------------------------------------------------------------- accuracy on a real model


def test_smollm2_perplexity_with_an_fp8_cache_stays_close_and_does_not_depend_on_chunking() -> None:
    """A slice of the fixed texts (the chapter and python -m nanovllm.bench.kv_cache_accuracy measure all of them):
    within 5 % of the 32-bit cache's perplexity, different from it (the cache really is 8-bit), and the same
    whatever the prefill chunks (every attention reads what the cache holds)."""
    from nanovllm.bench.kv_cache_accuracy import perplexity, text_token_ids
    from nanovllm.book.smollm2 import smollm2_dir

    model = str(smollm2_dir())
    ppl = {}
    for kv in ("auto", "fp8"):
        with LLM(model, kv_cache_dtype=kv, device="cpu", kvcache_block_size=16, num_kvcache_blocks=10) as llm:
            for lang in ("en", "zh"):
                ids = text_token_ids(llm.tokenizer, lang, 160)
                ppl[kv, lang] = perplexity(llm, ids, chunk=80)
                if kv == "fp8" and lang == "en":
                    assert math.isclose(perplexity(llm, ids, chunk=160), ppl[kv, lang], rel_tol=1e-4)
    for lang in ("en", "zh"):
        ratio = ppl["fp8", lang] / ppl["auto", lang]
        assert ratio != 1.0 and abs(ratio - 1) < 0.05, (lang, ppl)
        assert 1 < ppl["auto", lang] < 200, ppl  # a real model on real text


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_bf16_kernels_at_qwen3_layout_match_the_reference(block_size: int) -> None:
    torch.manual_seed(block_size)
    kv_heads, group, d = 8, 2, 128
    lengths = {"A": 700, "B": 37, "C": 1}
    blocks_of = {n: -(-k // block_size) for n, k in lengths.items()}
    ids = iter(random.Random(0).sample(range(sum(blocks_of.values()) + 4), sum(blocks_of.values())))
    tables = {n: [next(ids) for _ in range(b)] for n, b in blocks_of.items()}
    kv = {n: (torch.randn(k, kv_heads, d, device=DEVICE, dtype=torch.bfloat16) * 3,
              torch.randn(k, kv_heads, d, device=DEVICE, dtype=torch.bfloat16)) for n, k in lengths.items()}
    ref = fp8_caches(sum(blocks_of.values()) + 4, block_size, kv_heads, d)
    tri = [t.clone() for t in ref]
    for name, n in lengths.items():
        ctx = set_prefill_context([n], [n], [tables[name]], block_size, device=DEVICE)
        REF.store_kvcache(*kv[name], *ref[:2], ctx.slot_mapping, *ref[2:])
        ta.store_kvcache(*kv[name], *tri[:2], ctx.slot_mapping, *tri[2:])
        reset_context()
    assert all(same(a, b) for a, b in zip(ref, tri, strict=True))  # compiled: the same bytes
    names = list(lengths)
    ctx = set_decode_context([lengths[n] for n in names], [tables[n] for n in names], block_size, device=DEVICE)
    q = torch.randn(3, kv_heads * group, d, device=DEVICE, dtype=torch.bfloat16)
    want = REF.decode(q, *ref[:2], ctx, d**-0.5, *ref[2:]).float()
    for splits in (None, 1, 4):
        got = ta.decode_attention(q, *tri[:2], ctx, d**-0.5, num_splits=splits, k_scales=tri[2], v_scales=tri[3])
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    reset_context()
    ctx = set_prefill_context([64, 37], [700, 37], [tables["A"], tables["B"]], block_size, device=DEVICE)
    q = torch.randn(101, kv_heads * group, d, device=DEVICE, dtype=torch.bfloat16)
    fresh_k = torch.cat([kv["A"][0][636:], kv["B"][0]])
    fresh_v = torch.cat([kv["A"][1][636:], kv["B"][1]])
    want = REF.prefill(q, fresh_k, fresh_v, *ref[:2], ctx, d**-0.5, *ref[2:]).float()
    got = ta.prefill_attention(q, fresh_k, fresh_v, *tri[:2], ctx, d**-0.5, None, *tri[2:])
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_engine_with_graphs_fused_store_and_async_scheduling_follows_the_reference(
    tiny: Path, fp8_ref_qwen3: Fp8Reference
) -> None:
    """CUDA graphs capture the float8 decode (the scales are static tensors, like the cache); the fused q/k/v kernel
    quantizes as it stores; asynchronous scheduling and copy-on-write forks keep the scales with their blocks.
    Both runs, eager and with everything on, must be near-greedy for transformers reading the same quantized K/V.
    (Not equal to each other: a tiny random model's greedy tokens sit on near-ties, and the graphs' padded batches
    split decode differently, so the two runs part on a near-tie after a dozen tokens, as bf16 runs may too.)
    float32, so that the model's own rounding does not blur the check."""
    settings = {"kv_cache_dtype": "fp8", "kvcache_block_size": 16, "num_kvcache_blocks": 64,
                "max_num_batched_tokens": 64, "dtype": "float32"}
    prompts = [*prompts_of([40, 7, 90, 15], seed=11), [*prompts_of([40], seed=11)[0], 4, 5, 6]]
    params = [greedy(24), greedy(24, n=3), greedy(24), greedy(24), greedy(24)]
    for name, extra in {"eager": {"enforce_eager": True, "compile_small_ops": False, "async_scheduling": False},
                        "graphs": {}}.items():
        with LLM(str(tiny), **settings, **extra) as llm:
            assert llm.model_runner.kv_cache.dtype == FP8
            if name == "graphs":
                assert llm.model_runner.graphs is not None and llm.config.async_scheduling
            outputs = llm.generate(prompts, params, use_tqdm=False)
        flat_prompts = [p for p, out in zip(prompts, outputs, strict=True) for _ in out.get("outputs", [out])]
        generations = [o["token_ids"] for out in outputs for o in out.get("outputs", [out])]
        assert len(generations) == 7
        fp8_ref_qwen3.check(flat_prompts, generations)
