"""nanovllm.book.lang: the chapters print in the reader's language, and every phrase they print has its Chinese."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from nanovllm.book.lang import LANG_ENV, Phrases, Text, display_width, reading_language
from tools import book
from tools.tangle import ROOT, chapter_files, read_chapter

SAY = Phrases({"free list: {free}": "空闲队列：{free}", "step": "步"})


def test_the_build_sets_the_variable_the_book_reads() -> None:
    assert book.LANG_ENV == LANG_ENV and set(book.LANGUAGES) == {"en", "zh"}


def test_say_speaks_english_unless_the_book_reads_in_chinese(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LANG_ENV, raising=False)
    assert reading_language() == "en" and SAY("free list: {free}", free=[3, 4]) == "free list: [3, 4]"
    monkeypatch.setenv(LANG_ENV, "zh")
    assert reading_language() == "zh" and SAY("free list: {free}", free=[3, 4]) == "空闲队列：[3, 4]"
    monkeypatch.setenv(LANG_ENV, "fr")
    with pytest.raises(ValueError, match=LANG_ENV):
        reading_language()


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_a_phrase_without_its_chinese_fails_in_both_languages(monkeypatch: pytest.MonkeyPatch, lang: str) -> None:
    monkeypatch.setenv(LANG_ENV, lang)
    with pytest.raises(KeyError, match="no Chinese for the phrase 'free blocks'"):
        SAY("free blocks")


def test_a_translation_fills_the_same_fields() -> None:
    with pytest.raises(ValueError, match="must fill the fields"):
        Phrases({"free list: {free}": "空闲队列：{blocks}"})


def test_text_pads_by_display_width() -> None:
    assert display_width("步 2") == 4 and display_width("，") == 2
    assert f"{Text('步'):>4}|{Text('ab'):<4}|{Text('步骤'):^8}|{Text('x'):*>3}|" == "  步|ab  |  步骤  |**x|"
    assert f"{Text('块'):6}|" == "块    |"  # a bare width pads like a string: on the right
    assert f"{Text('很长的标题'):>4}|" == "很长的标题|"  # never cut, as str does not
    assert f"{Text('abc'):.2}" == "ab"  # other specs are str's


def chapter_code(chapter: Path) -> ast.Module:
    cells = read_chapter(chapter).cells
    return ast.parse("\n\n".join(c.source for c in cells if c.cell_type == "code"), filename=str(chapter))


def phrase_tables(tree: ast.Module) -> dict[str, ast.Dict]:
    """The chapter's ``name = Phrases({...})`` tables, by name (``say``, and ``_say`` in an exported cell)."""
    tables = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "Phrases"):
            (target,) = node.targets
            assert isinstance(node.value.args[0], ast.Dict) and target.id not in tables
            tables[target.id] = node.value.args[0]
    return tables


SPEAKING = [c for c in chapter_files(ROOT) if phrase_tables(chapter_code(c))]


def prints(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
               for node in ast.walk(tree))


def test_every_chapter_that_prints_speaks_the_readers_language() -> None:
    """What a chapter prints is part of its lesson, in either language (tests/site_checks_zh_outputs.py checks the
    built Chinese site): a chapter that prints keeps its phrases' Chinese in a Phrases table."""
    silent = [c.name for c in chapter_files(ROOT) if prints(chapter_code(c)) and c not in SPEAKING]
    assert silent == [], f"chapters that print with no Phrases table: {silent}"


@pytest.mark.parametrize("chapter", SPEAKING, ids=lambda c: c.stem)
def test_every_phrase_a_chapter_says_is_in_its_table_and_every_entry_is_said(chapter: Path) -> None:
    """Static, so that a branch the CPU build never runs (a GPU cell) is checked too."""
    tree = chapter_code(chapter)
    tables = phrase_tables(tree)
    inside = {id(node) for table in tables.values() for node in ast.walk(table)}
    literals = {node.value for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in inside}
    for name, table in tables.items():
        keys = [k.value for k in table.keys if isinstance(k, ast.Constant)]
        assert len(keys) == len(table.keys) == len(set(keys)), f"{name}: keys are plain strings, each once"
        said = {node.args[0].value for node in ast.walk(tree)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
                and node.args and isinstance(node.args[0], ast.Constant)}
        assert said <= set(keys), f"{name}: said but not in its table: {sorted(said - set(keys))}"
        assert set(keys) <= literals, f"{name}: in the table but never used: {sorted(set(keys) - literals)}"
