"""Which chapters' exported code imports a module that a later chapter creates?

The book is read in order, and the package is tangled from it: a chapter's exported cells should use
only what it or an earlier chapter built. A *forward import* breaks that: chapter 06's exported model
importing ``layers.linear``, which chapter 16 creates, says that chapter 06 cannot be read (or run) on
its own. This tool lists them: for every ``from nanovllm.X import ...`` in an exported cell, the chapter
that first exports to ``X`` (for a package, to any module under it) must not come later in the book's reading
order: part by part (tools/parts.py), so that appendix D, read with the core chapters, comes before chapter 11.
Notebook-only cells (no ``#| export``) may import anything: they are the book's demonstrations; so may the
import of ``add_to_class`` and its siblings, which the tangler drops.

    python -m tools.forward_imports     # the table
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools import tangle
from tools.parts import reading_position


@dataclass(frozen=True, order=True)
class ForwardImport:
    """Chapter ``chapter``'s exported code imports ``module``, which ``creator`` (a later chapter) creates."""

    chapter: str
    module: str
    creator: str


def chapter_name(path: str) -> str:
    """notebooks/06_model.py -> 06_model"""
    return Path(path).stem


def forward_imports(root: Path) -> list[ForwardImport]:
    """Every forward import of the book's exported cells, once per (chapter, module), sorted."""
    cells = list(tangle.exported_cells(root))
    order = {path.relative_to(root).as_posix(): reading_position(path.stem) for path in tangle.chapter_files(root)}
    creators: dict[str, str] = {}
    for cell, target, _ in cells:
        creators.setdefault(target, cell.chapter)

    def creator_of(module: str) -> str | None:
        if module in creators:
            return creators[module]
        # A package: its first module's chapter.
        inside = [chapter for name, chapter in creators.items() if name.startswith(module + ".")]
        return min(inside, key=order.__getitem__) if inside else None

    found: set[ForwardImport] = set()
    for cell, _, _ in cells:
        for node in ast.walk(ast.parse(cell.code)):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nanovllm.")):
                continue
            if node.module == tangle.SPLICE_HELPER_MODULE:
                # add_to_class and its siblings: the notebook's helpers (appendix D), which the tangler drops.
                continue
            module = node.module.removeprefix("nanovllm.")
            creator = creator_of(module)
            if creator is not None and order[creator] > order[cell.chapter]:
                found.add(ForwardImport(chapter_name(cell.chapter), module, chapter_name(creator)))
    return sorted(found)


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    found = forward_imports(root)
    for item in found:
        print(f"{item.chapter:<28} imports {item.module:<22} which {item.creator} creates")
    print(f"{len(found)} forward imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
