"""Appendix B: the map from upstream nano-vllm to this book names only what exists.

The chapter's own check runs here too, and each of its three rules is shown to fail on a map
that breaks it. Upstream's inventory is stored in the chapter; with a nano-vllm git directory in
``$NANOVLLM_UPSTREAM``, the last test reads it from upstream again (skipped otherwise: no
network and no checkout are needed).
"""

from __future__ import annotations

import ast
import contextlib
import os
import subprocess
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAPTER = ROOT / "notebooks" / "B_from_nano_vllm.py"


@pytest.fixture(scope="module")
def appendix() -> dict:
    """The namespace left by running the chapter's code cells (they assert the map holds)."""
    namespace: dict = {"__name__": "appendix_b"}
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(None):
        for cell in jupytext.read(CHAPTER, fmt="py:percent").cells:
            if cell.cell_type == "code":
                exec(compile(cell.source, str(CHAPTER), "exec"), namespace)
    return namespace


def check(appendix: dict, source: str, inventory: dict | None = None) -> list[str]:
    problems, _ = appendix["check_map"](source, ROOT, inventory or appendix["UPSTREAM_NAMES"])
    return problems


def test_every_name_in_the_map_exists_and_every_upstream_name_is_listed(appendix: dict) -> None:
    problems, counts = appendix["check_map"](CHAPTER.read_text(encoding="utf-8"), ROOT, appendix["UPSTREAM_NAMES"])
    assert problems == []
    assert counts["upstream names"] == sum(len(names) for names in appendix["UPSTREAM_NAMES"].values()) > 200


def test_names_resolve_as_modules_attributes_fields_or_files(appendix: dict) -> None:
    resolve = appendix["resolve"]
    assert resolve("Sequence.num_cached_tokens", "nanovllm.engine.sequence", ROOT)  # set on self in __init__
    assert resolve("engine.scheduler.Scheduler.schedule", None, ROOT)  # from the package root
    assert resolve("RotaryEmbedding.cos_sin_cache", "nanovllm.layers.rotary_embedding", ROOT)  # a buffer
    assert resolve("Config.model", "nanovllm.config", ROOT)  # a dataclass field without a default
    assert resolve("./README.md", None, ROOT)
    assert not resolve("Sequence.num_cache_tokens", "nanovllm.engine.sequence", ROOT)
    assert not resolve("engine.scheduler.Scheduler.preempt", None, ROOT)  # upstream's name, not ours
    assert not resolve("Sequence.num_cached_tokens.real", "nanovllm.engine.sequence", ROOT)
    assert not resolve("./LICENSE", None, ROOT)


def test_a_name_of_ours_that_does_not_exist_is_reported(appendix: dict) -> None:
    source = CHAPTER.read_text(encoding="utf-8").replace("`BlockPool.take_free_block`", "`BlockPool.take_block`")
    problems = check(appendix, source)
    assert any("`BlockPool.take_block`" in p and p.startswith("en:") for p in problems)
    assert any("`BlockPool.take_block`" in p and p.startswith("zh:") for p in problems)


def test_tables_that_disagree_across_languages_are_reported(appendix: dict) -> None:
    source = CHAPTER.read_text(encoding="utf-8")
    zh_start = source.index('tags=["zh"]\n# ### `nanovllm/engine/scheduler.py`')
    zh_row = source.index("| `Scheduler.preempt` | `Scheduler._preempt` |", zh_start)
    broken = source[:zh_row] + source[zh_row:].replace("`Scheduler._preempt`", "`Scheduler._schedule_decode`", 1)
    assert any("English and Chinese rows differ" in p for p in check(appendix, broken))


def test_upstream_names_left_out_or_made_up_are_reported(appendix: dict) -> None:
    source = CHAPTER.read_text(encoding="utf-8")
    inventory = {file: list(names) for file, names in appendix["UPSTREAM_NAMES"].items()}
    inventory["nanovllm/engine/scheduler.py"].append("Scheduler.swap_out")
    inventory["nanovllm/engine/sequence.py"].remove("Sequence.is_prefill")
    problems = check(appendix, source, inventory)
    assert "upstream's `Scheduler.swap_out` (nanovllm/engine/scheduler.py) is missing from the map" in problems
    assert any("`Sequence.is_prefill` is listed" in p and "no such name" in p for p in problems)


# ---- the stored inventory against an upstream checkout (optional) ------------------------------
def class_names(node: ast.ClassDef) -> list[str]:
    """Methods but __init__, class-level fields, and fields assigned to or registered on self."""
    names: list[str] = []
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name != "__init__":
            names.append(item.name)
        elif isinstance(item, ast.Assign):
            names += [t.id for t in item.targets if isinstance(t, ast.Name)]
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.append(item.target.id)
    for sub in ast.walk(node):
        if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
            names.append(sub.attr)
        elif (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
              and sub.func.attr in ("register_buffer", "register_parameter")
              and sub.args and isinstance(sub.args[0], ast.Constant)):
            names.append(sub.args[0].value)
    return [f"{node.name}.{name}" for name in dict.fromkeys(names)]


def module_names(source: str, is_package_init: bool) -> list[str]:
    names: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            names += [node.name, *class_names(node)]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.ImportFrom) and is_package_init:
            names += [alias.asname or alias.name for alias in node.names]
    return names


def upstream_inventory(git_dir: Path, commit: str) -> dict[str, list[str]]:
    """Every file of an upstream commit; a Python file's classes, functions, methods and fields."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(git_dir), *args], capture_output=True, text=True, check=True).stdout

    inventory: dict[str, list[str]] = {"": []}
    for name in git("ls-tree", "-r", "--name-only", commit).split():
        if name.endswith(".py"):
            inventory[name] = module_names(git("show", f"{commit}:{name}"), name.endswith("__init__.py"))
        else:
            inventory[""].append(name)
    return inventory


@pytest.mark.skipif(not os.environ.get("NANOVLLM_UPSTREAM"), reason="set NANOVLLM_UPSTREAM to a nano-vllm git dir")
def test_the_stored_inventory_is_upstreams(appendix: dict) -> None:
    inventory = upstream_inventory(Path(os.environ["NANOVLLM_UPSTREAM"]), appendix["UPSTREAM_COMMIT"])
    as_sets = {file: set(names) for file, names in inventory.items()}
    assert as_sets == {file: set(names) for file, names in appendix["UPSTREAM_NAMES"].items()}
