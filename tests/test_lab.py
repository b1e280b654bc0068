"""Reading the chapters in JupyterLab: opening and saving must not change a chapter; the server
that ``./dev lab`` starts serves chapters as notebooks and reading copies in one language.

JupyterLab opens a chapter through jupytext's contents manager (the .py file becomes a
notebook model) and autosaves it through the same manager, even when the reader typed nothing
(the kernel's start alone marks the notebook modified). These tests do exactly that, with
jupytext's own contents manager, on a copy of every chapter and of the repository's jupytext
configuration.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupytext import TextFileContentsManager
from jupytext.config import find_jupytext_configuration_file

from tools import lab, tangle

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = tangle.chapter_files(ROOT)
CJK = re.compile(r"[\u4e00-\u9fff]")


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


# ---- JupyterLab for real: the server ./dev lab starts (tools/lab.py's command line) ----------------


class Lab:
    """A JupyterLab server started the way ``./dev lab`` starts it, rooted at a copy of the book."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port, self.token = lab.free_port(18888), secrets.token_hex(16)
        command = lab.lab_command(self.port, self.token, "en", ["--no-browser"], root=root)
        self.log = (root / "lab.log").open("w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, cwd=root,
                                        env={**os.environ, "JUPYTER_PLATFORM_DIRS": "1"})
        deadline = time.monotonic() + 90
        while True:
            try:
                self.get("/api/status")
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("JupyterLab did not start:\n" + (root / "lab.log").read_text()) from None
                time.sleep(0.5)

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as response:
            return json.loads(response.read() or b"{}")

    def get(self, path: str) -> dict:
        return self.request("GET", path)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


@pytest.fixture(scope="module")
def served_book(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    root = copy_of_the_book(tmp_path_factory.mktemp("lab"))
    lab.write_reading_copies(root / "read")
    server = Lab(root)
    try:
        yield server
    finally:
        server.stop()


def test_the_server_serves_every_chapter_as_a_notebook_and_saving_changes_nothing(served_book: Lab) -> None:
    for chapter in CHAPTERS:
        path = f"/api/contents/notebooks/{chapter.name}"
        model = served_book.get(f"{path}?type=notebook&content=1")
        tags = {t for cell in model["content"]["cells"] for t in cell["metadata"].get("tags", [])}
        assert model["type"] == "notebook" and {"en", "zh"} <= tags, chapter.name
        before = (served_book.root / "notebooks" / chapter.name).read_bytes()
        served_book.request("PUT", path, {"type": "notebook", "format": "json", "content": model["content"]})
        assert (served_book.root / "notebooks" / chapter.name).read_bytes() == before, chapter.name


def test_python_files_open_as_notebooks_by_default(served_book: Lab) -> None:
    settings = served_book.get("/lab/api/settings/@jupyterlab/docmanager-extension:plugin")
    # The browser composes a plugin's settings from its schema's defaults (where overrides.json lands)
    # and the reader's own settings (none here).
    assert settings["schema"]["properties"]["defaultViewers"]["default"]["python"] == "Jupytext Notebook"
    assert "defaultViewers" not in settings["settings"]
    page = urllib.request.urlopen(f"http://127.0.0.1:{served_book.port}/lab?token={served_book.token}").read()
    assert b"jupyterlab-jupytext" in page  # the extension that provides the "Jupytext Notebook" viewer is loaded


@pytest.mark.parametrize("lang", lab.LANGUAGES)
def test_reading_copies_speak_one_language(served_book: Lab, lang: str) -> None:
    for chapter in CHAPTERS:
        model = served_book.get(f"/api/contents/read/{lang}/{chapter.stem}.ipynb?content=1")
        cells = model["content"]["cells"]
        assert model["type"] == "notebook" and f'set_language("{lang}")' in cells[1]["source"]
        prose = [c["source"] for c in cells[2:] if c["cell_type"] == "markdown"]
        comments = [line for c in cells if c["cell_type"] == "code" for line in c["source"].splitlines()
                    if line.lstrip().startswith("# ")]
        if lang == "en":  # a Chinese word may be quoted (the player's labels), a Chinese text may not
            assert [t[:80] for t in prose + comments if len(CJK.findall(t)) > 12] == [], chapter.name
        else:
            assert prose and all(CJK.search(t) for t in prose), chapter.name
        answers = [c for c in cells if "answers" in c["metadata"].get("tags", [])]
        assert all(c["metadata"]["jupyter"] == {"source_hidden": True, "outputs_hidden": True} for c in answers)


def test_reading_copies_are_rewritten_only_when_their_chapter_changes(tmp_path: Path) -> None:
    first = lab.write_reading_copies(tmp_path)
    stamps = {p: p.stat().st_mtime_ns for p in first}
    (tmp_path / "en" / "99_gone.ipynb").write_text("{}")
    assert lab.write_reading_copies(tmp_path) == first
    assert {p: p.stat().st_mtime_ns for p in first} == stamps and not (tmp_path / "en" / "99_gone.ipynb").exists()
