"""The code on the Chinese site speaks Chinese: docstrings and printed traces (issue 59, item 6).

A docstring is written in English with its Chinese twin as ``# zh:`` lines right below it
(tools/bilingual.py); the package and the English site keep the English, the Chinese site and the
Chinese reading copies show the twin in the docstring's place (tools/book.py's localize_code).
What a chapter prints goes through its ``say`` table (nanovllm.book.lang), and so does what the
benchmark it runs prints. These tests count what is left in English on the Chinese side.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from nanovllm.book.lang import LANG_ENV
from tools.bilingual import docstrings
from tools.book import localize, localize_code
from tools.tangle import ROOT, chapter_files, english_comments, read_chapter, split_directives

PROSE = re.compile(r"[A-Za-z]{3,}")
CHINESE = re.compile(r"[\u4e00-\u9fff]")
# A phrase of English in a printed literal: two words in a row (a lone word is often a name or a term the
# Chinese text keeps, such as "eager" or "decode").
ENGLISH_PHRASE = re.compile(r"\b[A-Za-z][a-z]+[ ,;']+[a-z]{2,}\b")
SAYERS = {"say", "_say", "_say_bench", "_say_latency"}
# Chapters whose exported command-line programs (GPU benchmarks, the server) still print their reports in English
# only: no cell of the book runs them, and the site shows their figures as recorded runs, printed through the
# chapter's `say`. The benchmark that chapter 19 runs on the page (`nanovllm.bench`, `--latency`) speaks Chinese.
COMMAND_LINE_ONLY = {"13_attention_benchmarks", "14_cuda_graphs", "22_openai_server", "23_serving_benchmark",
                     "24_fp8_kv_cache", "25b_speculation_measured", "26_mixture_of_experts", "28_fleet",
                     "29_structured_output", "29c_grammar_workers"}


def zh_code_cells(chapter: Path) -> list:
    return [c for c in localize(read_chapter(chapter), "zh").cells if c.cell_type == "code"]


def english_docstring_lines(source: str) -> list[str]:
    """The lines of the docstrings in ``source`` that are English: prose, in a docstring without Chinese."""
    return [line.strip() for doc in docstrings(source) if not CHINESE.search(doc.literal)
            for line in doc.literal.splitlines() if PROSE.search(line)]


CELL = '''class Pool:
    """Blocks of the KV cache.

    One list, one set.
    """
    # zh: KV 缓存的块。
    # zh:
    # zh: 一个列表，一个集合。

    def take(self) -> int:
        """The head of the free list."""
        # zh: 空闲队列的队头。
        # en: The list is never empty here.
        # zh: 这里列表从不为空。
        return 0

    def put(self, block: int) -> None:
        r"""Back to the tail; a block
        that holds nothing."""  # noqa: D401
        # zh: 放回队尾；
        # zh:     一个什么都不装的块。
        pass
'''


def test_the_chinese_side_shows_each_twin_in_its_docstrings_place() -> None:
    zh = localize_code(CELL, "zh")
    assert zh == '''class Pool:
    """KV 缓存的块。

    一个列表，一个集合。
    """

    def take(self) -> int:
        """空闲队列的队头。"""
        # 这里列表从不为空。
        return 0

    def put(self, block: int) -> None:
        r"""放回队尾；
            一个什么都不装的块。"""  # noqa: D401
        pass'''
    tree = ast.parse(zh)  # a reading copy still runs
    assert ast.get_docstring(tree.body[0]) == "KV 缓存的块。\n\n一个列表，一个集合。"


def test_the_english_side_and_the_package_keep_the_english_docstrings() -> None:
    en = localize_code(CELL, "en")
    assert en == english_comments(CELL)  # the English site shows what the tangler writes into the package
    assert "zh:" not in en and not CHINESE.search(en)
    assert '    """Blocks of the KV cache.\n\n    One list, one set.\n    """\n\n    def take' in en


def test_a_docstring_without_its_twin_stays_english_and_is_counted() -> None:
    source = 'def f():\n    """Do the thing."""\n    # en: a comment\n    # zh: 一条注释\n    return 1\n'
    assert localize_code(source, "zh").splitlines()[1] == '    """Do the thing."""'
    assert english_docstring_lines(localize_code(source, "zh")) == ['"""Do the thing."""']


@pytest.mark.parametrize("chapter", chapter_files(ROOT), ids=lambda c: c.stem)
def test_no_english_docstring_on_the_chinese_site(chapter: Path) -> None:
    """Every code cell as the Chinese site shows it (exported or not): 0 English docstring lines."""
    left = [line for cell in zh_code_cells(chapter) for line in english_docstring_lines(cell.source)]
    assert left == [], f"{chapter.stem}: {len(left)} English docstring lines on the Chinese site, e.g. {left[:3]}"


def printed_literals(node: ast.AST):
    """The string constants of what a ``print`` call prints, less what a phrase table says (in the reading
    language) and the keys and calls that pick what is printed (``row["batch"]``, ``f(x)``)."""
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name) and node.func.id in SAYERS:
            return
        if isinstance(node.func, ast.Attribute):  # "...".join(...), "...".format(...)
            yield from printed_literals(node.func.value)
        return
    if isinstance(node, ast.Subscript):
        yield from printed_literals(node.value)
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.FormattedValue):
        yield from printed_literals(node.value)  # not its format spec
    else:
        for child in ast.iter_child_nodes(node):
            yield from printed_literals(child)


@pytest.mark.parametrize("chapter", chapter_files(ROOT), ids=lambda c: c.stem)
def test_no_english_trace_in_what_the_chinese_chapters_print(chapter: Path) -> None:
    """What the chapter's cells print, and what the exported code they run prints, says its words through a
    Phrases table; only the command-line programs of COMMAND_LINE_ONLY still print English. A diagnostic (a log
    line or an error, printed to stderr) is not a trace: it is left as it is, like the engine's error messages."""
    found = []
    for cell in zh_code_cells(chapter):
        directives, _ = split_directives(cell.source)
        if chapter.stem in COMMAND_LINE_ONLY and {"export", "exporti"} & set(directives):
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:  # a magic or a shell escape
            continue
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"
                 and not any(k.arg == "file" and ast.unparse(k.value) == "sys.stderr" for k in n.keywords)]
        found += [text for call in calls for arg in call.args for text in printed_literals(arg)
                  if ENGLISH_PHRASE.search(text) and not CHINESE.search(text)]
    assert found == [], f"{chapter.stem} prints English: {found[:5]}"


def test_the_benchmark_prints_chinese_in_the_chinese_book(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Chapter 19's runs of `python -m nanovllm.bench` and `--latency` on a CPU, as the Chinese site shows them:
    every line says something in Chinese but the one that names a setting."""
    from nanovllm.bench.engine import main as bench
    from nanovllm.bench.latency import main as latency
    from nanovllm.book.tiny_models import build_tiny_model

    tiny = str(build_tiny_model("qwen3"))
    monkeypatch.setenv(LANG_ENV, "zh")
    assert bench(["--model", tiny, "--device", "cpu", "--num-seqs", "3", "--input-len", "4", "8", "--output-len",
                  "2", "4", "--peer-batch-size", "2"]) == 0
    assert latency(["--model", tiny, "--device", "cpu", "--batches", "1", "--input-len", "8", "--output-len",
                    "12"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 9
    english = [line for line in lines if not CHINESE.search(line) and not re.fullmatch(r"fused_decode=\w+:", line)]
    assert english == []
