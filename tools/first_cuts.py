"""How big is each engine module's first cut, next to upstream nano-vllm's file?

The book builds each module in reading order: the chapter that introduces it exports a *first cut* in
the shape of upstream's file, and later chapters extend it (``tools/tangle.py``). This tool measures
that promise in code lines, the way the book's issue tracker states it: lines that hold code, not
blank lines, comments or docstrings. A module's first cut is what its introducing chapter exports to
it (notebook-only imports aside); each later chapter's extension is counted the same way; the total
is the generated module without its ``__all__``.

    python -m tools.first_cuts     # the table
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools import tangle

# Code lines of upstream's files at bb823b3 (main on 2026-04-26), counted by `code_lines` below.
UPSTREAM_LINES = {
    "engine.sequence": 65,
    "engine.block_manager": 102,
    "engine.scheduler": 78,
    "engine.model_runner": 235,
    "engine.llm_engine": 81,
    "config": 22,
}
# The engine modules whose first cut must stay upstream-shaped.
BOUNDED = ("engine.sequence", "engine.block_manager", "engine.scheduler", "engine.model_runner", "engine.llm_engine")
MAX_RATIO = 1.5
SKIPPED_TOKENS = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                  tokenize.ENCODING, tokenize.ENDMARKER}


def code_lines(source: str) -> int:
    """Lines that hold code: no blank lines, comments or docstrings (of the module, classes and functions)."""
    tree = ast.parse(source)
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                first.value.value, str
            ):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in SKIPPED_TOKENS:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return len(lines)


def cell_code(cell: tangle.Cell, module: str) -> str:
    """What a cell gives its module: its code in English, without the imports that only the notebook needs."""
    code = tangle.english_comments(cell.code)
    lines = code.splitlines()
    target = tangle.Module(module, [cell.chapter])
    for node in ast.parse(code).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and tangle.notebook_only_import(node, target):
            lines[node.lineno - 1 : node.end_lineno] = [""] * (node.end_lineno - node.lineno + 1)
    return "\n".join(lines)


@dataclass
class Growth:
    """One module's code lines: the first cut, then what each later chapter adds."""

    module: str
    chapters: list[str] = field(default_factory=list)
    by_chapter: dict[str, int] = field(default_factory=dict)
    total: int = 0

    @property
    def first_cut(self) -> int:
        return self.by_chapter[self.chapters[0]]


def measure(root: Path) -> dict[str, Growth]:
    """Every module's growth, from the chapters under ``root``."""
    growth: dict[str, Growth] = {}
    for cell, target, _ in tangle.exported_cells(root):
        entry = growth.setdefault(target, Growth(target))
        if cell.chapter not in entry.chapters:
            entry.chapters.append(cell.chapter)
        entry.by_chapter[cell.chapter] = entry.by_chapter.get(cell.chapter, 0) + code_lines(cell_code(cell, target))
    for path, text in tangle.tangle(root).items():
        name = ".".join(path.with_suffix("").parts[1:])
        if name in growth:
            lines = text.splitlines()
            for node in ast.parse(text).body:
                if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
                    lines[node.lineno - 1 : node.end_lineno] = [""] * (node.end_lineno - node.lineno + 1)
            growth[name].total = code_lines("\n".join(lines))
    return growth


def report(growth: dict[str, Growth]) -> str:
    """The table: upstream, first cut and its ratio, each extension, total."""
    rows = [f"{'module':<22}{'upstream':>9}{'first cut':>10}{'ratio':>7}  {'extensions by chapter':<52}{'total':>6}"]
    for name in [*UPSTREAM_LINES, *sorted(set(growth) - set(UPSTREAM_LINES))]:
        if name not in growth:
            continue
        entry, upstream = growth[name], UPSTREAM_LINES.get(name)
        ratio = f"{entry.first_cut / upstream:.2f}" if upstream else ""
        first = f"{entry.first_cut} ({_number(entry.chapters[0])})"
        extensions = ", ".join(f"{_number(c)} +{entry.by_chapter[c]}" for c in entry.chapters[1:])
        rows.append(f"{name:<22}{upstream or '':>9}{first:>10}{ratio:>7}  {extensions:<52}{entry.total:>6}")
    return "\n".join(rows)


def _number(chapter: str) -> str:
    return Path(chapter).stem.split("_")[0]


def main() -> int:
    growth = measure(tangle.ROOT)
    print(report(growth))
    over = [name for name in BOUNDED if growth[name].first_cut > MAX_RATIO * UPSTREAM_LINES[name]]
    if over:
        print(f"first_cuts: over {MAX_RATIO}x upstream: {', '.join(over)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
