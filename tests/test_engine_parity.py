"""The engine against transformers greedy decoding on the tiny models, under every scheduling regime."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.tiny_models import TINY_VOCAB_SIZE, build_tiny_model

MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny(request: pytest.FixtureRequest) -> Path:
    return build_tiny_model(request.param)


@pytest.fixture(scope="module")
def hf_greedy(tiny: Path):
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    memo: dict[tuple[int, ...], list[int]] = {}

    def reference(prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        key = (*prompt, -max_tokens)
        if key not in memo:
            with torch.inference_mode():
                ids = torch.tensor([prompt])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                     min_new_tokens=max_tokens, do_sample=False)
            memo[key] = out[0, len(prompt):].tolist()
        return memo[key]

    return reference


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def check(llm: LLM, prompts: list[list[int]], hf_greedy) -> None:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [hf_greedy(p) for p in prompts]


def test_plain_batch_of_mixed_lengths(tiny: Path, hf_greedy) -> None:
    llm = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=128)
    check(llm, prompts_of([1, 3, 4, 5, 9, 17, 33]), hf_greedy)


def test_prefix_cache_hits_in_a_second_round(tiny: Path, hf_greedy) -> None:
    llm = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=128)
    shared = prompts_of([12], seed=1)[0]
    first = [shared + tail for tail in prompts_of([3, 6], seed=2)]
    check(llm, first, hf_greedy)
    hits = []
    llm.scheduler.observer = lambda event, data: hits.append(data["cache_hits"]) if event == "schedule" else None
    second = [shared + tail for tail in prompts_of([5, 1, 8], seed=3)] + [shared[:8]]
    check(llm, second, hf_greedy)
    assert any(hits), "the second round must reuse cached prefix blocks"


def test_chunked_prefill(tiny: Path, hf_greedy) -> None:
    llm = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=128, max_num_batched_tokens=7)
    check(llm, prompts_of([23, 2, 15, 7, 8]), hf_greedy)


def test_preemption_with_a_tiny_pool(tiny: Path, hf_greedy) -> None:
    llm = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=12)
    preempted = []
    llm.scheduler.observer = lambda event, data: preempted.extend(data["preempted"]) if event == "schedule" else None
    check(llm, prompts_of([10, 9, 11, 6, 12]), hf_greedy)
    assert preempted, "a 12-block pool must force preemption"


def test_one_sequence_at_a_time(tiny: Path, hf_greedy) -> None:
    llm = LLM(str(tiny), kvcache_block_size=8, num_kvcache_blocks=32, max_num_seqs=1)
    check(llm, prompts_of([5, 13, 2]), hf_greedy)


def test_everything_at_once_without_prefix_caching(tiny: Path, hf_greedy) -> None:
    llm = LLM(str(tiny), kvcache_block_size=2, num_kvcache_blocks=24, max_num_batched_tokens=9,
              max_num_seqs=3, enable_prefix_caching=False)
    check(llm, prompts_of([14, 3, 9, 1, 20]), hf_greedy)
