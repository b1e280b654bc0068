"""Speculative decoding (chapter 25): prompt lookup, drafts reserved and rolled back, and lossless greedy output.

The property tests drive the real scheduler and block manager with a fake model (``scheduler_sim``) and a
proposer whose drafts are right or wrong by a drawn pattern: every step keeps the scheduler's invariants,
nothing is published that holds a rejected draft, the pool ends whole, and every completion equals the one
computed without speculation. The engine tests run tiny models and check token-for-token equality with the
engine without speculation, through preemption, chunked prefill, prefix hits, forks, an 8-bit cache, EOS
and max_tokens inside a run of accepted drafts, a failing verify step, and requests that sample.
"""

import json
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.config import Config
from nanovllm.engine import model_runner
from nanovllm.engine.prefix_cache import NO_HASH
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.speculative import NgramProposer, Speculator
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams
from tests.core.test_provenance_fuzz import NUM_WORKLOADS, SEED, fuzz
from tests.core.test_scheduler_properties import check_completions, workloads
from tests.scheduler_sim import VOCAB, InvariantChecker, check, next_token, simulate

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- the proposer ----------------------------------------------------------------------------------------------
def test_prompt_lookup_prefers_the_longest_match_and_its_first_occurrence():
    proposer = NgramProposer(num_speculative_tokens=3)
    # The last 3 tokens (1, 2, 3) occur at 0 and 5; the first occurrence has the longer continuation.
    assert proposer.propose([1, 2, 3, 7, 8, 1, 2, 3, 9, 1, 2, 3]) == [7, 8, 1]
    # Only the last token (5) occurs before: a 1-gram match.
    assert proposer.propose([5, 6, 7, 5]) == [6, 7, 5]
    assert proposer.propose([1, 2, 3, 4]) == [] and proposer.propose([1]) == []
    assert proposer.propose([1, 2, 1], limit=1) == [2] and proposer.propose([1, 2, 1], limit=0) == []
    assert NgramProposer(3, max_ngram=2, min_ngram=2).propose([4, 5, 6, 9, 5]) == []
    with pytest.raises(ValueError, match="min_ngram"):
        NgramProposer(3, max_ngram=1, min_ngram=2)


# ---- the scheduler, with a fake model --------------------------------------------------------------------------
class PatternProposer:
    """Proposes the fake model's own continuation (of sample 0), with the drafts at the drawn positions wrong."""

    def __init__(self, k: int, wrong: frozenset[int]) -> None:
        self.k, self.wrong = k, wrong

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        context, draft = list(token_ids), []
        for _ in range(min(self.k, self.k if limit is None else limit)):
            token = next_token(tuple(context))
            if len(context) % 7 in self.wrong:
                token = (token + 1) % VOCAB
            context.append(token)
            draft.append(token)
        return draft


def reserve(scheduler, seqs, proposer) -> int:
    """What the engine does for a scheduled decode step: a speculator's drafts (of ``proposer``, or ``proposer``
    itself when it is one), given slots by the scheduler; how many were reserved."""
    speculator = proposer if isinstance(proposer, Speculator) else Speculator(proposer)
    return scheduler.reserve_drafts(seqs, speculator.propose(seqs, scheduler.budget_left(seqs)))


