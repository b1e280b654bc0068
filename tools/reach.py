"""Which functions, methods and classes of the package does nothing but the test suite reach?

A definition of `nanovllm` that no other package code, no chapter cell, no script and no tool names is either dead
(nobody names it) or kept for the tests alone. Either way a reader of the package meets code that serves no reader:
it should go, or say why it stays (`tests/book/test_reach.py` holds the reasons).

Reaching is by name, as text: a definition is reached when its name appears, outside its own definition, as a name,
an attribute or a string (`getattr`, a call sent to a rank by name) in the package, the chapters, `scripts/` or
`tools/`. That is coarse (two methods of one name reach each other) but never calls code dead that something names.
Dunders (methods, and a module's `__getattr__`) and IPython's display methods (`_repr_html_`), which the runtime
calls by name, are not listed.

    python -m tools.reach        # the definitions only tests reach, then those nothing names
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What readers and the runtime reach besides the package: the chapters, the scripts, the tools.
OTHER_CODE = ("notebooks", "scripts", "tools")
# Methods the runtime calls by their name: Python's dunders and IPython's display protocol (_repr_html_, ...).
RUNTIME_PROTOCOL = re.compile(r"__\w+__|_repr_\w+_")


@dataclass(frozen=True, order=True)
class Definition:
    module: str  # nanovllm/engine/sequence.py
    qualname: str  # Sequence.fork
    line: int

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


def definitions(package: Path) -> list[Definition]:
    """Top-level functions and classes of every module, and the methods of its classes (dunders left out)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package.parent).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and not RUNTIME_PROTOCOL.fullmatch(node.name)):
                found.append(Definition(module, node.name, node.lineno))
            if isinstance(node, ast.ClassDef):
                found += [Definition(module, f"{node.name}.{member.name}", member.lineno) for member in node.body
                          if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef))
                          and not RUNTIME_PROTOCOL.fullmatch(member.name)]
    return found


def names_in(source: str) -> Counter:
    """How often each identifier is used in ``source``: as a name, an attribute, a string or an import (a definition
    is no use of its name)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a cell with a shell escape or a magic: count what reads like an identifier
        return Counter(word for word in _words(source))
    counts: Counter = Counter()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            counts[node.id] += 1
        elif isinstance(node, ast.Attribute):
            counts[node.attr] += 1
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            counts[node.value] += 1
        elif isinstance(node, ast.alias):
            counts[node.name.rsplit(".", 1)[-1]] += 1
            if node.asname:
                counts[node.asname] += 1
    return counts


def _words(source: str) -> list[str]:
    word, words = [], []
    for char in source + " ":
        if char.isalnum() or char == "_":
            word.append(char)
        elif word:
            words.append("".join(word))
            word = []
    return [w for w in words if w.isidentifier()]


def count_in(folders: list[Path]) -> Counter:
    counts: Counter = Counter()
    for folder in folders:
        for path in sorted(folder.rglob("*.py")) if folder.is_dir() else [folder]:
            counts += names_in(path.read_text(encoding="utf-8"))
    return counts


def reach(root: Path = ROOT) -> tuple[list[Definition], list[Definition]]:
    """(Definitions that only the tests name, definitions that nothing names), each sorted."""
    package = root / "nanovllm"
    elsewhere = count_in([package]) + count_in([root / folder for folder in OTHER_CODE if (root / folder).is_dir()])
    in_tests = count_in([root / "tests"])
    only_tests, nowhere = [], []
    for definition in definitions(package):
        if elsewhere[definition.name]:
            continue
        (only_tests if in_tests[definition.name] else nowhere).append(definition)
    return sorted(only_tests), sorted(nowhere)


def main() -> int:
    only_tests, nowhere = reach()
    print("reached only by the tests:")
    for d in only_tests:
        print(f"  {d.module}:{d.line} {d.qualname}")
    print("reached by nothing:")
    for d in nowhere:
        print(f"  {d.module}:{d.line} {d.qualname}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
