"""Reading the chapters in JupyterLab: opening and saving must not change a chapter; the server
that ``./dev lab`` starts serves chapters as notebooks and reading copies in one language, keeps a
reader's edits to a copy, and takes its port from the arguments after ``--``. What a reader sees in
the browser is tested in test_lab_browser.py, with the server started here (``Lab``).

JupyterLab opens a chapter through jupytext's contents manager (the .py file becomes a
notebook model) and autosaves it through the same manager, even when the reader typed nothing
(the kernel's start alone marks the notebook modified). These tests do exactly that, with
jupytext's own contents manager, on a copy of every chapter and of the repository's jupytext
configuration.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from copy import deepcopy
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import nbformat
import pytest
from jupytext import TextFileContentsManager
from jupytext.config import find_jupytext_configuration_file

from tools import lab, tangle
from tools.book import execute, localize

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = tangle.chapter_files(ROOT)
PLUGIN = ROOT / "tools" / "jupyterlab" / "labextensions" / "nanovllm-book" / "static" / "chapters.js"
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


# ---- JupyterLab for real: the server ./dev lab starts ------------------------------------------------


def jupyter_home(home: Path, autosave_s: int | None = None) -> dict[str, str]:
    """An environment whose Jupyter configuration, settings and workspaces live under ``home``, not the user's."""
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_DATA_DIR": str(home / "data"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTER_PLATFORM_DIRS": "1"}
    if autosave_s is not None:  # JupyterLab autosaves every 120 s; the browser tests wait less
        settings = home / "config" / "lab" / "user-settings" / "@jupyterlab" / "docmanager-extension"
        settings.mkdir(parents=True, exist_ok=True)
        (settings / "plugin.jupyterlab-settings").write_text(json.dumps({"autosaveInterval": autosave_s}))
    return env


class Lab:
    """JupyterLab started the way ``./dev lab`` starts it (``python -m tools.lab``), rooted at a copy of the book.

    The port is given after ``--``, as a reader would; ``url`` is the line the command printed.
    """

    def __init__(self, root: Path, home: Path, lang: str = "en", extra: tuple[str, ...] = (),
                 autosave_s: int | None = None) -> None:
        self.root, self.port = root, lab.free_port(18888)
        command = [sys.executable, "-m", "tools.lab", "--root", str(root), lang,
                   "--", "--no-browser", "--port", str(self.port), *extra]
        self.log_path = home / "lab.log"
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                        env=jupyter_home(home, autosave_s))
        deadline = time.monotonic() + 90
        while True:
            started = re.search(r"^lab: JupyterLab is starting at (\S+)$", self.log_path.read_text(), re.M)
            try:
                if started:
                    self.url = started[1]
                    self.token = parse_qs(urlsplit(self.url).query)["token"][0]
                    self.get("/api/status")
                    return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("JupyterLab did not start:\n" + self.log_path.read_text())
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
    server = Lab(root, tmp_path_factory.mktemp("home"))
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
        # What the kernel reports: JupyterLab would otherwise add it, marking the chapter unsaved on opening.
        assert model["content"]["metadata"]["language_info"] == lab.LANGUAGE_INFO, chapter.name
        before = (served_book.root / "notebooks" / chapter.name).read_bytes()
        served_book.request("PUT", path, {"type": "notebook", "format": "json", "content": model["content"]})
        assert (served_book.root / "notebooks" / chapter.name).read_bytes() == before, chapter.name


def test_only_chapters_open_as_notebooks_by_default(served_book: Lab) -> None:
    settings = served_book.get("/lab/api/settings/@jupyterlab/docmanager-extension:plugin")
    # The browser composes a plugin's settings from its schema's defaults (where overrides.json lands)
    # and the reader's own settings (none here). Python files keep the text editor; chapters, a file
    # type of their own (the plugin below), open as jupytext notebooks.
    assert settings["schema"]["properties"]["defaultViewers"]["default"] == {"book-chapter": "Jupytext Notebook"}
    assert "defaultViewers" not in settings["settings"]
    page = urllib.request.urlopen(f"http://127.0.0.1:{served_book.port}/lab?token={served_book.token}").read()
    assert b"jupyterlab-jupytext" in page  # the extension that provides the "Jupytext Notebook" viewer is loaded
    assert b'"name": "nanovllm-book"' in page  # and the plugin that gives chapters their file type


