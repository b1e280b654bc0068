"""Chapter 05: parallel sampling (n > 1): one prefill, a fork that shares the prompt's blocks,
copy-on-write before a shared block is written, and the frees; then the engine end to end."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import nanovllm.engine.model_runner as model_runner
from nanovllm.book.tiny_models import TINY_VOCAB_SIZE
from nanovllm.engine.llm_engine import NonFiniteLogitsError
from nanovllm.engine.model_runner import NOT_SAMPLED, copy_kv_blocks
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus, sibling_samples
from nanovllm.layers.sampler import sampling_inputs, seeded_generator
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams


def make(blocks: int = 16, bs: int = 4, seqs: int = 4, tokens: int = 64, caching: bool = True) -> Scheduler:
    return Scheduler(num_kvcache_blocks=blocks, kvcache_block_size=bs, max_num_seqs=seqs,
                     max_num_batched_tokens=tokens, enable_prefix_caching=caching)  # fmt: skip


def request(length: int, n: int, max_tokens: int = 4, bs: int = 4, start: int = 100) -> Sequence:
    return Sequence(range(start, start + length), SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n),
                    block_size=bs)  # fmt: skip


def refs(sched: Scheduler, block_ids: list[int]) -> list[int]:
    return [sched.block_manager.blocks[b].ref_count for b in block_ids]


def prefill_and_fork(sched: Scheduler, seq: Sequence, first_tokens: list[int]) -> list[Sequence]:
    """Add ``seq``, run its prefill, return the request's n sequences (the first one, then its siblings)."""
    sched.add(seq)
    seqs, is_prefill = sched.schedule()
    assert is_prefill and seqs == [seq]
    sched.postprocess(seqs, first_tokens, is_prefill)
    return [s for s in sched.running if s.request_id == seq.seq_id]


# ---- the parameter -------------------------------------------------------------------------------

@pytest.mark.parametrize(("n", "error"), [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError)])
def test_n_is_checked(n: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="n"):
        SamplingParams(n=n)


def test_sibling_samples_is_the_one_order_of_a_steps_extra_samples() -> None:
    """Sibling k of each sequence whose prompt the step completes, sequence by sequence; a chunk forks nothing."""
    done, chunk, single = request(4, n=3), request(8, n=2, start=100), request(3, n=1, start=200)
    done.num_scheduled_tokens, chunk.num_scheduled_tokens, single.num_scheduled_tokens = 4, 5, 3
    assert sibling_samples([chunk, done, single]) == [(1, 1), (1, 2)]
    chunk.num_scheduled_tokens = 8
    assert sibling_samples([chunk, done, single]) == [(0, 1), (1, 1), (1, 2)]


# ---- the fork --------------------------------------------------------------------------------------

def test_the_prompt_is_prefilled_once_and_forks_into_n_sequences_sharing_every_block() -> None:
    sched = make()
    parent = request(6, n=3)  # 6 tokens in blocks of 4: a full block and a partial one
    samples = prefill_and_fork(sched, parent, [7, 8, 9])
    assert [s.sample_index for s in samples] == [0, 1, 2] and samples[0] is parent
    assert all(s.request_id == parent.seq_id for s in samples) and len({s.seq_id for s in samples}) == 3
    assert [s.completion_token_ids for s in samples] == [[7], [8], [9]]  # one token each, same logits row
    table = parent.block_table
    assert len(table) == 2 and all(s.block_table == table for s in samples)
    assert refs(sched, table) == [3, 3]  # the partial last block is shared too
    assert all(s.num_cached_tokens == 6 and s.status is SequenceStatus.RUNNING for s in samples)
    assert sched.block_manager.num_free_blocks == 14


def test_copy_on_write_at_the_first_shared_write_and_the_last_holder_writes_in_place() -> None:
    sched = make()
    samples = prefill_and_fork(sched, request(6, n=3), [7, 8, 9])
    full, shared = samples[0].block_table
    decode, is_prefill = sched.schedule()
    assert not is_prefill and decode == samples
    # Each writes position 6, in the shared partial block: the first two get private copies ...
    for s in samples[:2]:
        (copy,) = s.blocks_to_copy
        assert copy[0] == shared and s.block_table == [full, copy[1]]
    assert samples[0].blocks_to_copy[0][1] != samples[1].blocks_to_copy[0][1]
    # ... and the last one, now its only holder, writes in place.
    assert samples[2].blocks_to_copy == [] and samples[2].block_table == [full, shared]
    assert refs(sched, [full, shared]) == [3, 1]
    sched.postprocess(decode, [1, 2, 3], is_prefill)
    assert all(s.blocks_to_copy == [] for s in samples)  # the runner made them when it ran the step


