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