def chapter_name_pattern() -> re.Pattern:
    """The pattern the JupyterLab plugin recognizes chapters by (a JavaScript string; the same regex in Python)."""
    line = next(line for line in PLUGIN.read_text().splitlines() if "const CHAPTER_NAME = " in line)
    return re.compile(json.loads('"' + line.split("'")[1] + '"'))


def test_the_plugin_recognizes_the_chapters_and_nothing_else() -> None:
    """JupyterLab matches a file type on the file's name, not its folder: no other .py file may look like a chapter."""
    pattern = chapter_name_pattern()
    assert all(pattern.match(chapter.name) for chapter in CHAPTERS)
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    others = [p for p in tracked.stdout.split() if not p.startswith("notebooks/") and pattern.match(Path(p).name)]
    assert len(tracked.stdout.split()) > 50 and others == []
    assert not pattern.match("scheduler.py") and not pattern.match("04_scheduler.en.ipynb")


def test_the_port_given_after_dashes_wins_and_the_printed_url_opens_the_language_workspace(served_book: Lab) -> None:
    url = urlsplit(served_book.url)
    assert url.port == served_book.port  # Lab gave it after --, as `./dev lab -- --port N` does
    assert url.path == "/lab/workspaces/nanovllm-en/tree/read/en"
    page = urllib.request.urlopen(served_book.url).read().decode()
    config = json.loads(re.search(r'id="jupyter-config-data"[^>]*>(.*?)</script>', page, re.S)[1])
    assert (config["workspace"], config["treePath"]) == ("nanovllm-en", "read/en")


def test_a_port_given_after_dashes_replaces_the_default_one() -> None:
    command = lab.lab_command(8888, "t", "zh", ["--port", "8899"])
    assert [a for a in command if a.startswith(("--port", "--ServerApp.port="))] == ["--port"]
    assert command[-2:] == ["--port", "8899"]  # one port, the reader's ("port only accepts one value" before)
    assert "--ServerApp.default_url=/lab/workspaces/nanovllm-zh/tree/read/zh" in command
    assert "--IdentityProvider.token=t" in lab.lab_command(8888, "t", "en", ["--token=x"])  # no such option: ours stays
    assert not any(a.startswith("--IdentityProvider.token")
                   for a in lab.lab_command(8888, "t", "en", ["--IdentityProvider.token=mine"])[:-1])
    server = lab.server_for("zh", 8888, lab.jupyterlab_arguments(["--port=8899", "--ip=10.1.2.3",
                                                                  "--ServerApp.token=mine"]))
    assert server.url() == "http://10.1.2.3:8899/lab/workspaces/nanovllm-zh/tree/read/zh?token=mine"


def test_a_taken_port_given_after_dashes_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "tools.lab", "--root", str(tmp_path), "--", "--port", str(port)],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and f"port {port} (given after --) is in use" in run.stderr
    assert "starting" not in run.stdout and not (tmp_path / "read").exists()


