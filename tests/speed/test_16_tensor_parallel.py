"""Chapter 16: tensor-parallel layers at world size 1, and the slices each simulated rank keeps."""

from __future__ import annotations

import pytest
import torch

import nanovllm.layers.linear as linear_module
from nanovllm.layers.context import reset_context, set_decode_context, set_prefill_context
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    tp_world,
)

IN = 8


def load(layer, weight, bias=None, shard_id=None):
    layer.weight.weight_loader(layer.weight, weight, shard_id)
    if bias is not None:
        layer.bias.weight_loader(layer.bias, bias, shard_id)
    return layer


def test_world_size_one_without_distributed() -> None:
    assert tp_world() == (0, 1)
    assert tp_world(1, 4) == (1, 4)
    layer = ColumnParallelLinear(IN, 6)
    assert (layer.tp_rank, layer.tp_size) == (0, 1) and layer.weight.shape == (6, IN)
    with pytest.raises(ValueError, match="tp_rank"):
        tp_world(2, 2)


def test_rank_and_size_come_from_torch_distributed_when_initialized(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(linear_module.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(linear_module.dist, "get_world_size", lambda: 2)
    layer = ColumnParallelLinear(IN, 6)
    assert (layer.tp_rank, layer.tp_size) == (1, 2) and layer.weight.shape == (3, IN)
    full = torch.randn(6, IN)
    load(layer, full)
    assert torch.equal(layer.weight, full[3:])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_and_row_slices_and_reassembly(tp: int) -> None:
    torch.manual_seed(tp)
    w, b, x = torch.randn(8, IN), torch.randn(8), torch.randn(5, IN)
    expected = load(ReplicatedLinear(IN, 8, bias=True), w, b)(x)
    torch.testing.assert_close(expected, x @ w.T + b)
    cols, partials = [], []
    for r in range(tp):
        col = load(ColumnParallelLinear(IN, 8, bias=True, tp_rank=r, tp_size=tp), w, b)
        rows = slice(r * 8 // tp, (r + 1) * 8 // tp)
        assert torch.equal(col.weight, w[rows]) and torch.equal(col.bias, b[rows])
        cols.append(col(x))
        row = load(RowParallelLinear(IN, 8, bias=True, tp_rank=r, tp_size=tp), w, b)
        cols_in = slice(r * IN // tp, (r + 1) * IN // tp)
        assert torch.equal(row.weight, w[:, cols_in]) and torch.equal(row.bias, b)
        partials.append(row.forward_local(x[:, cols_in]))
    torch.testing.assert_close(torch.cat(cols, -1), expected)
    torch.testing.assert_close(sum(partials), expected)  # the bias is counted once


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_gate_up_slices(tp: int) -> None:
    gate, up = torch.randn(6, IN), torch.randn(6, IN)
    for r in range(tp):
        layer = MergedColumnParallelLinear(IN, [6, 6], tp_rank=r, tp_size=tp)
        load(layer, up, shard_id=1)
        load(layer, gate, shard_id=0)
        part = slice(r * 6 // tp, (r + 1) * 6 // tp)
        assert torch.equal(layer.weight, torch.cat([gate[part], up[part]]))
        merged = MergedColumnParallelLinear(IN, [6, 6], tp_rank=r, tp_size=tp)
        load(merged, torch.cat([gate, up]))  # shard_id None: an already merged checkpoint tensor
        assert torch.equal(merged.weight, layer.weight)


@pytest.mark.parametrize(("tp", "heads", "kv_heads"), [(1, 4, 2), (2, 4, 2), (2, 8, 2), (4, 8, 4), (2, 4, 4)])
def test_qkv_slices_keep_gqa_groups(tp: int, heads: int, kv_heads: int) -> None:
    d = 2
    wq, wk, wv = torch.randn(heads * d, IN), torch.randn(kv_heads * d, IN), torch.randn(kv_heads * d, IN)
    bq, bk, bv = torch.randn(heads * d), torch.randn(kv_heads * d), torch.randn(kv_heads * d)
    for r in range(tp):
        layer = QKVParallelLinear(IN, d, heads, kv_heads, bias=True, tp_rank=r, tp_size=tp)
        for name, w, b in zip("vqk", (wv, wq, wk), (bv, bq, bk), strict=True):  # any order
            load(layer, w, b, name)
        qh, kvh = heads // tp, kv_heads // tp
        expected = torch.cat([wq[r * qh * d:(r + 1) * qh * d], wk[r * kvh * d:(r + 1) * kvh * d],
                              wv[r * kvh * d:(r + 1) * kvh * d]])
        assert torch.equal(layer.weight, expected)
        assert torch.equal(layer.bias[: qh * d], bq[r * qh * d:(r + 1) * qh * d])
        # a query head's KV head under the split is the one it uses unsplit
        group = heads // kv_heads
        for h in range(qh):
            assert (r * qh + h) // group == r * kvh + h // group
        merged = QKVParallelLinear(IN, d, heads, kv_heads, tp_rank=r, tp_size=tp)
        load(merged, torch.cat([wq, wk, wv]))
        assert torch.equal(merged.weight, layer.weight)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_embedding_and_head(tp: int) -> None:
    table, tokens, x = torch.randn(8, IN), torch.tensor([7, 0, 3, 4, 4, 1]), torch.randn(3, IN)
    embeds, heads = [], []
    for r in range(tp):
        emb = load(VocabParallelEmbedding(8, IN, tp_rank=r, tp_size=tp), table)
        assert torch.equal(emb.weight, table[r * 8 // tp:(r + 1) * 8 // tp])
        embeds.append(emb.forward_local(tokens))
        heads.append(load(ParallelLMHead(8, IN, tp_rank=r, tp_size=tp), table).forward_local(x))
    torch.testing.assert_close(sum(embeds), table[tokens])
    torch.testing.assert_close(torch.cat(heads, -1), x @ table.T)


def test_lm_head_keeps_last_token_of_each_sequence_in_prefill() -> None:
    table, hidden = torch.randn(8, IN), torch.randn(9, IN)
    head = load(ParallelLMHead(8, IN), table)
    try:
        set_prefill_context([4, 2, 3], [4, 5, 3], [[0], [1, 2], [3]], block_size=4)
        torch.testing.assert_close(head(hidden), hidden[[3, 5, 8]] @ table.T)
        set_decode_context([2, 7], [[0], [1, 2]], block_size=4)
        torch.testing.assert_close(head(hidden[:2]), hidden[:2] @ table.T)
    finally:
        reset_context()
    torch.testing.assert_close(head(hidden), hidden @ table.T)


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"number of key/value heads \(3\) is not divisible"):
        QKVParallelLinear(IN, 2, 6, 3, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match=r"vocabulary size \(9\)"):
        VocabParallelEmbedding(9, IN, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match=r"input size \(8\)"):
        RowParallelLinear(IN, 4, tp_rank=0, tp_size=3)
    layer = ReplicatedLinear(IN, 4)
    with pytest.raises(ValueError, match=r"shape \(4, 7\) does not fit parameter of shape \(4, 8\)"):
        load(layer, torch.randn(4, 7))
    merged = MergedColumnParallelLinear(IN, [4, 4])
    with pytest.raises(ValueError, match="shard_id"):
        load(merged, torch.randn(4, IN), shard_id=2)
    with pytest.raises(ValueError, match="part 0 should have 4 rows"):
        load(merged, torch.randn(3, IN), shard_id=0)
    with pytest.raises(ValueError, match="no bias"):
        ParallelLMHead(8, IN, bias=True)
