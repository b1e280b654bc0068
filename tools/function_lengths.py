"""Which functions of the package are too long to read at once?

Issue 37's rule: outside Triton kernels (``@triton.jit``), no function of ``nanovllm/`` is longer than
MAX_LINES lines, from its ``def`` line to its last line (docstring and comments included: they are read
too). Kernels are exempt: a kernel's body is one pass over a tile, which splitting would not make clearer.

    python -m tools.function_lengths     # the functions over the limit, longest first
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

MAX_LINES = 60


@dataclass(frozen=True, order=True)
class LongFunction:
    """``name`` (``Class.method`` for a method) in ``path`` runs ``lines`` lines."""

    path: str
    name: str
    lines: int


def is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated ``@triton.jit`` (or ``@triton.jit(...)``)."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def long_functions(package: Path, limit: int = MAX_LINES) -> list[LongFunction]:
    """Every function or method of the package's modules over ``limit`` lines, kernels aside, sorted by path."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        owners = {child: node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                  for child in node.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    name = f"{owners[node]}.{node.name}" if node in owners else node.name
                    found.append(LongFunction(path.relative_to(package.parent).as_posix(), name, lines))
    return sorted(found)


def main() -> int:
    package = Path(__file__).resolve().parent.parent / "nanovllm"
    found = long_functions(package)
    for item in sorted(found, key=lambda f: -f.lines):
        print(f"{item.lines:5d}  {item.path}: {item.name}")
    print(f"{len(found)} functions over {MAX_LINES} lines (Triton kernels aside)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
