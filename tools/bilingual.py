"""Check that every chapter speaks both languages.

Rules, one per kind of text:

* every markdown cell is tagged ``en`` or ``zh`` (exactly one of them), and each ``en`` cell is
  immediately followed by its ``zh`` twin;
* in code cells, a run of ``# en:`` comment lines is immediately followed by a run of
  ``# zh:`` lines at the same indentation, and no ``# zh:`` run stands alone;
* in code cells, a comment in English prose is an ``# en:`` line: a plain ``# why ...`` comment,
  whole-line or after code, would reach Chinese readers untranslated. Tool directives (``#|``,
  ``# noqa``, ``# fmt:``, ``# type:``, ``# pragma``) and comments without a word of prose
  (``# -1``, ``# 4 x 16``) are not prose;
* in code cells, a docstring in English prose is followed by its twin: a run of ``# zh:`` lines right
  below its closing quotes, at its indentation, one line for each line of the Chinese docstring
  (``# zh:`` alone for a blank one)::

      def allocate(self, seq: Sequence) -> None:
          '''Give ``seq`` the blocks its prompt needs.'''
          # zh: 为 ``seq`` 分配它的提示词所需的块。

  The docstring itself is the English: the package and the English site keep it as it is (the
  tangler drops ``# zh:`` lines), and the Chinese site and reading copies show the twin in its place
  (``tools.book.localize_code``).

Usage: ``python tools/bilingual.py [chapter.py ...]`` (default: every chapter). Exit status 1
and one line per problem, naming the file and the cell, when a twin is missing.
"""

from __future__ import annotations

import io
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as `python tools/bilingual.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.tangle import ROOT, chapter_files, read_chapter

LANGUAGES = ("en", "zh")
COMMENT = re.compile(r"^(?P<indent>\s*)# (?P<lang>en|zh):")
DIRECTIVE = re.compile(r"^#(\||\s*(noqa|fmt:|type:|pragma))")
# A word of prose: three letters or more; Chinese text counts as translated.
PROSE = re.compile(r"[A-Za-z]{3,}")
CHINESE = re.compile(r"[\u4e00-\u9fff]")
TWIN_LINE = re.compile(r"^(?P<indent>\s*)# zh:(?: (?P<text>.*)|)$")


@dataclass(frozen=True)
class Docstring:
    """A docstring (a string that is a statement of its own) in a cell, and its Chinese twin, if it has one."""

    first: int  # the line of its opening quotes, 1-based
    last: int  # the line of its closing quotes
    column: int  # where its opening quotes (or its prefix) start: the indentation of its twin
    end_column: int  # just past its closing quotes
    literal: str  # the string as written, quotes and prefix included
    twin: tuple[str, ...]  # the lines of its Chinese: the ``# zh:`` lines right below it, at its indentation

    @property
    def end(self) -> int:
        """The last line it takes in the cell, its twin included."""
        return self.last + len(self.twin)

    def is_english(self) -> bool:
        return bool(PROSE.search(self.literal)) and not CHINESE.search(self.literal)


def docstrings(source: str) -> list[Docstring]:
    """The docstrings of a cell's code, found by Python's tokenizer, each with its twin (or none).

    A docstring is a string that makes a statement alone: the first statement of a module, class or
    function, or a bare string below an attribute. A cell the tokenizer cannot read has none.
    """
    lines = source.splitlines()
    found, statement_start, pending = [], True, None
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if pending is not None and token.type not in (tokenize.COMMENT, tokenize.NL):
                if token.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                    found.append(pending)
                pending = None
            if token.type == tokenize.STRING and statement_start:
                pending = token
            if token.type not in (tokenize.NL, tokenize.COMMENT):
                statement_start = token.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return []
    result = []
    for token in found:
        (first, column), (last, end_column) = token.start, token.end
        twin = []
        for line in lines[last:]:
            match = TWIN_LINE.match(line)
            if match is None or len(match["indent"]) != column:
                break
            twin.append(match["text"] or "")
        result.append(Docstring(first, last, column, end_column, token.string, tuple(twin)))
    return result


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
    cells = read_chapter(path).cells
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
            documented = docstrings(cell.source)
            twins = {doc.last + 1 for doc in documented if doc.twin}
            for doc in documented:
                if doc.is_english() and not doc.twin:
                    problems.append(f"{where}, line {doc.first}: a docstring without its Chinese twin: write "
                                    "it as '# zh:' lines right below the docstring, at its indentation")
            runs = comment_runs(cell.source)
            for j, (lang, indent, line) in enumerate(runs):
                if lang == "zh" and line in twins:
                    continue  # a docstring's twin, not a comment's
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