@pytest.mark.parametrize("extra", [["--port", "8897", "--port", "8898"], ["--port=eighty"], ["--ip"]])
def test_arguments_jupyterlab_rejects_are_refused_before_anything_starts(
    tmp_path: Path, extra: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The command's main(), in this process (the test above runs it as a command): a start that got past the check
    would fail at once instead of writing copies or starting JupyterLab."""

    def started(*args: object) -> None:
        raise AssertionError("JupyterLab arguments it rejects got past the check")

    monkeypatch.setattr(lab, "write_reading_copies", started)
    monkeypatch.setattr(os, "execv", started)
    assert lab.main(["--root", str(tmp_path), "--", *extra]) == 2
    printed = capsys.readouterr()
    assert "JupyterLab was not started" in printed.err
    assert "starting" not in printed.out and not (tmp_path / "read").exists()


@pytest.mark.parametrize("lang", lab.LANGUAGES)
def test_reading_copies_speak_one_language(served_book: Lab, lang: str) -> None:
    for chapter in CHAPTERS:
        model = served_book.get(f"/api/contents/read/{lang}/{chapter.stem}.{lang}.ipynb?content=1")
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


@pytest.mark.parametrize("lang", lab.LANGUAGES)
def test_a_copy_run_in_a_real_kernel_prints_in_its_language(small_book: Path, lang: str) -> None:
    """Chapter 01's reading copy, run by an IPython kernel as JupyterLab runs it, with the server's environment
    saying the other language: every line the chapter prints comes out in the copy's language."""
    import nbclient
    import nbformat

    copy = small_book / "read" / lang / f"{CHAPTERS[1].stem}.{lang}.ipynb"
    lab.write_reading_copies(root=small_book)
    notebook = nbformat.read(copy, as_version=4)
    other = "zh" if lang == "en" else "en"
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute(env={**os.environ, "NANOVLLM_BOOK_LANG": other})
    printed = "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for output in cell.outputs if output.output_type == "stream")
    verdict = {"en": "all exercise answers check out", "zh": "练习答案全部验证通过"}
    assert verdict[lang] in printed and verdict[other] not in printed
    if lang == "en":
        assert not CJK.search(printed)


# ---- the reading copies: rewritten when their chapter changes, unless the reader edited them ----------


@pytest.fixture()
def small_book(tmp_path: Path) -> Path:
    """A copy of two chapters of the book, to change them."""
    (tmp_path / "notebooks").mkdir()
    for chapter in CHAPTERS[:2]:
        shutil.copy(chapter, tmp_path / "notebooks" / chapter.name)
    return tmp_path


def edit_chapter(book: Path, name: str) -> None:
    chapter = book / "notebooks" / name
    chapter.write_text(chapter.read_text() + '\n# %% [markdown] tags=["en"]\n# A new paragraph.\n\n'
                       '# %% [markdown] tags=["zh"]\n# 新的一段。\n')


def test_reading_copies_are_rewritten_only_when_their_chapter_changes(small_book: Path) -> None:
    first = lab.write_reading_copies(root=small_book)
    assert first.written == first.copies and len(first.copies) == 4 and not first.kept + first.left
    assert {p.name for p in first.copies} == {f"{c.stem}.{lang}.ipynb" for c in CHAPTERS[:2] for lang in lab.LANGUAGES}
    stamps = {p: p.stat().st_mtime_ns for p in first.copies}
    again = lab.write_reading_copies(root=small_book)
    assert again.copies == first.copies and again.written == [] and again.report(small_book) == []
    assert {p: p.stat().st_mtime_ns for p in first.copies} == stamps
    edit_chapter(small_book, CHAPTERS[0].name)
    changed = lab.write_reading_copies(root=small_book)
    assert {p.name for p in changed.written} == {f"{CHAPTERS[0].stem}.{lang}.ipynb" for lang in lab.LANGUAGES}
    assert "A new paragraph." in changed.written[0].read_text()


def saved_by_jupyterlab(path: Path, change=None) -> None:
    """Save a copy the way JupyterLab does (one-space indent, outputs, execution counts), maybe changed first."""
    notebook = json.loads(path.read_text())
    code = next(cell for cell in notebook["cells"] if cell["cell_type"] == "code")
    code["execution_count"] = 1
    code["outputs"] = [{"name": "stdout", "output_type": "stream", "text": ["ran\n"]}]
    notebook["cells"][0]["metadata"]["jupyter"] = {"source_hidden": True}  # folding is no edit
    if change:
        change(notebook)
    path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False))


def test_a_copy_run_and_saved_but_not_edited_keeps_its_outputs_until_its_chapter_changes(small_book: Path) -> None:
    copy = lab.write_reading_copies(root=small_book).copies[0]
    saved_by_jupyterlab(copy)
    saved = copy.read_text()
    assert '"ran\\n"' in saved
    assert lab.write_reading_copies(root=small_book).written == [] and copy.read_text() == saved
    edit_chapter(small_book, CHAPTERS[0].name)
    assert copy in lab.write_reading_copies(root=small_book).written and '"ran\\n"' not in copy.read_text()