def check_drafts(sched, seqs, is_prefill):
    """After reserve_drafts: the budget holds, every slot the step writes is in a block of this table alone."""
    check(not is_prefill, "drafts in a prefill step")
    check(sum(s.num_scheduled_tokens for s in seqs) <= sched.max_num_batched_tokens, "drafts exceed the budget")
    bm = sched.block_manager
    for s in seqs:
        check(s.num_scheduled_tokens == 1 + s.num_draft_tokens, f"seq {s.seq_id}: drafts not scheduled")
        check(len(s.block_table) == -(-len(s) // bm.block_size), f"seq {s.seq_id}: drafts without their blocks")
        for pos in range(s.num_cached_tokens, len(s)):
            block = bm.blocks[s.block_table[pos // bm.block_size]]
            check(block.ref_count == 1 and block.hash == NO_HASH, f"seq {s.seq_id} writes a draft into {block}")


def published_blocks_hold_accepted_tokens(sched, seqs, is_prefill):
    """Every published block in a live table holds exactly that sequence's tokens: no rejected draft."""
    for s in list(sched.running) + list(sched.waiting):
        for i, block_id in enumerate(s.block_table):
            block = sched.block_manager.blocks[block_id]
            if block.hash != NO_HASH:
                check(block.token_ids == s.block(i), f"seq {s.seq_id}: published block {block_id} holds a draft")


@SETTINGS
@given(workloads(), st.integers(1, 5), st.frozensets(st.integers(0, 6), max_size=7))
def test_drafts_keep_the_invariants_and_the_completions(workload, k, wrong):
    checker = InvariantChecker(workload)

    def after_postprocess(sched, seqs, is_prefill):
        checker.after_postprocess(sched, seqs, is_prefill)
        published_blocks_hold_accepted_tokens(sched, seqs, is_prefill)

    seen = {}

    def remember(sched, seqs, is_prefill):
        seen["sched"] = sched
        check_drafts(sched, seqs, is_prefill)

    seqs, _ = simulate(workload, checker.after_schedule, after_postprocess, proposer=PatternProposer(k, wrong),
                       after_drafts=remember)
    check_completions(workload, seqs)
    assert set(checker.finished) == {s.seq_id for s in seqs}
    if "sched" in seen:
        bm = seen["sched"].block_manager
        assert bm.num_free_blocks == bm.num_blocks and all(block.ref_count == 0 for block in bm.blocks)


def test_every_draft_right_means_k_plus_one_tokens_a_step():
    from tests.scheduler_sim import Request, Workload

    workload = Workload(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                        enable_prefix_caching=True, eos=(), requests=[Request(0, [1, 2, 3], 41, True, 1)])
    seqs, steps = simulate(workload, proposer=PatternProposer(4, frozenset()))
    check_completions(workload, seqs)
    # One prefill (the first token), then 40 tokens at 5 a step.
    assert steps == 1 + 40 // 5
    seqs, steps = simulate(workload, proposer=PatternProposer(4, frozenset(range(7))))
    assert steps == 41


# ---- the engine, on tiny models --------------------------------------------------------------------------------
class Replay:
    """Proposes what a plain run wrote after the same tokens, with the positions in ``wrong`` (mod 5) wrong."""

    def __init__(self, runs, k=4, wrong=(0,)):
        self.runs, self.k, self.wrong = runs, k, wrong

    def propose(self, token_ids, limit=None):
        n, k = len(token_ids), min(self.k, self.k if limit is None else limit)
        for run in self.runs:
            if run[:n] == token_ids:
                return [token + 1 if (n + i) % 5 in self.wrong else token for i, token in enumerate(run[n : n + k])]
        return []


PROMPTS = ["Question: Where do fish live? Answer:", "Small steps make", "Small steps make small progress",
           "Write clear code"]


def generate(model, settings, params, eos=None, runs=None, wrong=(0,), **speculation):
    """Completions of PROMPTS by (request, sample), the number of steps, and the engine (``llm.regimes`` counts
    the steps that preempted and those with prefix-cache hits)."""
    llm = LLM(model, device="cpu", **settings, **speculation)
    llm.regimes = Counter()

    def watch(event, data):
        if event == "schedule":
            llm.regimes.update(preempted=bool(data["preempted"]), cache_hits=bool(data["cache_hits"]))

    llm.scheduler.observer = watch
    if eos is not None:
        llm.scheduler.eos_token_ids = frozenset(eos)
    if llm.speculator is not None:
        if runs is not None:
            llm.speculator.proposer = Replay(runs, wrong=wrong)
        # Rows for all 8 sequences (n = 2) to verify 4 drafts each: these tests are about the tokens, not the rule.
        llm.speculator.max_verify_rows = 40
    ids = [llm.add_request(prompt, params) for prompt in PROMPTS]
    outputs, steps = {}, 0
    while not llm.is_finished():
        for output in llm.step()[0]:
            outputs[ids.index(output.request_id), output.sample_index] = output[1]
        steps += 1
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "a block leaked"
    return outputs, steps, llm


ENGINES = {
    "preemption": {"kvcache_block_size": 4, "num_kvcache_blocks": 22},
    "forks, copy-on-write": {"kvcache_block_size": 4, "num_kvcache_blocks": 64},
    "chunked prefill": {"kvcache_block_size": 4, "num_kvcache_blocks": 64, "max_num_batched_tokens": 7},
    "prefix hits": {"kvcache_block_size": 2, "num_kvcache_blocks": 96, "max_num_seqs": 1},
    "fp8 cache": {"kvcache_block_size": 4, "num_kvcache_blocks": 64, "kv_cache_dtype": "fp8"},
    "seeded sampling": {"kvcache_block_size": 4, "num_kvcache_blocks": 64},
}


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen3_moe"])
def tiny(request):
    return str(build_tiny_model(request.param))


@pytest.mark.parametrize("engine", ENGINES)
def test_speculation_gives_the_tokens_of_plain_greedy_decoding(tiny, engine):
    settings = ENGINES[engine]
    params = SamplingParams(temperature=0, max_tokens=21, n=2 if engine.startswith("forks") else 1)
    if engine == "seeded sampling":
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=21)
    plain, plain_steps, llm = generate(tiny, settings, params)
    runs = [llm.tokenizer(prompt)["input_ids"] + plain[i, 0] for i, prompt in enumerate(PROMPTS)]
    ngram, _, _ = generate(tiny, settings, params, speculative_method="ngram")
    assert ngram == plain
    for wrong in ((0,), (1, 3), ()):
        replayed, steps, llm = generate(tiny, settings, params, runs=runs, wrong=wrong, speculative_method="ngram")
        assert replayed == plain, f"drafts wrong at {wrong}"
        assert steps < plain_steps and llm.speculator.counts.accepted > 0
        # The regime the case is named after did occur while drafts were verified.
        if engine == "preemption":
            assert llm.regimes["preempted"] > 0
        if engine == "prefix hits":
            assert llm.regimes["cache_hits"] > 0


@pytest.fixture(scope="module")
def self_draft(tiny, tmp_path_factory):
    from nanovllm.engine.speculative import write_self_draft

    return str(write_self_draft(tiny, 1, tmp_path_factory.mktemp("draft")))


@pytest.mark.parametrize("engine", ["preemption", "forks, copy-on-write", "chunked prefill", "prefix hits",
                                    "seeded sampling"])
def test_a_draft_model_gives_the_tokens_of_plain_decoding(tiny, self_draft, engine):
    """The draft proposer (a self draft of the model's first layer, and the model drafting for itself) through the
    engine's regimes: the plain engine's tokens, no block leaked (generate checks); greedy drafts of the model
    itself are all kept."""
    settings = ENGINES[engine]
    params = SamplingParams(temperature=0, max_tokens=21, n=2 if engine.startswith("forks") else 1)
    if engine == "seeded sampling":
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=21)
    plain, plain_steps, _ = generate(tiny, settings, params)
    drafted, _, llm = generate(tiny, settings, params, speculative_method="draft", speculative_model=self_draft)
    assert drafted == plain and llm.speculator.counts.drafted > 0
    itself, steps, llm = generate(tiny, settings, params, speculative_method="draft", speculative_model=tiny)
    assert itself == plain
    if engine != "seeded sampling":
        assert llm.speculator.counts.accepted == llm.speculator.counts.drafted > 0 and steps < plain_steps


def test_a_self_draft_is_the_models_first_layers(tmp_path):
    from safetensors.torch import load_file

    from nanovllm.engine.speculative import write_self_draft

    model = build_tiny_model("qwen3", num_hidden_layers=3)
    draft = write_self_draft(model, 2, tmp_path / "draft")
    config = json.loads((draft / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and len(config.get("layer_types", [0, 0])) == 2
    weights, original = load_file(str(draft / "model.safetensors")), load_file(str(model / "model.safetensors"))
    assert not any(name.startswith("model.layers.2.") for name in weights)
    assert all(torch.equal(tensor, original[name]) for name, tensor in weights.items())
    assert set(original) - set(weights) == {name for name in original if name.startswith("model.layers.2.")}
    assert (draft / "tokenizer.json").is_file()
    for wrong in (0, 3):
        with pytest.raises(ValueError, match="num_layers must be from 1 to 2"):
            write_self_draft(model, wrong, tmp_path / f"wrong-{wrong}")


def test_drafts_shrink_as_the_batch_grows_and_stop_past_the_row_budget():
    class Greedy:
        """Proposes as many drafts as it is allowed."""

        def propose(self, token_ids, limit=None):
            return [5] * limit

    speculator = Speculator(Greedy())
    assert [speculator.drafts_per_sequence(b) for b in (1, 4, 5, 6, 8, 256)] == [15, 3, 2, 0, 0, 0]
    speculator.max_verify_rows, speculator.min_drafts = 12, 1
    scheduler = Scheduler(num_kvcache_blocks=64, kvcache_block_size=4, max_num_seqs=8, max_num_batched_tokens=256)
    params = SamplingParams(temperature=0, max_tokens=64)
    for i in range(5):
        scheduler.add(Sequence([1, 2, 3, i], params, block_size=4))
    seqs, _ = scheduler.schedule()
    scheduler.postprocess(seqs, [7] * len(seqs), True)
    seqs, is_prefill = scheduler.schedule()
    assert not is_prefill and len(seqs) == 5
    # 12 rows for 5 sequences: one draft each (10 rows); 4 sequences would get two each.
    assert reserve(scheduler, seqs, speculator) == 5
    assert sum(seq.num_scheduled_tokens for seq in seqs) <= speculator.max_verify_rows
    scheduler.drop_drafts(seqs)
    speculator.max_verify_rows = 9
    assert speculator.propose(seqs, scheduler.budget_left(seqs)) == [[]] * 5
    assert reserve(scheduler, seqs, speculator) == 0 and all(seq.num_scheduled_tokens == 1 for seq in seqs)


def test_staged_verify_rows_are_the_eager_rows():
    """What a graph replays (`DecodeStaging.stage_rows` of `verify_rows`) is what the eager path computes
    (`prepare_verify`'s context, loaded as chapter 14 loads a decode step), padding rows included."""
    from nanovllm.engine.cuda_graphs import DecodeBuffers, DecodeStaging
    from nanovllm.engine.model_runner import prepare_verify, verify_rows
    from nanovllm.layers.context import get_context, reset_context

    scheduler = Scheduler(num_kvcache_blocks=16, kvcache_block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    for prompt in ([1, 2, 3, 1, 2], [7, 8, 7]):
        scheduler.add(Sequence(prompt, SamplingParams(temperature=0, max_tokens=16), block_size=4))
    seqs, _ = scheduler.schedule()
    scheduler.postprocess(seqs, [3, 8], True)
    seqs, _ = scheduler.schedule()
    assert reserve(scheduler, seqs, NgramProposer(3)) == 5
    staged, eager = (DecodeBuffers.allocate(rows=16, max_blocks=4, device="cpu") for _ in range(2))
    DecodeStaging(staged, block_size=4).stage_rows(*verify_rows(seqs), graph_batch=8)
    try:
        input_ids, positions = prepare_verify(seqs, block_size=4)
        eager.load(input_ids, positions, get_context(), graph_batch=8)
    finally:
        reset_context()
    assert staged.positions[:8].tolist() == [5, 6, 7, 8, 3, 4, 5, 0]
    assert staged.context_lens[:8].tolist() == [6, 7, 8, 9, 4, 5, 6, 0]
    assert torch.equal(staged.storage[: staged.prefix_bytes(8)], eager.storage[: eager.prefix_bytes(8)])


def test_the_recorder_draws_drafts_and_what_the_model_kept():
    """The scheduler tells its observer about drafts and verification; appendix A's recorder turns them into frames
    whose captions (both languages) name the kept drafts and the blocks given back."""
    from nanovllm.viz import FakeEngine
    from nanovllm.viz.player import caption

    fake = FakeEngine(num_kvcache_blocks=8, kvcache_block_size=4)
    seq = fake.add([1, 2, 3, 4, 1, 2, 3], max_tokens=8)
    scheduler = fake.scheduler
    seqs, is_prefill = scheduler.schedule()
    scheduler.postprocess(seqs, [4], is_prefill)
    seqs, _ = scheduler.schedule()
    # Drafts 1, 2, 3 (the prompt again) fill a new block; the model keeps none of them.
    assert reserve(scheduler, seqs, NgramProposer(3)) == 3 and len(seq.block_table) == 3
    new_tokens, kept = scheduler.accept_drafts(seqs, [[9, 9, 9, 9]])
    assert kept == [0]
    scheduler.postprocess(seqs, new_tokens, False)
    drafts, verified = (next(f for f in fake.recording["frames"] if f["phase"] == phase)
                        for phase in ("drafts", "verified"))
    assert drafts["event"]["drafts"] == [{"seq": seq.seq_id, "count": 3}]
    assert verified["event"]["verified"] == [{"seq": seq.seq_id, "drafted": 3, "kept": 0, "freed": [2]}]
    assert "kept 0 of 3 drafts" in caption(verified) and "gives back block 2" in caption(verified)
    assert "保留 0/3 个草稿" in caption(verified, "zh") and "+3 tokens" in caption(drafts)


def test_a_sequence_whose_drafts_fail_pauses_them_and_tries_again(tiny):
    """Drafts that are always wrong: two verify steps, then one after each pause, each pause twice the one before;
    always right: every step verifies. The tokens are plain greedy decoding's either way."""
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    settings = {"kvcache_block_size": 4, "num_kvcache_blocks": 64}
    plain_llm = LLM(tiny, device="cpu", **settings)
    plain = plain_llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]["token_ids"]
    runs = [plain_llm.tokenizer(PROMPTS[0])["input_ids"] + plain]
    counts = {}
    for name, wrong in (("always wrong", tuple(range(5))), ("always right", ())):
        llm = LLM(tiny, device="cpu", speculative_method="ngram", **settings)
        llm.speculator.proposer = Replay(runs, wrong=wrong)
        assert llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]["token_ids"] == plain
        counts[name] = llm.speculator.counts.verifications
    pause = Speculator(NgramProposer(4)).draft_pause_tokens
    # Over 119 decode steps: two misses, then pauses of 16, 32 and 64 tokens, each followed by one miss (a pause of
    # a fixed 16 tokens would have verified 2 + 117 // 17 = 8 times).
    steps, expected = 2, 2
    while steps + pause + 1 <= 119:
        steps, expected, pause = steps + pause + 1, expected + 1, 2 * pause
    assert counts["always wrong"] == expected == 5
    assert counts["always right"] == -(-119 // 5)


def test_each_pause_in_a_row_is_twice_the_one_before_until_a_good_verify_step():
    speculator = Speculator(NgramProposer(4))
    seq = Sequence(list(range(10)), SamplingParams(), block_size=4)
    pauses = []
    for _ in range(8):
        # A verify step of four drafts that kept none: one token.
        speculator.record([seq], [4], [0])
        backoff = speculator.backoff[seq]
        if backoff.resume_at > len(seq):
            pauses.append(backoff.resume_at - len(seq))
            assert not speculator.may_draft(seq)
            backoff.resume_at = 0
    assert pauses == [16, 32, 64, 128, 256, 512, 512]
    # A verify step that gives enough tokens ends the run of pauses: the next one is short again.
    speculator.record([seq], [4], [2])
    speculator.record([seq], [4], [0])
    assert speculator.backoff[seq].resume_at == len(seq) + 16
    # The counters saw ten verify steps of four drafts each, two kept.
    assert (speculator.counts.verifications, speculator.counts.drafted, speculator.counts.accepted) == (10, 40, 2)
    # A sequence that drafted nothing in a step is not judged by it.
    fresh = Sequence(list(range(10)), SamplingParams(), block_size=4)
    speculator.record([fresh], [0], [0])
    assert fresh not in speculator.backoff and speculator.may_draft(fresh)


def test_asynchronous_steps_where_the_batch_is_too_large_to_speculate(tiny):
    """With async scheduling, large batches pipeline their steps and small ones verify drafts synchronously; the
    tokens are those of plain greedy decoding either way."""
    settings = {"kvcache_block_size": 4, "num_kvcache_blocks": 96, "async_scheduling": True}
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (9, 14, 21, 30)]
    plain_llm = LLM(tiny, device="cpu", **settings)
    plain = [o["token_ids"] for o in plain_llm.generate(PROMPTS, params, use_tqdm=False)]
    runs = [plain_llm.tokenizer(p)["input_ids"] + out for p, out in zip(PROMPTS, plain, strict=True)]
    llm = LLM(tiny, device="cpu", speculative_method="ngram", **settings)
    # Right drafts, so that no sequence pauses its drafts (a paused one pipelines: see the test above).
    llm.speculator.proposer = Replay(runs, wrong=())
    # Drafts only once at most two sequences run: 4 and 3 sequences pipeline their steps.
    llm.speculator.max_verify_rows, llm.speculator.min_drafts = 4, 1
    launches, inner = [], llm._launch

    def watched(previous):
        launched = inner(previous)
        launches.append((previous is not None, len(launched.seqs), any(s.num_draft_tokens for s in launched.seqs)))
        return launched

    llm._launch = watched
    assert [o["token_ids"] for o in llm.generate(PROMPTS, params, use_tqdm=False)] == plain
    assert llm.speculator.counts.accepted > 0
    assert any(pipelined for pipelined, _, _ in launches), "no step was queued behind another"
    assert not any(pipelined and batch <= 2 for pipelined, batch, _ in launches), "a small batch did not wait"
    assert not any(drafts for _, batch, drafts in launches if batch > 2)


def test_an_end_inside_a_run_of_accepted_drafts(tiny):
    settings = {"kvcache_block_size": 4, "num_kvcache_blocks": 64}
    params = SamplingParams(temperature=0, max_tokens=24)
    plain, _, llm = generate(tiny, settings, params)
    runs = [llm.tokenizer(prompt)["input_ids"] + plain[i, 0] for i, prompt in enumerate(PROMPTS)]
    # EOS: the first token that the first request writes from its 6th position on and not before it;
    # max_tokens: 13, inside a run of 4 drafts.
    first = plain[0, 0]
    end = next(j for j in range(5, len(first)) if first[j] not in first[:j])
    ended, _, _ = generate(tiny, settings, params, eos={first[end]})
    assert len(ended[0, 0]) == end + 1
    spec, _, _ = generate(tiny, settings, params, eos={first[end]}, runs=runs, wrong=(), speculative_method="ngram")
    assert spec == ended
    short = SamplingParams(temperature=0, max_tokens=13)
    expected, _, _ = generate(tiny, settings, short)
    spec, _, _ = generate(tiny, settings, short, runs=runs, wrong=(), speculative_method="ngram")
    assert spec == expected and all(len(tokens) == 13 for tokens in spec.values())


def test_seeded_sampling_gives_the_same_tokens_with_speculation(tiny):
    """Seeded requests at a temperature, with top-k and top-p, beside greedy ones, all verifying drafts: a verify
    row draws the token of its index with the request's generator, so every request keeps its tokens."""
    settings = {"kvcache_block_size": 4, "num_kvcache_blocks": 64}
    params = [SamplingParams(temperature=0, max_tokens=16), SamplingParams(temperature=0.9, seed=7, max_tokens=16),
              SamplingParams(temperature=0.7, seed=5, top_k=20, top_p=0.9, max_tokens=16),
              SamplingParams(temperature=1.2, seed=3, max_tokens=16)]

    def run(runs=None, **speculation):
        llm = LLM(tiny, device="cpu", **settings, **speculation)
        if runs is not None:
            llm.speculator.proposer = Replay(runs, wrong=(2,))
        return llm.generate(PROMPTS, params, use_tqdm=False), llm

    plain, llm = run()
    runs = [llm.tokenizer(p)["input_ids"] + out["token_ids"] for p, out in zip(PROMPTS, plain, strict=True)]
    spec, llm = run(runs, speculative_method="ngram")
    assert [o["token_ids"] for o in spec] == [o["token_ids"] for o in plain]
    assert llm.speculator.counts.accepted > 0


class Fixed:
    """Always proposes the same drafts."""

    def __init__(self, drafts):
        self.drafts = drafts

    def propose(self, token_ids, limit=None):
        return self.drafts[: len(self.drafts) if limit is None else limit]


def test_unseeded_sampling_keeps_the_models_distribution(monkeypatch):
    """Many unseeded samples with fixed drafts: how often the first verified token equals the first draft matches
    the plain engine's frequency within sampling noise, and an engine that accepts every draft is caught. (The tiny
    Qwen3, whose second token at temperature 0.7 is uncertain; the tiny Llama's is all but certain.)"""
    tiny = str(build_tiny_model("qwen3"))
    settings = {"kvcache_block_size": 4, "num_kvcache_blocks": 768, "max_num_seqs": 256, "max_num_batched_tokens": 4096}
    prompt, count = "Small steps make", 400
    params = SamplingParams(temperature=0.7, max_tokens=3, ignore_eos=True)

    def second_tokens(llm):
        return [out["token_ids"][1] for out in llm.generate([prompt] * count, params, use_tqdm=False)]

    plain = second_tokens(LLM(tiny, device="cpu", **settings))
    draft = Counter(plain).most_common(1)[0][0]
    rate = plain.count(draft) / count
    assert 0.1 < rate < 0.9, f"the tiny model's most likely second token has {rate:.0%}: pick another prompt"
    noise = 4 * (2 * rate * (1 - rate) / count) ** 0.5

    def speculating(accept_everything=False):
        llm = LLM(tiny, device="cpu", speculative_method="ngram", **settings)
        llm.speculator.proposer = Fixed([draft, draft])
        # All 400 sequences verify their two drafts in one step (the default rule would not speculate at 400).
        llm.speculator.max_verify_rows = 3 * count
        if accept_everything:
            accept = llm.scheduler.accept_drafts

            def planted_bug(seqs, targets):
                return accept(seqs, [[*seq.token_ids[len(seq) - seq.num_draft_tokens :], row[-1]]
                                     for seq, row in zip(seqs, targets, strict=True)])

            monkeypatch.setattr(llm.scheduler, "accept_drafts", planted_bug)
        tokens = second_tokens(llm)
        assert llm.speculator.counts.drafted >= count
        return tokens.count(draft) / count

    assert abs(speculating() - rate) < noise
    assert abs(speculating(accept_everything=True) - rate) > noise


def test_a_failing_verify_step_leaves_nothing_behind_and_runs_again(tiny, monkeypatch):
    settings = {"kvcache_block_size": 4, "num_kvcache_blocks": 32}
    params = SamplingParams(temperature=0, max_tokens=16)
    plain, _, llm = generate(tiny, settings, params)
    runs = [llm.tokenizer(prompt)["input_ids"] + plain[i, 0] for i, prompt in enumerate(PROMPTS)]
    llm = LLM(tiny, device="cpu", speculative_method="ngram", **settings)
    llm.speculator.proposer = Replay(runs)
    ids = [llm.add_request(prompt, params) for prompt in PROMPTS]
    verify, calls = llm.model_runner.verify, Counter()

    def flaky(seqs):
        calls["verify"] += 1
        if calls["verify"] in (2, 5):
            raise RuntimeError("the device fell over")
        return verify(seqs)

    monkeypatch.setattr(llm.model_runner, "verify", flaky)
    outputs, failures = {}, 0
    while not llm.is_finished():
        free = llm.scheduler.block_manager.num_free_blocks
        lengths = {seq.seq_id: len(seq) for seq in llm.scheduler.running}
        tables = {seq.seq_id: len(seq.block_table) for seq in llm.scheduler.running}
        try:
            finished = llm.step()[0]
        except RuntimeError:
            failures += 1
            # Drafts and their blocks are gone: lengths are as they were, and each table holds the blocks of its
            # tokens, the decode's own slot included (chapter 20's rollback keeps a decode step's new block).
            running = llm.scheduler.running
            assert {seq.seq_id: len(seq) for seq in running} == lengths
            assert all(len(seq.block_table) == -(-len(seq) // 4) for seq in running)
            grown = sum(len(seq.block_table) - tables[seq.seq_id] for seq in running)
            assert llm.scheduler.block_manager.num_free_blocks == free - grown
            assert all(seq.num_draft_tokens == 0 and seq.num_scheduled_tokens == 0 for seq in llm.scheduler.running)
            continue
        for output in finished:
            outputs[ids.index(output.request_id), 0] = output[1]
    assert failures == 2 and outputs == plain


def test_settings_that_cannot_work_together_are_refused(tiny):
    assert Config.from_kwargs(tiny, device="cpu").speculative_method is None
    config = Config.from_kwargs(tiny, device="cpu", speculative_method="ngram", num_speculative_tokens=6)
    assert config.num_speculative_tokens == 6 and config.async_scheduling is False
    # Asynchronous scheduling is kept: verify steps wait for the step in flight (see the async test).
    assert Config.from_kwargs(tiny, device="cpu", speculative_method="ngram", async_scheduling=True).async_scheduling
    refused = [
        ({"speculative_method": "medusa"}, ValueError, "must be one of"),
        ({"speculative_method": "draft"}, ValueError, "needs speculative_model"),
        ({"speculative_model": tiny}, ValueError, "needs speculative_method='draft'"),
        ({"speculative_method": "ngram", "speculative_model": tiny}, ValueError, "read by speculative_method='draft'"),
        ({"speculative_method": "draft", "speculative_model": str(build_tiny_model("qwen3", vocab_size=300))},
         ValueError, "must share the model's tokenizer"),
        ({"speculative_method": "draft", "speculative_model": "/no/such/model"}, Exception, "/no/such/model"),
        ({"num_speculative_tokens": 4}, ValueError, "needs a speculative_method"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 0}, ValueError, r"in \[1, 64\]"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 2.5}, TypeError, "must be an int"),
        ({"speculative_method": "ngram", "tensor_parallel_size": 2}, ValueError, "tensor_parallel_size=1"),
    ]
    for wrong, error, message in refused:
        with pytest.raises(error, match=message):
            Config.from_kwargs(tiny, device="cpu", **wrong)


def test_a_draft_model_with_another_tokenizer_of_the_same_size_is_refused(tiny, tmp_path):
    """Issue 60, item 7: a draft model whose vocabulary had the model's size but another tokenizer was accepted, and
    then never had a draft accepted. Two token ids swapped, or two merges in the other order, are refused; a copy
    of the model's own tokenizer is accepted."""
    import shutil

    def draft_with(change) -> str:
        draft = tmp_path / f"draft-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny, draft)
        tokenizer = json.loads((draft / "tokenizer.json").read_text(encoding="utf-8"))
        change(tokenizer["model"])
        (draft / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
        return str(draft)

    def swap_two_ids(model: dict) -> None:
        vocab = model["vocab"]
        first, second = sorted(vocab)[40:42]
        vocab[first], vocab[second] = vocab[second], vocab[first]

    def reorder_merges(model: dict) -> None:
        model["merges"][0], model["merges"][1] = model["merges"][1], model["merges"][0]

    draft = {"speculative_method": "draft", "device": "cpu"}
    for change in (swap_two_ids, reorder_merges):
        with pytest.raises(ValueError, match="a tokenizer of the same size with other token ids or merges"):
            Config.from_kwargs(tiny, speculative_model=draft_with(change), **draft)
    assert Config.from_kwargs(tiny, speculative_model=draft_with(lambda model: None), **draft).speculative_model


def test_the_default_drafts_fill_the_decode_graph_of_one_sequence(tiny):
    """A method's default drafts make one sequence's verify step exactly a captured graph's rows (7 drafts: the graph
    of 8; 4 drafts left 3 of its rows empty), and two sequences fill the graph of 16 within the back-off rule."""
    from nanovllm.engine.cuda_graphs import capture_sizes

    drafts = Config.from_kwargs(tiny, device="cpu", speculative_method="ngram").num_speculative_tokens
    assert 1 + drafts in capture_sizes(256)
    rule = Speculator(NgramProposer(drafts))
    assert 2 * (1 + min(drafts, rule.drafts_per_sequence(2))) in capture_sizes(256)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_speculation_on_the_gpu_gives_the_tokens_of_plain_greedy_decoding(monkeypatch):
    tiny = str(build_tiny_model("qwen3"))
    # float32: in bfloat16 a step's rounding depends on its rows (cuBLAS picks its kernel by shape), so a near tie in
    # the random tiny model can go the other way once a verify step has more rows than the decode step it replaces.
    settings = {"kvcache_block_size": 16, "num_kvcache_blocks": 64, "device": "cuda", "dtype": "float32"}
    params = SamplingParams(temperature=0, max_tokens=32)
    plain = LLM(tiny, **settings).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(tiny, speculative_method="ngram", **settings)
    runs = [llm.tokenizer(p)["input_ids"] + out["token_ids"] for p, out in zip(PROMPTS, plain, strict=True)]
    llm.speculator.proposer = Replay(runs)
    # Every verify step replays a decode graph (one row per query token), never the eager path.
    replays, replay = [], llm.model_runner.graphs.replay_loaded
    llm.model_runner.graphs.replay_loaded = lambda n: replays.append(n) or replay(n)
    monkeypatch.setattr(model_runner, "prepare_verify", None)
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o["token_ids"] for o in spec] == [o["token_ids"] for o in plain]
    assert llm.speculator.counts.accepted > 0 and max(replays) > len(PROMPTS)


@given(st.lists(st.integers(1, 5), min_size=1, max_size=60), st.integers(0, 10_000))
@settings(max_examples=50, deadline=None)
def test_a_stop_string_inside_a_run_of_accepted_tokens_cuts_the_text_where_one_token_at_a_time_does(chunks, seed):
    """A verify step hands the server several tokens at once: the streamed text and where a stop string ends it
    are those of the same tokens arriving one by one."""
    import random

    from transformers import AutoTokenizer

    from nanovllm.serve.detokenize import IncrementalDetokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model("qwen3"))
    rng = random.Random(seed)
    tokens = [rng.randrange(3, 500) for _ in range(sum(chunks))]
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    start = rng.randrange(max(1, len(text) - 3))
    stop = text[start : start + rng.randint(1, 3)] or "never"

    def stream(sizes):
        detokenizer, out, at = IncrementalDetokenizer(tokenizer, stop=[stop]), [], 0
        for size in sizes:
            out.append(detokenizer.add(tokens[at : at + size]))
            at += size
        return "".join(out) + detokenizer.finish(), detokenizer.stopped

    assert stream(chunks) == stream([1] * len(tokens))


class Batching:
    """Proposes [3, 4, ...] up to the limit, one sequence at a time or all at once, and counts the calls."""

    def __init__(self):
        self.calls = Counter()

    def propose(self, token_ids, limit=None):
        self.calls["propose"] += 1
        return list(range(3, 3 + (4 if limit is None else limit)))

    def propose_many(self, token_lists, limits):
        self.calls["propose_many"] += 1
        return [list(range(3, 3 + limit)) for limit in limits]


@pytest.mark.parametrize("budget", [64, 9])
def test_a_proposer_for_many_sequences_is_asked_once_where_the_budget_covers_every_room(budget):
    from nanovllm.engine.scheduler import Scheduler

    scheduler = Scheduler(num_kvcache_blocks=32, kvcache_block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [Sequence([5, 6, 7], SamplingParams(temperature=0, max_tokens=20), block_size=4) for _ in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    scheduled, _ = scheduler.schedule()
    scheduler.postprocess(scheduled, [9, 9, 9], True)
    scheduled, is_prefill = scheduler.schedule()
    assert not is_prefill and len(scheduled) == 3
    scheduler.max_num_batched_tokens = budget
    proposer = Batching()
    reserved = reserve(scheduler, scheduled, proposer)
    # 16 verify rows over 3 sequences: 4 drafts each; a budget of 9 leaves 6 after the 3 last tokens: 4, then 2.
    if budget == 64:
        assert proposer.calls == {"propose_many": 1} and reserved == 12
    else:
        assert proposer.calls == {"propose": 2} and reserved == 6
        assert [seq.num_draft_tokens for seq in scheduled] == [4, 2, 0]


# ---- the provenance fuzz, with drafts verified at decode steps -------------------------------------------------------
def test_every_cached_read_has_the_right_provenance_with_speculative_decoding():
    """Drafts write K/V into fresh slots and the model may reject them: still, every read finds the KV of its own
    prefix (a rejected draft's slot is written again before anyone reads it), and no step writes into a shared or
    published block."""
    runs, hit_blocks, copies = fuzz(NUM_WORKLOADS // 8, seed=SEED + 2, speculative=True)
    assert hit_blocks > runs and copies > runs // 10
