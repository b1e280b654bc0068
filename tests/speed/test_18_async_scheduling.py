"""Chapter 18: asynchronous scheduling, the host one step ahead of the device.

A token that is still computing (``PENDING_TOKEN``, filled in later); the scheduler in two halves, ``advance`` and
``resolve``, forks included; ``SampledTokens`` and the runner's ``launch``; the engine with one step in flight,
against the synchronous engine; and the scheduler's property tests and the provenance fuzz run the way the
asynchronous engine runs them, each step resolved after the next one is scheduled.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given

from nanovllm.config import Config
from nanovllm.engine.model_runner import NOT_SAMPLED, ModelRunner, SampledTokens, prepare_decode
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from nanovllm.layers.context import get_context, reset_context
from nanovllm.layers.sampler import NON_FINITE
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams
from tests.core.test_provenance_fuzz import NUM_WORKLOADS, SEED, fuzz
from tests.core.test_scheduler_properties import SETTINGS, check_completions, workloads
from tests.scheduler_sim import InvariantChecker, simulate

WAITING, RUNNING, FINISHED = SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.FINISHED


def make(blocks=16, bs=4, seqs=4, tokens=16, eos=(), caching=True) -> Scheduler:
    return Scheduler(
        num_kvcache_blocks=blocks,
        kvcache_block_size=bs,
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
        eos_token_ids=eos,
        enable_prefix_caching=caching,
    )


def seq(n_or_tokens, max_tokens=4, bs=4, ignore_eos=False) -> Sequence:
    tokens = list(range(100, 100 + n_or_tokens)) if isinstance(n_or_tokens, int) else n_or_tokens
    return Sequence(tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), block_size=bs)


def request(length: int, n: int, max_tokens: int = 4, bs: int = 4, start: int = 100) -> Sequence:
    return Sequence(range(start, start + length), SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n),
                    block_size=bs)  # fmt: skip


# Chapter 05's scheduler for requests with n samples (a larger token budget than chapter 04's `make`, no EOS ids).
def make_for_samples(blocks: int = 16, bs: int = 4, seqs: int = 4, tokens: int = 64, caching: bool = True) -> Scheduler:
    return Scheduler(num_kvcache_blocks=blocks, kvcache_block_size=bs, max_num_seqs=seqs,
                     max_num_batched_tokens=tokens, enable_prefix_caching=caching)  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_context():
    reset_context()
    yield
    reset_context()


def scheduled(tokens: list[int], table: list[int], cached: int, count: int, block_size: int = 4) -> Sequence:
    seq = Sequence(tokens, SamplingParams(temperature=0), block_size=block_size)
    seq.block_table, seq.num_cached_tokens, seq.num_scheduled_tokens = table, cached, count
    return seq


# ---- Sequence: a pending token, counted now and filled in later ------------------------------------------------------
def test_a_pending_token_is_counted_then_filled_in() -> None:
    seq = Sequence([1, 2, 3], block_size=2)
    index = seq.append_pending_token()
    assert index == 3 and len(seq) == 4 and seq.last_token == PENDING_TOKEN and seq.num_blocks == 2
    seq.set_token(3, 9)
    assert seq.completion_token_ids == [9]
    with pytest.raises(AssertionError, match="not pending"):
        seq.set_token(3, 10)  # already filled in


def test_truncate_drops_tokens_past_a_finish_but_never_the_prompt() -> None:
    seq = Sequence([1, 2, 3], block_size=2)
    seq.append_token(7)
    seq.append_pending_token()
    seq.num_cached_tokens = 4
    seq.truncate(4)
    assert seq.token_ids == [1, 2, 3, 7] and seq.num_cached_tokens == 4
    seq.truncate(3)
    assert seq.token_ids == [1, 2, 3] and seq.num_cached_tokens == 3
    for bad in (2, 5):
        with pytest.raises(AssertionError):
            seq.truncate(bad)


def test_a_preempted_sequence_may_finish_while_waiting() -> None:
    seq = Sequence([1], block_size=4)
    seq.status = SequenceStatus.RUNNING
    seq.status = SequenceStatus.WAITING  # preempted while its newest token was being computed
    seq.status = SequenceStatus.FINISHED  # ... which turned out to end it
    assert seq.is_finished


# ---- the scheduler in two halves: advance counts a step, resolve fills in its tokens ---------------------------------
def test_advance_counts_the_step_and_resolve_fills_in_the_tokens() -> None:
    s = make()
    a, b = seq(5), seq(3)
    s.add(a), s.add(b)
    seqs, is_prefill = s.schedule()
    seqs, indices = s.advance(seqs, is_prefill)
    assert indices == [5, 3] and a.last_token == b.last_token == PENDING_TOKEN
    assert a.num_cached_tokens == 5 and a.num_scheduled_tokens == 0
    # The next step is scheduled before the tokens are known: each decodes its pending token.
    decode, is_prefill = s.schedule()
    assert decode == [a, b] and not is_prefill
    assert s.resolve(seqs, indices, [40, 41]) == []
    assert a.token_ids[-1] == 40 and b.token_ids[-1] == 41


def test_resolve_finishes_on_eos_and_drops_the_token_computed_after_it() -> None:
    s = make(eos={2})
    a = seq(4, max_tokens=10)
    s.add(a)
    first, _ = s.schedule()
    first, first_indices = s.advance(first, True)
    second, _ = s.schedule()  # a's pending token is decoded before anyone knows it is EOS
    second, second_indices = s.advance(second, False)
    assert len(a) == 6
    assert s.resolve(first, first_indices, [2]) == [a]
    assert a.is_finished and a.token_ids == [100, 101, 102, 103, 2] and not a.block_table
    assert s.resolve(second, second_indices, [7]) == []  # computed past the end: ignored
    assert a.token_ids[-1] == 2 and s.is_finished() and s.block_manager.num_free_blocks == 16


def test_max_tokens_frees_the_blocks_at_advance_and_finishes_at_resolve() -> None:
    s = make(blocks=1)
    a, b = seq(4, max_tokens=1), seq(4, max_tokens=1)
    s.add(a), s.add(b)
    first, _ = s.schedule()
    assert first == [a]  # one block, a's: b must wait for it
    first, indices = s.advance(first, True)
    assert not a.block_table and not s.running and not a.is_finished
    second, _ = s.schedule()  # b gets the blocks a gave back, before a's token is known
    assert second == [b]
    assert s.resolve(first, indices, [9]) == [a] and a.completion_token_ids == [9]


def test_a_sequence_preempted_with_a_pending_token_can_finish_in_waiting() -> None:
    s = make(blocks=3, eos={2})
    a, b = seq(4, max_tokens=8), seq(3, max_tokens=8)
    s.add(a), s.add(b)
    prefill, _ = s.schedule()
    prefill, indices = s.advance(prefill, True)
    s.resolve(prefill, indices, [5, 6])
    decode, _ = s.schedule()
    decode, decode_indices = s.advance(decode, False)
    # Both now need a third block and one is free: the next schedule preempts b, whose token is pending.
    step_three, _ = s.schedule()
    assert b.status is WAITING and list(s.waiting) == [b] and step_three == [a]
    assert s.resolve(decode, decode_indices, [7, 2]) == [b]
    assert b.is_finished and not s.waiting and b.completion_token_ids == [6, 2]


def test_async_advance_forks_with_pending_first_tokens() -> None:
    sched = make_for_samples()
    parent = request(6, n=3)
    sched.add(parent)
    seqs, is_prefill = sched.schedule()
    counted, indices = sched.advance(seqs, is_prefill)
    assert counted[0] is parent and len(counted) == 3 and indices == [6, 6, 6]
    assert all(s.last_token == PENDING_TOKEN for s in counted)
    decode, _ = sched.schedule()  # the next step is scheduled before the first tokens are known
    assert decode == counted and sum(len(s.blocks_to_copy) for s in decode) == 2
    assert sched.resolve(counted, indices, [7, 8, 9]) == []
    assert [s.token_ids[6] for s in counted] == [7, 8, 9]


def test_sampled_tokens_give_the_forked_siblings_their_rows() -> None:
    parent, other = request(6, n=3), request(3, n=1, start=200)
    for s in (parent, other):
        s.num_scheduled_tokens = len(s)
    # Rows: parent, other, then the parent's two siblings (sibling_samples order), keyed by request and sample.
    step = SampledTokens.start([parent, other], [0, 1], torch.tensor([70, 71, 72, 73]))
    assert step.samples == [(parent.seq_id, 0), (other.seq_id, 0), (parent.seq_id, 1), (parent.seq_id, 2)]
    assert step.token_ids() == [70, 71, 72, 73]
    siblings = [parent.fork(1), parent.fork(2)]
    for s in [parent, other, *siblings]:
        s.append_pending_token()
    ids = step.input_ids_for([siblings[1], parent, siblings[0]], torch.tensor([PENDING_TOKEN] * 3))
    assert ids.tolist() == [73, 70, 72]


# ---- the runner: SampledTokens, launch, and a step's input ids from the step before ----------------------------------
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


# ---- the engine: one step in flight ----------------------------------------------------------------------------------
def _frequent_tokens(tiny: Path, prompts: list[list[int]], regime: dict) -> frozenset[int]:
    """Five tokens the model often generates for these prompts: made EOS ids, they end sequences early."""
    llm = LLM(str(tiny), async_scheduling=False, **regime)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=25, ignore_eos=True), use_tqdm=False)
    return frozenset(t for t, _ in Counter(t for o in outputs for t in o["token_ids"][2:]).most_common(5))


@pytest.mark.parametrize(
    "regime",
    [
        {"kvcache_block_size": 4, "num_kvcache_blocks": 128},
        {"kvcache_block_size": 4, "num_kvcache_blocks": 12},  # preemption
        {"kvcache_block_size": 4, "num_kvcache_blocks": 128, "max_num_batched_tokens": 7},  # chunked prefill
        {"kvcache_block_size": 2, "num_kvcache_blocks": 24, "max_num_batched_tokens": 9, "max_num_seqs": 3,
         "enable_prefix_caching": False},
        {"kvcache_block_size": 8, "num_kvcache_blocks": 32, "max_num_seqs": 1},
    ],
    ids=["plain", "preemption", "chunks", "everything", "one-at-a-time"],
)
def test_async_scheduling_gives_the_same_tokens_and_frees_everything(tiny: Path, regime: dict) -> None:
    """Greedy and seeded requests, sequences ending on EOS mid-batch (after the next step was already
    scheduled), max_tokens of 1: the tokens equal the synchronous engine's, and no block is leaked."""
    prompts = [[3 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate([10, 9, 11, 6, 12, 1, 23, 5])]
    params = [SamplingParams(temperature=0, max_tokens=25), SamplingParams(temperature=1.0, seed=3, max_tokens=25),
              SamplingParams(temperature=0, max_tokens=1), SamplingParams(temperature=0.7, seed=8, max_tokens=9,
                                                                         ignore_eos=True)] * 2
    eos = _frequent_tokens(tiny, prompts, regime)
    outputs, stops = {}, {}
    for scheduling in (False, True):
        llm = LLM(str(tiny), async_scheduling=scheduling, **regime)
        llm.scheduler.eos_token_ids = eos
        outputs[scheduling] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        pool = llm.scheduler.block_manager
        assert llm.is_finished() and llm.in_flight is None
        assert len(pool.free_block_ids) == pool.num_blocks
        ends = zip(outputs[scheduling], params, strict=True)
        stops[scheduling] = sum(o[-1] in eos and len(o) < p.max_tokens for o, p in ends)
    assert outputs[True] == outputs[False]
    assert stops[True] >= 2, "the test needs sequences that stop on EOS before max_tokens"


def test_async_step_reports_the_step_before(tiny: Path) -> None:
    llm = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=32, async_scheduling=True)
    seq_id = llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert llm.step() == ([], 0, True)  # the prefill is queued, nothing is collected yet
    assert llm.in_flight is not None and not llm.is_finished()
    finished, num_tokens, is_prefill = llm.step()  # queues the decode step, collects the prefill
    assert (finished, num_tokens, is_prefill) == ([], 3, True)
    finished, num_tokens, is_prefill = llm.step()  # nothing left to schedule: collects the decode step
    assert [seq_id] == [i for i, _ in finished] and (num_tokens, is_prefill) == (1, False)
    assert llm.is_finished() and len(finished[0][1]) == 2


