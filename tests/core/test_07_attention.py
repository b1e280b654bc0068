"""Chapter 07: the paged attention reference backend against a naive dense attention."""

from __future__ import annotations

import random

import pytest
import torch

from nanovllm.layers.attention import Attention, TorchBackend, attention_backend
from nanovllm.layers.context import (
    get_context,
    reset_context,
    set_context,
    set_decode_context,
    set_prefill_context,
)


@pytest.fixture(autouse=True)
def _clean_context():
    reset_context()
    yield
    reset_context()


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n_q, H, d] are the last n_q of n_k positions; loops over heads, explicit softmax, float64."""
    n_q, heads, _ = q.shape
    n_k, kv_heads, _ = k.shape
    group = heads // kv_heads
    out = torch.empty(n_q, heads, q.shape[2], dtype=torch.float64)
    for h in range(heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for j in range(n_q):
            visible = n_k - n_q + j + 1
            weights = torch.softmax((kh[:visible] @ q[j, h].double()) * scale, dim=0)
            out[j, h] = weights @ vh[:visible]
    return out


def make_layer(heads: int, kv_heads: int, d: int, num_blocks: int, block_size: int) -> Attention:
    layer = Attention(heads, d, d**-0.5, kv_heads)
    layer.k_cache = torch.full((num_blocks, block_size, kv_heads, d), float("nan"))
    layer.v_cache = torch.full((num_blocks, block_size, kv_heads, d), float("nan"))
    return layer


def random_tables(
    lengths: list[int], block_size: int, rng: random.Random, spare: int = 3
) -> tuple[list[list[int]], int]:
    """Disjoint random block tables covering ``lengths`` tokens; returns (tables, num_blocks)."""
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + spare
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for n in needed:
        tables.append(free[:n])
        free = free[n:]
    return tables, num_blocks


@pytest.mark.parametrize("seed", range(8))
def test_prefill_with_cached_prefix_then_decode_matches_naive(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    block_size = rng.choice([1, 2, 4, 16])
    kv_heads = rng.choice([1, 2])
    heads = kv_heads * rng.choice([1, 2, 4])
    d = rng.choice([4, 8])
    num_seqs = rng.randint(1, 4)
    prompt = [rng.randint(1, 20) for _ in range(num_seqs)]
    # en: cached prefix: 0, whole blocks, or a partial block (a later chunk of a chunked prefill)
    cached = []
    for n in prompt:
        choice = rng.choice(["zero", "blocks", "partial"])
        whole = (n - 1) // block_size * block_size
        cached.append(0 if choice == "zero" else whole if choice == "blocks" else rng.randint(0, n - 1))
    decode_steps = 3
    total = [n + decode_steps for n in prompt]
    tables, num_blocks = random_tables(total, block_size, rng)
    layer = make_layer(heads, kv_heads, d, num_blocks, block_size)
    q_all = [torch.randn(n, heads, d) for n in total]
    k_all = [torch.randn(n, kv_heads, d) for n in total]
    v_all = [torch.randn(n, kv_heads, d) for n in total]

    # Step 1: compute the cached prefixes (only the sequences that have one).
    with_prefix = [i for i in range(num_seqs) if cached[i] > 0]
    if with_prefix:
        set_prefill_context([cached[i] for i in with_prefix], [cached[i] for i in with_prefix],
                            [tables[i] for i in with_prefix], block_size)
        layer(torch.cat([q_all[i][: cached[i]] for i in with_prefix]),
              torch.cat([k_all[i][: cached[i]] for i in with_prefix]),
              torch.cat([v_all[i][: cached[i]] for i in with_prefix]))
    # Step 2: the rest of each prompt, reading prefixes through the block tables.
    set_prefill_context([p - c for p, c in zip(prompt, cached, strict=True)], prompt, tables, block_size)
    out = layer(torch.cat([q_all[i][cached[i]: prompt[i]] for i in range(num_seqs)]),
                torch.cat([k_all[i][cached[i]: prompt[i]] for i in range(num_seqs)]),
                torch.cat([v_all[i][cached[i]: prompt[i]] for i in range(num_seqs)]))
    expected = torch.cat([
        naive_attention(q_all[i][cached[i]: prompt[i]], k_all[i][: prompt[i]], v_all[i][: prompt[i]], d**-0.5)
        for i in range(num_seqs)
    ])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # Steps 3+: decode.
    for step in range(decode_steps):
        lens = [n + step + 1 for n in prompt]
        set_decode_context(lens, tables, block_size)
        out = layer(torch.stack([q_all[i][lens[i] - 1] for i in range(num_seqs)]),
                    torch.stack([k_all[i][lens[i] - 1] for i in range(num_seqs)]),
                    torch.stack([v_all[i][lens[i] - 1] for i in range(num_seqs)]))
        expected = torch.cat([
            naive_attention(q_all[i][lens[i] - 1: lens[i]], k_all[i][: lens[i]], v_all[i][: lens[i]], d**-0.5)
            for i in range(num_seqs)
        ])
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_prefill_without_cache_attends_over_given_kv() -> None:
    torch.manual_seed(0)
    layer = Attention(4, 8, 8**-0.5, 2)  # k_cache empty: the warm-up forward
    set_prefill_context([3, 5], [3, 5])  # no block tables, nothing stored
    q, k, v = torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    out = layer(q, k, v)
    expected = torch.cat([naive_attention(q[:3], k[:3], v[:3], 8**-0.5), naive_attention(q[3:], k[3:], v[3:], 8**-0.5)])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert layer.k_cache.numel() == 0


def test_store_skips_slot_minus_one_and_writes_exact_slots() -> None:
    layer = make_layer(2, 1, 4, num_blocks=3, block_size=2)
    k, v = torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    before = layer.k_cache.clone()
    set_context(True, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), 3, 3,
                slot_mapping=torch.tensor([5, -1, 0]))
    layer(torch.randn(3, 2, 4), k, v)
    assert torch.equal(layer.k_cache[2, 1], k[0]) and torch.equal(layer.v_cache[0, 0], v[2])
    untouched = torch.ones(3, 2, dtype=torch.bool)
    untouched[2, 1] = untouched[0, 0] = False
    assert layer.k_cache[untouched].isnan().all() and before[untouched].isnan().all()


def test_decode_padded_row_returns_zeros_and_others_unaffected() -> None:
    torch.manual_seed(1)
    layer = make_layer(2, 2, 4, num_blocks=2, block_size=4)
    ks, vs = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    set_prefill_context([2], [2], [[1]], 4)
    layer(torch.randn(2, 2, 4), ks[:2], vs[:2])
    set_context(False, slot_mapping=torch.tensor([6, -1]), context_lens=torch.tensor([3, 0], dtype=torch.int32),
                block_tables=torch.tensor([[1], [-1]], dtype=torch.int32))
    q = torch.randn(2, 2, 4)
    out = layer(q, torch.stack([ks[2], ks[2]]), torch.stack([vs[2], vs[2]]))
    torch.testing.assert_close(out[0].double(), naive_attention(q[:1], ks, vs, 0.5)[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros(2, 4))


def test_broken_invariants_are_asserted() -> None:
    # The model runner builds every context from the scheduler's sequences: these are bugs, not bad input.
    layer = Attention(2, 4, 0.5, 1)
    with pytest.raises(AssertionError, match="needs block tables"):
        set_prefill_context([2], [5])
    with pytest.raises(AssertionError, match="needs block 1"):
        set_prefill_context([5], [5], [[0]], block_size=4)
    with pytest.raises(AssertionError):
        set_prefill_context([3], [2], [[0]], block_size=4)
    set_context(False, slot_mapping=torch.tensor([0]), context_lens=torch.tensor([1]),
                block_tables=torch.tensor([[0]]))
    with pytest.raises(AssertionError, match="needs a KV cache"):
        layer(torch.randn(1, 2, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4))


def test_backends_are_built_by_name_and_the_context_resets() -> None:
    assert isinstance(attention_backend("torch"), TorchBackend) and isinstance(Attention(2, 4, 0.5, 1).backend,
                                                                               TorchBackend)
    ctx = set_decode_context([3], [[2]], block_size=4)
    assert get_context() is ctx and ctx.slot_mapping.tolist() == [10] and not ctx.is_prefill
    reset_context()
    assert get_context().slot_mapping is None and not get_context().is_prefill
