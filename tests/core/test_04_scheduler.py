"""Chapter 04: the scheduler (prefill first, budget, chunks, preemption, finishing, bad input)."""

import pytest

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

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


def step(s: Scheduler, token: int = 1):
    seqs, is_prefill = s.schedule()
    plan = [(x, x.num_cached_tokens, x.num_scheduled_tokens) for x in seqs]
    s.postprocess(seqs, [token] * len(seqs), is_prefill)
    return plan, is_prefill


def test_keyword_only_and_defaults():
    with pytest.raises(TypeError):
        Scheduler(8, 4, 2, 8)
    s = make()
    assert s.observer is None and s.is_finished() and not s.waiting and not s.running
    assert s.block_manager.prefix_cache is not None and s.eos_token_ids == frozenset()


def test_check_fits_accepts_exactly_what_fits_the_whole_cache():
    s = make(blocks=4, bs=4)
    ok = seq(10, max_tokens=7)  # 16 KV tokens = 4 blocks
    assert ok.max_kv_tokens == 16
    s.check_fits(ok)
    s.add(ok)
    with pytest.raises(ValueError, match="can never fit the KV cache"):
        s.check_fits(seq(10, max_tokens=8))
    with pytest.raises(ValueError, match="can never fit"):
        s.check_fits(seq(17, max_tokens=1))
    assert list(s.waiting) == [ok]
    while not s.is_finished():
        step(s)
    assert ok.num_completion_tokens == 7


def test_add_asserts_a_new_sequence_of_the_cache_block_size():
    # The engine makes every sequence with Config.kvcache_block_size: a mismatch is a bug, not bad input.
    s = make(bs=4)
    with pytest.raises(AssertionError, match="block sizes"):
        s.add(seq(3, bs=8))
    a = seq(3)
    s.add(a)
    b = seq(3)
    b.status = RUNNING
    with pytest.raises(AssertionError, match="not new"):
        s.add(b)
    assert list(s.waiting) == [a]


def test_schedule_with_nothing_to_do_is_a_bug():
    with pytest.raises(AssertionError, match="nothing to schedule"):
        make().schedule()


def test_prefill_first_and_steps_are_never_mixed():
    s = make(blocks=32, tokens=64)
    a = seq(5, max_tokens=5)
    s.add(a)
    plan, is_prefill = step(s)
    assert is_prefill and plan == [(a, 0, 5)] and a.status is RUNNING
    plan, is_prefill = step(s)
    assert not is_prefill and plan == [(a, 5, 1)]
    b = seq(3, max_tokens=2)
    s.add(b)
    plan, is_prefill = step(s)  # a new arrival: prefill comes first, a waits
    assert is_prefill and plan == [(b, 0, 3)]
    plan, is_prefill = step(s)
    assert not is_prefill and [p[0] for p in plan] == [a, b] and all(p[2] == 1 for p in plan)


def test_token_budget_and_sequence_cap():
    s = make(blocks=64, seqs=2, tokens=10)
    xs = [seq(4) for _ in range(4)]
    for x in xs:
        s.add(x)
    plan, _ = step(s)
    assert [p[0] for p in plan] == xs[:2]  # cap of 2 sequences
    plan, _ = step(s)
    assert [p[0] for p in plan] == xs[2:]
    plan, is_prefill = step(s)
    assert not is_prefill and len(plan) == 2  # decode obeys the cap too
    s2 = make(blocks=64, seqs=8, tokens=3)
    ys = [seq(1, max_tokens=3) for _ in range(5)]
    for y in ys:
        s2.add(y)
    plan, _ = step(s2)
    assert len(plan) == 3  # 1-token prompts: the budget of 3 is the limit
    step(s2)
    plan, is_prefill = step(s2)
    assert not is_prefill and len(plan) == 3  # decode: one token per sequence, within the budget