def test_async_scheduling_is_allowed_with_tensor_parallelism(tiny: Path) -> None:
    # Chapter 16's ranks take pending tokens from their own copy of the previous step's samples.
    assert Config.from_kwargs(tiny, tensor_parallel_size=2, async_scheduling=True, device="cpu").async_scheduling
    assert not Config.from_kwargs(tiny, tensor_parallel_size=2, device="cpu").async_scheduling  # auto: CUDA only


# ---- the property tests and the provenance fuzz, each step resolved after the next is scheduled ----------------------
@SETTINGS
@given(workloads())
def test_async_scheduling_keeps_the_invariants_and_the_completions(workload):
    """Each step resolved one step late (chapter 10): the same invariants between steps, every request
    finishes exactly once with the completion a synchronous run gives, the pool ends whole."""
    checker, seen = InvariantChecker(workload), {}

    def after_resolve(sched, seqs, is_prefill):
        checker.after_postprocess(sched, seqs, is_prefill)
        seen["bm"] = sched.block_manager

    seqs, _steps = simulate(workload, checker.after_schedule, after_resolve, asynchronous=True)
    check_completions(workload, seqs)
    assert set(checker.finished) == {s.seq_id for s in seqs}
    bm = seen["bm"]
    assert bm.num_free_blocks == bm.num_blocks and all(block.ref_count == 0 for block in bm.blocks)


