"""Targets of the processes that test_17_tp_runtime.py spawns itself. A spawned child imports its target's module:
this one imports what a rank needs, where the test module would import much more (about 2 s of CPU a child)."""

from __future__ import annotations

import torch.distributed as dist

from nanovllm.engine.tp_runtime import init_rank
from nanovllm.layers.linear import agree_min


def agree_rank(rank: int, port: int, value: int, conn) -> None:
    """One of two gloo ranks: the smallest of the two values, sent back through ``conn``."""
    init_rank(rank, 2, "cpu", port)
    conn.send(agree_min(value))
    dist.destroy_process_group()