def test_chunked_prefill_keeps_blocks_stays_at_head_and_discards_its_sample():
    s = make(blocks=16, bs=4, seqs=4, tokens=6)
    a, b = seq(10, max_tokens=2), seq(3, max_tokens=2)
    s.add(a)
    s.add(b)
    seqs, is_prefill = s.schedule()
    assert is_prefill and seqs == [a] and a.num_scheduled_tokens == 6
    assert len(a.block_table) == 3 and s.waiting[0] is a and a.status is WAITING
    assert a.scheduled_token_ids == list(range(100, 106))
    s.postprocess(seqs, [42], is_prefill)
    assert a.num_tokens == 10 and a.num_cached_tokens == 6 and a.completion_token_ids == []
    table = list(a.block_table)
    seqs, is_prefill = s.schedule()
    # the chunk continues first; b fits the 2 tokens of budget left only partly: a second chunk, last
    assert seqs == [a, b] and a.num_scheduled_tokens == 4 and b.num_scheduled_tokens == 2
    assert a.block_table == table and s.waiting[0] is b and list(s.running) == [a]
    s.postprocess(seqs, [7, 8], is_prefill)
    assert a.completion_token_ids == [7] and b.completion_token_ids == [] and b.num_cached_tokens == 2


def test_at_most_one_partial_sequence_per_step_and_it_is_the_last():
    s = make(blocks=64, bs=2, seqs=8, tokens=7)
    xs = [seq(3, bs=2) for _ in range(5)]
    for x in xs:
        s.add(x)
    for _ in range(4):
        seqs, is_prefill = s.schedule()
        partial = [x for x in seqs if x.num_cached_tokens + x.num_scheduled_tokens < len(x)]
        assert len(partial) <= 1 and (not partial or partial[0] is seqs[-1])
        assert sum(x.num_scheduled_tokens for x in seqs) <= 7
        s.postprocess(seqs, [1] * len(seqs), is_prefill)


def test_decode_block_table_covers_the_new_token():
    s = make(blocks=16, bs=2, tokens=64)
    a = seq(3, max_tokens=6, bs=2)
    s.add(a)
    step(s)
    while not a.is_finished:
        seqs, is_prefill = s.schedule()
        assert not is_prefill and seqs == [a]
        pos = a.num_cached_tokens
        assert pos == len(a) - 1 and len(a.block_table) * 2 > pos and len(a.block_table) == a.num_blocks
        s.postprocess(seqs, [1], is_prefill)


def test_preemption_takes_the_newest_first_and_requeues_at_the_head():
    s = make(blocks=6, bs=2, seqs=3, tokens=64, caching=False)
    a, b, c = (seq(4, max_tokens=4, bs=2, ignore_eos=True) for _ in range(3))
    for x in (a, b, c):
        s.add(x)
    step(s)  # all three prefilled: 2 blocks each, pool full; each now has 5 tokens
    assert s.block_manager.num_free_blocks == 0
    seqs, is_prefill = s.schedule()
    # a needs a third block: c (newest) is preempted, and its two blocks serve both a and b
    assert not is_prefill and seqs == [a, b]
    assert list(s.waiting) == [c] and c.status is WAITING and c.block_table == [] and c.num_cached_tokens == 0
    assert list(s.running) == [a, b]
    s.postprocess(seqs, [1, 1], is_prefill)
    assert len(c) == 5  # its generated token is kept: it is recomputed as part of its prompt later


def test_a_sequence_preempts_itself_when_it_is_the_last_one():
    s = make(blocks=3, bs=2, seqs=4, tokens=64, caching=False)
    a, b = seq([1, 2], max_tokens=4, bs=2), seq([3, 4], max_tokens=4, bs=2)
    s.add(a)
    s.add(b)
    step(s)
    assert s.block_manager.num_free_blocks == 1
    seqs, is_prefill = s.schedule()
    assert seqs == [a] and not is_prefill
    assert list(s.waiting) == [b] and b.block_table == [] and list(s.running) == [a]
    s.postprocess(seqs, [5], is_prefill)
    while not s.is_finished():
        step(s)
    assert a.num_completion_tokens == b.num_completion_tokens == 4


