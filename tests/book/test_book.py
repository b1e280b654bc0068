"""tools/book.py: a raising chapter fails the build; each language keeps its own text."""

from __future__ import annotations

import copy
from pathlib import Path

import jupytext
import nbformat
import pytest

from tools import book
from tools.tangle import read_chapter

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
    broken, fine = tmp_path / "98_broken.py", tmp_path / "99_fine.py"
    broken.write_text(RAISING, encoding="utf-8")
    fine.write_text(RAISING.split("# %%\nraise")[0], encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    for lang in book.LANGUAGES:
        (out / lang).mkdir(parents=True)
        (out / lang / "98_broken.ipynb").write_text("an older run's outputs", encoding="utf-8")
    assert book.main(["execute", str(broken), str(fine), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "98_broken.py raised while executing in en" in err and "the claim on this page is false" in err
    # The failing chapter leaves no executed copy behind, in any language (not even an older one); the
    # others still ran, once per language, with their outputs, as the sites need them.
    for lang in book.LANGUAGES:
        assert not (out / lang / "98_broken.ipynb").exists()
        outputs = [o for c in nbformat.read(out / lang / "99_fine.ipynb", as_version=4).cells
                   for o in c.get("outputs", [])]
        assert [o.get("text") for o in outputs] == ["before\n"]


SPEAKING = """# %%
import os

print(os.environ.get("NANOVLLM_BOOK_LANG"))
"""


def test_each_language_runs_with_the_variable_that_the_book_reads(tmp_path: Path) -> None:
    chapter = tmp_path / "97_speaking.py"
    chapter.write_text(SPEAKING, encoding="utf-8")
    assert book.main(["execute", str(chapter), "--out", str(tmp_path / "out")]) == 0
    for lang in book.LANGUAGES:
        cell = nbformat.read(tmp_path / "out" / lang / "97_speaking.ipynb", as_version=4).cells[0]
        assert cell.outputs[0]["text"] == f"{lang}\n"
    assert book.main(["execute", str(chapter), "--out", str(tmp_path / "zh-only"), "--lang", "zh"]) == 0
    assert [p.parent.name for p in (tmp_path / "zh-only").rglob("*.ipynb")] == ["zh"]


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


EXERCISES = """# %% [markdown] tags=["en"]
# ## Exercises
#
# 1. Two plus two?

# %% [markdown] tags=["zh"]
# ## 练习
#
# 1. 二加二？

# %%
assert 2 + 2 == 4

# %%
print("all exercise answers check out")

# %% [markdown] tags=["en"]
# Not an exercise.

# %% [markdown] tags=["zh"]
# 不是练习。

# %%
x = 1
"""


def test_the_code_cells_after_the_exercises_are_tagged_as_answers() -> None:
    for lang in ("en", "zh"):
        notebook = book.localize(jupytext.reads(EXERCISES, fmt="py:percent"), lang)
        code = [c for c in notebook.cells if c.cell_type == "code"]
        assert [("answers" in c.metadata.get("tags", [])) for c in code] == [True, True, False]


def test_every_chapter_with_exercises_has_answers() -> None:
    for chapter in book.chapter_files(book.ROOT):
        cells = read_chapter(chapter).cells
        if any(c.cell_type == "markdown" and book.EXERCISES.search(c.source) for c in cells):
            assert book.answer_cells(cells), f"{chapter.name}: no code cell right after its exercises"


def test_localize_keeps_one_language_of_bilingual_outputs() -> None:
    pytest.importorskip("torch", reason="the player ships inside nanovllm, whose package imports the engine")
    from nanovllm.viz.player import player_html
    from tests.core.test_A_visualization import hand_made

    notebook = jupytext.reads("# %%\nx = 1\n", fmt="py:percent")
    both = player_html(hand_made(), lang="both", player_id="p")
    notebook.cells[0].outputs = [nbformat.v4.new_output("display_data", data={"text/html": both})]
    for lang in ("en", "zh"):
        output = book.localize(copy.deepcopy(notebook), lang).cells[0].outputs[0]
        assert output["data"]["text/html"] == player_html(hand_made(), lang=lang, player_id="p")