def test_every_cached_read_has_the_right_provenance_with_async_scheduling():
    """Blocks are published when a step is resolved, which is after the next step was queued: still,
    no step reads a slot before the step that writes it (the GPU runs the queue in order)."""
    runs, hit_blocks, copies = fuzz(NUM_WORKLOADS // 4, seed=SEED + 1, asynchronous=True)
    assert hit_blocks > runs and copies > runs // 10



# ---- the sampler inside the captured step (SamplingGraphs) ---------------------------------------------------------
def test_plain_temperatures_sends_a_step_with_any_filter_seed_or_fork_to_the_eager_sampler() -> None:
    from nanovllm.engine.cuda_graphs import plain_temperatures

    def decoding(params: SamplingParams) -> Sequence:
        return Sequence([1, 2, 3], params, block_size=4)

    plain = [decoding(SamplingParams(temperature=0.0)), decoding(SamplingParams(temperature=0.5, top_p=1.0))]
    assert plain_temperatures(plain) == [0.0, 0.5]
    assert plain_temperatures([]) == []
    for odd in (SamplingParams(top_k=5), SamplingParams(top_p=0.5), SamplingParams(seed=3)):
        assert plain_temperatures([*plain, decoding(odd)]) is None
    assert plain_temperatures([decoding(SamplingParams(top_k=None))]) == [1.0]
    forking = decoding(SamplingParams(n=3))
    assert forking.pending_forks == 2 and plain_temperatures([*plain, forking]) is None


def test_sample_in_graph_is_on_only_with_graphs_on_one_rank(tiny: Path) -> None:
    assert not Config.from_kwargs(tiny, device="cpu").sample_in_graph  # auto: CUDA graphs only
    for settings in ({"device": "cpu"}, {"device": "cpu", "tensor_parallel_size": 2}):
        with pytest.raises(ValueError, match="sample_in_graph=True needs CUDA graphs on one rank"):
            Config.from_kwargs(tiny, sample_in_graph=True, **settings)
    with pytest.raises(ValueError, match="sample_in_graph"):
        Config.from_kwargs(tiny, device="cpu", sample_in_graph="yes")


class _LinearHead(torch.nn.Module):
    """A stand-in model for SamplingGraphs: compute_logits is one matmul over the graph's output rows."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states @ self.weight.T


def _sampling_graphs(hidden: int, vocab: int, sizes: list[int]):
    """SamplingGraphs over stand-in decode graphs (only what it reads of a CudaGraphRunner), captured."""
    from types import SimpleNamespace

    from nanovllm.engine.cuda_graphs import SamplingGraphs, graph_batch_size
    from nanovllm.layers.triton_sampler import triton_temperature_sample

    graphs = SimpleNamespace(sizes=sizes, device=torch.device("cuda"), pool=None,
                             outputs=torch.zeros(sizes[-1], hidden, device="cuda"),
                             bucket=lambda n: graph_batch_size(n, sizes))  # fmt: skip
    weight = torch.randn(vocab, hidden, device="cuda")
    sampling = SamplingGraphs(_LinearHead(weight), graphs, triton_temperature_sample)
    sampling.capture()
    return sampling, graphs, weight


@pytest.mark.gpu
def test_gpu_sampling_graphs_draw_greedy_rows_exactly_and_new_noise_at_every_replay() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sampling, graphs, weight = _sampling_graphs(hidden=32, vocab=1000, sizes=[1, 2, 4, 8])
    graphs.outputs.copy_(torch.randn(8, 32, device="cuda"))
    logits = graphs.outputs @ weight.T
    greedy = sampling.sample([0.0] * 5).clone()
    assert torch.equal(greedy, logits[:5].argmax(-1))
    key = int(sampling.seed)
    first = sampling.sample([1.0] * 8).clone()
    second = sampling.sample([1.0] * 8).clone()
    # Eight rows of 1,000 columns at temperature 1: two replays agree on every row by chance with tiny odds.
    assert int(sampling.seed) == key + 2 and not torch.equal(first, second)
    graphs.outputs[2] = float("nan")
    assert sampling.sample([0.0, 1.0, 1.0])[2].item() == NON_FINITE


@pytest.mark.gpu
def test_gpu_sampling_graphs_sample_the_softmax() -> None:
    """Chapter 12's chi-square test, replayed from the graph: 300 replays of 64 rows of the same six logits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sampling, graphs, _ = _sampling_graphs(hidden=6, vocab=6, sizes=[64])
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], device="cuda")
    # The identity head: the graph's output rows are the logits (the tensor the graphs captured, filled in place).
    sampling.model.weight.copy_(torch.eye(6, device="cuda"))
    graphs.outputs.copy_(base.repeat(64, 1))
    temperature = 2.5
    draws = torch.cat([sampling.sample([temperature] * 64).clone() for _ in range(300)])
    observed = torch.bincount(draws.cpu(), minlength=6).double()
    expected = draws.numel() * (base.cpu() / temperature).softmax(-1).double()
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    assert chi_square < 20.5, (observed, expected)  # 5 degrees of freedom, 99.9 % quantile


