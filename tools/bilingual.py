"""Check that every chapter speaks both languages.

Rules, one per kind of text:

* every markdown cell is tagged ``en`` or ``zh`` (exactly one of them), and each ``en`` cell is
  immediately followed by its ``zh`` twin;
* in code cells, a run of ``# en:`` comment lines is immediately followed by a run of
  ``# zh:`` lines at the same indentation, and no ``# zh:`` run stands alone;
* in code cells, a comment in English prose is an ``# en:`` line: a plain ``# why ...`` comment,
  whole-line or after code, would reach Chinese readers untranslated. Tool directives (``#|``,
  ``# noqa``, ``# fmt:``, ``# type:``, ``# pragma``) and comments without a word of prose
  (``# -1``, ``# 4 x 16``) are not prose.

Usage: ``python tools/bilingual.py [chapter.py ...]`` (default: every chapter). Exit status 1
and one line per problem, naming the file and the cell, when a twin is missing.
"""

from __future__ import annotations

import io
import re
import sys
import tokenize
from pathlib import Path

import jupytext

if __package__ in (None, ""):  # run as `python tools/bilingual.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.tangle import ROOT, chapter_files

LANGUAGES = ("en", "zh")
COMMENT = re.compile(r"^(?P<indent>\s*)# (?P<lang>en|zh):")
DIRECTIVE = re.compile(r"^#(\||\s*(noqa|fmt:|type:|pragma))")
# A word of prose: three letters or more; Chinese text counts as translated.
PROSE = re.compile(r"[A-Za-z]{3,}")
CHINESE = re.compile(r"[\u4e00-\u9fff]")


def describe(index: int, source: str) -> str:
    first = next((line.strip() for line in source.splitlines() if line.strip()), "(empty)")
    return f"cell {index} ({first[:60]!r})"


def is_prose_in(cell: object, lang: str) -> bool:
    return cell is not None and cell.cell_type == "markdown" and lang in cell.metadata.get("tags", [])


def comment_runs(source: str) -> list[tuple[str, str, int]]:
    """Group consecutive bilingual comment lines into runs: (language, indent, line number)."""
    runs: list[tuple[str, str, int]] = []
    previous: tuple[str, str] | None = None
    for number, line in enumerate(source.splitlines(), start=1):
        match = COMMENT.match(line)
        key = (match["lang"], match["indent"]) if match else None
        if key and key != previous:
            runs.append((key[0], key[1], number))
        previous = key
    return runs


def english_comments(source: str) -> list[int]:
    """Line numbers of the comments in English prose that are not ``# en:`` lines. Comments are found by
    Python's tokenizer, so a ``#`` inside a string is no comment; a cell it cannot read (a shell escape, a
    magic) falls back to whole-line comments."""
    try:
        comments = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
                    if token.type == tokenize.COMMENT]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        comments = [(number, line.strip()) for number, line in enumerate(source.splitlines(), start=1)
                    if line.lstrip().startswith("#")]
    return [number for number, text in comments
            if not COMMENT.match(text) and not DIRECTIVE.match(text) and PROSE.search(text)
            and not CHINESE.search(text)]


def check_notebook(path: Path) -> list[str]:
    """Return one message per missing or mis-tagged twin in the chapter at ``path``."""
    name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    cells = jupytext.read(path, fmt="py:percent").cells
    problems = []
    for i, cell in enumerate(cells):
        where = f"{name}: {describe(i + 1, cell.source)}"
        if cell.cell_type == "markdown":
            langs = [t for t in cell.metadata.get("tags", []) if t in LANGUAGES]
            if len(langs) != 1:
                problems.append(f"{where}: markdown cell must be tagged exactly one of 'en' or 'zh'")
                continue
            nxt = cells[i + 1] if i + 1 < len(cells) else None
            prev = cells[i - 1] if i > 0 else None
            if langs == ["en"] and not is_prose_in(nxt, "zh"):
                problems.append(f"{where}: 'en' cell has no 'zh' twin right after it")
            if langs == ["zh"] and not is_prose_in(prev, "en"):
                problems.append(f"{where}: 'zh' cell has no 'en' twin right before it")
        elif cell.cell_type == "code":
            runs = comment_runs(cell.source)
            for j, (lang, indent, line) in enumerate(runs):
                if lang == "en":
                    nxt_run = runs[j + 1] if j + 1 < len(runs) else None
                    if not (nxt_run and nxt_run[0] == "zh" and nxt_run[1] == indent):
                        problems.append(f"{where}, line {line}: '# en:' comment has no '# zh:' twin after it")
                elif j == 0 or runs[j - 1][0] != "en" or runs[j - 1][1] != indent:
                    problems.append(f"{where}, line {line}: '# zh:' comment has no '# en:' twin before it")
            for line in english_comments(cell.source):
                problems.append(f"{where}, line {line}: an English comment without its twin: write it as "
                                "'# en:' lines followed by '# zh:' lines")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    paths = [Path(a).resolve() for a in args] or chapter_files(ROOT)
    problems = [p for path in paths for p in check_notebook(path)]
    for problem in problems:
        print(problem)
    if problems:
        print(f"bilingual: {len(problems)} missing twin(s)", file=sys.stderr)
        return 1
    print(f"bilingual: {len(paths)} chapter(s), every prose cell has its twin")
    return 0


if __name__ == "__main__":
    sys.exit(main())
