"""Reading the chapters in JupyterLab: opening and saving a chapter must not change it.

JupyterLab opens a chapter through jupytext's contents manager (the .py file becomes a
notebook model) and autosaves it through the same manager, even when the reader typed nothing
(the kernel's start alone marks the notebook modified). These tests do exactly that, with
jupytext's own contents manager, on a copy of every chapter and of the repository's jupytext
configuration.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from jupytext import TextFileContentsManager
from jupytext.config import find_jupytext_configuration_file

from tools import tangle

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = tangle.chapter_files(ROOT)


def copy_of_the_book(target: Path) -> Path:
    """The chapters and the jupytext configuration that applies to them, at the same relative places."""
    (target / "notebooks").mkdir(parents=True)
    for chapter in CHAPTERS:
        shutil.copy(chapter, target / "notebooks" / chapter.name)
    config = find_jupytext_configuration_file(ROOT / "notebooks")
    if config and Path(config).is_relative_to(ROOT):
        destination = target / Path(config).relative_to(ROOT)
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(config, destination)
    return target


@pytest.fixture(scope="module")
def book(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_of_the_book(tmp_path_factory.mktemp("book"))


@pytest.mark.parametrize("chapter", [c.name for c in CHAPTERS])
def test_opening_and_saving_a_chapter_leaves_it_byte_identical(book: Path, chapter: str) -> None:
    manager = TextFileContentsManager(root_dir=str(book))
    path = f"notebooks/{chapter}"
    before = (book / path).read_bytes()
    model = manager.get(path, content=True, type="notebook")
    assert model["type"] == "notebook" and model["content"]["cells"]
    manager.save({"type": "notebook", "content": model["content"]}, path)
    after = (book / path).read_bytes()
    assert after == before, f"saving {chapter} unchanged rewrote it:\n" + "\n".join(
        line for line in after.decode().splitlines()[:16] if line not in before.decode().splitlines())