def add_a_note(notebook: dict) -> None:
    notebook["cells"].insert(3, {"cell_type": "markdown", "id": "note", "metadata": {}, "source": ["My note."]})


def test_a_copy_the_reader_edited_is_kept_and_the_command_says_so(small_book: Path) -> None:
    copies = lab.write_reading_copies(root=small_book).copies
    noted, typed_in = copies[0], copies[1]
    saved_by_jupyterlab(noted, add_a_note)
    saved_by_jupyterlab(typed_in, lambda nb: nb["cells"][1]["source"].append("\nprint('mine')"))
    done = lab.write_reading_copies(root=small_book)
    assert done.kept == [noted, typed_in] and done.outdated == [] and done.written == []
    assert "My note." in noted.read_text() and "mine" in typed_in.read_text()
    assert done.report(small_book) == [f"lab: {p.relative_to(small_book)} holds your edits: kept as it is."
                                       for p in (noted, typed_in)]
    edit_chapter(small_book, CHAPTERS[0].name)
    done = lab.write_reading_copies(root=small_book)
    assert done.kept == [noted, typed_in] and done.outdated == [noted] and "My note." in noted.read_text()
    assert "Its chapter has changed since: delete or rename it" in done.report(small_book)[0]
    noted.unlink()
    assert noted in lab.write_reading_copies(root=small_book).written and "A new paragraph." in noted.read_text()


def test_copies_of_another_name_are_removed_only_when_the_reader_never_edited_them(small_book: Path) -> None:
    copies = lab.write_reading_copies(root=small_book).copies
    # Copies of a chapter that is gone: one untouched, one with a note.
    gone, gone_noted = (copies[0].with_name(f"{n}_gone.en.ipynb") for n in (98, 99))
    shutil.copy(copies[0], gone)
    shutil.copy(copies[1], gone_noted)
    saved_by_jupyterlab(gone_noted, add_a_note)
    # Copies named the way they were before the language was in the name (no record of how they were made).
    older, older_noted = (copy.with_name(copy.name.replace(".en.", ".")) for copy in copies[:2])
    for older_copy, copy in ((older, copies[0]), (older_noted, copies[1])):
        notebook = json.loads(copy.read_text())
        del notebook["metadata"][lab.RECORD]
        notebook["cells"][0]["source"] = "**Reading copy** of an older kind."
        older_copy.write_text(json.dumps(notebook))
    saved_by_jupyterlab(older_noted, add_a_note)
    (copies[0].parent / "broken.ipynb").write_text("{")
    done = lab.write_reading_copies(root=small_book)
    assert not gone.exists() and not older.exists()
    assert done.left == sorted([gone_noted, older_noted, copies[0].parent / "broken.ipynb"])
    assert all("may hold your notes: left as it is" in line for line in done.report(small_book))