def test_a_prompt_that_ends_on_a_block_boundary_needs_no_copy() -> None:
    sched = make()
    samples = prefill_and_fork(sched, request(8, n=3), [7, 8, 9])
    decode, _ = sched.schedule()
    assert all(s.blocks_to_copy == [] for s in decode)
    assert len({s.block_table[2] for s in samples}) == 3  # each wrote its first token into a new block
    assert refs(sched, samples[0].block_table[:2]) == [3, 3]


def test_the_prompts_blocks_return_to_the_free_list_when_the_last_sample_lets_go() -> None:
    sched = make()
    samples = prefill_and_fork(sched, request(6, n=2, max_tokens=3), [7, 8])
    full = samples[0].block_table[0]
    step = 0
    while not sched.is_finished():
        seqs, is_prefill = sched.schedule()
        sched.postprocess(seqs, [10 + step] * len(seqs), is_prefill)
        step += 1
    assert all(s.is_finished and not s.block_table for s in samples)
    assert sched.block_manager.num_free_blocks == 16 and sched.block_manager.blocks[full].ref_count == 0


def test_max_tokens_one_finishes_every_sample_at_the_fork() -> None:
    sched = make()
    parent = request(6, n=3, max_tokens=1)
    sched.add(parent)
    seqs, is_prefill = sched.schedule()
    finished = sched.postprocess(seqs, [7, 8, 9], is_prefill)
    assert [s.completion_token_ids for s in finished] == [[7], [8], [9]]
    assert sched.is_finished() and sched.block_manager.num_free_blocks == 16


def test_postprocess_wants_one_token_per_sample_and_changes_nothing_otherwise() -> None:
    sched = make()
    parent = request(6, n=3)
    sched.add(parent)
    seqs, is_prefill = sched.schedule()
    with pytest.raises(AssertionError):
        sched.postprocess(seqs, [7], is_prefill)
    assert parent.num_scheduled_tokens == 6 and parent.num_cached_tokens == 0 and parent.pending_forks == 2


def test_a_chunked_prompt_forks_only_after_its_last_chunk() -> None:
    sched = make(tokens=4)
    parent = request(10, n=2)
    sched.add(parent)
    for _ in range(2):  # chunks of 4 and 4: nothing sampled, nothing forked
        seqs, is_prefill = sched.schedule()
        assert sibling_samples(seqs) == []
        sched.postprocess(seqs, [NOT_SAMPLED], is_prefill)
        assert len(sched.running) == 0 and parent.pending_forks == 1
    seqs, is_prefill = sched.schedule()  # the last 2 tokens: 1 + 1 samples
    assert sibling_samples(seqs) == [(0, 1)]
    sched.postprocess(seqs, [7, 8], is_prefill)
    assert [s.completion_token_ids for s in sched.running] == [[7], [8]]
    assert refs(sched, parent.block_table) == [2, 2, 2]


def test_a_request_that_hits_the_prefix_cache_forks_the_hit_blocks_too() -> None:
    sched = make()
    first = request(9, n=1, max_tokens=1)
    sched.add(first)
    seqs, is_prefill = sched.schedule()
    cached = first.block_table[:2]
    sched.postprocess(seqs, [5], is_prefill)  # finishes: its two full blocks stay cached, free
    again = request(9, n=3, max_tokens=2)
    sched.add(again)
    seqs, is_prefill = sched.schedule()
    assert again.num_cached_tokens == 8 and again.block_table[:2] == cached
    sched.postprocess(seqs, [6, 7, 8], is_prefill)
    samples = [s for s in sched.running if s.request_id == again.seq_id]
    assert len(samples) == 3 and refs(sched, again.block_table) == [3, 3, 3]


