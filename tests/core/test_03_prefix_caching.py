"""Chapter 03: prefix caching (chained hashes, publication, hits, revival, stale entries)."""

import pytest

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.prefix_cache import NO_HASH, PrefixCache, block_hash
from nanovllm.engine.sequence import Sequence


def prefill(bm: BlockManager, tokens: list[int], written: dict | None = None) -> Sequence:
    """Allocate and compute a whole prompt; record (prefix, position) per slot in ``written``."""
    seq = Sequence(tokens, block_size=bm.block_size)
    bm.allocate(seq)
    if written is not None:
        for pos in range(seq.num_cached_tokens, len(seq)):
            slot = seq.block_table[pos // bm.block_size] * bm.block_size + pos % bm.block_size
            written[slot] = (tuple(tokens[: pos + 1]), pos)
    seq.num_cached_tokens = len(seq)
    bm.publish_full_blocks(seq)
    return seq


def wrong_positions(bm: BlockManager, seq: Sequence, written: dict) -> list[int]:
    bs = bm.block_size
    return [
        pos
        for pos in range(seq.num_cached_tokens)
        if written.get(seq.block_table[pos // bs] * bs + pos % bs) != (tuple(seq.token_ids[: pos + 1]), pos)
    ]


def test_block_hash_is_deterministic_chained_and_64_bit():
    h0 = block_hash([1, 2, 3, 4])
    assert h0 == block_hash([1, 2, 3, 4]) and 0 <= h0 < 2**64 and h0 != NO_HASH
    assert block_hash([5, 6], h0) != block_hash([5, 6], block_hash([9, 9, 9, 9]))
    assert block_hash([5, 6], h0) != block_hash([5, 6])
    assert block_hash([1, 2]) != block_hash([2, 1])
    assert block_hash([2**40]) != block_hash([0])


def test_allocation_publishes_nothing_and_postprocess_publishes_full_blocks_only():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence(list(range(10)), block_size=4)
    bm.allocate(seq)
    assert bm.hash_to_block_id == {}
    seq.num_cached_tokens = 6  # a chunk of 6 tokens was computed
    bm.publish_full_blocks(seq)
    assert list(bm.hash_to_block_id.values()) == [seq.block_table[0]]
    seq.num_cached_tokens = 10
    bm.publish_full_blocks(seq)
    blocks = [bm.blocks[b] for b in seq.block_table]
    assert blocks[0].hash == block_hash(list(range(4)))
    assert blocks[1].hash == block_hash(list(range(4, 8)), blocks[0].hash)
    assert blocks[2].hash == NO_HASH and blocks[2].token_ids == []  # partial block: never published
    assert blocks[1].token_ids == [4, 5, 6, 7]
    assert sorted(bm.hash_to_block_id.values()) == sorted(seq.block_table[:2])


def test_hits_stop_at_first_miss_and_never_cover_the_last_prompt_token():
    bm = BlockManager(num_blocks=16, block_size=2)
    a = prefill(bm, [1, 2, 3, 4, 5, 6])
    assert bm.prefix_cache.match(Sequence([1, 2, 3, 4, 5, 6, 7], block_size=2)) == a.block_table[:3]
    # The whole prompt is cached, but its last block holds the last token: not a hit.
    assert bm.prefix_cache.match(Sequence([1, 2, 3, 4, 5, 6], block_size=2)) == a.block_table[:2]
    assert bm.prefix_cache.match(Sequence([1, 2, 3, 4, 5], block_size=2)) == a.block_table[:2]
    assert bm.prefix_cache.match(Sequence([1, 2, 9, 9, 5, 6, 7], block_size=2)) == a.block_table[:1]
    assert bm.prefix_cache.match(Sequence([1, 2], block_size=2)) == []
    seq = Sequence([1, 2, 3, 4, 5, 6], block_size=2)
    bm.allocate(seq)
    assert seq.num_cached_tokens == 4 and len(seq) - seq.num_cached_tokens >= 1


@pytest.mark.parametrize("length", range(1, 14))
def test_at_least_one_token_is_always_computed(length):
    bm = BlockManager(num_blocks=32, block_size=3)
    prefill(bm, list(range(length)))
    again = Sequence(list(range(length)), block_size=3)
    bm.allocate(again)
    assert again.num_cached_tokens == 3 * ((length - 1) // 3) < length


def test_lookup_compares_tokens():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = prefill(bm, [1, 2, 3])
    fake = block_hash([7, 8])
    bm.prefix_cache.hash_to_block_id[fake] = a.block_table[0]  # a planted "collision"
    assert bm.prefix_cache.match(Sequence([7, 8, 9], block_size=2)) == []


def test_freed_blocks_stay_cached_and_a_hit_revives_that_exact_block():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = prefill(bm, [1, 2, 3, 4, 5])
    table = list(a.block_table)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4 and bm.blocks[table[0]].hash != NO_HASH
    b = Sequence([1, 2, 3, 4, 6], block_size=2)
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == table[:2] and b.num_cached_tokens == 4
    assert not set(table[:2]) & set(bm.free_block_ids) and set(table[:2]) <= bm.used_block_ids
    assert b.block_table[2] not in table[:2]


def test_hits_on_free_blocks_count_against_the_free_list():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = prefill(bm, [1, 2, 3, 4, 5])
    bm.deallocate(a)
    b = Sequence([1, 2, 3, 4, 5, 6, 7], block_size=2)  # needs 4 blocks, 2 of them free hits
    assert not bm.can_allocate(b)
    c = Sequence([1, 2, 3, 4, 5], block_size=2)  # 2 free hits + 1 new block = 3 free blocks
    assert bm.can_allocate(c)
    bm.allocate(c)
    assert c.num_cached_tokens == 4 and bm.num_free_blocks == 0


def test_decode_publishes_blocks_filled_by_generated_tokens():
    bm = BlockManager(num_blocks=8, block_size=2)
    seq = prefill(bm, [1, 2, 3])
    for token in (4, 5, 6):
        seq.append_token(token)
        bm.may_append(seq)
        seq.num_cached_tokens += 1
        bm.publish_full_blocks(seq)
    # tokens 1..6 have their KV written; a new prompt 1..6 + 7 reuses all three blocks
    assert bm.prefix_cache.match(Sequence([1, 2, 3, 4, 5, 6, 7], block_size=2)) == seq.block_table[:3]


class ForgetfulPrefixCache(PrefixCache):
    def forget(self, block) -> None:  # upstream's bug
        pass


class OverEagerPrefixCache(PrefixCache):
    def forget(self, block) -> None:
        self.hash_to_block_id.pop(block.hash, None)


def stale_recipe(bm: BlockManager) -> tuple[list[int], list[int]]:
    written: dict = {}
    bm.deallocate(prefill(bm, [1, 2, 3, 4, 9], written))
    bm.deallocate(prefill(bm, [7, 7, 3, 4], written))
    c = Sequence([1, 2, 3, 4, 5], block_size=2)
    bm.allocate(c)
    prefill_hits = c.block_table[: c.num_cached_tokens // 2]
    return prefill_hits, wrong_positions(bm, c, written)


def test_stale_entry_is_removed_when_its_block_is_reused():
    assert stale_recipe(BlockManager(num_blocks=3, block_size=2)) == ([0], [])


def test_forgetful_cache_gives_a_false_hit(monkeypatch):
    monkeypatch.setattr(BlockManager, "prefix_cache_class", ForgetfulPrefixCache)
    hits, wrong = stale_recipe(BlockManager(num_blocks=3, block_size=2))
    assert hits == [0, 1] and wrong == [2, 3]


def test_only_the_blocks_own_entry_is_removed():
    def recipe(bm: BlockManager) -> list[int]:
        a = prefill(bm, [1, 2, 3, 4])
        b = prefill(bm, [1, 2, 3, 4])  # its block for "3 4" duplicates a's: same hash, newer block
        assert bm.blocks[a.block_table[1]].hash == bm.blocks[b.block_table[1]].hash
        assert bm.hash_to_block_id[bm.blocks[a.block_table[1]].hash] == b.block_table[1]
        bm.deallocate(a)
        bm.deallocate(b)
        bm.deallocate(prefill(bm, [8, 8, 8, 8]))  # overwrites a's block 1 (the older duplicate)
        c = Sequence([1, 2, 3, 4, 5], block_size=2)
        bm.allocate(c)
        return c.block_table[: c.num_cached_tokens // 2]

    assert recipe(BlockManager(num_blocks=4, block_size=2)) == [0, 2]

    class OverEager(BlockManager):
        prefix_cache_class = OverEagerPrefixCache

    assert recipe(OverEager(num_blocks=4, block_size=2)) == [0]  # correct but a lost hit


def test_hash_table_entries_always_point_at_blocks_carrying_that_hash():
    bm = BlockManager(num_blocks=5, block_size=2)
    for tokens in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7], [9, 9, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5, 5, 5, 5]):
        seq = prefill(bm, tokens)
        for h, block_id in bm.hash_to_block_id.items():
            assert bm.blocks[block_id].hash == h
        bm.deallocate(seq)
