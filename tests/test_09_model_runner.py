"""Chapter 09: step inputs, KV cache sizing and the model runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nanovllm.config import Config
from nanovllm.engine.model_runner import (
    NOT_SAMPLED,
    ModelRunner,
    allocate_kv,
    kv_block_bytes,
    max_useful_blocks,
    num_kv_blocks,
    prepare_decode,
    prepare_prefill,
)
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.attention import TorchBackend
from nanovllm.layers.context import get_context, reset_context
from nanovllm.layers.sampler import NON_FINITE
from nanovllm.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def _clean_context():
    reset_context()
    yield
    reset_context()


def scheduled(tokens: list[int], table: list[int], cached: int, count: int, block_size: int = 4) -> Sequence:
    seq = Sequence(tokens, SamplingParams(temperature=0), block_size=block_size)
    seq.block_table, seq.num_cached_tokens, seq.num_scheduled_tokens = table, cached, count
    return seq


def test_prefill_of_new_sequences_needs_no_block_tables() -> None:
    a, b = scheduled([1, 2, 3], [4], 0, 3), scheduled([5, 6, 7, 8, 9], [0, 2], 0, 5)
    ids, pos = prepare_prefill([a, b], block_size=4)
    ctx = get_context()
    assert ids.tolist() == [1, 2, 3, 5, 6, 7, 8, 9] and pos.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert ctx.is_prefill and ctx.cu_seqlens_q.tolist() == ctx.cu_seqlens_k.tolist() == [0, 3, 8]
    assert ctx.max_seqlen_q == ctx.max_seqlen_k == 5
    assert ctx.slot_mapping.tolist() == [16, 17, 18, 0, 1, 2, 3, 8]
    assert ctx.block_tables is None


def test_a_chunk_after_cached_tokens_sees_its_prefix_and_writes_only_its_slots() -> None:
    seq = scheduled(list(range(10, 24)), [7, 1, 3, 5], cached=6, count=5)
    ids, pos = prepare_prefill([seq], block_size=4)
    ctx = get_context()
    assert ids.tolist() == [16, 17, 18, 19, 20] and pos.tolist() == [6, 7, 8, 9, 10]
    assert ctx.cu_seqlens_q.tolist() == [0, 5] and ctx.cu_seqlens_k.tolist() == [0, 11]
    assert ctx.slot_mapping.tolist() == [1 * 4 + 2, 1 * 4 + 3, 3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2]
    assert ctx.block_tables.tolist() == [[7, 1, 3, 5]]


def test_warmup_prefill_stores_nothing() -> None:
    seq = scheduled([1, 2, 3], [], 0, 3)
    prepare_prefill([seq], block_size=4, with_cache=False)
    assert get_context().slot_mapping is None and get_context().block_tables is None


def test_decode_inputs() -> None:
    a = scheduled([1] * 6, [3, 8], 5, 1)
    b = scheduled([2] * 9, [0, 1, 5], 8, 1)
    ids, pos = prepare_decode([a, b], block_size=4)
    ctx = get_context()
    assert ids.tolist() == [1, 2] and pos.tolist() == [5, 8]
    assert not ctx.is_prefill and ctx.context_lens.tolist() == [6, 9]
    assert ctx.slot_mapping.tolist() == [8 * 4 + 1, 5 * 4 + 0]
    assert ctx.block_tables.tolist() == [[3, 8, -1], [0, 1, 5]]


def test_inputs_assert_sequences_in_the_right_state() -> None:
    with pytest.raises(AssertionError, match="no scheduled tokens"):
        prepare_prefill([scheduled([1, 2], [0], 0, 0)], block_size=4)
    with pytest.raises(AssertionError, match="not ready to decode"):
        prepare_decode([scheduled([1, 2, 3], [0], 0, 1)], block_size=4)


def test_block_count_rules(tiny: Path) -> None:
    config = Config.from_kwargs(tiny, kvcache_block_size=4, max_model_len=64, max_num_seqs=2)
    hf = config.hf_config
    block = kv_block_bytes(hf, 4, torch.float32)
    assert block == 2 * hf.num_hidden_layers * 4 * hf.num_key_value_heads * hf.head_dim * 4
    assert kv_block_bytes(hf, 4, torch.bfloat16) == block // 2
    assert kv_block_bytes(hf, 4, torch.float32, tensor_parallel_size=2) == block // 2
    assert max_useful_blocks(config) == 2 * 16
    assert num_kv_blocks(config, block, available_bytes=10 * block + 7) == 10
    assert num_kv_blocks(config, block, available_bytes=10**9) == 32  # capped: never more than usable
    with pytest.raises(ValueError, match="no room for a single KV block"):
        num_kv_blocks(config, block, available_bytes=block - 1)
    fixed = Config.from_kwargs(tiny, kvcache_block_size=4, num_kvcache_blocks=5)
    assert num_kv_blocks(fixed, block, available_bytes=0) == 5
    budget = Config.from_kwargs(tiny, kvcache_block_size=4, kvcache_memory_gb=block * 3 / 2**30)
    assert num_kv_blocks(budget, block) == 3


@pytest.mark.parametrize("setting", ["num_kvcache_blocks", "kvcache_memory_gb"])
def test_a_pool_the_machine_cannot_hold_names_the_setting(setting: str) -> None:
    shape = (2, 28, 10**8, 16, 8, 128)  # 2.4 PiB of float16
    with pytest.raises(ValueError, match=rf"KV cache of 100000000 blocks needs .* GiB, more than .*; lower {setting}"):
        allocate_kv(shape, torch.float16, torch.device("cpu"), setting)
    assert allocate_kv((2, 1, 3, 4, 1, 2), torch.float16, torch.device("cpu"), setting).shape == (2, 1, 3, 4, 1, 2)


def test_runner_allocates_one_tensor_with_per_layer_views(tiny: Path) -> None:
    config = Config.from_kwargs(tiny, kvcache_block_size=8, num_kvcache_blocks=6)
    runner = ModelRunner(config)
    hf = config.hf_config
    assert tuple(runner.kv_cache.shape) == (2, hf.num_hidden_layers, 6, 8, hf.num_key_value_heads, hf.head_dim)
    assert len(runner.attention_layers) == hf.num_hidden_layers
    for i, layer in enumerate(runner.attention_layers):
        assert layer.k_cache.data_ptr() == runner.kv_cache[0, i].data_ptr()
        assert layer.v_cache.data_ptr() == runner.kv_cache[1, i].data_ptr()
        assert layer.backend is runner.attention  # one backend object, built once, handed to every layer
    assert isinstance(runner.attention, TorchBackend)
    assert config.num_kvcache_blocks == 6


def test_run_samples_only_rows_that_finish_their_prompt(tiny: Path) -> None:
    runner = ModelRunner(Config.from_kwargs(tiny, kvcache_block_size=4, num_kvcache_blocks=16))
    whole = scheduled([3, 4, 5], [0], 0, 3)
    chunk = scheduled(list(range(20, 30)), [1, 2, 3], 0, 6)
    tokens = runner.run([whole, chunk], is_prefill=True)
    assert tokens[1] == NOT_SAMPLED and 0 <= tokens[0] < 512


def test_seeded_rows_draw_by_their_own_position(tiny: Path) -> None:
    runner = ModelRunner(Config.from_kwargs(tiny, kvcache_block_size=4, num_kvcache_blocks=16))
    params = SamplingParams(temperature=1.5, seed=7)

    def draw(extra_rows: int) -> int:
        seqs = [scheduled([9, 8, 7, 6, 5], [0, 1], 0, 5)]
        seqs[0].sampling_params = params
        seqs += [scheduled([1 + i, 2], [4 + i], 0, 2) for i in range(extra_rows)]
        return runner.run(seqs, is_prefill=True)[0]

    assert draw(0) == draw(3)


# ---- pending tokens: launch, SampledTokens (asynchronous scheduling, chapter 18) ----------------
def test_write_pending_writes_what_input_ids_for_returns(monkeypatch) -> None:
    from nanovllm.engine.model_runner import SampledTokens
    from nanovllm.engine.sequence import PENDING_TOKEN

    def step_of(*tokens: list[int]) -> list[Sequence]:
        seqs = [scheduled(t, [i], cached=len(t) - 1, count=1) for i, t in enumerate(tokens)]
        for seq in seqs:
            seq.token_ids[-1] = PENDING_TOKEN
        return seqs

    a, b, c = step_of([5, 6, 7], [9, 10], [12, 13, 14])
    # The usual step: the sequences the previous step sampled, in its order, all pending (one marked NON_FINITE).
    previous = SampledTokens.start([a, b, c], [0, 1, 2], torch.tensor([70, NON_FINITE, 90]))
    expected = previous.input_ids_for([a, b, c], torch.full((3,), PENDING_TOKEN))
    with monkeypatch.context() as patch:
        patch.setattr(SampledTokens, "input_ids_for", lambda *args: pytest.fail("the usual step took the gather"))
        written = torch.full((3,), PENDING_TOKEN)
        previous.write_pending([a, b, c], written)
    assert written.tolist() == expected.tolist() == [70, 0, 90]
    # Any other step (a finished in between and c's token is known) takes the gather, with the same result.
    c.token_ids[-1] = 14
    written = torch.tensor([PENDING_TOKEN, 14])
    previous.write_pending([b, c], written)
    assert written.tolist() == [0, 14]
    reordered = torch.full((2,), PENDING_TOKEN)
    c.token_ids[-1] = PENDING_TOKEN
    previous.write_pending([c, a], reordered)
    assert reordered.tolist() == [90, 70]


def test_a_pending_input_token_comes_from_the_previous_step(tiny: Path) -> None:
    from nanovllm.engine.model_runner import SampledTokens
    from nanovllm.engine.sequence import PENDING_TOKEN

    a = scheduled([5, 6, 7, 8], [0, 1], cached=3, count=1)
    b = scheduled([9, 10, 11], [2], cached=2, count=1)
    c = scheduled([12, 13], [3], cached=1, count=1)
    # The previous step sampled c (row 0) and a (row 1); b's last token is known.
    a.token_ids[-1] = c.token_ids[-1] = PENDING_TOKEN
    previous = SampledTokens.start([c, b, a], [0, 2], torch.tensor([70, 80]))
    input_ids, positions = prepare_decode([a, b, c], 4, "cpu")
    reset_context()
    assert previous.input_ids_for([a, b, c], input_ids).tolist() == [80, 11, 70] and positions.tolist() == [3, 2, 1]
    assert previous.token_ids() == [70, NOT_SAMPLED, 80]
    # A sample the sampler marked NON_FINITE (chapter 08) must not reach the embedding as -2.
    marked = SampledTokens.start([c, b, a], [0, 2], torch.tensor([NON_FINITE, 80]))
    assert marked.input_ids_for([a, b, c], input_ids).tolist() == [80, 11, 0]
    assert marked.token_ids() == [NON_FINITE, NOT_SAMPLED, 80]  # the host still sees the mark
    orphan = SampledTokens.start([b], [0], torch.tensor([1]))
    with pytest.raises(AssertionError, match="not one this step samples"):
        orphan.input_ids_for([a], input_ids[:1])
    runner = ModelRunner(Config.from_kwargs(tiny, device="cpu", kvcache_block_size=4, num_kvcache_blocks=8))
    with pytest.raises(AssertionError, match="still pending"):
        runner.compute_logits([a, b, c], is_prefill=False)  # who computes a's token?
    assert get_context().slot_mapping is None  # the context was reset
    pending = scheduled([1, 2], [0], cached=0, count=3)
    pending.append_pending_token()
    with pytest.raises(AssertionError, match="before its last token"):
        runner.launch([pending], is_prefill=True)


def test_launch_then_token_ids_equals_run(tiny: Path) -> None:
    runner = ModelRunner(Config.from_kwargs(tiny, device="cpu", kvcache_block_size=4, num_kvcache_blocks=8))
    tokens = {}
    for how in ("run", "launch"):
        seq = scheduled([3, 4, 5, 6, 7], [0, 1], cached=0, count=5)
        tokens[how] = runner.run([seq], True) if how == "run" else runner.launch([seq], True).token_ids()
    assert tokens["run"] == tokens["launch"] and tokens["run"][0] >= 0


def test_a_forked_sibling_samples_from_its_own_row_next_to_a_partial_chunk(tiny: Path) -> None:
    """A step with a finished prompt that forks (n = 2) and a partial chunk: two picks for two rows, but not
    rows 0 and 1. The sibling's first token comes from the finished prompt's row, never the chunk's."""
    runner = ModelRunner(Config.from_kwargs(tiny, device="cpu", kvcache_block_size=4, num_kvcache_blocks=16))
    done = Sequence(list(range(5, 14)), SamplingParams(temperature=0, n=2), block_size=4)
    chunk = Sequence(list(range(40, 60)), SamplingParams(temperature=0), block_size=4)
    done.block_table, chunk.block_table = [0, 1, 2], [3, 4, 5, 6, 7]
    done.num_scheduled_tokens, chunk.num_scheduled_tokens = len(done), 8  # the chunk stops short
    tokens = runner.launch([done, chunk], True).token_ids()
    assert tokens[1] == NOT_SAMPLED and len(tokens) == 3  # the chunk's row, then the sibling's extra sample
    assert tokens[2] == tokens[0], tokens  # greedy: the sibling's first token is the prompt's
