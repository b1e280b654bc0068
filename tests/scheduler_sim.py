"""A model-free driver for the scheduler, shared by the property tests and the provenance fuzz.

``simulate`` plays the engine loop on a ``Workload``: requests arrive at given steps, a fake model
returns a token that depends only on the tokens a sequence has computed so far (as a greedy model
would), and hooks see the scheduler's state after every ``schedule`` and ``postprocess``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from nanovllm.engine.scheduler import Observer, Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus, sibling_samples
from nanovllm.engine.speculative import Proposer, Speculator
from nanovllm.sampling_params import SamplingParams

VOCAB = 5
EOS = 0


def next_token(context: tuple[int, ...], sample_index: int = 0) -> int:
    """The fake model and sampler: a deterministic function of the whole context and of which of its
    request's samples draws (the n samples of parallel sampling diverge, as sampled ones would)."""
    return hash(context if sample_index == 0 else (context, sample_index)) % VOCAB


def reference_completion(
    prompt: list[int], max_tokens: int, ignore_eos: bool, eos: frozenset[int], sample_index: int = 0
) -> list[int]:
    """What a request (or sample ``sample_index`` of it) must generate, computed without any scheduler."""
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        token = next_token(tuple(tokens), sample_index)
        tokens.append(token)
        out.append(token)
        if not ignore_eos and token in eos:
            break
    return out


@dataclass
class Request:
    arrival: int
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    n: int = 1  # samples of the prompt (parallel sampling: one prefill, then n - 1 forks)


@dataclass
class Workload:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    eos: tuple[int, ...]
    requests: list[Request] = field(default_factory=list)

    def scheduler(self) -> Scheduler:
        return Scheduler(
            num_kvcache_blocks=self.num_blocks,
            kvcache_block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            eos_token_ids=self.eos,
            enable_prefix_caching=self.enable_prefix_caching,
        )

    def fits(self, request: Request) -> bool:
        # The scheduler refuses only what can never fit the KV cache; the engine also caps n (chapter 10).
        return math.ceil((len(request.prompt) + request.max_tokens - 1) / self.block_size) <= self.num_blocks

    def samples(self) -> list[tuple[Request, int]]:
        """(request, sample index) for every sequence the workload ends with, in `simulate`'s order."""
        return [(request, j) for request in self.requests for j in range(request.n)]