# ---- a copy opens with the executed book's outputs, or says why it has none (issue 59, item 4) --------------


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Chapter 01 executed in both languages, as ``python -m tools.book execute`` leaves it (about 3 s a language)."""
    folder = tmp_path_factory.mktemp("book")
    (folder / "notebooks").mkdir()
    shutil.copy(CHAPTERS[1], folder / "notebooks" / CHAPTERS[1].name)
    execute([folder / "notebooks" / CHAPTERS[1].name], folder / "executed")
    return folder / "executed"


def with_executed_book(small_book: Path, executed: Path) -> Path:
    shutil.copytree(executed, small_book / lab.EXECUTED)
    return small_book


def read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def code_outputs(notebook: dict) -> list:
    return [cell["outputs"] for cell in notebook["cells"] if cell["cell_type"] == "code"]


def printed(notebook: dict) -> str:
    return "".join(o.get("text", "") for outputs in code_outputs(notebook) for o in outputs)


def test_a_copy_opens_with_the_executed_books_outputs_in_its_language(small_book: Path, executed: Path) -> None:
    done = lab.write_reading_copies(root=with_executed_book(small_book, executed))
    name = CHAPTERS[1].stem
    for lang, verdict in (("en", "all exercise answers check out"), ("zh", "练习答案全部验证通过")):
        made = read(small_book / "read" / lang / f"{name}.{lang}.ipynb")
        assert made["metadata"][lab.RECORD]["outputs"] == "executed"
        assert f"build/executed/{lang}/{name}.ipynb" in "".join(made["cells"][0]["source"])
        # The site's outputs (tools/book.py builds its pages from localize(executed)), printed ones joined.
        site = localize(nbformat.read(executed / lang / f"{name}.ipynb", as_version=4), lang)
        assert code_outputs(made)[1:] == [lab.joined_streams(deepcopy(c.outputs)) for c in site.cells
                                             if c.cell_type == "code"]
        assert verdict in printed(made) and any(o for o in code_outputs(made)) and code_outputs(made)[0] == []
        if lang == "en":
            assert not CJK.search(printed(made))
    # Chapter 00 was not executed here: its copies open bare, and say so; so does ./dev lab.
    bare = read(small_book / "read" / "en" / f"{CHAPTERS[0].stem}.en.ipynb")
    assert bare["metadata"][lab.RECORD]["outputs"] == "missing" and not any(code_outputs(bare))
    assert "**No outputs yet**" in "".join(bare["cells"][0]["source"])
    assert done.bare == {lang: {"missing": [CHAPTERS[0].stem]} for lang in lab.LANGUAGES}
    assert all(CHAPTERS[0].stem in line for line in done.outputs_report()[:2])
    assert sorted(done.generated) == sorted(done.copies)  # all of them just written: theirs to sign


def test_without_an_executed_book_the_command_says_so_once_per_language(small_book: Path) -> None:
    report = lab.write_reading_copies(root=small_book).outputs_report()
    assert [line.split(":")[1] for line in report[:2]] == [" read/en/", " read/zh/"]
    assert "no copy has outputs, the book was not executed in en here" in report[0]


def add_code(book_root: Path, name: str, code: str) -> None:
    chapter = book_root / "notebooks" / name
    chapter.write_text(chapter.read_text() + f"\n# %%\n{code}\n")


def test_outputs_of_older_code_are_not_shown_but_prose_and_comments_may_change(
        small_book: Path, executed: Path) -> None:
    name, chapter = CHAPTERS[1].stem, small_book / "notebooks" / CHAPTERS[1].name
    with_executed_book(small_book, executed)
    original = chapter.read_text()
    # Prose and a comment changed since the chapter was executed: the outputs still belong to its code.
    edit_chapter(small_book, CHAPTERS[1].name)
    chapter.write_text(chapter.read_text().replace("\n# %%\n", "\n# %%\n# A comment of a later day.\n", 1))
    done = lab.write_reading_copies(root=small_book)
    made = read(small_book / "read" / "en" / f"{name}.en.ipynb")
    assert made["metadata"][lab.RECORD]["outputs"] == "executed" and any(code_outputs(made))
    assert "A new paragraph." in json.dumps(made) and "A comment of a later day." in json.dumps(made)
    # Code changed: no outputs, rather than outputs the code no longer prints; the note and ./dev lab say why.
    add_code(small_book, CHAPTERS[1].name, "print(2 + 2)")
    done = lab.write_reading_copies(root=small_book)
    made = read(small_book / "read" / "zh" / f"{name}.zh.ipynb")
    assert made["metadata"][lab.RECORD]["outputs"] == "stale" and not any(code_outputs(made))
    assert "这一章的代码在执行之后改过了" in "".join(made["cells"][0]["source"])
    assert done.bare["zh"] == {"missing": [CHAPTERS[0].stem], "stale": [name]}
    assert any("code changed since they were executed" in line and name in line for line in done.outputs_report())
    # The chapter as it was executed again: the unedited copies take the outputs back.
    chapter.write_text(original)
    done = lab.write_reading_copies(root=small_book)
    assert {p.name for p in done.written} == {f"{name}.{lang}.ipynb" for lang in lab.LANGUAGES}
    assert all(read(p)["metadata"][lab.RECORD]["outputs"] == "executed" for p in done.written)


def test_an_unedited_copy_takes_the_outputs_when_the_book_is_executed_an_edited_one_is_kept(
        small_book: Path, executed: Path) -> None:
    copies = lab.write_reading_copies(root=small_book).copies  # no executed book yet: bare copies
    noted = next(p for p in copies if p.name == f"{CHAPTERS[1].stem}.en.ipynb")
    saved_by_jupyterlab(noted, add_a_note)
    done = lab.write_reading_copies(root=with_executed_book(small_book, executed))
    assert {p.name for p in done.written} == {f"{CHAPTERS[1].stem}.zh.ipynb"}  # the unedited one, with outputs
    assert done.kept == [noted] and done.outdated == [] and "My note." in noted.read_text()
    assert done.report(small_book) == [f"lab: {noted.relative_to(small_book)} holds your edits: kept as it is."]
    assert noted not in done.generated  # the reader's, not this command's: JupyterLab signs it when it saves it
    # A copy of an older kind (it records no chapter text), edited: kept, and said to be of an older kind.
    notebook = json.loads(noted.read_text())
    del notebook["metadata"][lab.RECORD]["text"]
    noted.write_text(json.dumps(notebook))
    done = lab.write_reading_copies(root=small_book)
    assert done.older == [noted] and "Reading copies are made differently since" in done.report(small_book)[0]


def stream(name: str, text: str) -> dict:
    return {"output_type": "stream", "name": name, "text": text}


def test_printed_outputs_are_joined_and_played_as_jupyterlab_holds_them() -> None:
    """JupyterLab's OutputAreaModel joins consecutive streams of one name and plays \\r and \\b as a terminal does
    when it loads a notebook, and saves them so: a copy that kept them apart would change when saved unedited."""
    figure = {"output_type": "display_data", "data": {"text/plain": "<figure>"}, "metadata": {}}
    joined = lab.joined_streams([stream("stdout", "a\n"), stream("stdout", "b\n"), stream("stderr", "warn\n"),
                                 stream("stdout", "c"), figure, stream("stdout", "d")])
    assert joined == [stream("stdout", "a\nb\n"), stream("stderr", "warn\n"), stream("stdout", "c"), figure,
                      stream("stdout", "d")]
    assert lab.joined_streams([stream("stderr", "10%\r50%"), stream("stderr", "\r100%\n")]) == [
        stream("stderr", "100%\n")]
    assert lab.terminal("abc\rX\n", "", 0) == ("Xbc\n", 4)
    assert lab.terminal("ab\bc", "", 0) == ("ac", 2)  # JupyterLab's backspace takes the character under it too


def test_jupyterlabs_own_menus_speak_the_language_of_the_copies() -> None:
    """``./dev lab zh`` left JupyterLab's menus in English: a language has its settings, zh with the language pack."""
    overrides = {lang: json.loads((lab.SETTINGS / lang / "overrides.json").read_text()) for lang in lab.LANGUAGES}
    translation = "@jupyterlab/translation-extension:plugin"
    locales = {lang: settings.pop(translation) for lang, settings in overrides.items()}
    assert locales == {"en": {"locale": "en"}, "zh": {"locale": "zh_CN"}} and overrides["en"] == overrides["zh"]
    assert f"--LabApp.app_settings_dir={lab.SETTINGS / 'zh'}" in lab.lab_command(8888, "t", "zh", [])
    from jupyterlab_server.translation_utils import get_language_packs

    assert "zh_CN" in get_language_packs("en")[0]  # installed, where JupyterLab looks for it
    pin = re.search(r'"jupyterlab-language-pack-zh-CN==([^"]+)"', (ROOT / "pyproject.toml").read_text())[1]
    assert importlib.metadata.version("jupyterlab-language-pack-zh-CN") == pin


def test_the_copies_this_command_wrote_are_signed_as_trusted(small_book: Path, executed: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Unsigned, a copy opens untrusted: no player plays, and a figure shows as its text."""
    from nbformat.sign import NotebookNotary

    monkeypatch.setenv("JUPYTER_DATA_DIR", str(small_book / "jupyter"))  # not the reader's own store
    done = lab.write_reading_copies(root=with_executed_book(small_book, executed))
    lab.trust(done.generated)
    notary = NotebookNotary()
    assert notary.data_dir == str(small_book / "jupyter")
    assert all(notary.check_signature(nbformat.read(path, as_version=4)) for path in done.copies)
