"""The book builds in reading order: each engine module's first cut is upstream-shaped (tools/first_cuts.py)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from tools import first_cuts, tangle

ROOT = Path(__file__).resolve().parents[2]
HEADER = (
    "# ---\n# jupyter:\n#   kernelspec:\n#     display_name: Python 3\n#     language: python\n"
    "#     name: python3\n# ---\n"
)


def test_code_lines_skip_blank_lines_comments_and_docstrings() -> None:
    source = textwrap.dedent('''
        """A module docstring
        on two lines."""

        # a comment
        X = [1,
             2]  # a trailing comment


        class A:
            """A class docstring."""

            def f(self) -> str:
                """A function docstring."""
                return """not a docstring
                but a string"""
    ''')
    # X's two lines, the class line, the def line, the return's two lines.
    assert first_cuts.code_lines(source) == 6


@pytest.fixture(scope="module")
def book() -> dict[str, first_cuts.Growth]:
    return first_cuts.measure(ROOT)


@pytest.mark.parametrize("module", first_cuts.BOUNDED)
def test_each_engine_module_first_cut_stays_within_its_bound(book: dict, module: str) -> None:
    growth = book[module]
    limit = first_cuts.MAX_RATIO * first_cuts.UPSTREAM_LINES[module]
    assert growth.first_cut <= limit, (
        f"{module}: the first cut in {growth.chapters[0]} has {growth.first_cut} code lines, more than "
        f"{first_cuts.MAX_RATIO}x upstream's {first_cuts.UPSTREAM_LINES[module]}; move a later feature into the "
        "chapter that tells its story (an extension)"
    )


def test_extensions_are_counted_by_chapter_and_notebook_only_imports_are_not(tmp_path: Path) -> None:
    first = """
# %%
#| default_exp engine.sequence

# %% seq
#| export
class Sequence:
    def __init__(self) -> None:
        self.tokens = []
"""
    later = """
# %% forks
#| export engine.sequence
from nanovllm.book.literate import add_to_class
from nanovllm.engine.sequence import Sequence


@add_to_class(Sequence)
def fork(self) -> Sequence:
    return Sequence()
"""
    for name, body in (("01_sequence.py", first), ("04b_forks.py", later)):
        path = tmp_path / "notebooks" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(HEADER + body, encoding="utf-8")
    growth = first_cuts.measure(tmp_path)["engine.sequence"]
    assert growth.chapters == ["notebooks/01_sequence.py", "notebooks/04b_forks.py"]
    assert growth.first_cut == 3 and growth.by_chapter["notebooks/04b_forks.py"] == 3  # decorator, def, return
    assert growth.total == 5  # the class block with both methods, no __all__
    assert "engine.sequence" in first_cuts.report({"engine.sequence": growth})


def test_the_report_names_every_bounded_module_and_its_extensions(book: dict) -> None:
    table = first_cuts.report(book)
    assert all(module in table for module in first_cuts.BOUNDED)
    # The scheduler's first cut is chapter 04's; forks, asynchronous scheduling and robustness extend it.
    assert book["engine.scheduler"].chapters[0] == "notebooks/04_scheduler.py"
    assert len(book["engine.scheduler"].chapters) > 1 and tangle.chapter_files(ROOT)


def test_retyped_members_are_bounded() -> None:
    retyped = first_cuts.retyped_members(ROOT)
    total = first_cuts.retyped_lines(retyped)
    assert total <= first_cuts.MAX_RETYPED_LINES, (
        f"{total} retyped code lines, more than {first_cuts.MAX_RETYPED_LINES}: extend with an addition instead of "
        f"replacing a member whole, where that reads as well (a new hook is a cost too)\n"
        f"{first_cuts.retyped_report(retyped)}"
    )


def test_hooks_are_reported_with_their_distance_and_bounded() -> None:
    retyped = first_cuts.retyped_members(ROOT)
    planted = first_cuts.hooks(retyped)
    report = first_cuts.hooks_report(retyped, first_cuts.reading_order(ROOT))
    assert len(planted) <= first_cuts.MAX_HOOKS, f"{len(planted)} hooks, more than {first_cuts.MAX_HOOKS}\n{report}"
    # Every hook is listed by name, and no filler comes before the chapter that planted it.
    assert all(f"{item.module}.{item.name}" in report for item in planted)
    assert all(first_cuts.chapters_ahead(item, first_cuts.reading_order(ROOT)) > 0 for item in planted)


def test_a_member_replaced_by_a_later_chapter_is_counted_and_an_addition_is_not(tmp_path: Path) -> None:
    first = """
