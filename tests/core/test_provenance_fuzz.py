"""Provenance fuzz: every KV the engine reads was written for the same prefix at the same position.

We replace the model's KV cache by a dictionary. For every token a step computes, the slot
``block_table[pos // block_size] * block_size + pos % block_size`` receives a record of what the
real K and V would depend on: the whole prefix up to and including ``pos`` (interned as an id)
and ``pos``. Before each step, every position a scheduled sequence reads from the cache (all of
``0 .. num_cached_tokens - 1``, which includes every prefix-cache hit) must hold the record for
*its own* prefix; and a step may only write into blocks that nobody else holds and that are not
published. Some requests ask for n > 1 samples: they fork after their prefill and share the
prompt's blocks, and a copy-on-write copies a block's records the way the model runner copies its
K/V, before the step's reads and writes. Twenty thousand small random workloads (a few seconds)
with a three-token vocabulary, so that prefixes collide constantly, run through the real
scheduler (chapter 18's tests run five thousand more the way its asynchronous engine does, each
step resolved after the next is scheduled, and chapter 25's with drafts). The last tests plant
known bugs (upstream's stale hash entry; publishing at allocation; a write into a shared block; a
skipped or misdirected copy) and check that the fuzz catches each.
"""

import random

import pytest

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.prefix_cache import NO_HASH, PrefixCache
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence
from tests.scheduler_sim import VOCAB, Request, Violation, Workload, next_token, simulate

NUM_WORKLOADS = 20_000
SEED = 20261129