def test_preempting_one_sample_releases_only_its_references_and_its_recompute_hits_the_cache() -> None:
    # 9-token prompt in blocks of 4: 2 full blocks + 1 partial, shared by 3 samples; 6 blocks in all.
    sched = make(blocks=6, seqs=3)
    samples = prefill_and_fork(sched, request(9, n=3, max_tokens=8), [7, 8, 9])
    full = samples[0].block_table[:2]
    decode, _ = sched.schedule()  # two copies of the partial block: one block left
    assert sched.block_manager.num_free_blocks == 1 and len(decode) == 3
    sched.postprocess(decode, [1, 2, 3], False)
    for _ in range(2):  # positions 10 and 11 fit the blocks they have
        decode, _ = sched.schedule()
        sched.postprocess(decode, [1, 2, 3], False)
    decode, _ = sched.schedule()  # position 12 needs a new block each, one is free: the newest is preempted
    victim = samples[2]
    assert victim.status is SequenceStatus.WAITING and not victim.block_table and list(sched.waiting) == [victim]
    assert refs(sched, full) == [2, 2]  # the others still hold the prompt's full blocks
    sched.postprocess(decode, [4] * len(decode), False)
    while victim.status is SequenceStatus.WAITING:
        seqs, is_prefill = sched.schedule()
        if victim in seqs:
            assert is_prefill and victim.block_table[:2] == full and victim.num_cached_tokens >= 8
        sched.postprocess(seqs, [4] * (len(seqs) + len(sibling_samples(seqs))), is_prefill)


# ---- what travels and what the runner does ----------------------------------------------------------

def test_a_pickled_sequence_carries_its_sample_and_its_copies() -> None:
    """What a tensor-parallel rank needs: every rank makes the step's copies (chapter 16)."""
    sched = make()
    samples = prefill_and_fork(sched, request(6, n=2), [7, 8])
    sched.schedule()  # the first sample copies the shared block, the second writes in place
    first, second = (pickle.loads(pickle.dumps(s)) for s in samples)
    assert first.blocks_to_copy == samples[0].blocks_to_copy and len(first.blocks_to_copy) == 1
    assert (second.request_id, second.sample_index, second.pending_forks) == (samples[0].seq_id, 1, 0)
    assert pickle.loads(pickle.dumps(request(6, n=4))).pending_forks == 3


def test_copy_kv_blocks_copies_whole_blocks_in_every_layer() -> None:
    kv = torch.randn(2, 3, 6, 2, 1, 4)
    before = kv.clone()
    copy_kv_blocks(kv, [])
    assert torch.equal(kv, before)
    copy_kv_blocks(kv, [(0, 3), (1, 5)])
    assert torch.equal(kv[:, :, 3], before[:, :, 0]) and torch.equal(kv[:, :, 5], before[:, :, 1])
    assert torch.equal(kv[:, :, [0, 1, 2, 4]], before[:, :, [0, 1, 2, 4]])


def test_each_sample_draws_from_its_own_seeded_stream() -> None:
    def noise(position: int, sample_index: int = 0) -> torch.Tensor:
        return torch.empty(16).exponential_(generator=seeded_generator(42, position, "cpu", sample_index))

    assert torch.equal(noise(5), noise(5, 0))  # sample 0 keeps a request's n = 1 stream
    streams = [noise(5, j) for j in range(4)]
    assert all(not torch.equal(a, b) for i, a in enumerate(streams) for b in streams[i + 1 :])
    inputs = sampling_inputs([SamplingParams(seed=42)] * 2, [5, 5], "cpu", [0, 3])
    draws = [torch.empty(16).exponential_(generator=g) for g in inputs["generators"]]
    assert torch.equal(draws[0], streams[0]) and torch.equal(draws[1], streams[3])


# ---- the engine end to end -------------------------------------------------------------------------

def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


def poisoned(llm: LLM) -> LLM:
    """Fill the KV cache with NaN: a sample that reads a slot nobody wrote for it (a skipped or misdirected
    copy) gets NaN logits, and its tokens change."""
    llm.model_runner.kv_cache.fill_(float("nan"))
    return llm


def test_n_greedy_samples_equal_transformers_greedy(tiny_arch: Path) -> None:
    batch = prompts_of([5, 9, 8, 14])  # blocks of 4: partial last blocks (copies) and a boundary (none)
    model = AutoModelForCausalLM.from_pretrained(tiny_arch).eval()
    llm = poisoned(LLM(str(tiny_arch), kvcache_block_size=4, num_kvcache_blocks=64))
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=3), use_tqdm=False)
    for prompt, output in zip(batch, outputs, strict=True):
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                      do_sample=False)[0, len(prompt) :].tolist()
        assert [sample["token_ids"] for sample in output["outputs"]] == [expected] * 3
    assert llm.scheduler.block_manager.num_free_blocks == 64