class Violation(AssertionError):
    """An invariant failed; the message says which."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Violation(message)


StepHook = Callable[[Scheduler, list[Sequence], bool], None]


def simulate(
    workload: Workload,
    after_schedule: StepHook | None = None,
    after_postprocess: StepHook | None = None,
    max_steps: int | None = None,
    observer: Observer | None = None,
    asynchronous: bool = False,
    proposer: Proposer | None = None,
    after_drafts: StepHook | None = None,
) -> tuple[list[Sequence], int]:
    """Run the workload to the end; return the sequences and the step count.

    The sequences come in request order, each request's samples in sample order (``Workload.samples``):
    a request with n > 1 forks n - 1 siblings after its prefill. Hooks receive a step's sequences
    together with the siblings it forked.

    asynchronous: what chapter 10's async engine does: each step is counted (``advance``) as soon as
    it is scheduled, and its tokens are resolved only after the next step has been scheduled. The
    fake model then "computes" a token when it is resolved, from the (by then known) prefix.

    proposer: speculative decoding (chapter 25, synchronous only): each decode step reserves the drafts that a
    `Speculator` of ``proposer`` proposes (``after_drafts`` sees the step then), the fake model gives its token
    after the last token and after each draft, and ``accept_drafts`` keeps what agrees.
    """
    assert proposer is None or not asynchronous, "speculative decoding runs synchronously"
    sched = workload.scheduler()
    speculator = None if proposer is None else Speculator(proposer)
    pending = sorted(enumerate(workload.requests), key=lambda item: item[1].arrival)
    seqs: list[Sequence | None] = [None] * len(workload.requests)
    forked: dict[int, list[Sequence]] = {}  # request's first seq_id -> its siblings
    postprocessed: list[Sequence] = []

    def watch(event: str, data: dict) -> None:
        # The postprocess event lists the step's sequences with the siblings it forked.
        if event == "postprocess":
            postprocessed[:] = data["seqs"]
            for seq in data["seqs"]:
                if seq.sample_index and seq not in forked.setdefault(seq.request_id, []):
                    forked[seq.request_id].append(seq)
        if observer is not None:
            observer(event, data)

    sched.observer = watch
    if max_steps is None:
        total = sum((len(r.prompt) + r.max_tokens) * r.n for r in workload.requests)
        max_steps = 50 * total + 100
    now, steps = 0, 0
    in_flight: tuple[list[Sequence], list[int | None], bool] | None = None

    def resolve(step: tuple[list[Sequence], list[int | None], bool]) -> None:
        done, indices, was_prefill = step
        tokens = [-1 if i is None or s.is_finished else next_token(tuple(s.token_ids[:i]), s.sample_index)
                  for s, i in zip(done, indices, strict=True)]
        sched.resolve(done, indices, tokens)
        if after_postprocess is not None:
            after_postprocess(sched, done, was_prefill)

    while pending or not sched.is_finished() or in_flight is not None:
        if sched.is_finished() and in_flight is not None:
            step, in_flight = in_flight, None
            resolve(step)  # the last step in flight: nothing left to schedule before it
            continue
        if sched.is_finished():
            now = max(now, pending[0][1].arrival)  # idle: jump to the next arrival
        while pending and pending[0][1].arrival <= now:
            index, request = pending.pop(0)
            params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=request.ignore_eos, n=request.n)
            seqs[index] = Sequence(request.prompt, params, block_size=workload.block_size)
            sched.add(seqs[index])
        scheduled, is_prefill = sched.schedule()
        if after_schedule is not None:
            after_schedule(sched, scheduled, is_prefill)
        if asynchronous:
            launched = (*sched.advance(scheduled, is_prefill), is_prefill)
            if in_flight is not None:
                resolve(in_flight)
            in_flight = launched
        else:
            def context(s: Sequence) -> tuple[int, ...]:
                return tuple(s.token_ids[: s.num_cached_tokens + s.num_scheduled_tokens])

            drafts = None if speculator is None or is_prefill else \
                speculator.propose(scheduled, sched.budget_left(scheduled))
            if drafts is not None and sched.reserve_drafts(scheduled, drafts):
                if after_drafts is not None:
                    after_drafts(sched, scheduled, is_prefill)
                # The model's token after the last token and after each draft: a verify step.
                targets = [[next_token(tuple(s.token_ids[: s.num_cached_tokens + 1 + i]), s.sample_index)
                            for i in range(s.num_scheduled_tokens)] for s in scheduled]
                drafted = [s.num_draft_tokens for s in scheduled]
                tokens, kept = sched.accept_drafts(scheduled, targets)
                speculator.record(scheduled, drafted, kept)
            else:
                # One token per sequence, then the forked siblings' first tokens, as the model runner samples them.
                tokens = [next_token(context(s), s.sample_index) for s in scheduled]
                tokens += [next_token(context(scheduled[i]), k) for i, k in sibling_samples(scheduled)]
            sched.postprocess(scheduled, tokens, is_prefill)
            if after_postprocess is not None:
                after_postprocess(sched, list(postprocessed), is_prefill)
        steps += 1
        now += 1
        check(steps <= max_steps, f"no end after {steps} steps: the scheduler hangs")
    return [s for first in seqs if first is not None for s in (first, *forked.get(first.seq_id, []))], steps


class InvariantChecker:
    """Checks the scheduler's and block manager's invariants; pass its methods as hooks."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.bs = workload.block_size
        self.finished: dict[int, Sequence] = {}
        self.prev_running: list[Sequence] = []

    def _blocks(self, n_tokens: int) -> int:
        return -(-n_tokens // self.bs)

    def common(self, sched: Scheduler) -> None:
        bm = sched.block_manager
        free = list(bm.free_block_ids)
        check(len(free) == len(set(free)), "a block is twice in the free list")
        check(set(free).isdisjoint(bm.used_block_ids), "a block is both free and used")
        check(set(free) | bm.used_block_ids == set(range(bm.num_blocks)), "free and used do not cover the pool")
        live = list(sched.waiting) + list(sched.running)
        ids = [s.seq_id for s in live]
        check(len(ids) == len(set(ids)), "a sequence is queued twice")
        check(not set(ids) & set(self.finished), "a finished sequence is queued")
        holders = Counter(b for s in live for b in s.block_table)
        for block in bm.blocks:
            check(block.ref_count == holders[block.block_id],
                  f"block {block.block_id}: ref_count {block.ref_count}, held by {holders[block.block_id]} tables")
            check((block.ref_count == 0) == (block.block_id in free), f"block {block.block_id}: free iff ref 0")
        for h, block_id in bm.hash_to_block_id.items():
            check(bm.blocks[block_id].hash == h, f"hash entry points at block {block_id} which carries another hash")
        for s in sched.running:
            check(s.status is SequenceStatus.RUNNING, f"seq {s.seq_id} in running is {s.status.name}")
        for i, s in enumerate(sched.waiting):
            check(s.status is SequenceStatus.WAITING, f"seq {s.seq_id} in waiting is {s.status.name}")
            if i > 0 or not s.block_table:
                check(not s.block_table and s.num_cached_tokens == 0,
                      f"waiting seq {s.seq_id} holds blocks but is not a chunk in progress at the head")

    def after_schedule(self, sched: Scheduler, seqs: list[Sequence], is_prefill: bool) -> None:
        w = self.workload
        self.common(sched)
        check(len(seqs) >= 1, "an empty step")
        check(len(seqs) <= w.max_num_seqs, "more sequences than max_num_seqs")
        check(sum(s.num_scheduled_tokens for s in seqs) <= w.max_num_batched_tokens, "token budget exceeded")
        check(len({s.seq_id for s in seqs}) == len(seqs), "a sequence scheduled twice in one step")
        for s in seqs:
            # Every scheduled sequence holds exactly ceil(len(seq) / block_size) blocks: enough for
            # every slot this step writes (positions num_cached .. num_cached + num_scheduled - 1 < len).
            check(len(s.block_table) == self._blocks(len(s)), f"seq {s.seq_id}: wrong number of blocks")
            check(s.num_scheduled_tokens >= 1, f"seq {s.seq_id} scheduled with no tokens")
            check(s.num_cached_tokens + s.num_scheduled_tokens <= len(s), f"seq {s.seq_id} computes past its end")
            # No step writes K/V into a block that another table holds (copy-on-write gave it its own).
            bm = sched.block_manager
            for pos in range(s.num_cached_tokens, s.num_cached_tokens + s.num_scheduled_tokens):
                block_id = s.block_table[pos // self.bs]
                check(bm.blocks[block_id].ref_count == 1,
                      f"seq {s.seq_id} writes position {pos} into block {block_id} with ref count "
                      f"{bm.blocks[block_id].ref_count}")
            for source, destination in s.blocks_to_copy:
                check(destination == s.block_table[s.num_cached_tokens // self.bs] and source != destination,
                      f"seq {s.seq_id}: copy {source} -> {destination} is not into the block it writes")
        if is_prefill:
            partial = [s for s in seqs if s.num_cached_tokens + s.num_scheduled_tokens < len(s)]
            check(len(partial) <= 1, "more than one partial prefill in a step")
            if partial:
                check(partial[0] is seqs[-1] and sched.waiting and sched.waiting[0] is partial[0],
                      "the partial prefill is not the last scheduled sequence at the head of waiting")
            for s in seqs:
                if s not in partial:
                    check(s.status is SequenceStatus.RUNNING and s in sched.running, f"seq {s.seq_id} not running")
        else:
            check(len(seqs) <= w.max_num_batched_tokens, "decode step over the token budget")
            # Preemption takes the newest running sequences (a suffix of the running queue) and puts
            # them back at the head of waiting, oldest first.
            waiting_ids = {s.seq_id for s in sched.waiting}
            preempted = [s for s in self.prev_running if s.seq_id in waiting_ids]
            k = len(preempted)
            check(preempted == self.prev_running[len(self.prev_running) - k :], "preempted a non-newest sequence")
            check(list(sched.waiting)[:k] == preempted, "preempted sequences are not at the head of waiting in order")
            for s in preempted:
                check(not s.block_table and s.num_cached_tokens == 0, f"preempted seq {s.seq_id} kept its blocks")
            for s in seqs:
                check(s.num_scheduled_tokens == 1 and s.num_cached_tokens == len(s) - 1,
                      f"decode seq {s.seq_id} does not compute exactly its last token")
                check(s in sched.running, f"decode seq {s.seq_id} not in running")

    def after_postprocess(self, sched: Scheduler, seqs: list[Sequence], is_prefill: bool) -> None:
        self.common(sched)
        self.prev_running = list(sched.running)
        for s in sched.running:
            # Between steps a running sequence has every token but the last cached, and holds
            # exactly the blocks for its cached tokens (the next decode step may add one).
            check(s.num_cached_tokens == len(s) - 1, f"running seq {s.seq_id}: cached != len - 1")
            check(len(s.block_table) == self._blocks(s.num_cached_tokens), f"running seq {s.seq_id}: block count")
        for s in seqs:
            check(s.num_scheduled_tokens == 0, f"seq {s.seq_id} still has scheduled tokens")
            if s.is_finished:
                check(not s.block_table, f"finished seq {s.seq_id} still holds blocks")
                self.finished[s.seq_id] = s


@dataclass
class RegimesSeen:
    """A scheduler observer that counts what a run went through: prefill steps that computed only part of a prompt
    (chunked prefill), prefill steps that found blocks in the prefix cache, and preempted sequences. Tests set it as
    ``scheduler.observer`` and then assert that the regime they meant to exercise happened."""

    partial: int = 0
    cached: int = 0
    preempted: int = 0

    def __call__(self, event: str, data: dict) -> None:
        if event != "schedule":
            return
        if data["is_prefill"]:
            self.partial += any(s.num_cached_tokens + s.num_scheduled_tokens < len(s) for s in data["seqs"])
            self.cached += any(s.num_cached_tokens > 0 for s in data["seqs"])
        self.preempted += len(data["preempted"])