class ProvenanceKV:
    """The KV cache as provenance records: slot -> what the KV there was computed from.

    Synchronously a slot records (prefix id, position) when it is written. With ``deferred`` (the
    asynchronous scheduler) a step is scheduled before its input token is known, so a slot records
    (writer sequence, position) and the prefixes are compared when it is read, by which time every
    token up to that position has been resolved (tokens never change once resolved).
    """

    def __init__(self, block_size: int, deferred: bool = False, speculative: bool = False) -> None:
        self.bs = block_size
        self.deferred = deferred
        self.speculative = speculative
        self.slots: dict[int, tuple] = {}
        self.trie: dict[tuple[int, int], int] = {}  # (parent prefix id, token) -> prefix id
        self.prefix_ids: dict[int, list[int]] = {}  # seq_id -> prefix id of each position
        self.tokens_seen: dict[int, list[int]] = {}  # seq_id -> the tokens those ids were computed for
        self.copies = 0  # copy-on-write copies made

    def ids(self, seq: Sequence) -> list[int]:
        ids = self.prefix_ids.setdefault(seq.seq_id, [])
        if self.speculative:
            # Speculative decoding (chapter 25) replaces rejected drafts: from the first token that changed since
            # the ids were computed, compute them again.
            seen = self.tokens_seen.setdefault(seq.seq_id, [])
            same = next((pos for pos, (a, b) in enumerate(zip(seen, seq.token_ids, strict=False)) if a != b),
                        min(len(seen), len(seq)))
            del ids[same:]
            seen[:] = seq.token_ids
        for pos in range(len(ids), len(seq)):
            key = (ids[-1] if ids else -1, seq.token_ids[pos])
            ids.append(self.trie.setdefault(key, len(self.trie)))
        return ids

    def record(self, seq: Sequence, pos: int) -> tuple:
        return (seq, pos) if self.deferred else (self.ids(seq)[pos], pos)

    def same_source(self, stored: tuple | None, seq: Sequence, pos: int, ids: list[int] | None = None) -> bool:
        """``ids``: ``self.ids(seq)``, when the caller has it (a step's reads ask for it once per sequence)."""
        if not self.deferred:
            return stored == ((self.ids(seq) if ids is None else ids)[pos], pos)
        mine = seq.token_ids[: pos + 1]
        if PENDING_TOKEN in mine:
            raise Violation(f"seq {seq.seq_id} reads position {pos} before its token is known")
        writer, written_pos = stored or (None, -1)
        return written_pos == pos and writer.token_ids[: pos + 1] == mine

    def after_schedule(self, sched, seqs: list[Sequence], is_prefill: bool) -> None:
        bs = self.bs
        for seq in seqs:  # copy-on-write first: the runner copies before the step's forward
            for source, destination in seq.blocks_to_copy:
                self.copies += 1
                for offset in range(bs):
                    record = self.slots.get(source * bs + offset)
                    if record is None:
                        self.slots.pop(destination * bs + offset, None)
                    else:
                        self.slots[destination * bs + offset] = record
        for seq in seqs:  # reads next: all of them see the cache as it was before the step
            table = seq.block_table
            ids = None if self.deferred else self.ids(seq)
            for pos in range(seq.num_cached_tokens):
                slot = table[pos // bs] * bs + pos % bs
                if not self.same_source(self.slots.get(slot), seq, pos, ids):
                    raise Violation(
                        f"seq {seq.seq_id} reads position {pos} from block {table[pos // bs]}, whose KV was "
                        f"written for {self.slots.get(slot)} instead of {self.record(seq, pos)}"
                    )
        for seq in seqs:
            self.write(sched, seq, range(seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens))

    def after_drafts(self, sched, seqs: list[Sequence], is_prefill: bool) -> None:
        """The drafts' slots (chapter 25), written by the same forward as the last tokens that after_schedule wrote,
        after the same copies and reads."""
        for seq in seqs:
            self.write(sched, seq, range(seq.num_cached_tokens + 1, seq.num_cached_tokens + seq.num_scheduled_tokens))

    def write(self, sched, seq: Sequence, positions: range) -> None:
        bs, blocks, table = self.bs, sched.block_manager.blocks, seq.block_table
        for pos in positions:
            block = blocks[table[pos // bs]]
            if block.ref_count != 1 or block.hash != NO_HASH:
                raise Violation(f"seq {seq.seq_id} writes into block {block.block_id}, shared or published")
            self.slots[block.block_id * bs + pos % bs] = self.record(seq, pos)


def random_workload(rng: random.Random) -> Workload:
    block_size = rng.randint(1, 4)
    shared = [[rng.randrange(3) for _ in range(rng.randint(1, 8))] for _ in range(2)]
    requests = []
    for _ in range(rng.randint(1, 6)):
        prefix = rng.choice([[], *shared])
        prompt = prefix + [rng.randrange(3) for _ in range(rng.randint(0 if prefix else 1, 5))]
        n = rng.choice([1, 1, 1, 2, 3])  # parallel sampling: forks that share the prompt's blocks
        requests.append(Request(rng.randint(0, 6), prompt, rng.randint(1, 6), rng.random() < 0.5, n))
    need = max(-(-(len(r.prompt) + r.max_tokens - 1) // block_size) for r in requests)
    return Workload(
        num_blocks=need + rng.randint(0, 6),
        block_size=block_size,
        max_num_seqs=max(rng.randint(1, 4), *(r.n for r in requests)),
        max_num_batched_tokens=rng.randint(1, 12),
        enable_prefix_caching=True,
        eos=(0,) if rng.random() < 0.3 else (),
        requests=requests,
    )


class GuessingProposer:
    """Speculative decoding's drafts (chapter 25): 0 to 4 tokens of the fake model's own continuation (sample 0),
    each wrong with probability 1/3, so that runs of accepted drafts and rejections both occur."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        context, draft = list(token_ids), []
        for _ in range(min(self.rng.randint(0, 4), 4 if limit is None else limit)):
            token = next_token(tuple(context))
            token = (token + 1) % VOCAB if self.rng.random() < 1 / 3 else token
            context.append(token)
            draft.append(token)
        return draft


def fuzz(num_workloads: int, seed: int = SEED, asynchronous: bool = False,
         speculative: bool = False) -> tuple[int, int, int]:
    """Run the fuzz; return (workloads run, cache-hit blocks seen, copy-on-write copies made).
    Raises Violation on the first bad read or write.

    asynchronous: each step's tokens are resolved after the next step is scheduled (chapter 10).
    speculative: decode steps verify drafts (chapter 25), whose slots are written once they are reserved."""
    rng = random.Random(seed)
    hit_blocks = copies = 0

    def count_hits(event: str, data: dict) -> None:
        nonlocal hit_blocks
        if event == "schedule":
            hit_blocks += sum(len(blocks) for blocks in data["cache_hits"].values())

    for i in range(num_workloads):
        workload = random_workload(rng)
        kv = ProvenanceKV(workload.block_size, deferred=asynchronous, speculative=speculative)
        speculation = {"proposer": GuessingProposer(rng), "after_drafts": kv.after_drafts} if speculative else {}
        try:
            simulate(workload, after_schedule=kv.after_schedule, observer=count_hits, asynchronous=asynchronous,
                     **speculation)
        except Violation as error:
            raise Violation(f"workload {i}: {error}\n{workload}") from None
        copies += kv.copies
    return num_workloads, hit_blocks, copies


def test_every_cached_read_has_the_right_provenance():
    runs, hit_blocks, copies = fuzz(NUM_WORKLOADS)
    assert runs == NUM_WORKLOADS
    assert hit_blocks > NUM_WORKLOADS  # the workloads exercise the cache: many thousands of hits
    assert copies > NUM_WORKLOADS // 10  # and copy-on-write: thousands of copies


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_fuzz_detects_the_stale_hash_entry_bug_in_both_modes(monkeypatch, asynchronous: bool):
    monkeypatch.setattr(BlockManager, "prefix_cache_class", ForgetfulPrefixCache)
    with pytest.raises(Violation, match="whose KV was"):
        fuzz(NUM_WORKLOADS, asynchronous=asynchronous)


class ForgetfulPrefixCache(PrefixCache):
    def forget(self, block) -> None:  # upstream's bug: the stale entry stays
        pass


def test_fuzz_detects_publishing_at_allocation(monkeypatch):
    allocate = BlockManager.allocate

    def allocate_and_publish_at_once(self, seq):
        allocate(self, seq)
        computed = seq.num_cached_tokens
        seq.num_cached_tokens = len(seq)  # pretend the whole prompt is already written
        self.publish_full_blocks(seq)
        seq.num_cached_tokens = computed

    monkeypatch.setattr(BlockManager, "allocate", allocate_and_publish_at_once)
    with pytest.raises(Violation):
        fuzz(NUM_WORKLOADS)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_fuzz_detects_a_write_into_a_shared_block(monkeypatch, asynchronous: bool):
    monkeypatch.setattr(BlockManager, "_shared_write_block", lambda self, seq: None)  # no copy-on-write
    with pytest.raises(Violation, match="shared or published"):
        fuzz(NUM_WORKLOADS, asynchronous=asynchronous)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_fuzz_detects_a_skipped_copy(monkeypatch, asynchronous: bool):
    may_append = BlockManager.may_append

    def may_append_and_lose_the_copy(self, seq):  # the runner never sees the copy
        may_append(self, seq)
        seq.blocks_to_copy = []

    monkeypatch.setattr(BlockManager, "may_append", may_append_and_lose_the_copy)
    with pytest.raises(Violation, match="whose KV was"):
        fuzz(NUM_WORKLOADS, asynchronous=asynchronous)


def test_fuzz_detects_a_copy_into_the_wrong_block(monkeypatch):
    may_append = BlockManager.may_append

    def may_append_and_misdirect(self, seq):  # the copy lands in the source's neighbour
        may_append(self, seq)
        seq.blocks_to_copy = [(s, (d + 1) % self.num_blocks) for s, d in seq.blocks_to_copy]

    monkeypatch.setattr(BlockManager, "may_append", may_append_and_misdirect)
    with pytest.raises(Violation, match="whose KV was"):
        fuzz(NUM_WORKLOADS)
