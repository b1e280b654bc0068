"""tools/book.py: a raising chapter fails the build; each language keeps its own text."""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat

from tools import book

RAISING = """# %% [markdown] tags=["en"]
# # A chapter that breaks

# %% [markdown] tags=["zh"]
# # 一个会出错的章节

# %%
print("before")

# %%
raise RuntimeError("the claim on this page is false")
"""


def test_a_raising_chapter_fails_execution_with_its_name(tmp_path: Path, capsys) -> None:
    chapter = tmp_path / "99_broken.py"
    chapter.write_text(RAISING, encoding="utf-8")
    assert book.main(["execute", str(chapter), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "99_broken.py raised" in err and "the claim on this page is false" in err
    assert not (tmp_path / "out" / "99_broken.ipynb").exists()


def test_localize_keeps_one_language_and_tags_hidden_cells() -> None:
    source = (
        '# %% [markdown] tags=["en"]\n# Hello\n\n# %% [markdown] tags=["zh"]\n# 你好\n\n'
        "# %%\n#| hide\nx = 1\n\n# %%\n# en: English line\n# zh: 中文行\ny = 2\n"
    )
    expectations = (("en", "Hello", "你好", "# English line"), ("zh", "你好", "Hello", "# 中文行"))
    for lang, kept, dropped, comment in expectations:
        notebook = book.localize(jupytext.reads(source, fmt="py:percent"), lang)
        markdown = [c.source for c in notebook.cells if c.cell_type == "markdown"]
        code = [c for c in notebook.cells if c.cell_type == "code"]
        assert markdown == [kept] and dropped not in str(markdown)
        assert "hide" in code[0].metadata["tags"] and "hide" not in code[1].metadata.get("tags", [])
        assert code[1].source == f"{comment}\ny = 2"
        nbformat.validate(notebook)
