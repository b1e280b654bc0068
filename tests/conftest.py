"""Shared test set-up.

Without CUDA, Triton kernels run in its interpreter, which must be switched on before Triton is
first imported: Triton's own ``tl.*`` helpers are decorated at import time, and transformers
imports Triton early. So it is set here, before any test module is collected.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
