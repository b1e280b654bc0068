"""Chapter 11: the Triton kernels against the torch reference backend.

Without CUDA the kernels run in the Triton interpreter (tiny shapes, float32 / float16: the
interpreter's bf16 dot products are wrong). With CUDA the same tests run compiled, and the
``gpu`` tests add bf16 at Qwen3-0.6B's layout and a model-level check.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import os
import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # en: Must happen before the kernel module is imported (Triton reads it when decorating kernels).
    os.environ["TRITON_INTERPRET"] = "1"

import nanovllm.layers.triton_attention as ta  # noqa: E402

if not CUDA and not ta.INTERPRETED:  # imported earlier in this process without the interpreter
    ta = importlib.reload(ta)

from nanovllm.config import Config  # noqa: E402
from nanovllm.layers.attention import Attention, TorchBackend, attention_backend  # noqa: E402
from nanovllm.layers.context import (  # noqa: E402
    reset_context,
    set_context,
    set_decode_context,
    set_prefill_context,
)
from tests.core.test_07_attention import random_tables  # noqa: E402
from tests.core.test_10_engine import save_tiny_llama  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
REF = TorchBackend()
TOL = {torch.float32: 2e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _clean_context():
    reset_context()
    yield
    reset_context()


def nan_cache(num_blocks: int, block_size: int, kv_heads: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    # Unwritten slots hold NaN: a kernel that reads one poisons its output and fails the test.
    return torch.full((num_blocks, block_size, kv_heads, d), float("nan"), dtype=dtype, device=DEVICE)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


# ---------------------------------------------------------------- store

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_store_matches_reference_and_skips_minus_one(dtype: torch.dtype, block_size: int) -> None:
    torch.manual_seed(block_size)
    kv_heads, d, num_tokens, num_blocks = 2, 16, 9, 3
    # k, v as views into a fused projection (token stride larger than kv_heads * d), like the model's.
    fused = torch.randn(num_tokens, 3, kv_heads, d, dtype=dtype, device=DEVICE)
    k, v = fused[:, 1], fused[:, 2]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(DEVICE)
    slots[[2, 5]] = -1
    ours = [nan_cache(num_blocks, block_size, kv_heads, d, dtype) for _ in range(2)]
    ref = [c.clone() for c in ours]
    ta.store_kvcache(k, v, *ours, slots)
    REF.store_kvcache(k, v, *ref, slots)
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    assert ours[0].isnan().sum() == (num_blocks * block_size - (num_tokens - 2)) * kv_heads * d


# ---------------------------------------------------------------- prefill

def run_prefill_case(seed: int, dtype: torch.dtype, block_sizes, groups, max_len: int, heads_kv=(1, 2), d: int = 16):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    block_size, group, kv_heads = rng.choice(block_sizes), rng.choice(groups), rng.choice(heads_kv)
    heads = kv_heads * group
    num_seqs = rng.randint(1, 3)
    total = [rng.randint(1, max_len) for _ in range(num_seqs)]
    # cached prefix: 0, whole blocks, or a partial block (a later chunk of a chunked prefill)
    cached = []
    for n in total:
        kind = rng.choice(["zero", "blocks", "partial"])
        whole = (n - 1) // block_size * block_size
        cached.append(0 if kind == "zero" else whole if kind == "blocks" else rng.randint(0, n - 1))
    tables, num_blocks = random_tables(total, block_size, rng)
    caches = [nan_cache(num_blocks, block_size, kv_heads, d, dtype) for _ in range(2)]
    k_all = [torch.randn(n, kv_heads, d, dtype=dtype, device=DEVICE) for n in total]
    v_all = [torch.randn(n, kv_heads, d, dtype=dtype, device=DEVICE) for n in total]
    # The prefixes are stored by an earlier step (the reference store: store is tested on its own).
    for i in range(num_seqs):
        if cached[i]:
            ctx = set_prefill_context([cached[i]], [cached[i]], [tables[i]], block_size, device=DEVICE)
            REF.store_kvcache(k_all[i][: cached[i]], v_all[i][: cached[i]], *caches, ctx.slot_mapping)
    ctx = set_prefill_context([t - c for t, c in zip(total, cached, strict=True)], total, tables, block_size,
                              device=DEVICE)
    q = torch.randn(ctx.slot_mapping.numel(), heads, d, dtype=dtype, device=DEVICE)
    k = torch.cat([k_all[i][cached[i]:] for i in range(num_seqs)])
    v = torch.cat([v_all[i][cached[i]:] for i in range(num_seqs)])
    ta.store_kvcache(k, v, *caches, ctx.slot_mapping)
    scale = d**-0.5
    out = ta.prefill_attention(q, k, v, *caches, ctx, scale)
    expected = REF.prefill(q, k, v, *caches, ctx, scale)
    close(out, expected, dtype)
    assert out.dtype == dtype and out.shape == q.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill_with_cached_prefix_matches_reference(group: int, block_size: int, dtype: torch.dtype) -> None:
    seed = group * 100 + block_size + (dtype == torch.float16)
    run_prefill_case(seed, dtype, [block_size], [group], max_len=70)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_without_cache_attends_over_given_kv(dtype: torch.dtype) -> None:
    """The warm-up forward: no KV cache, no block tables; attention over the fresh k, v."""
    torch.manual_seed(3)
    layer = Attention(4, 16, 0.25, 2)
    layer.backend = attention_backend("triton")
    set_prefill_context([3, 21], [3, 21], device=DEVICE)
    q = torch.randn(24, 4, 16, dtype=dtype, device=DEVICE)
    fused = torch.randn(24, 2, 2, 16, dtype=dtype, device=DEVICE)  # strided k, v views
    k, v = fused[:, 0], fused[:, 1]
    out = layer(q, k, v)
    empty = torch.tensor([])
    close(out, REF.prefill(q, k, v, empty, empty, set_prefill_context([3, 21], [3, 21], device=DEVICE), 0.25), dtype)
    assert layer.k_cache.numel() == 0


def test_prefill_errors_match_reference() -> None:
    q, kv = torch.randn(2, 2, 16, device=DEVICE), torch.randn(2, 1, 16, device=DEVICE)
    empty = torch.tensor([])
    ctx = set_prefill_context([2], [5], [[0]], 16, device=DEVICE)
    with pytest.raises(ValueError, match="no KV cache"):
        ta.prefill_attention(q, kv, kv, empty, empty, ctx, 0.25)
    ctx = set_context(True, torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32), 2, 5)
    with pytest.raises(ValueError, match="needs block tables"):
        ta.prefill_attention(q, kv, kv, empty, empty, ctx, 0.25)


# ---------------------------------------------------------------- decode

def decode_setup(seed: int, dtype: torch.dtype, block_sizes, groups, max_len: int, d: int = 16, pad_row: bool = True):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    block_size, group, kv_heads = rng.choice(block_sizes), rng.choice(groups), rng.choice([1, 2])
    heads = kv_heads * group
    lens = [rng.randint(1, max_len) for _ in range(rng.randint(1, 3))]
    tables, num_blocks = random_tables(lens, block_size, rng)
    caches = [nan_cache(num_blocks, block_size, kv_heads, d, dtype) for _ in range(2)]
    for n, table in zip(lens, tables, strict=True):
        ctx = set_prefill_context([n], [n], [table], block_size, device=DEVICE)
        REF.store_kvcache(torch.randn(n, kv_heads, d, dtype=dtype, device=DEVICE),
                          torch.randn(n, kv_heads, d, dtype=dtype, device=DEVICE), *caches, ctx.slot_mapping)
    ctx = set_decode_context(lens, tables, block_size, device=DEVICE)
    if pad_row:  # a CUDA-graph padding row: context length 0, block table all -1
        width = ctx.block_tables.shape[1]
        ctx = set_context(False, slot_mapping=torch.cat([ctx.slot_mapping, ctx.slot_mapping.new_tensor([-1])]),
                          context_lens=torch.cat([ctx.context_lens, ctx.context_lens.new_tensor([0])]),
                          block_tables=torch.cat([ctx.block_tables, ctx.block_tables.new_full((1, width), -1)]))
    q = torch.randn(ctx.context_lens.numel(), heads, d, dtype=dtype, device=DEVICE)
    return q, caches, ctx, d**-0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_plain_and_split_match_reference(group: int, block_size: int, dtype: torch.dtype) -> None:
    seed = group * 100 + block_size + (dtype == torch.float16)
    q, caches, ctx, scale = decode_setup(seed, dtype, [block_size], [group], 90)
    expected = REF.decode(q, *caches, ctx, scale)
    plain = ta.decode_attention(q, *caches, ctx, scale, num_splits=1)
    close(plain, expected, dtype)
    assert torch.equal(plain[-1], torch.zeros_like(plain[-1]))  # the padded row
    for splits in (2, 3):
        split = ta.decode_attention(q, *caches, ctx, scale, num_splits=splits)
        close(split, plain, dtype)
        assert torch.equal(split[-1], torch.zeros_like(split[-1]))


def test_decode_errors() -> None:
    q = torch.randn(1, 2, 16, device=DEVICE)
    ctx = set_decode_context([1], [[0]], 16, device=DEVICE)
    with pytest.raises(ValueError, match="needs a KV cache"):
        ta.decode_attention(q, torch.tensor([]), torch.tensor([]), ctx, 0.25)
    cache = torch.zeros(1, 16, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        ta.decode_attention(q, cache, cache, ctx, 0.25, num_splits=0)
    with pytest.raises(ValueError, match="does not fit a cache"):
        ta.decode_attention(torch.randn(1, 3, 16, device=DEVICE), torch.zeros(1, 16, 2, 16, device=DEVICE),
                            torch.zeros(1, 16, 2, 16, device=DEVICE), ctx, 0.25)


def test_split_heuristic() -> None:
    # few programs and a long context: split; many programs or short contexts: plain
    assert ta.choose_num_splits(batch=1, num_kv_heads=8, max_context=8192, num_sms=132) > 1
    assert ta.choose_num_splits(batch=256, num_kv_heads=8, max_context=8192, num_sms=132) == 1
    assert ta.choose_num_splits(batch=17, num_kv_heads=8, max_context=8192, num_sms=132) == 1
    assert ta.choose_num_splits(batch=1, num_kv_heads=8, max_context=128, num_sms=132) == 1
    splits = ta.choose_num_splits(batch=2, num_kv_heads=8, max_context=1 << 20, num_sms=132)
    assert 1 < splits <= 32 and 2 * 8 * splits >= 132
    # never more than four programs per SM: 16 sequences x 8 KV heads on 132 SMs -> 4 slices, not 5
    assert ta.choose_num_splits(batch=16, num_kv_heads=8, max_context=8192, num_sms=132) == 4


# ---------------------------------------------------------------- the layer, and the backends attention_backend builds

def test_layer_through_triton_backend_matches_torch_layer() -> None:
    """A prefill with a prefix, then decode, through Attention layers set to each backend."""
    torch.manual_seed(5)
    layers = {}
    for name in ("torch", "triton"):
        layer = Attention(4, 16, 0.25, 2)
        layer.backend = attention_backend(name)
        layer.k_cache, layer.v_cache = nan_cache(6, 16, 2, 16, torch.float32), nan_cache(6, 16, 2, 16, torch.float32)
        layers[name] = layer
    qkv = (torch.randn(40, 4, 16, device=DEVICE), torch.randn(40, 2, 16, device=DEVICE),
           torch.randn(40, 2, 16, device=DEVICE))
    steps = [((0, 20), set_prefill_context), ((20, 39), set_prefill_context), ((39, 40), set_decode_context)]
    table = [4, 0, 2]
    for (a, b), setter in steps:
        outs = {}
        for name, layer in layers.items():
            if setter is set_prefill_context:
                set_prefill_context([b - a], [b], [table], 16, device=DEVICE)
            else:
                set_decode_context([b], [table], 16, device=DEVICE)
            outs[name] = layer(*(t[a:b] for t in qkv))
        close(outs["triton"], outs["torch"], torch.float32)
    assert torch.equal(layers["triton"].k_cache.nan_to_num(), layers["torch"].k_cache.nan_to_num())


def test_attention_backend_builds_the_kernels_and_cpu_tensors_need_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert isinstance(attention_backend("triton"), ta.TritonBackend)
    if importlib.util.find_spec("flash_attn") is None:  # FlashAttention 4 is imported when its backend is built
        with pytest.raises(ModuleNotFoundError, match="flash_attn"):
            attention_backend("flash-attn")
    monkeypatch.setattr(ta, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ta.store_kvcache(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 4, 1, 4),
                         torch.zeros(1, 4, 1, 4), torch.tensor([0]))


# ---------------------------------------------------------------- launches that fit the GPU

@pytest.mark.parametrize("major,shared_memory,sms,large", [
    (8, 166_912, 108, True),  # an A100
    (8, 101_376, 128, False),  # an RTX 4090 (compute capability 8.9)
    (9, 232_448, 132, True),  # an H200
    (7, 98_304, 80, False),  # a V100: older than the figures measured, it takes 8.x's
])  # fmt: skip
def test_large_prefill_tiles_go_only_to_a_gpu_with_the_shared_memory_for_them(
    major: int, shared_memory: int, sms: int, large: bool
) -> None:
    gpu = SimpleNamespace(major=major, shared_memory_per_block_optin=shared_memory, multi_processor_count=sms)
    assert (ta.choose_prefill_launch(gpu, 128, torch.bfloat16, programs_128=2 * sms) == (128, 128, 8, 3)) is large
    assert ta.choose_prefill_launch(gpu, 128, torch.bfloat16, programs_128=2 * sms - 1) == (64, 64, 4, 3)
    # A torch that does not report the property: the small tiles (they fit the three GPUs the script compiles for).
    unknown = SimpleNamespace(major=major, multi_processor_count=sms)
    assert ta.choose_prefill_launch(unknown, 128, torch.bfloat16, programs_128=1 << 30) == (64, 64, 4, 3)


def test_every_attention_launch_fits_the_shared_memory_of_its_gpu(attention_sass: Callable[..., list[dict]]) -> None:
    """Compiled here for an A100, an RTX 4090 and an H200 (scripts/attention_sass.py --shared-memory): each launch
    the engine picks there asks for no more shared memory than a block of that GPU may use. Before
    choose_prefill_launch checked, an RTX 4090's large prefill asked for 163,840 bytes of its 101,376 and could not
    start."""
    rows = attention_sass("--shared-memory")
    assert {row["gpu"] for row in rows} == {"A100", "RTX 4090", "H200"}
    assert [row for row in rows if row["shared"] > row["limit"]] == []
    # The large tiles were among them, where they fit.
    assert {row["gpu"] for row in rows if row["launch"] == [128, 128, 8, 3]} == {"A100", "H200"}


# ---------------------------------------------------------------- warm-up

def test_warm_up_prefill_launches_every_variant_and_writes_nothing() -> None:
    cache = nan_cache(2, 16, 2, 8, torch.float32)
    before = cache.clone()
    configs = ta.prefill_launch_configs(torch.device(DEVICE), 8, torch.float32)
    assert len(configs) == len(set(configs)) >= 1
    assert ta.warm_up_prefill(4, 2, 8, cache, cache, 8**-0.5) == 2 * len(configs)  # fresh and paged
    assert torch.equal(cache.nan_to_num(), before.nan_to_num())


def compiled_variants(kernel: object) -> int:
    """How many compiled variants a Triton kernel holds (its per-device caches' first entry is the kernel cache)."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


@pytest.mark.gpu
def test_gpu_warm_up_leaves_no_prefill_variant_to_compile() -> None:
    """After warm_up_prefill, prefills of every kind (fresh/paged, small/large grid, any width) compile nothing."""
    dtype, heads, kv_heads, d, bs = torch.bfloat16, 16, 8, 128, 16
    caches = [torch.zeros(400, bs, kv_heads, d, dtype=dtype, device=DEVICE) for _ in range(2)]
    ta.warm_up_prefill(heads, kv_heads, d, *caches, d**-0.5)
    torch.cuda.synchronize()
    before = compiled_variants(ta.prefill_attention_kernel)
    for seqlens_q, seqlens_k in (([3], [3]), ([2000] * 3, [2000] * 3), ([1], [17]), ([5], [20]),
                                 ([1500] * 3, [1700] * 3), ([1], [256])):  # table widths 2, 107, 16
        tables = [list(range(i * 130, i * 130 + -(-k // bs))) for i, k in enumerate(seqlens_k)]
        ctx = set_prefill_context(seqlens_q, seqlens_k, tables, bs, device=DEVICE)
        n = sum(seqlens_q)
        q = torch.randn(n, heads, d, dtype=dtype, device=DEVICE)
        k = torch.randn(n, kv_heads, d, dtype=dtype, device=DEVICE)
        ta.prefill_attention(q, k, k, *caches, ctx, d**-0.5)
    torch.cuda.synchronize()
    assert compiled_variants(ta.prefill_attention_kernel) == before


# ---------------------------------------------------------------- GPU: bf16 at real shapes, the model



@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
def test_gpu_bf16_qwen3_layout(block_size: int) -> None:
    """16 q heads, 8 KV heads, head_dim 128, bf16: store, prefill with prefixes, decode plain/split/auto."""
    rng = random.Random(block_size)
    torch.manual_seed(block_size)
    dtype, heads, kv_heads, d = torch.bfloat16, 16, 8, 128
    total = [rng.randint(1, 1500) for _ in range(5)]
    cached = [rng.choice([0, (n - 1) // block_size * block_size, rng.randint(0, n - 1)]) for n in total]
    decode_lens = [n + 1 for n in total]
    tables, num_blocks = random_tables(decode_lens, block_size, rng)
    caches = [nan_cache(num_blocks, block_size, kv_heads, d, dtype) for _ in range(2)]
    refs = [c.clone() for c in caches]
    for i, c in enumerate(cached):
        if c:
            ctx = set_prefill_context([c], [c], [tables[i]], block_size, device=DEVICE)
            k, v = torch.randn(2, c, kv_heads, d, dtype=dtype, device=DEVICE)
            ta.store_kvcache(k, v, *caches, ctx.slot_mapping)
            REF.store_kvcache(k, v, *refs, ctx.slot_mapping)
    ctx = set_prefill_context([t - c for t, c in zip(total, cached, strict=True)], total, tables, block_size,
                              device=DEVICE)
    n = ctx.slot_mapping.numel()
    q, k, v = torch.randn(n, heads, d, dtype=dtype, device=DEVICE), *torch.randn(2, n, kv_heads, d, dtype=dtype,
                                                                                    device=DEVICE)
    ta.store_kvcache(k, v, *caches, ctx.slot_mapping)
    REF.store_kvcache(k, v, *refs, ctx.slot_mapping)
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(caches, refs, strict=True))
    close(ta.prefill_attention(q, k, v, *caches, ctx, d**-0.5), REF.prefill(q, k, v, *caches, ctx, d**-0.5), dtype)
    ctx = set_decode_context(decode_lens, tables, block_size, device=DEVICE)
    q, k, v = torch.randn(5, heads, d, dtype=dtype, device=DEVICE), *torch.randn(2, 5, kv_heads, d, dtype=dtype,
                                                                                    device=DEVICE)
    ta.store_kvcache(k, v, *caches, ctx.slot_mapping)
    expected = REF.decode(q, *caches, ctx, d**-0.5)
    for splits in (1, 4, 7, None):
        close(ta.decode_attention(q, *caches, ctx, d**-0.5, num_splits=splits), expected, dtype)


@pytest.mark.gpu
def test_gpu_long_context_decode_split_matches_plain() -> None:
    q, caches, ctx, scale = decode_setup(7, torch.bfloat16, [256], [2], 9000, d=128)
    plain = ta.decode_attention(q, *caches, ctx, scale, num_splits=1)
    close(plain, REF.decode(q, *caches, ctx, scale), torch.bfloat16)
    close(ta.decode_attention(q, *caches, ctx, scale, num_splits=16), plain, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_gpu_a_few_sequences_take_short_tiles_and_start_early_and_match(seed: int) -> None:
    """One to three sequences (and a padding row) over a 16-bit cache: 16 or more slices take MANY_SPLITS_BLOCK_N-key
    tiles and, on Hopper, the early start of both kernels; the result is the reference's, and the plain kernel's."""
    # Qwen3-0.6B (8 KV heads), one sequence, a 4,096-token table: the engine's batch-1 step takes this launch.
    assert ta.choose_num_splits(1, 8, 4096, ta._num_sms(torch.device(DEVICE))) >= ta.MANY_SPLITS
    q, caches, ctx, scale = decode_setup(seed, torch.bfloat16, [16, 256], [1, 2, 4], 3000, d=128)
    expected = REF.decode(q, *caches, ctx, scale)
    for splits in (None, ta.MANY_SPLITS, 32):
        close(ta.decode_attention(q, *caches, ctx, scale, num_splits=splits), expected, torch.bfloat16)
    close(ta.decode_attention(q, *caches, ctx, scale, num_splits=1), expected, torch.bfloat16)


def tiny_qwen3_logits(dtype: torch.dtype, backend: str) -> torch.Tensor:
    """The tiny Qwen3 on CUDA: a flat batch with a chunked prefill and a prefix hit, then decode; all logits."""
    from nanovllm.book.tiny_models import build_tiny_model
    from nanovllm.models.loader import build_model

    model = build_model(build_tiny_model("qwen3"), dtype=dtype, device=DEVICE)
    bs = 16
    a = list(range(3, 60))
    seqs = {"A": a, "B": list(range(100, 141)), "C": [*a[:32], 300, 301, 302]}
    tables = {"A": [3, 10, 1, 20], "B": [0, 2, 4], "C": [3, 10, 15]}  # C shares A's first two blocks
    for layer in (m for m in model.modules() if isinstance(m, Attention)):
        layer.backend = attention_backend(backend)
        shape = (24, bs, layer.num_kv_heads, layer.head_dim)
        layer.k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        layer.v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    plan = [([("A", 0, 57), ("B", 0, 20)], False), ([("B", 20, 41), ("C", 32, 35)], False),
            ([("A", 56, 57), ("B", 40, 41), ("C", 34, 35)], True)]
    rows = []
    for parts, decode in plan:
        ids = torch.tensor([t for n, s, e in parts for t in seqs[n][s:e]], device=DEVICE)
        pos = torch.cat([torch.arange(s, e) for _, s, e in parts]).to(DEVICE)
        if decode:
            set_decode_context([e for _, _, e in parts], [tables[n] for n, _, _ in parts], bs, device=DEVICE)
        else:
            set_prefill_context([e - s for _, s, e in parts], [e for _, _, e in parts],
                                [tables[n] for n, _, _ in parts], bs, device=DEVICE)
        with torch.inference_mode():
            rows.append(model.compute_logits(model(ids, pos)).float())
    reset_context()
    return torch.cat(rows)


@pytest.mark.gpu
def test_gpu_tiny_qwen3_forward_triton_equals_torch() -> None:
    """float32: the two backends agree to 1e-3 on the logits; bf16: Triton is no less accurate than torch."""
    reference = tiny_qwen3_logits(torch.float32, "torch")
    torch.testing.assert_close(tiny_qwen3_logits(torch.float32, "triton"), reference, atol=1e-3, rtol=0)
    err_torch = (tiny_qwen3_logits(torch.bfloat16, "torch") - reference).abs().max().item()
    err_triton = (tiny_qwen3_logits(torch.bfloat16, "triton") - reference).abs().max().item()
    assert err_triton <= 1.5 * err_torch + 1e-2, (err_triton, err_torch)


# ---------------------------------------------------------------- FlashAttention 4 (GPU, when installed)

FLASH_ATTN = CUDA and importlib.util.find_spec("flash_attn") is not None and \
    importlib.util.find_spec("flash_attn.cute") is not None
flash = pytest.mark.skipif(not FLASH_ATTN, reason="needs CUDA and FlashAttention 4 (pip install --pre flash-attn-4)")


@pytest.mark.gpu
@flash
@pytest.mark.parametrize("block_size", [16, 64, 128, 256])
def test_gpu_flash_attn_matches_reference(block_size: int) -> None:
    """bf16, Qwen3-0.6B's layout: FlashAttention 4's prefill (without and with cached prefixes) and decode (with a
    padded row, as CUDA graphs pad a batch) against the torch reference. Its contract on the cache: pages no sequence
    uses may hold NaN, but the unwritten rows of a used page must be finite (it loads whole pages when a page is one
    key tile, 128 rows on the H200, and 0 x NaN is NaN); the engine's cache starts as zeros (chapter 09)."""
    from nanovllm.layers.context import Context

    fa = ta.FlashAttnBackend()
    rng = random.Random(block_size)
    torch.manual_seed(block_size)
    dtype, heads, kv_heads, d, scale = torch.bfloat16, 16, 8, 128, 128**-0.5
    # Without a cache: the step's own K and V, packed like q (what a step with no prefix hit computes).
    lens = [1, 17, 300, 1000, 256]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEVICE)
    ctx = Context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    q, k, v = torch.randn(sum(lens), heads, d, dtype=dtype, device=DEVICE), \
        *torch.randn(2, sum(lens), kv_heads, d, dtype=dtype, device=DEVICE)
    empty = torch.empty(0, dtype=dtype, device=DEVICE)
    close(fa.prefill(q, k, v, empty, empty, ctx, scale), REF.prefill(q, k, v, empty, empty, ctx, scale), dtype)
    # With cached prefixes, through the block tables.
    total = [rng.randint(1, 1500) for _ in range(5)]
    cached = [rng.choice([0, (n - 1) // block_size * block_size, rng.randint(0, n - 1)]) for n in total]
    decode_lens = [n + 1 for n in total]
    tables, num_blocks = random_tables(decode_lens, block_size, rng)
    caches = [nan_cache(num_blocks, block_size, kv_heads, d, dtype) for _ in range(2)]
    for cache in caches:
        cache[[block for table in tables for block in table]] = 0.0
    for i, c in enumerate(cached):
        if c:
            ctx = set_prefill_context([c], [c], [tables[i]], block_size, device=DEVICE)
            fa.store_kvcache(*torch.randn(2, c, kv_heads, d, dtype=dtype, device=DEVICE), *caches, ctx.slot_mapping)
    ctx = set_prefill_context([t - c for t, c in zip(total, cached, strict=True)], total, tables, block_size,
                              device=DEVICE)
    n = ctx.slot_mapping.numel()
    q, k, v = torch.randn(n, heads, d, dtype=dtype, device=DEVICE), *torch.randn(2, n, kv_heads, d, dtype=dtype,
                                                                                    device=DEVICE)
    fa.store_kvcache(k, v, *caches, ctx.slot_mapping)
    close(fa.prefill(q, k, v, *caches, ctx, scale), REF.prefill(q, k, v, *caches, ctx, scale), dtype)
    # Decode, then the same batch with a padded row (context length 0, a block table of -1) appended.
    ctx = set_decode_context(decode_lens, tables, block_size, device=DEVICE)
    q, k, v = torch.randn(5, heads, d, dtype=dtype, device=DEVICE), *torch.randn(2, 5, kv_heads, d, dtype=dtype,
                                                                                    device=DEVICE)
    fa.store_kvcache(k, v, *caches, ctx.slot_mapping)
    expected = REF.decode(q, *caches, ctx, scale)
    close(fa.decode(q, *caches, ctx, scale), expected, dtype)
    padded = Context(is_prefill=False, context_lens=torch.cat([ctx.context_lens, ctx.context_lens.new_zeros(1)]),
                     block_tables=torch.cat([ctx.block_tables, torch.full_like(ctx.block_tables[:1], -1)]))
    close(fa.decode(torch.cat([q, torch.randn_like(q[:1])]), *caches, padded, scale)[:5], expected, dtype)


@pytest.mark.gpu
@flash
def test_gpu_tiny_qwen3_forward_flash_attn_is_as_accurate_as_torch() -> None:
    """bf16 logits of chapter 07's scenario (a chunked prefill, a prefix hit, decode): FlashAttention 4 is no less
    accurate than the torch reference, both measured against the torch reference in float32."""
    reference = tiny_qwen3_logits(torch.float32, "torch")
    err_torch = (tiny_qwen3_logits(torch.bfloat16, "torch") - reference).abs().max().item()
    err_flash = (tiny_qwen3_logits(torch.bfloat16, "flash-attn") - reference).abs().max().item()
    assert err_flash <= 1.5 * err_torch + 1e-2, (err_flash, err_torch)


def test_the_engine_picks_the_kernels_on_a_gpu_and_the_reference_on_a_cpu() -> None:
    from nanovllm.config import ATTENTION_BACKENDS, resolve_attention_backend

    assert ATTENTION_BACKENDS == ("torch", "triton", "flash-attn")
    assert resolve_attention_backend("auto", "cuda", "bfloat16") == "triton"
    assert resolve_attention_backend("auto", "cpu", "float32") == "torch"
    assert resolve_attention_backend("torch", "cuda", "bfloat16") == "torch"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_attention_backend("flash", "cuda", "bfloat16")
    assert isinstance(attention_backend("triton"), ta.TritonBackend)
    assert isinstance(attention_backend("torch"), TorchBackend)


# ---------------------------------------------------------------- settings: 'triton' on a CPU, 'flash-attn' on no GPU
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny_llama")


def test_triton_on_cpu_needs_the_interpreter(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        Config.from_kwargs(tiny_llama, device="cpu", attention_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert Config.from_kwargs(tiny_llama, device="cpu", attention_backend="triton").attention_backend == "triton"


def test_flash_attn_backend_needs_a_cuda_gpu(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match=r"attention_backend='flash-attn' needs a CUDA GPU, got device='cpu'"):
        Config.from_kwargs(str(tiny_llama), device="cpu", attention_backend="flash-attn")