# %%
#| default_exp engine.sequence

# %% seq
#| export
class Sequence:
    def __init__(self) -> None:
        self.tokens = []

    def size(self) -> int:
        return len(self.tokens)
"""
    later = """
# %% size again
#| export engine.sequence
from nanovllm.book.literate import add_to_class
from nanovllm.engine.sequence import Sequence


@add_to_class(Sequence)
def size(self) -> int:
    return len(self.tokens) + 0


@add_to_class(Sequence)
def fork(self) -> Sequence:
    return Sequence()


Sequence.limit = 4
"""
    for name, body in (("01_sequence.py", first), ("04b_forks.py", later)):
        path = tmp_path / "notebooks" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(HEADER + body, encoding="utf-8")
    retyped = first_cuts.retyped_members(tmp_path)
    # size: decorator, def, return; fork and limit are additions.
    assert retyped == [first_cuts.Retyped("notebooks/04b_forks.py", "engine.sequence", "Sequence.size",
                                          "notebooks/01_sequence.py", 3)]
    assert "1 members, 3 code lines" in first_cuts.retyped_report(retyped)


def test_a_seam_filled_later_is_not_counted_but_a_filled_seam_replaced_again_is(tmp_path: Path) -> None:
    first = """
# %%
#| default_exp engine.engine

# %% engine
#| export
class Engine:
    def __init__(self) -> None:
        self.size = 0

    def waits(self) -> bool:
        \"\"\"Whether the next step waits (never, in this first cut).\"\"\"
        return False

    def grow(self) -> None:
        pass
"""
    later = """
# %% engine, later
#| export engine.engine
from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.engine.engine import Engine


@add_to_init(Engine)
def _init_limit(self) -> None:
    self.limit = 4


@add_to_class(Engine)
def waits(self) -> bool:
    return self.size > 2


@add_to_class(Engine)
def grow(self) -> None:
    self.size += 1
"""
    last = later.replace("engine, later", "engine, last").replace("self.size > 2", "self.size > self.limit")
    for name, body in (("01_engine.py", first), ("02_later.py", later), ("03_last.py", last)):
        path = tmp_path / "notebooks" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(HEADER + body, encoding="utf-8")
    retyped = first_cuts.retyped_members(tmp_path)
    # Chapter 02 fills two seams and adds to the constructor; chapter 03 replaces what 02 wrote: that counts.
    assert [(Path(r.chapter).stem, r.name, r.seam) for r in retyped] == [
        ("02_later", "Engine.waits", True), ("02_later", "Engine.grow", True),
        ("03_last", "Engine.waits", False), ("03_last", "Engine.grow", False)]
    assert first_cuts.retyped_lines(retyped) == 6
    report = first_cuts.retyped_report(retyped)
    assert "2 members, 6 code lines" in report
    assert "    engine.engine         03 6" in report, report
    # The two hooks are a cost of their own: chapter 01 plants them, chapter 02 (one ahead) fills them.
    hooks = first_cuts.hooks_report(retyped, first_cuts.reading_order(tmp_path))
    assert "01 -> 02    1 ahead  engine.engine.Engine.waits" in hooks, hooks
    assert "2 hooks, 0 of them filled seven or more chapters ahead" in hooks


@pytest.mark.parametrize(("source", "seam"), [
    ("def world():\n    return 0, 1\n", True),
    ("def siblings(self, seqs):\n    return []\n", True),
    ("def siblings(self, seqs):\n    return [seqs]\n", False),
    ("def store(self, x):\n    raise NotImplementedError('no such cache')\n", True),
    ("def store(self, x):\n    if x:\n        raise ValueError(x)\n", False),
    ("def rows(self, x):\n    return x\n", True),
    ("def me(self):\n    return self\n", False),
    ("def world(size):\n    return 0, size\n", False),
    ("def rows(self, x):\n    return x[1:]\n", False),
    ("def hidden(self, x):\n    return y\n", False),
])
def test_a_seam_returns_a_constant_or_one_of_its_arguments_unchanged(source: str, seam: bool) -> None:
    """A tuple or list of constants is a constant (``[]``: none), an identity hook (``return x``) and a hook that
    only refuses (``raise``) are seams; a function that returns ``self``, a computed value or a name it was not given
    is code, and so is one that raises only sometimes: replacing it retypes it."""
    assert first_cuts.is_seam(ast.parse(source).body[0]) is seam