def test_observer_reports_preemptions_and_cache_hits():
    s = make(blocks=6, bs=2, seqs=3, tokens=64)
    events = []
    s.observer = lambda event, data: events.append((event, data))
    system = [9, 9, 8, 8]
    a, b, c = (seq([*system, i], max_tokens=4, bs=2, ignore_eos=True) for i in range(3))
    s.add(a)
    assert events[-1] == ("add", {"seq": a})
    step(s)
    s.add(b)
    s.add(c)
    step(s)
    schedule_event = [d for e, d in events if e == "schedule"][-1]
    assert schedule_event["is_prefill"] and schedule_event["cache_hits"] == {b.seq_id: a.block_table[:2],
                                                                            c.seq_id: a.block_table[:2]}
    while not s.is_finished():
        step(s)
    kinds = [e for e, _ in events]
    assert kinds.count("schedule") == kinds.count("postprocess")
    preempted = [x for e, d in events if e == "schedule" for x in d["preempted"]]
    finished = [x for e, d in events if e == "postprocess" for x in d["finished"]]
    assert preempted and sorted(x.seq_id for x in finished) == sorted(x.seq_id for x in (a, b, c))
    for e, d in events:
        if e == "postprocess":
            assert set(d) == {"seqs", "token_ids", "finished"} and len(d["seqs"]) == len(d["token_ids"])
        if e == "schedule":
            assert set(d) == {"seqs", "is_prefill", "preempted", "cache_hits"}


def test_preempted_sequence_revives_its_cached_blocks():
    s = make(blocks=7, bs=2, seqs=3, tokens=64)
    a = seq([1, 2, 3, 4, 5], max_tokens=6, bs=2, ignore_eos=True)
    b = seq([6, 7, 8, 9, 10], max_tokens=6, bs=2, ignore_eos=True)
    s.add(a)
    s.add(b)
    step(s)  # 3 blocks each, 1 free
    events = []
    s.observer = lambda event, data: events.append((event, data))
    while not any(d["preempted"] for e, d in events if e == "schedule"):
        step(s)
    assert b in s.waiting
    while b.status is WAITING:
        step(s)
    hits = [d["cache_hits"] for e, d in events if e == "schedule" and b.seq_id in d["cache_hits"]]
    assert hits and len(hits[0][b.seq_id]) >= 1  # its first blocks were still cached


def test_finish_on_eos_unless_ignored_and_on_max_tokens():
    s = make(eos=[7])
    a, b, c = seq(3, max_tokens=5), seq(3, max_tokens=5, ignore_eos=True), seq(3, max_tokens=1)
    for x in (a, b, c):
        s.add(x)
    step(s, token=7)
    assert a.is_finished and a.completion_token_ids == [7]
    assert c.is_finished and c.completion_token_ids == [7]
    assert not b.is_finished and list(s.running) == [b]
    assert a.block_table == [] and c.block_table == []
    while not s.is_finished():
        step(s, token=7)
    assert b.completion_token_ids == [7] * 5 and s.block_manager.num_free_blocks == 16


def test_postprocess_rejects_mismatched_or_unscheduled_input():
    s = make()
    a = seq(3)
    s.add(a)
    seqs, is_prefill = s.schedule()
    with pytest.raises(AssertionError):
        s.postprocess(seqs, [1, 2], is_prefill)
    s.postprocess(seqs, [1], is_prefill)
    with pytest.raises(AssertionError):
        s.postprocess(seqs, [1], is_prefill)  # the same step twice
    assert a.num_cached_tokens == 3 and a.completion_token_ids == [1]


def test_prefix_caching_off_still_works():
    s = make(blocks=8, bs=2, caching=False)
    a, b = seq([1, 2, 3, 4, 5], bs=2), seq([1, 2, 3, 4, 6], bs=2)
    s.add(a)
    step(s)
    s.add(b)
    seqs, _ = s.schedule()
    assert seqs == [b] and b.num_cached_tokens == 0 and b.num_scheduled_tokens == 5
