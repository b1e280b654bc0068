"""The engine against transformers greedy decoding on the tiny models, under every scheduling regime."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanovllm.book.tiny_models import TINY_VOCAB_SIZE
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

MAX_TOKENS = 10


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def scheduling(request: pytest.FixtureRequest) -> bool:
    """async_scheduling off and on: the tokens must not depend on it (chapter 10)."""
    return request.param


@pytest.fixture(scope="module")
def hf_greedy(tiny_arch: Path):
    model = AutoModelForCausalLM.from_pretrained(tiny_arch).eval()
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


def test_plain_batch_of_mixed_lengths(tiny_arch: Path, hf_greedy, scheduling: bool) -> None:
    llm = LLM(str(tiny_arch), async_scheduling=scheduling, kvcache_block_size=4, num_kvcache_blocks=128)
    check(llm, prompts_of([1, 3, 4, 5, 9, 17, 33]), hf_greedy)


def test_prefix_cache_hits_in_a_second_round(tiny_arch: Path, hf_greedy, scheduling: bool) -> None:
    llm = LLM(str(tiny_arch), async_scheduling=scheduling, kvcache_block_size=4, num_kvcache_blocks=128)
    shared = prompts_of([12], seed=1)[0]
    first = [shared + tail for tail in prompts_of([3, 6], seed=2)]
    check(llm, first, hf_greedy)
    hits = []
    llm.scheduler.observer = lambda event, data: hits.append(data["cache_hits"]) if event == "schedule" else None
    second = [shared + tail for tail in prompts_of([5, 1, 8], seed=3)] + [shared[:8]]
    check(llm, second, hf_greedy)
    assert any(hits), "the second round must reuse cached prefix blocks"


def test_chunked_prefill(tiny_arch: Path, hf_greedy, scheduling: bool) -> None:
    llm = LLM(str(tiny_arch), async_scheduling=scheduling, kvcache_block_size=4, num_kvcache_blocks=128,
              max_num_batched_tokens=7)
    check(llm, prompts_of([23, 2, 15, 7, 8]), hf_greedy)


def test_preemption_with_a_tiny_pool(tiny_arch: Path, hf_greedy, scheduling: bool) -> None:
    llm = LLM(str(tiny_arch), async_scheduling=scheduling, kvcache_block_size=4, num_kvcache_blocks=12)
    preempted = []
    llm.scheduler.observer = lambda event, data: preempted.extend(data["preempted"]) if event == "schedule" else None
    check(llm, prompts_of([10, 9, 11, 6, 12]), hf_greedy)
    assert preempted, "a 12-block pool must force preemption"


def test_one_sequence_at_a_time(tiny_arch: Path, hf_greedy, scheduling: bool) -> None:
    llm = LLM(str(tiny_arch), async_scheduling=scheduling, kvcache_block_size=8, num_kvcache_blocks=32, max_num_seqs=1)
    check(llm, prompts_of([5, 13, 2]), hf_greedy)


def test_everything_at_once_without_prefix_caching(tiny_arch: Path, hf_greedy, scheduling: bool) -> None:
    llm = LLM(str(tiny_arch), async_scheduling=scheduling, kvcache_block_size=2, num_kvcache_blocks=24,
              max_num_batched_tokens=9, max_num_seqs=3, enable_prefix_caching=False)
    check(llm, prompts_of([14, 3, 9, 1, 20]), hf_greedy)


LOGITS_ATOL = 1e-4  # fp32 on CPU; the observed gap is about 1e-5


def test_logits_match_transformers_at_every_step(tiny_arch: Path) -> None:
    """Every row of logits the engine computes, in every step (chunks, cache hits, preemption, decode),
    is within LOGITS_ATOL of transformers' logits for the same token prefix."""
    llm = LLM(str(tiny_arch), kvcache_block_size=4, num_kvcache_blocks=14, max_num_batched_tokens=9)
    model, recorded, chunk_rows = llm.model_runner.model, [], []
    compute_logits, schedule = model.compute_logits, llm.scheduler.schedule

    def schedule_and_note_prefixes():
        seqs, is_prefill = schedule()
        # Row i of this step's logits predicts the token after position num_cached + num_scheduled - 1.
        recorded.append([seq.token_ids[: seq.num_cached_tokens + seq.num_scheduled_tokens] for seq in seqs])
        chunk_rows.extend(s for s in seqs if s.num_cached_tokens + s.num_scheduled_tokens < s.num_prompt_tokens)
        return seqs, is_prefill

    def compute_and_record(hidden):
        logits = compute_logits(hidden)
        recorded[-1] = list(zip(recorded[-1], logits.detach().clone(), strict=True))
        return logits

    llm.scheduler.schedule, model.compute_logits = schedule_and_note_prefixes, compute_and_record
    events = []
    llm.scheduler.observer = lambda event, data: events.append(data) if event == "schedule" else None
    shared = prompts_of([8], seed=5)[0]
    prompts = [shared + p for p in prompts_of([5, 9, 2], seed=6)] + prompts_of([13], seed=7)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    rows = [row for step in recorded for row in step]
    assert len(recorded) > 10 and len(rows) > 40
    assert any(e["preempted"] for e in events) and any(e["cache_hits"] for e in events)
    assert chunk_rows, "the 9-token budget must split a prompt into chunks"
    reference = AutoModelForCausalLM.from_pretrained(tiny_arch).eval()
    worst = 0.0
    with torch.inference_mode():
        for prefix, logits in rows:
            expected = reference(torch.tensor([prefix])).logits[0, -1]
            worst = max(worst, (logits.float() - expected).abs().max().item())
    assert worst < LOGITS_ATOL, f"largest logit gap {worst:.2e}"
