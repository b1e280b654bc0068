"""Chapter 14: capture sizes, buckets, padding rows (CPU); graph replay == eager, KV sizing (GPU)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.config import Config
from nanovllm.engine.cuda_graphs import (
    DecodeBuffers,
    DecodeStaging,
    capture_sizes,
    graph_batch_size,
    graphs_unavailable_reason,
)
from nanovllm.engine.model_runner import ModelRunner, prepare_decode
from nanovllm.engine.sequence import Sequence
from nanovllm.layers import fused_qkv  # Triton: interpreted without CUDA (conftest switches it on)
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.context import get_context, reset_context, set_decode_context
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.sampling_params import SamplingParams

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _clean_context():
    reset_context()
    yield
    reset_context()


# ---- CPU: pure functions --------------------------------------------------------------------------


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 7, 8, 15, 16, 17, 40, 64, 100, 512, 513, 2000])
def test_capture_sizes(max_num_seqs: int) -> None:
    sizes = capture_sizes(max_num_seqs)
    top = min(max_num_seqs, 512)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == top
    for size in sizes[:-1]:
        assert size in (1, 2, 4, 8) or size % 16 == 0
    # every power of two up to 16 and every multiple of 16 up to the top is there
    assert {s for s in (1, 2, 4, 8, 16) if s <= top} <= set(sizes)
    assert set(range(16, top + 1, 16)) <= set(sizes)


def test_capture_sizes_for_512() -> None:
    # A bad max_num_seqs is refused by Config (tests/core/test_10_engine.py), before any graph is captured.
    assert capture_sizes(512) == [1, 2, 4, 8, *range(16, 513, 16)]


@pytest.mark.parametrize("max_num_seqs", [1, 5, 40, 512])
def test_bucket_is_the_smallest_size_that_holds_the_batch(max_num_seqs: int) -> None:
    sizes = capture_sizes(max_num_seqs)
    for batch in range(1, sizes[-1] + 1):
        size = graph_batch_size(batch, sizes)
        assert size in sizes and size >= batch
        assert all(s < batch for s in sizes if s < size)
    assert graph_batch_size(sizes[-1] + 1, sizes) is None
    with pytest.raises(AssertionError, match="batch must be >= 1"):
        graph_batch_size(0, sizes)


def test_load_fills_real_rows_and_padding_rows() -> None:
    buffers = DecodeBuffers.allocate(rows=8, max_blocks=4, device="cpu")
    buffers.block_tables.fill_(99)  # stale values from an earlier step must not survive
    ctx = set_decode_context([6, 11, 3], [[3, 8], [0, 1, 5], [2]], block_size=4)
    buffers.load(torch.tensor([7, 8, 9]), torch.tensor([5, 10, 2]), ctx, graph_batch=5)
    assert buffers.input_ids[:5].tolist() == [7, 8, 9, 0, 0]
    assert buffers.positions[:5].tolist() == [5, 10, 2, 0, 0]
    assert buffers.slot_mapping[:5].tolist() == [8 * 4 + 1, 5 * 4 + 2, 2 * 4 + 2, -1, -1]
    assert buffers.context_lens[:5].tolist() == [6, 11, 3, 0, 0]
    assert buffers.block_tables[:5].tolist() == [[3, 8, -1, -1], [0, 1, 5, -1], [2, -1, -1, -1]] + [[-1] * 4] * 2
    assert buffers.context_lens.dtype == torch.int32 and buffers.block_tables.dtype == torch.int32
    # a smaller step afterwards: its padding rows overwrite the previous real rows
    ctx = set_decode_context([2], [[6]], block_size=4)
    buffers.load(torch.tensor([4]), torch.tensor([1]), ctx, graph_batch=2)
    assert buffers.slot_mapping[:2].tolist() == [6 * 4 + 1, -1] and buffers.context_lens[:2].tolist() == [2, 0]
    assert buffers.block_tables[:2].tolist() == [[6, -1, -1, -1], [-1] * 4]


def test_load_asserts_an_overrun_and_bad_sizes() -> None:
    buffers = DecodeBuffers.allocate(rows=4, max_blocks=2, device="cpu")
    wide = set_decode_context([9], [[0, 1, 2]], block_size=4)  # 3 blocks > the buffer's 2
    with pytest.raises(AssertionError, match="longer than max_model_len"):
        buffers.load(torch.tensor([1]), torch.tensor([8]), wide, graph_batch=1)
    ok = set_decode_context([2, 2], [[0], [1]], block_size=4)
    with pytest.raises(AssertionError, match="graph batch"):
        buffers.load(torch.tensor([1, 2]), torch.tensor([1, 1]), ok, graph_batch=1)
    with pytest.raises(AssertionError, match="rows"):
        buffers.load(torch.tensor([1, 2]), torch.tensor([1, 1]), ok, graph_batch=8)


def test_buffers_are_views_of_one_allocation_in_layout_order() -> None:
    buffers = DecodeBuffers.allocate(rows=5, max_blocks=3, device="cpu")
    assert buffers.storage.numel() == DecodeBuffers.nbytes(5, 3) == 5 * (8 + 8 + 8 + 4) + 5 * 3 * 4
    starts = [getattr(buffers, name).data_ptr() - buffers.storage.data_ptr() for name, *_ in DecodeBuffers.LAYOUT]
    assert starts == [0, 40, 80, 120, 140]
    buffers.context_lens[2] = 7  # a write through a field is a write into the storage
    assert buffers.storage[120 + 2 * 4 : 120 + 3 * 4].view(torch.int32).item() == 7
    # a bucket of 2 needs the four one-column fields and two rows of block tables
    assert buffers.prefix_bytes(2) == 140 + 2 * 3 * 4 and buffers.prefix_bytes(5) == buffers.storage.numel()


def _decoding(tokens: list[int], table: list[int]) -> Sequence:
    seq = Sequence(tokens, SamplingParams(temperature=0), block_size=4)
    seq.block_table, seq.num_cached_tokens, seq.num_scheduled_tokens = table, len(tokens) - 1, 1
    return seq


@pytest.mark.parametrize("seed", range(6))
def test_staging_writes_what_prepare_decode_and_load_write(seed: int) -> None:
    """Steps of random sizes on the same buffers: the rows a bucket reads hold the same values either way."""
    generator = torch.Generator().manual_seed(seed)
    rows, max_blocks = 16, 5
    loaded = DecodeBuffers.allocate(rows, max_blocks, device="cpu")
    staged = DecodeBuffers.allocate(rows, max_blocks, device="cpu")
    staging = DecodeStaging(staged, block_size=4)
    sizes = capture_sizes(rows)
    for _ in range(8):
        n = int(torch.randint(1, rows + 1, (), generator=generator))
        seqs = []
        for _ in range(n):
            length = int(torch.randint(1, 4 * max_blocks + 1, (), generator=generator))
            table = torch.randperm(64, generator=generator)[: -(-length // 4)].tolist()
            seqs.append(_decoding(torch.randint(0, 100, (length,), generator=generator).tolist(), table))
        bucket = graph_batch_size(n, sizes)
        loaded.load(*prepare_decode(seqs, 4), get_context(), bucket)
        reset_context()
        staging.stage(seqs, bucket)
        for name, *_ in DecodeBuffers.LAYOUT:
            assert torch.equal(getattr(staged, name)[:bucket], getattr(loaded, name)[:bucket]), name


def test_staging_asserts_what_load_asserts() -> None:
    staging = DecodeStaging(DecodeBuffers.allocate(rows=4, max_blocks=2, device="cpu"), block_size=4)
    ready = [_decoding([1, 2, 3], [0]), _decoding([4, 5], [1])]
    with pytest.raises(AssertionError, match="graph batch"):
        staging.stage(ready, graph_batch=1)
    with pytest.raises(AssertionError, match="rows"):
        staging.stage(ready, graph_batch=8)
    prefill = _decoding([1, 2, 3], [0])
    prefill.num_cached_tokens, prefill.num_scheduled_tokens = 0, 3
    with pytest.raises(AssertionError, match="not ready to decode"):
        staging.stage([prefill], graph_batch=1)


def test_graphs_unavailable_reason() -> None:
    assert graphs_unavailable_reason("cuda", "triton") is None
    assert "enforce_eager" in graphs_unavailable_reason("cuda", "triton", enforce_eager=True)
    assert "CUDA" in graphs_unavailable_reason("cpu", "torch")
    assert "not capture-safe" in graphs_unavailable_reason("cuda", "torch")


def test_compile_small_ops_setting(tiny: Path) -> None:
    if not CUDA:
        assert Config.from_kwargs(tiny).compile_small_ops is False  # auto: off on CPU
    assert Config.from_kwargs(tiny, compile_small_ops=True).compile_small_ops is True
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="compile_small_ops"):
            Config.from_kwargs(tiny, compile_small_ops=bad)


def test_runner_asserts_no_sequence_is_longer_than_max_model_len(tiny: Path) -> None:
    runner = ModelRunner(Config.from_kwargs(tiny, device="cpu", kvcache_block_size=4, num_kvcache_blocks=16,
                                            max_model_len=16))
    seq = Sequence(list(range(17)), SamplingParams(temperature=0), block_size=4)
    seq.block_table, seq.num_cached_tokens, seq.num_scheduled_tokens = [0, 1, 2, 3, 4], 16, 1
    with pytest.raises(AssertionError, match="longer than max_model_len"):
        runner.run([seq], is_prefill=False)


# ---- GPU -------------------------------------------------------------------------------------------


def _prefilled(runner: ModelRunner, lengths: list[int], decode_steps: int, seed: int) -> list[Sequence]:
    """Sequences with disjoint block tables that fit lengths + decode_steps, prefilled through the runner."""
    generator = torch.Generator().manual_seed(seed)
    vocab, block_size = runner.config.hf_config.vocab_size, runner.block_size
    seqs, next_block = [], 0
    for n in lengths:
        seq = Sequence(torch.randint(0, vocab, (n,), generator=generator).tolist(), SamplingParams(temperature=0),
                       block_size=block_size)
        blocks = -(-(n + decode_steps) // block_size)
        seq.block_table, next_block = list(range(next_block, next_block + blocks)), next_block + blocks
        seq.num_scheduled_tokens = n
        seqs.append(seq)
    assert next_block <= runner.kv_cache.shape[2]
    for seq, token in zip(seqs, runner.run(seqs, is_prefill=True), strict=True):
        seq.append_token(token)
    return seqs


def _ready_to_decode(seqs: list[Sequence]) -> None:
    for seq in seqs:
        seq.num_cached_tokens, seq.num_scheduled_tokens = len(seq) - 1, 1


@pytest.fixture(scope="module")
def graph_runner(tiny: Path) -> ModelRunner:
    if not CUDA:
        pytest.skip("needs CUDA")
    config = Config.from_kwargs(tiny, dtype="float32", kvcache_block_size=16, num_kvcache_blocks=256,
                                max_model_len=256, max_num_seqs=32)
    runner = ModelRunner(config)
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8, 16, 32]
    return runner


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3, 5, 16, 17, 32])
def test_gpu_graph_replay_equals_eager(graph_runner: ModelRunner, batch: int) -> None:
    runner = graph_runner
    lengths = [5 + (37 * i) % 60 for i in range(batch)]
    seqs = _prefilled(runner, lengths, decode_steps=4, seed=batch)
    graphs = runner.graphs
    for _ in range(4):
        _ready_to_decode(seqs)
        # the forward itself: same hidden states from the model and from the replayed graph
        input_ids, positions = prepare_decode(seqs, runner.block_size, runner.device)
        with torch.inference_mode():
            eager_hidden = runner.model(input_ids, positions)
            graph_hidden = graphs.replay(input_ids, positions, get_context()).clone()
        reset_context()
        torch.testing.assert_close(graph_hidden, eager_hidden, atol=1e-4, rtol=1e-4)
        # the whole step: same tokens with the graphs switched off and on
        runner.graphs = None
        try:
            eager_tokens = runner.run(seqs, is_prefill=False)
        finally:
            runner.graphs = graphs
        graph_tokens = runner.run(seqs, is_prefill=False)
        assert graph_tokens == eager_tokens
        for seq, token in zip(seqs, graph_tokens, strict=True):
            seq.append_token(token)


@pytest.mark.gpu
def test_gpu_batch_beyond_the_largest_graph_runs_eagerly(tiny: Path) -> None:
    config = Config.from_kwargs(tiny, dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64,
                                max_model_len=128, max_num_seqs=4)
    runner = ModelRunner(config)
    assert runner.graphs.sizes == [1, 2, 4] and not runner.graphs.covers(6)
    seqs = _prefilled(runner, [7, 20, 33, 9, 14, 50], decode_steps=1, seed=0)
    _ready_to_decode(seqs)
    replays = []
    graph = runner.graphs.graphs[4]
    original = graph.replay
    graph.replay = lambda: replays.append(1) or original()
    try:
        tokens = runner.run(seqs, is_prefill=False)
    finally:
        graph.replay = original
    assert replays == [] and len(tokens) == 6
    # the block-table buffer is sized from max_model_len: 128 / 16 = 8 columns
    assert runner.graphs.buffers.block_tables.shape == (4, 8)


def test_compile_small_ops_runs_every_small_op_through_its_compiled_version(tiny: Path, monkeypatch) -> None:
    """On a CPU, a stand-in for torch.compile records what the model calls: every RMSNorm, SiluAndMul and
    Qwen3 attention module must run the function torch.compile returned, not the eager one."""
    calls: dict[str, int] = {}

    def recording_compile(fn, **kwargs):
        assert kwargs == {"dynamic": True}

        def compiled(*args):
            calls[fn.__name__] = calls.get(fn.__name__, 0) + 1
            return fn(*args)

        return compiled

    monkeypatch.setattr(torch, "compile", recording_compile)
    config = Config.from_kwargs(tiny, device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=32,
                                max_model_len=128, max_num_seqs=4, enforce_eager=True, compile_small_ops=True)
    runner = ModelRunner(config)
    assert calls == {}  # nothing ran yet (a CPU runner does no warm-up forward)
    _prefilled(runner, [9, 30], decode_steps=0, seed=3)
    kinds = (RMSNorm, SiluAndMul, RotaryEmbedding)
    small = [m for m in runner.model.modules() if isinstance(m, kinds)]
    attention = [m for m in runner.model.modules() if hasattr(m, "fused_input")]
    assert small and attention
    assert all(m.op is not type(m).op for m in small)
    # The fused q/k/v kernel is Triton and handed down on a GPU only: on a CPU the q/k norms and the rotary
    # embedding run through their compiled ops.
    assert all(m.fused_input is None for m in attention)
    assert calls.keys() == {"rms_norm", "silu_and_mul", "rotary"}, calls


@pytest.mark.gpu
def test_gpu_compiled_small_ops_match_eager(tiny: Path) -> None:
    from torch._dynamo.utils import counters

    logits = {}
    for compiled in (False, True):
        config = Config.from_kwargs(tiny, dtype="float32", kvcache_block_size=16, num_kvcache_blocks=32,
                                    max_model_len=128, max_num_seqs=4, enforce_eager=True, compile_small_ops=compiled)
        torch._dynamo.reset()
        counters.clear()
        runner = ModelRunner(config)
        seqs = _prefilled(runner, [9, 30, 17], decode_steps=1, seed=3)
        _ready_to_decode(seqs)
        input_ids, positions = prepare_decode(seqs, runner.block_size, runner.device)
        with torch.inference_mode():
            logits[compiled] = runner.model.compute_logits(runner.model(input_ids, positions))
        reset_context()
        # Something was compiled exactly when asked (RMSNorm, SiluAndMul, the rotary embedding), and every
        # attention layer got the fused q/k/v kernel.
        graphs = counters["stats"]["unique_graphs"]
        assert graphs >= 3 if compiled else graphs == 0, graphs
        fused = [m.fused_input for m in runner.model.modules() if hasattr(m, "fused_input")]
        assert fused and all((f is not None) == compiled for f in fused)
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_kv_sizing_stays_within_the_memory_budget(tmp_path: Path) -> None:
    # A model whose KV blocks are big enough that the budget, not max_useful_blocks, sets the count.
    model = build_tiny_model("qwen3", tmp_path / "wide-kv", num_key_value_heads=2, num_attention_heads=4,
                             head_dim=64, max_position_embeddings=40960)
    gc.collect()
    torch.cuda.empty_cache()
    utilization = 0.05
    config = Config.from_kwargs(model, dtype="float32", kvcache_block_size=16, max_model_len=40960,
                                max_num_seqs=128, gpu_memory_utilization=utilization)
    runner = ModelRunner(config)
    from nanovllm.engine.model_runner import max_useful_blocks

    assert config.num_kvcache_blocks < max_useful_blocks(config)  # the budget decided
    # the largest prefill the scheduler may send, then a decode step, with the cache in place
    seqs = _prefilled(runner, [config.max_num_batched_tokens - 1], decode_steps=1, seed=0)
    _ready_to_decode(seqs)
    runner.run(seqs, is_prefill=False)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    assert total - free <= total * utilization, f"{(total - free) / 2**30:.2f} GiB used > budget"


def test_paged_prefill_warm_up_runs_and_touches_only_the_first_block(tiny: Path) -> None:
    runner = ModelRunner(Config.from_kwargs(tiny, device="cpu", kvcache_block_size=4, num_kvcache_blocks=4))
    runner.kv_cache.fill_(7.0)
    runner.compile_paged_prefill()
    # block 0, slot 1 of every layer now holds the warm-up token's K/V; every other slot is untouched
    changed = (runner.kv_cache != 7.0).any(dim=(-1, -2))  # [2, layers, blocks, block_size]
    assert changed[:, :, 0, 1].all() and changed.sum() == changed[:, :, 0, 1].numel()


# ---- the fused q/k/v kernel (Triton; interpreted on CPU) ---------------------------------------------


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else []))
@pytest.mark.parametrize("with_cache", [True, False], ids=["store", "no-cache"])
def test_fused_qkv_kernel_matches_the_layers_and_the_store(qk_norm: bool, dtype: torch.dtype,
                                                           with_cache: bool) -> None:
    """norm_rotate_store == chapter 06's norm_and_rotate + chapter 07's store; slot -1 and other slots untouched."""
    from nanovllm.layers.context import set_context
    from nanovllm.models.qwen3 import Qwen3Attention

    device = "cuda" if CUDA else "cpu"
    torch.manual_seed(0)
    heads, kv_heads, d, tokens, block_size = 4, 2, 16, 7, 4
    attention = Qwen3Attention(64, heads, kv_heads, d, RotaryEmbedding(d, d, 64, 10000.0), qk_norm=qk_norm)
    attention = attention.to(device=device, dtype=dtype)
    if qk_norm:
        for norm in (attention.q_norm, attention.k_norm):
            norm.weight.data.uniform_(0.5, 1.5)
    layer = attention.attn
    if with_cache:
        layer.k_cache, layer.v_cache = torch.full((2, 5, block_size, kv_heads, d), float("nan"), dtype=dtype,
                                                  device=device).unbind(0)
    slots = torch.tensor([4, 5, -1, 9, 13, 2, 19], device=device)
    set_context(True, slot_mapping=slots)
    positions = torch.tensor([0, 1, 2, 40, 41, 63, 7], device=device)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, dtype=dtype, device=device)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q_ref, k_ref = attention.norm_and_rotate(positions, q.reshape(tokens, heads, d), k.reshape(tokens, kv_heads, d))
    expected = [c.clone() for c in (layer.k_cache, layer.v_cache)]
    if with_cache:
        layer.backend.store_kvcache(k_ref, v.reshape(tokens, kv_heads, d), *expected, slots)
    got_q, got_k, got_v = fused_qkv.norm_rotate_store(attention, positions, qkv)
    # float32 maths inside the kernel, eager rounding of each op in the layers: about one unit in the last place.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got_q, q_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(got_k, k_ref, rtol=tol, atol=tol)
    assert torch.equal(got_v, v.reshape(tokens, kv_heads, d))
    for got, want in zip((layer.k_cache, layer.v_cache), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)


def test_fused_qkv_is_refused_for_a_partial_rotary_embedding() -> None:
    from nanovllm.models.qwen3 import Qwen3Attention

    assert fused_qkv.can_fuse(Qwen3Attention(64, 4, 2, 16, RotaryEmbedding(16, 16, 64, 10000.0)))
    assert not fused_qkv.can_fuse(Qwen3Attention(64, 4, 2, 16, RotaryEmbedding(16, 8, 64, 10000.0)))


@pytest.mark.gpu
def test_gpu_staged_decode_with_async_scheduling_matches_the_eager_engine(tiny: Path, monkeypatch) -> None:
    """The staged path (chapter 18) under async scheduling: sequences of different lengths finish at different
    steps, so both the one-copy pending tokens and the gather run; the tokens are the eager engine's."""
    if not CUDA:
        pytest.skip("needs CUDA")
    from nanovllm.engine.model_runner import SampledTokens
    from nanovllm.llm import LLM

    prompts = [[3 + i for i in range(n)] for n in (5, 17, 40, 9)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 7, 19, 44)]
    gathers = []
    real_gather = SampledTokens.input_ids_for
    monkeypatch.setattr(SampledTokens, "input_ids_for", lambda *args: gathers.append(1) or real_gather(*args))
    tokens, stages = {}, {}
    for eager in (True, False):
        llm = LLM(str(tiny), dtype="float32", enforce_eager=eager, async_scheduling=not eager, kvcache_block_size=16,
                  num_kvcache_blocks=64, max_model_len=256, max_num_seqs=8)
        try:
            runner = llm.model_runner
            if not eager:
                def counted(seqs, previous, stage=runner.replay_staged):
                    stages[len(seqs)] = stages.get(len(seqs), 0) + 1
                    return stage(seqs, previous)

                runner.replay_staged = counted
            tokens[eager] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.exit()
    assert tokens[False] == tokens[True]
    assert sorted(stages) == [1, 2, 3, 4] and gathers  # every batch size staged, and the gather ran too
