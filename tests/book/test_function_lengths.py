"""No function of the package over 60 lines, Triton kernels aside (tools/function_lengths.py), and no chapter over
about 2,000 lines (issue 37, item 5).

KNOWN lists the debt left to pay (none today): the test fails on any other function over the limit, on a listed
one that grew, and on a listed one that is now short enough (remove it).
"""

from pathlib import Path

from tools.bilingual import docstrings
from tools.function_lengths import MAX_LINES, long_functions

PACKAGE = Path(__file__).resolve().parents[2] / "nanovllm"

# The debt left to pay, {(path, name): lines today}: empty since create_app became routers and the last four
# launchers and benchmark steps were split (keep the mechanism for a function that must wait).
KNOWN: dict[tuple[str, str], int] = {}


def test_no_function_grows_past_the_limit_beyond_the_known_debt():
    found = {(item.path, item.name): item.lines for item in long_functions(PACKAGE)}
    new = {key: lines for key, lines in found.items() if key not in KNOWN}
    assert not new, f"functions over {MAX_LINES} lines: {new}"
    grown = {key: (KNOWN[key], lines) for key, lines in found.items() if lines > KNOWN[key]}
    assert not grown, f"known long functions that grew (was, now): {grown}"
    paid = sorted(set(KNOWN) - set(found))
    assert not paid, f"now within {MAX_LINES} lines, so remove them from KNOWN: {paid}"


def test_kernels_are_exempt_and_methods_are_named_by_their_class(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (package / "m.py").write_text(
        f"import triton\n\n\n@triton.jit\ndef kernel():\n{body}\n\n\nclass A:\n    def long(self):\n"
        + "\n".join(f"        y{i} = {i}" for i in range(MAX_LINES)) + "\n\n\ndef short():\n    return 1\n")
    assert [(f.name, f.lines) for f in long_functions(package)] == [("A.long", MAX_LINES + 1)]


# Issue 37, item 5: a chapter splits where its story splits before it passes about 2,000 lines (its two languages
# and its code together); 2,100 leaves room for a paragraph, not for another section. The Chinese twins of the
# docstrings (issue 59, item 6) are not counted: they mirror lines already there, and each site shows one of the two.
MAX_CHAPTER_LINES = 2100


def chapter_lines(path: Path) -> int:
    """The lines of a chapter, less its docstrings' Chinese twins."""
    text = path.read_text(encoding="utf-8")
    return len(text.splitlines()) - sum(len(doc.twin) for doc in docstrings(text))


def test_no_chapter_is_too_long_to_read():
    chapters = sorted((PACKAGE.parent / "notebooks").glob("*.py"))
    long = {path.name: n for path in chapters if (n := chapter_lines(path)) > MAX_CHAPTER_LINES}
    assert chapters and not long, f"chapters over {MAX_CHAPTER_LINES} lines, to split where the story splits: {long}"