@pytest.mark.gpu
def test_gpu_sample_in_graph_gives_the_eager_samplers_greedy_tokens(tiny: Path) -> None:
    """The engine with and without the captured sampler: the same greedy tokens; plain steps replay the sampling
    graphs, and a batch with a top-p row falls back to the eager sampler for its steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from nanovllm.engine.cuda_graphs import SamplingGraphs

    prompts = [[3 + i for i in range(n)] for n in (5, 17, 40, 9)]
    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 7, 19, 44)]
    # Top-p at temperature 0 is still greedy, but it sends its steps to the eager sampler.
    mixed = [*greedy[:3], SamplingParams(temperature=0, top_p=0.5, max_tokens=44, ignore_eos=True)]
    replays = []
    real_sample = SamplingGraphs.sample
    tokens = {}
    for in_graph in (False, True):
        llm = LLM(str(tiny), dtype="float32", sample_in_graph=in_graph, kvcache_block_size=16,
                  num_kvcache_blocks=64, max_model_len=256, max_num_seqs=8)  # fmt: skip
        try:
            assert (llm.model_runner.sampling_graphs is not None) == in_graph
            if in_graph:
                sampling = llm.model_runner.sampling_graphs
                sampling.sample = lambda temperatures, graphs=sampling: replays.append(len(temperatures)) or \
                    real_sample(graphs, temperatures)
            for name, params in (("greedy", greedy), ("mixed", mixed)):
                before = len(replays)
                tokens[in_graph, name] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
                if in_graph and name == "mixed":
                    # Only the steps after the top-p request finished (it has the most tokens to go) are plain.
                    assert len(replays) - before < 44
        finally:
            llm.exit()
    assert tokens[True, "greedy"] == tokens[False, "greedy"] == tokens[False, "mixed"] == tokens[True, "mixed"]
    assert sorted(set(replays)) == [1, 2, 3, 4]
