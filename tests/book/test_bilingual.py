"""The bilingual check: every prose cell and every teaching comment has its twin."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools import bilingual, tangle

ROOT = Path(__file__).resolve().parents[2]
PAIR = '# %% [markdown] tags=["en"]\n# Hello.\n\n# %% [markdown] tags=["zh"]\n# 你好。\n\n'


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "01_x.py"
    path.write_text(body, encoding="utf-8")
    return path


def test_a_complete_chapter_passes(tmp_path: Path) -> None:
    code = ("# %%\n# en: why\n# zh: 为什么\nx = 1  # noqa: E501\n#| export x\ny = [0]  # -1, 4 x 16\n"
            "s = 'a # string, no comment'\n# 只有中文的注释\n"
            'def f():\n    """Return one."""\n    # zh: 返回 1。\n    # en: one\n    # zh: 一\n    return 1\n'
            'def g():\n    """Several\n\n    lines."""\n    # zh: 几行\n    # zh:\n    # zh: 文字。\n'
            'def h():\n    """只有中文的文档字符串。"""\n')
    assert bilingual.check_notebook(write(tmp_path, PAIR + code)) == []


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ('# %% [markdown] tags=["en"]\n# Hello.\n\n# %%\nx = 1\n', "'en' cell has no 'zh' twin"),
        ('# %%\nx = 1\n\n# %% [markdown] tags=["zh"]\n# 你好。\n', "'zh' cell has no 'en' twin"),
        ("# %% [markdown]\n# Untagged.\n", "tagged exactly one of"),
        ("# %%\n# en: only English\nx = 1\n", "'# en:' comment has no '# zh:' twin"),
        ("# %%\n# zh: 只有中文\nx = 1\n", "'# zh:' comment has no '# en:' twin"),
        ("# %%\ndef f():\n    # en: inner\n# zh: 外层\n    pass\n", "'# en:' comment has no '# zh:' twin"),
        ("# %%\n# why this is so\nx = 1\n", "line 1: an English comment without its twin"),
        ("# %%\nx = 1  # why this is so\n", "line 1: an English comment without its twin"),
        ("# %%\n!ls  # a shell escape\n# why this is so\n", "line 2: an English comment without its twin"),
        ('# %%\ndef f():\n    """Return one."""\n    return 1\n', "line 2: a docstring without its Chinese twin"),
        ('# %%\ndef f():\n    """Return one."""\n\n    # zh: 返回 1。\n    return 1\n',
         "line 2: a docstring without its Chinese twin"),
        ('# %%\ndef f():\n    """Return one."""\n# zh: 返回 1。\n    return 1\n',
         "'# zh:' comment has no '# en:' twin"),
    ],
    ids=["missing-zh", "missing-en", "untagged", "comment-missing-zh", "comment-missing-en", "indent-mismatch",
         "plain-english-comment", "trailing-english-comment", "english-comment-beside-a-magic",
         "docstring-missing-zh", "docstring-twin-not-right-below", "docstring-twin-other-indent"],
)
def test_missing_twin_is_named(tmp_path: Path, body: str, fragment: str) -> None:
    problems = bilingual.check_notebook(write(tmp_path, body))
    assert len(problems) >= 1
    assert any(fragment in p and "01_x.py: cell" in p for p in problems), problems


def test_removing_a_zh_cell_from_a_real_chapter_fails(tmp_path: Path) -> None:
    """What CI would see if someone deleted one Chinese cell of chapter 01."""
    source = (ROOT / "notebooks/01_sequence.py").read_text(encoding="utf-8")
    zh_cells = [m.start() for m in re.finditer(r'^# %% \[markdown\] tags=\["zh"\]\n', source, re.M)]
    assert len(zh_cells) > 5
    start = zh_cells[2]
    end = source.index("\n# %%", start + 1) + 1
    damaged = write(tmp_path, source[:start] + source[end:])
    problems = bilingual.check_notebook(damaged)
    assert len(problems) == 1 and "'en' cell has no 'zh' twin" in problems[0]
    assert bilingual.main([str(damaged)]) == 1


def test_every_chapter_of_the_book_passes() -> None:
    chapters = tangle.chapter_files(ROOT)
    assert chapters, "the book has no chapters"
    assert bilingual.main([str(p) for p in chapters]) == 0
