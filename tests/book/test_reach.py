"""No package code that only the tests reach, or that nothing reaches (tools/reach.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tools.reach import Definition, reach

ROOT = Path(__file__).resolve().parents[2]
# A definition that only the tests reach and stays anyway: its qualified name and why.
KEPT_FOR_TESTS: dict[str, str] = {}


def test_the_package_holds_nothing_that_only_the_tests_reach() -> None:
    only_tests, nowhere = reach(ROOT)
    assert nowhere == [], f"nothing names these: {nowhere}"
    assert [d.qualname for d in only_tests if d.qualname not in KEPT_FOR_TESTS] == [], only_tests


def test_a_planted_test_only_function_and_a_dead_one_are_found(tmp_path: Path) -> None:
    """The check itself, on a toy tree: one function the package uses, one only a test names, one nobody names."""
    for folder in ("nanovllm", "tests", "notebooks", "scripts", "tools"):
        (tmp_path / folder).mkdir()
    (tmp_path / "nanovllm" / "core.py").write_text(textwrap.dedent('''
        def used() -> int:
            return 1


        def for_tests() -> int:
            return used()


        class Thing:
            def _repr_html_(self) -> str:
                return ""

            def dead(self) -> None:
                pass
        '''))
    (tmp_path / "notebooks" / "01_core.py").write_text("from nanovllm.core import Thing\nThing()\n")
    (tmp_path / "tests" / "test_core.py").write_text("from nanovllm.core import for_tests\nfor_tests()\n")
    only_tests, nowhere = reach(tmp_path)
    assert only_tests == [Definition("nanovllm/core.py", "for_tests", 6)]
    assert nowhere == [Definition("nanovllm/core.py", "Thing.dead", 14)]
