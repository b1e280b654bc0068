"""Chapter 02: the block manager (paging, ref counts, free list, decode growth, bad input)."""

from collections import Counter

import pytest

from nanovllm.engine.block_manager import Block, BlockManager, BlockPool
from nanovllm.engine.sequence import Sequence


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """Pretend the model computed the next ``n`` tokens of ``seq`` (what postprocess does)."""
    seq.num_cached_tokens += n
    bm.publish_full_blocks(seq)


def check_partition(bm: BlockManager, seqs: list[Sequence]) -> None:
    free = list(bm.free_block_ids)
    assert len(free) == len(set(free))
    assert set(free).isdisjoint(bm.used_block_ids)
    assert set(free) | bm.used_block_ids == set(range(bm.num_blocks))
    holders = Counter(b for s in seqs for b in s.block_table)
    assert all(block.ref_count == holders[block.block_id] for block in bm.blocks)


def test_fresh_pool():
    bm = BlockManager(num_blocks=5, block_size=4)
    assert isinstance(bm, BlockPool) and bm.block_size == 4 and bm.num_blocks == 5
    assert list(bm.free_block_ids) == [0, 1, 2, 3, 4] and bm.used_block_ids == set()
    assert all(isinstance(b, Block) and b.ref_count == 0 and b.hash == -1 and b.token_ids == [] for b in bm.blocks)
    assert bm.hash_to_block_id == {}


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("length", [1, 2, 5, 16, 17, 33])
def test_allocate_gives_ceil_blocks(block_size, length):
    bm = BlockManager(num_blocks=64, block_size=block_size, enable_prefix_caching=False)
    seq = Sequence(list(range(length)), block_size=block_size)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == -(-length // block_size) == seq.num_blocks
    assert seq.num_cached_tokens == 0
    assert seq.block_table == list(range(seq.num_blocks))  # taken from the head of the free list
    check_partition(bm, [seq])


def test_deallocate_frees_backwards_and_resets_sequence():
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=False)
    a = Sequence([1, 2, 3, 4, 5], block_size=2)
    bm.allocate(a)
    assert a.block_table == [0, 1, 2]
    compute(bm, a, 5)
    bm.deallocate(a)
    assert list(bm.free_block_ids) == [3, 4, 5, 2, 1, 0]
    assert a.block_table == [] and a.num_cached_tokens == 0
    check_partition(bm, [a])


def test_can_allocate_is_exact_at_the_boundary():
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    assert bm.can_allocate(Sequence(list(range(12)), block_size=4))
    assert not bm.can_allocate(Sequence(list(range(13)), block_size=4))
    with pytest.raises(AssertionError, match="ask can_allocate first"):
        bm.allocate(Sequence(list(range(13)), block_size=4))
    check_partition(bm, [])


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 7])
def test_decode_adds_a_block_exactly_when_the_table_stops_covering_the_sequence(block_size):
    bm = BlockManager(num_blocks=100, block_size=block_size, enable_prefix_caching=False)
    seq = Sequence([9, 9, 9], block_size=block_size)
    bm.allocate(seq)
    compute(bm, seq, 3)
    seq.append_token(0)
    for _ in range(50):
        before = len(seq.block_table)
        needs = len(seq) > before * block_size
        if block_size > 1:
            assert needs == (len(seq) % block_size == 1)
        assert bm.can_append(seq)
        bm.may_append(seq)
        assert len(seq.block_table) == before + needs == seq.num_blocks
        compute(bm, seq, 1)
        seq.append_token(0)
    check_partition(bm, [seq])


def test_can_append_false_when_pool_exhausted():
    bm = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=False)
    seq = Sequence([1, 2, 3, 4], block_size=2)
    bm.allocate(seq)
    compute(bm, seq, 4)
    seq.append_token(5)
    assert not bm.can_append(seq)
    with pytest.raises(AssertionError, match="ask can_append first"):
        bm.may_append(seq)
    assert seq.block_table == [0, 1]
    check_partition(bm, [seq])


def test_misuse_is_reported():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = Sequence([1, 2, 3], block_size=2)
    # The scheduler never does these: its contract with the block manager is asserted, not validated.
    with pytest.raises(AssertionError, match="allocate it before decoding"):
        bm.may_append(seq)
    with pytest.raises(AssertionError, match="allocate it before decoding"):
        bm.can_append(seq)
    bm.allocate(seq)
    with pytest.raises(AssertionError, match="already holds blocks"):
        bm.allocate(seq)
    with pytest.raises(AssertionError, match="released more often"):
        bm.release(3)
    check_partition(bm, [seq])


def test_hold_revives_a_free_block_and_release_returns_it_to_the_tail():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.hold(1)
    assert list(bm.free_block_ids) == [0, 2] and bm.used_block_ids == {1} and bm.blocks[1].ref_count == 1
    bm.hold(1)
    assert bm.blocks[1].ref_count == 2
    bm.release(1)
    assert 1 in bm.used_block_ids
    bm.release(1)
    assert list(bm.free_block_ids) == [0, 2, 1] and bm.used_block_ids == set()


def test_shared_blocks_are_counted_once_per_table():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Sequence([1, 2, 3, 4, 5], block_size=2)
    bm.allocate(a)
    compute(bm, a, 5)
    b = Sequence([1, 2, 3, 4, 6], block_size=2)
    # b hits blocks 0 and 1 (in use, no cost) and needs one free block; exactly one is free.
    assert bm.num_free_blocks == 1 and bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 4
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    check_partition(bm, [a, b])
    bm.deallocate(a)
    check_partition(bm, [b])
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]


def test_without_prefix_caching_nothing_is_shared_or_published():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = Sequence([1, 2, 3, 4, 5], block_size=2)
    bm.allocate(a)
    compute(bm, a, 5)
    b = Sequence([1, 2, 3, 4, 5], block_size=2)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)
    assert bm.hash_to_block_id == {} and all(block.hash == -1 for block in bm.blocks)
    check_partition(bm, [a, b])