REGIMES = {
    "plain": dict(kvcache_block_size=4, num_kvcache_blocks=64),
    "chunked": dict(kvcache_block_size=4, num_kvcache_blocks=64, max_num_batched_tokens=6),
    "preemption": dict(kvcache_block_size=4, num_kvcache_blocks=11),
}


@pytest.mark.parametrize("scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("regime", REGIMES.values(), ids=REGIMES.keys())
def test_forked_samples_equal_independent_requests_with_the_same_streams(tiny_arch: Path, regime: dict,
                                                                         scheduling: bool) -> None:
    """With seeds, sharing the prompt's blocks changes no token: each sample equals the same sample run as an
    independent request (fork_samples=False). From a NaN-poisoned cache, a lost copy would show."""
    batch = prompts_of([6, 13, 3], seed=3)
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, n=3, seed=11)
    runs = {}
    for fork in (True, False):
        llm = poisoned(LLM(str(tiny_arch), fork_samples=fork, async_scheduling=scheduling, **regime))
        runs[fork] = [[s["token_ids"] for s in o["outputs"]] for o in llm.generate(batch, params, use_tqdm=False)]
        assert llm.is_finished() and llm.scheduler.block_manager.num_free_blocks == regime["num_kvcache_blocks"]
    assert runs[True] == runs[False]
    # Distinct streams, not n copies of one sample (the tiny models are peaked: some samples may coincide).
    assert any(len({tuple(t) for t in samples}) > 1 for samples in runs[True])


def test_a_later_request_for_the_same_prompt_hits_the_cache_and_gives_the_same_samples(tiny_arch: Path) -> None:
    prompt = prompts_of([13], seed=5)[0]
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=2, seed=3)
    llm = poisoned(LLM(str(tiny_arch), kvcache_block_size=4, num_kvcache_blocks=64))
    first = llm.generate([prompt], params, use_tqdm=False)
    hits = []
    llm.scheduler.observer = lambda event, data: hits.append(data["cache_hits"]) if event == "schedule" else None
    second = llm.generate([prompt], params, use_tqdm=False)
    assert second == first and sum(len(blocks) for step in hits for blocks in step.values()) == 3


def test_the_result_keeps_nano_vllms_shape_and_adds_the_samples(tiny_arch: Path) -> None:
    llm = LLM(str(tiny_arch), kvcache_block_size=4, num_kvcache_blocks=64)
    one, three = llm.generate(["hello", "hello"], [SamplingParams(max_tokens=3), SamplingParams(max_tokens=3, n=3)],
                              use_tqdm=False)
    assert set(one) == {"text", "token_ids"}
    assert set(three) == {"text", "token_ids", "outputs"} and len(three["outputs"]) == 3
    assert {k: three[k] for k in ("text", "token_ids")} == three["outputs"][0]
    assert all(set(sample) == {"text", "token_ids"} for sample in three["outputs"])


def test_too_many_samples_are_refused_and_the_engine_keeps_serving(tiny_arch: Path) -> None:
    llm = LLM(str(tiny_arch), kvcache_block_size=4, num_kvcache_blocks=64, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"prompt 1: .*n=5.*raise max_num_seqs"):
        llm.generate(["fine", "too many"], [SamplingParams(max_tokens=2), SamplingParams(n=5)], use_tqdm=False)
    assert llm.is_finished()
    assert len(llm.generate(["fine"], SamplingParams(max_tokens=2, n=4), use_tqdm=False)[0]["outputs"]) == 4


def test_without_the_copy_the_samples_change(tiny_arch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parity tests above can fail: with the runner's copy switched off, forked samples read NaN, and the
    engine refuses their NaN logits (chapter 10) instead of sampling from them."""
    batch = prompts_of([6], seed=3)
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=3, seed=11)
    monkeypatch.setattr(model_runner, "copy_kv_blocks", lambda kv_cache, copies, kv_scales=None: None)
    llm = poisoned(LLM(str(tiny_arch), kvcache_block_size=4, num_kvcache_blocks=64))
    with pytest.raises(NonFiniteLogitsError, match="KV that no step wrote"):
        llm.generate(batch, params, use_tqdm=False)
