"""Property tests: random workloads through the real scheduler and block manager.

For every step of every generated workload (arrivals over time, shared prefixes, pool sizes,
budgets, chunking, preemption), the invariants of ``scheduler_sim.InvariantChecker`` hold:
ref counts equal the number of block tables holding a block; free and used partition the pool;
every scheduled sequence holds exactly ceil(len(seq) / block_size) blocks, which covers every
slot the step writes; running sequences between steps hold ceil(num_cached_tokens / block_size)
blocks with every token but the last cached; at most one partial prefill per step, the last one,
at the head of waiting; queues never lose or duplicate a sequence; no step writes K/V into a
block whose ref count is above 1 (requests with n > 1 fork after their prefill and share their
blocks; copy-on-write gives a writer its own). Every workload whose requests fit the pool
finishes within a bounded number of steps, and every completion (every sample's) equals the one
computed without any scheduler.
"""

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from tests.scheduler_sim import EOS, InvariantChecker, Request, Workload, reference_completion, simulate

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def workloads(draw, fit: bool = True) -> Workload:
    block_size = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(1, 12))
    prefixes = draw(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=8), min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 7))):
        prefix = draw(st.sampled_from([[], *prefixes]))
        prompt = prefix + draw(st.lists(st.integers(0, 4), min_size=0 if prefix else 1, max_size=6))
        request = Request(
            arrival=draw(st.integers(0, 8)),
            prompt=prompt,
            max_tokens=draw(st.integers(1, 6)),
            ignore_eos=draw(st.booleans()),
            n=draw(st.sampled_from([1, 1, 2, 3])),
        )
        requests.append(request)
    max_num_seqs = draw(st.integers(1, 5))
    if fit:
        max_num_seqs = max(max_num_seqs, *(r.n for r in requests))
    workload = Workload(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(1, 16)),
        enable_prefix_caching=draw(st.booleans()),
        eos=(EOS,) if draw(st.booleans()) else (),
        requests=requests,
    )
    if fit:
        # Grow the pool until every request fits it (what the engine's admission check requires).
        need = max(math.ceil((len(r.prompt) + r.max_tokens - 1) / block_size) for r in requests)
        workload.num_blocks = max(num_blocks, need)
    return workload


@SETTINGS
@given(workloads())
def test_invariants_hold_every_step_and_every_workload_finishes(workload):
    checker = InvariantChecker(workload)
    seqs, _steps = simulate(workload, checker.after_schedule, checker.after_postprocess)
    check_completions(workload, seqs)
    assert set(checker.finished) == {s.seq_id for s in seqs}  # each finished exactly once, none lost


def check_completions(workload: Workload, seqs: list[Sequence]) -> None:
    """Every sample of every request finished, with the completion computed without a scheduler."""
    eos = frozenset(workload.eos)
    assert len(seqs) == len(workload.samples())
    for seq, (request, sample_index) in zip(seqs, workload.samples(), strict=True):
        assert seq.is_finished and not seq.block_table and seq.sample_index == sample_index
        assert seq.completion_token_ids == reference_completion(
            request.prompt, request.max_tokens, request.ignore_eos, eos, sample_index
        )


@SETTINGS
@given(workloads(fit=False))
def test_add_rejects_exactly_the_requests_that_can_never_fit(workload):
    fitting = Workload(**{**workload.__dict__, "requests": [r for r in workload.requests if workload.fits(r)]})
    sched = workload.scheduler()
    for request in workload.requests:
        params = SamplingParams(max_tokens=request.max_tokens, n=request.n)
        seq = Sequence(request.prompt, params, block_size=workload.block_size)
        try:
            sched.check_fits(seq)
            sched.add(seq)
            accepted = True
        except ValueError as error:
            assert "can never fit" in str(error) or "raise max_num_seqs" in str(error)
            accepted = False
        assert accepted == workload.fits(request)
    assert len(sched.waiting) == len(fitting.requests)
    if fitting.requests:
        checker = InvariantChecker(fitting)
        simulate(fitting, checker.after_schedule, checker.after_postprocess)


@SETTINGS
@given(workloads())
def test_pool_is_whole_again_at_the_end(workload):
    seen = {}

    def remember(sched, seqs, is_prefill):
        seen["bm"] = sched.block_manager

    simulate(workload, after_postprocess=remember)
    bm = seen["bm"]
    assert bm.num_free_blocks == bm.num_blocks and not bm.used_block_ids
    assert all(block.ref_count == 0 for block in bm.blocks)
