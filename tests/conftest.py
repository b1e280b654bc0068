"""Shared test set-up: the engine's environment, the tiny models and the ``gpu`` marker.

Nothing here imports torch when the module is loaded, so that the tool tests (``TOOL_TESTS``: the
tangler, the bilingual check, the book and lab tools, packaging) collect and run without the engine's
dependencies. Before any other test module is imported, ``pytest_collectstart`` prepares the
engine's environment: without CUDA, Triton kernels run in its interpreter, which must be switched on
before Triton is first imported (Triton's own ``tl.*`` helpers are decorated at import time, and
transformers imports Triton early).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

TOOL_TESTS = frozenset(
    {"test_tangle.py", "test_first_cuts.py", "test_layout.py", "test_bilingual.py", "test_book.py", "test_lab.py",
     "test_lab_browser.py", "test_packaging.py", "site_checks.py"}
)


def pytest_configure(config: pytest.Config) -> None:
    # A shell without job control starts a background job (`./dev test &`) with Ctrl-C ignored, and Python then
    # keeps SIGINT ignored: the interrupt tests (chapters 16 and 20) would see no KeyboardInterrupt at all. They
    # test the engine's handling of Ctrl-C, so the run starts from Python's own handler, as in a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@cache
def engine_environment() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collectstart(collector: pytest.Collector) -> None:
    # Called just before a test module is imported, and only for the modules that are collected.
    if isinstance(collector, pytest.Module) and collector.path.name not in TOOL_TESTS:
        engine_environment()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped without CUDA (one marker: no skipif of their own)."""
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import torch

    if not torch.cuda.is_available():
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason="marked gpu: needs CUDA"))


@pytest.fixture(scope="session")
def tiny() -> Path:
    """Chapter 06's tiny Qwen3 (random weights, a real byte-level tokenizer), built once and cached."""
    from nanovllm.book.tiny_models import build_tiny_model

    return build_tiny_model("qwen3")


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def tiny_arch(request: pytest.FixtureRequest) -> Path:
    """The tiny model of each architecture family the engine serves: Qwen3 and Llama."""
    from nanovllm.book.tiny_models import build_tiny_model

    return build_tiny_model(request.param)


@pytest.fixture()
def attention_sass(tmp_path: Path) -> Callable[..., list[dict]]:
    """scripts/attention_sass.py in a process of its own (it compiles for GPUs, which the interpreter mode of this
    process rules out): a function of the script's arguments that returns the rows it writes as JSON."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"} | {"PYTHONPATH": str(root)}

    def run(*args: str) -> list[dict]:
        out = tmp_path / "attention_sass.json"
        subprocess.run([sys.executable, "scripts/attention_sass.py", *args, "--json", str(out)], cwd=root, env=env,
                       check=True, capture_output=True, timeout=600)  # fmt: skip
        return json.loads(out.read_text())

    return run
