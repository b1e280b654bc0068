"""Read the book in JupyterLab, one language at a time: ``./dev lab [en|zh]``.

``python -m tools.lab [en|zh] [--port N] [--print-only] [-- JUPYTERLAB ARGS...]``

1. Writes the **reading copies**: ``read/en/NN_topic.en.ipynb`` and ``read/zh/NN_topic.zh.ipynb``,
   one per chapter and language (the language is in the name, so that a tab says which one it
   shows), generated from ``notebooks/*.py`` the same way the sites are (tools/book.py's
   ``localize``: that language's prose and code comments only, exercise answers folded, ``#| hide``
   cells' code folded). Each starts with a note that says where edits go and where its outputs come
   from, and a cell that makes the players and the live panel speak that language. ``read/`` is
   ignored by git.

   A copy opens with the outputs of the executed book in its language, the ones its site shows
   (``python -m tools.book execute`` writes them to ``build/executed/<lang>/``, and ``./dev run``
   and ``./dev test`` run it): figures, players and traces are there before anything runs. They
   are taken only when they are the outputs of the chapter's code as it is now: the executed
   notebook holds the cells it ran, and its code cells must be the chapter's code cells, the same
   code in the same order. Prose and comments may have changed since (they change no output, and
   the copy shows those of now); code may not (a docstring is code here), and then the copy opens
   without outputs and its note says why (the chapter's code changed since it was executed, or it
   was never executed here), as does ``./dev lab`` when it starts. That is the rule for one
   chapter's text; a change elsewhere that alters what a chapter prints (in an earlier chapter's
   exported code, say) shows when the book is executed again, as on the site. The copies with the
   executed book's outputs are signed as trusted in Jupyter's own signature store (what JupyterLab
   does when a reader saves a notebook they ran), so that the players' scripts run and the figures
   show; nothing is fetched at view time, the outputs being self-contained.

   A reader's notes in a copy are kept. Each copy records a fingerprint of its cells as generated;
   a copy whose cells (their text, not their outputs) no longer match it was edited by the reader,
   and is never rewritten: ``./dev lab`` says so when it starts, and says when its chapter has
   changed since (delete or rename the copy to get the new version). An unedited copy is
   rewritten when its chapter or its executed outputs change, and otherwise left alone (with the
   outputs it was saved with). The copies carry the kernel's ``language_info``, their consecutive
   printed outputs are joined as JupyterLab joins them when it loads a notebook, and their folded
   answers carry both of JupyterLab's marks for folded outputs, so that opening one and starting
   its kernel leaves it unmodified (no "unsaved" mark, nothing for autosave to write), and saving
   it unedited writes the same bytes.

2. Starts JupyterLab at the repository root, in a workspace of that language's own
   (``nanovllm-en``, ``nanovllm-zh``: the tabs of one language never reopen in the other), and
   prints the URL that opens it. Only the chapters open as notebooks on a double-click: a small
   plugin in ``tools/jupyterlab/labextensions`` gives them a file type of their own (see its
   comment for why a folder cannot decide it), and ``tools/jupyterlab/<lang>/overrides.json``
   (JupyterLab's settings overrides, found through ``LabApp.app_settings_dir``, one folder per
   language) makes jupytext's notebook its default viewer; every other ``.py`` file (the generated
   package, the tools, the tests) opens in the text editor. The overrides also turn off fetching
   Jupyter's news feed, so nothing asks to reach the internet, and set JupyterLab's own menus and
   dialogs to the copies' language: ``zh_CN`` is the Chinese language pack pinned in pyproject.toml
   (``jupyterlab-language-pack-zh-CN``; the newest there is, 4.5.post3, made for JupyterLab 4.5:
   strings new in 4.6 stay English). They are defaults: a language a reader picks in JupyterLab's
   *Settings ▸ Language* menu is a user setting, and wins in both. Its contents manager
   (tools/lab_contents.py: jupytext's, which also gives a chapter the kernel's ``language_info``)
   makes a chapter open unmodified, as the copies do. As root it passes ``--allow-root``.

   Arguments after ``--`` go to JupyterLab and win over this command's own settings: read with
   JupyterLab's own command-line parser, a ``--port`` (or a token, an ip, a base URL) given there
   replaces the one this command would pass, and the URL printed is built from what JupyterLab
   will use. A port given there that is taken, or an argument JupyterLab rejects, stops this
   command before anything starts. Without a port, the first free one from 8888 is taken.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import re
import secrets
import socket
import sqlite3
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

if __package__ in (None, ""):  # run as `python tools/lab.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.book import localize
from tools.tangle import ROOT, chapter_files, read_chapter

SETTINGS = ROOT / "tools" / "jupyterlab"
EXTENSIONS = SETTINGS / "labextensions"
LANGUAGES = ("en", "zh")
# Where python -m tools.book execute writes the executed book, one folder per language (under the root).
EXECUTED = Path("build") / "executed"
NOTE = {
    "en": ("**Reading copy** of the chapter [`notebooks/{name}.py`](../../notebooks/{name}.py), in English only. "
           "Run and try things here, and write notes if you like: `./dev lab` keeps a copy you edited as it is "
           "(delete or rename it to get a newer version of the chapter), and replaces an unedited one when its "
           "chapter or the executed book changes. To change the book itself, edit the chapter (both languages "
           "side by side; `python -m tools.tangle` afterwards). "
           "中文版：[`read/zh/{name}.zh.ipynb`](../zh/{name}.zh.ipynb)."),
    "zh": ("这是章节 [`notebooks/{name}.py`](../../notebooks/{name}.py) 的**中文阅读副本**。可以在这里运行、尝试，"
           "也可以写笔记：你改过的副本，`./dev lab` 会原样保留（删除或改名后才会生成该章的新版本）；没改过的副本，"
           "章节或执行过的全书一改就会被替换。要修改本书，请编辑章节本身（中英两种语言并排其中；"
           "改完运行 `python -m tools.tangle`）。English: [`read/en/{name}.en.ipynb`](../en/{name}.en.ipynb)."),
}
# The note's second paragraph: where the copy's outputs come from, or why it has none.
OUTPUTS_NOTE = {
    "executed": {
        "en": "The outputs are the executed book's, the same as on the site (`build/executed/en/{name}.ipynb`): "
              "read them without running anything, or run a cell to get your own.",
        "zh": "下面的输出来自执行过的全书，与网站上的相同（`build/executed/zh/{name}.ipynb`）：不必运行就能读；"
              "运行一个单元，它的输出就换成你自己的。",
    },
    "missing": {
        "en": "**No outputs yet**: this chapter has not been executed in English here "
              "(`build/executed/en/{name}.ipynb` is missing). *Run ▸ Run All Cells* shows them; or execute it with "
              "`python -m tools.book execute notebooks/{name}.py` (`./dev run` executes the whole book), and the "
              "next `./dev lab` puts its outputs here.",
        "zh": "**还没有输出**：这一章在这里还没有以中文执行过（没有 `build/executed/zh/{name}.ipynb`）。"
              "选择*运行 ▸ 运行所有单元格*就能看到输出；或者用 `python -m tools.book execute notebooks/{name}.py` "
              "执行这一章（`./dev run` 会执行全书），下次 `./dev lab` 就会把输出放进来。",
    },
    "stale": {
        "en": "**No outputs shown**: the chapter's code has changed since it was executed "
              "(`build/executed/en/{name}.ipynb` holds the outputs of the older code, which could mislead). "
              "*Run ▸ Run All Cells* shows them; or execute it again with "
              "`python -m tools.book execute notebooks/{name}.py`, and the next `./dev lab` puts its outputs here.",
        "zh": "**没有显示输出**：这一章的代码在执行之后改过了（`build/executed/zh/{name}.ipynb` 里是旧代码的输出，"
              "可能误导读者）。选择*运行 ▸ 运行所有单元格*就能看到输出；或者用 "
              "`python -m tools.book execute notebooks/{name}.py` 重新执行这一章，下次 `./dev lab` 就会把输出放进来。",
    },
}
# The copy's first cell tells its kernel the language: the printed lines read NANOVLLM_BOOK_LANG
# (nanovllm.book.lang), the players and the live panel their own default (nanovllm.viz). The kernel
# is the reader's, started by JupyterLab for any copy, so the copy says it, not the server.
SETUP = {
    "en": "# This copy prints, plays and explains in English.\nimport os\n\n"
          "os.environ[\"NANOVLLM_BOOK_LANG\"] = \"en\"\n"
          "from nanovllm.viz import set_language\n\nset_language(\"en\")",
    "zh": "# 本副本的输出、播放器和实时面板都使用中文。\nimport os\n\n"
          "os.environ[\"NANOVLLM_BOOK_LANG\"] = \"zh\"\n"
          "from nanovllm.viz import set_language\n\nset_language(\"zh\")",
}
ANSWERS = {
    "en": "**Answers** (folded: click the bar below to open them; try the exercises first).",
    "zh": "**答案**（已折叠：点击下方的折叠条展开；先自己做练习）。",
}
# A folded cell still shows its first line: this one, rather than the first answer.
FOLDED_FIRST_LINE = {"en": "# Answers: click ••• to unfold.", "zh": "# 答案：点击 ••• 展开。"}
FOLDED = {"source_hidden": True, "outputs_hidden": True}
# What ipykernel reports when it starts (ipykernel.ipkernel.IPythonKernel.language_info). JupyterLab
# writes it into a notebook that lacks it, which marks a freshly opened copy modified.
LANGUAGE_INFO = {
    "codemirror_mode": {"name": "ipython", "version": sys.version_info[0]},
    "file_extension": ".py",
    "mimetype": "text/x-python",
    "name": "python",
    "nbconvert_exporter": "python",
    "pygments_lexer": "ipython3",
    "version": sys.version.split()[0],
}
# Where a copy records what it was generated as; FORMAT changes when the generator does (3: with outputs).
RECORD, FORMAT = "nanovllm_reading_copy", 3


def copy_name(chapter: Path, lang: str) -> str:
    """``04_scheduler.py`` -> ``04_scheduler.en.ipynb``: the language shows in JupyterLab's tab."""
    return f"{chapter.stem}.{lang}.ipynb"


def fingerprint(cells: list) -> str:
    """What a reader can edit in a notebook: its cells' kinds and text (not outputs, ids or folding)."""
    text = json.dumps([(cell["cell_type"], cell["source"]) for cell in cells], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def reading_copy(chapter: Path, lang: str, root: Path = ROOT) -> nbformat.NotebookNode:
    """The chapter in one language, as a notebook to read and run in JupyterLab, with the executed book's
    outputs when they are those of the chapter's code as it is now (``executed_run``)."""
    source = read_chapter(chapter)  # a copy of the chapter parsed once (`read_chapter`), changed below
    outputs, run = executed_run(source, root / EXECUTED / lang / f"{chapter.stem}.ipynb")
    if run is not None:
        code = (cell for cell in run.cells if cell.cell_type == "code")
        for cell, ran in zip((c for c in source.cells if c.cell_type == "code"), code, strict=True):
            cell.outputs, cell.execution_count = ran.outputs, ran.execution_count
    notebook = localize(source, lang)  # the outputs too: one language of the players, no build-machine paths
    body = []
    answers_announced = False
    for cell in notebook.cells:
        tags = cell.metadata.get("tags", [])
        if "answers" in tags:
            if not answers_announced:
                body.append(nbformat.v4.new_markdown_cell(ANSWERS[lang]))
                answers_announced = True
            cell.metadata["jupyter"] = dict(FOLDED)
            # JupyterLab keeps the older name of a folded output in step with this one, and would save it added.
            cell.metadata["collapsed"] = True
            cell.source = f"{FOLDED_FIRST_LINE[lang]}\n{cell.source}"
        elif "hide" in tags:
            cell.metadata["jupyter"] = {"source_hidden": True}
        if cell.cell_type == "code":
            cell.outputs = joined_streams(cell.outputs)
        body.append(cell)
    note = f"{NOTE[lang]}\n\n{OUTPUTS_NOTE[outputs][lang]}".format(name=chapter.stem)
    cells = [nbformat.v4.new_markdown_cell(note), nbformat.v4.new_code_cell(SETUP[lang]), *body]
    for k, cell in enumerate(cells):  # stable ids: the same chapter gives the same file, byte for byte
        cell.id = f"{lang}-{k}"
    notebook.cells = cells
    notebook.metadata.pop("jupytext", None)  # a plain .ipynb, not paired with any text file
    notebook.metadata["language_info"] = dict(LANGUAGE_INFO)
    notebook.metadata[RECORD] = {
        "chapter": f"notebooks/{chapter.name}", "language": lang, "format": FORMAT,
        "cells": fingerprint(cells),  # what the reader may edit (edited() compares it)
        "text": fingerprint(body),  # the chapter's part: a kept copy is outdated when it changes
        # Where the outputs come from: "executed" with a digest of them, "missing" or "stale" with none.
        "outputs": outputs,
        "outputs_digest": outputs_digest(body) if run is not None else None,
    }
    return notebook


def code_cells(notebook: nbformat.NotebookNode) -> list:
    """The notebook's code, cell by cell, without comments and blank lines (``code_of``)."""
    return [code_of(cell.source) for cell in notebook.cells if cell.cell_type == "code"]


def code_of(source: str) -> list[tuple[int, str]] | str:
    """A code cell's Python tokens, less its comments and blank lines: what running it depends on.

    A comment changes no output, and the book's comments change often on their own (a ``# zh:`` twin
    added, a sentence reworded): comparing text would call every such chapter's outputs stale. A cell
    that Python's tokenizer cannot read (an IPython magic, say) is compared as text.
    """
    try:
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        return [(t.type, t.string) for t in tokens if t.type not in (tokenize.COMMENT, tokenize.NL)]
    except (tokenize.TokenError, SyntaxError):  # IndentationError is a SyntaxError
        return source


def executed_run(source: nbformat.NotebookNode, path: Path) -> tuple[str, nbformat.NotebookNode | None]:
    """``("executed", notebook)`` when ``path`` holds a run of the chapter's code as it is now, else
    ``("missing", None)`` (never executed here) or ``("stale", None)`` (its code changed since).

    The executed notebook keeps the cells it ran, so the rule needs no clock: its code cells must be the
    chapter's code cells, the same code in the same order (file times would not do: a checkout or a
    copy sets them). Prose and comments are left out of the comparison: they change no output, and the
    copy takes the chapter's prose and comments of now.
    """
    run = read_notebook(path) if path.is_file() else None
    if run is None:
        return "missing", None
    if code_cells(run) != code_cells(source):
        return "stale", None
    return "executed", run


def outputs_digest(cells: list) -> str:
    """The copy's outputs, as a short digest: an unedited copy is rewritten when the executed book changes."""
    ran = [(cell.get("execution_count"), cell.get("outputs")) for cell in cells if cell.cell_type == "code"]
    return hashlib.sha256(json.dumps(ran, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


# What JupyterLab's output area does with a stream's text: a carriage return or a backspace moves back, and
# what follows overwrites (a terminal's progress line).
CONTROL = re.compile(r"[\n\b\r]")


def joined_streams(outputs: list) -> list:
    """The outputs as JupyterLab holds them once it has loaded them, and so as it saves them.

    JupyterLab's output area (OutputAreaModel in @jupyterlab/outputarea) joins consecutive stream outputs of
    one name (stdout, stderr) into one, and plays carriage returns and backspaces over their text. A copy that
    kept them apart would be saved joined, and so changed, by a reader who only opened it. This does the
    same, the same way, so that saving an unedited copy writes the bytes it was written with.
    """
    joined: list = []
    at = 0  # where the last stream's next text goes (a carriage return moves it back)
    for output in outputs:
        if output.get("output_type") != "stream":
            joined.append(output)
            continue
        text = "".join(output["text"]) if isinstance(output["text"], list) else output["text"]
        last = joined[-1] if joined else None
        if last is not None and last.get("output_type") == "stream" and last["name"] == output["name"]:
            last["text"], at = terminal(text, last["text"], at)
        else:
            output["text"], at = terminal(text, "", 0)
            joined.append(output)
    return joined


def terminal(text: str, screen: str, at: int) -> tuple[str, int]:
    """``text`` written over ``screen`` from position ``at``: JupyterLab's ``processText``, step for step.

    Returns the new screen and where the next text goes. A newline is added at the end of the screen
    (and the next text goes after it), a carriage return goes back to the start of the line, and a
    backspace removes the character before it (and, as JupyterLab does, the one under it).
    """
    start = 0
    while True:
        control = CONTROL.search(text, start)
        end = len(text) if control is None else control.start()
        piece = text[start:end]
        screen, at = screen[:at] + piece + screen[at + len(piece) :], at + len(piece)
        if control is None:
            return screen, at
        start = end + 1
        if text[end] == "\b":
            if at > 0 and screen[at - 1] != "\n":
                screen, at = screen[: at - 1] + screen[at + 1 :], at - 1
        elif text[end] == "\r":
            while at > 0 and screen[at - 1] != "\n":
                at -= 1
        else:
            screen += "\n"
            at = len(screen)


def edited(notebook: nbformat.NotebookNode) -> bool:
    """Whether the reader changed a cell's text (or added or removed cells) since the copy was written."""
    record = notebook.metadata.get(RECORD, {})
    return fingerprint(notebook.cells) != record.get("cells")


def read_notebook(path: Path) -> nbformat.NotebookNode | None:
    try:
        return nbformat.read(path, as_version=4)
    except (OSError, ValueError, KeyError, nbformat.reader.NotJSONError):
        return None  # not a notebook we can read: leave it to the reader


@dataclass
class Copies:
    """What ``write_reading_copies`` did, for the lines ``./dev lab`` prints."""

    copies: list[Path] = field(default_factory=list)  # every current reading copy
    written: list[Path] = field(default_factory=list)  # (re)written from its chapter this time
    kept: list[Path] = field(default_factory=list)  # edited by the reader: left as they are
    outdated: list[Path] = field(default_factory=list)  # kept, though their chapter changed since
    older: list[Path] = field(default_factory=list)  # kept, though copies are made differently since
    left: list[Path] = field(default_factory=list)  # not a current copy, may hold notes: left alone
    # Byte for byte what this command generates (written now, or unedited and unchanged since): safe to trust.
    generated: list[Path] = field(default_factory=list)
    # Copies generated without outputs, by language: "missing" (never executed here) or "stale" chapters.
    bare: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    def report(self, root: Path) -> list[str]:
        lines = []
        for path in self.kept:
            since = ""
            if path in self.outdated:
                since = " Its chapter has changed since: delete or rename it to get the new version."
            elif path in self.older:
                since = (" Reading copies are made differently since (they now open with the executed book's "
                         "outputs): delete or rename it to get a new one.")
            lines.append(f"lab: {path.relative_to(root)} holds your edits: kept as it is.{since}")
        for path in self.left:
            lines.append(f"lab: {path.relative_to(root)} is not a reading copy of this book (an older one, "
                         "or one of a chapter that is gone) and may hold your notes: left as it is.")
        return lines

    def outputs_report(self) -> list[str]:
        """Which copies open without outputs, and why (each copy's first cell says it too)."""
        lines = []
        for lang, bare in self.bare.items():
            folder, total = f"{EXECUTED}/{lang}/", sum(1 for path in self.copies if path.parent.name == lang)
            missing, stale = bare.get("missing", []), bare.get("stale", [])
            if len(missing) == total:
                lines.append(f"lab: read/{lang}/: no copy has outputs, the book was not executed in {lang} here "
                             f"({folder} is empty or missing): ./dev run, or python -m tools.book execute, executes "
                             "it; Run All in a copy shows its own.")
                continue
            if missing:
                lines.append(f"lab: read/{lang}/: {len(missing)} of {total} copies open without outputs, their "
                             f"chapters were not executed in {lang} here ({folder}): {', '.join(missing)}.")
            if stale:
                lines.append(f"lab: read/{lang}/: {len(stale)} of {total} copies open without outputs, their "
                             f"chapters' code changed since they were executed ({folder} holds older outputs): "
                             f"{', '.join(stale)}.")
        if lines:
            lines.append("lab: python -m tools.book execute notebooks/NN_topic.py ... executes chapters (both "
                         "languages); the next ./dev lab puts their outputs in the copies you have not edited.")
        return lines


def write_reading_copies(root: Path = ROOT) -> Copies:
    """Write every chapter's reading copies under ``root/read``, keeping every copy a reader edited."""
    chapters = chapter_files(root)
    done = Copies()
    for lang in LANGUAGES:
        folder = root / "read" / lang
        folder.mkdir(parents=True, exist_ok=True)
        fresh = {copy_name(chapter, lang): reading_copy(chapter, lang, root) for chapter in chapters}
        for name, notebook in fresh.items():
            target = folder / name
            done.copies.append(target)
            record, text = notebook.metadata[RECORD], copy_text(notebook)
            existing = read_notebook(target) if target.exists() else None
            if target.exists() and (existing is None or edited(existing)):  # the reader's: kept as it is
                done.kept.append(target)
                old = {} if existing is None else existing.metadata.get(RECORD, {})
                if existing is not None and "text" not in old:
                    done.older.append(target)  # an older kind of copy: it does not record its chapter's text
                elif old.get("text") != record["text"]:
                    done.outdated.append(target)
                continue
            if existing is None or existing.metadata.get(RECORD) != record:
                target.write_text(text, encoding="utf-8")
                done.written.append(target)
            # else: unedited, and its chapter and outputs unchanged; left with the outputs it was saved with
            if record["outputs"] != "executed":
                done.bare.setdefault(lang, {}).setdefault(record["outputs"], []).append(name.split(".")[0])
            if target.read_text(encoding="utf-8") == text:
                done.generated.append(target)
        for stale in sorted(set(folder.glob("*.ipynb")) - {folder / name for name in fresh}):
            notebook = read_notebook(stale)
            if notebook is not None and RECORD in notebook.metadata and not edited(notebook):
                stale.unlink()  # a copy of a chapter that is gone, never touched by the reader
            elif notebook is not None and unedited_older_copy(notebook, stale, fresh, lang):
                stale.unlink()
            else:
                done.left.append(stale)
    return done


def copy_text(notebook: nbformat.NotebookNode) -> str:
    """A copy's file, as JupyterLab's server writes a notebook (nbformat's layout) and a final newline."""
    return nbformat.writes(notebook) + "\n"


def trust(paths: list[Path]) -> None:
    """Sign the copies in Jupyter's signature store, as JupyterLab signs a notebook a reader ran and saved.

    An unsigned notebook opens untrusted: JupyterLab then runs no script in an HTML output and shows an
    SVG figure as its text, so the players would not play and the figures would be text. Only copies that
    are byte for byte what ``reading_copy`` made from the chapter and the executed book are signed (a copy
    the reader ran and saved was signed by JupyterLab then). The store is the reader's own (the Jupyter
    data folder, where JupyterLab looks), outside the repository.
    """
    from nbformat.sign import NotebookNotary  # imported here: only a real start (main) signs

    notary = NotebookNotary()
    for path in paths:
        notebook = nbformat.read(path, as_version=4)  # what the server will check: the file as read back
        if not notary.check_signature(notebook):
            notary.sign(notebook)


def unedited_older_copy(notebook: nbformat.NotebookNode, path: Path, fresh: dict, lang: str) -> bool:
    """A copy written before copies were named by language (``04_scheduler.ipynb``), which the reader
    did not edit: apart from its first cell (the note, reworded since), the same cells as the new copy."""
    new = fresh.get(f"{path.stem}.{lang}.ipynb")
    return new is not None and RECORD not in notebook.metadata and (
        fingerprint(notebook.cells[1:]) == fingerprint(new.cells[1:]))


# ---- JupyterLab's command line ---------------------------------------------------------------


def workspace(lang: str) -> str:
    return f"nanovllm-{lang}"


def default_url(lang: str) -> str:
    """The page ``./dev lab`` opens: that language's workspace, showing its folder of reading copies."""
    return f"/lab/workspaces/{workspace(lang)}/tree/read/{lang}"


class LabArgumentError(Exception):
    """JupyterLab would refuse the arguments given after ``--``."""


def jupyterlab_arguments(extra: list[str]) -> dict[str, object]:
    """What the arguments after ``--`` set, as ``{"ServerApp.port": 8899, ...}``, read by JupyterLab's own
    parser (so ``--port 8899``, ``--port=8899`` and ``--ServerApp.port=8899`` all read the same)."""
    from jupyterlab.labapp import LabApp  # imported here: it takes a second, and only starting needs it

    app = LabApp(log_level=logging.CRITICAL)
    try:
        app.parse_command_line(extra)
    except SystemExit as stop:  # argparse's usage message is printed already
        raise LabArgumentError(f"JupyterLab does not accept: {' '.join(extra)}") from stop
    given = {}
    for section, values in app.config.items():
        if isinstance(values, dict):
            given |= {f"{section}.{name}": value for name, value in values.items()}
    return given


@dataclass
class Server:
    """Where the server listens and how to get in: what the printed URL is made of."""

    port: int
    token: str
    lang: str
    ip: str = "localhost"
    base_url: str = "/"
    default_url: str = ""

    def url(self) -> str:
        host = "localhost" if self.ip in ("", "0.0.0.0", "::", "127.0.0.1", "localhost") else self.ip
        path = (self.base_url.rstrip("/") + "/" + (self.default_url or default_url(self.lang)).lstrip("/"))
        return f"http://{host}:{self.port}{path}" + (f"?token={self.token}" if self.token else "")


def given_token(given: dict[str, object]) -> str | None:
    for name in ("IdentityProvider.token", "ServerApp.token", "NotebookApp.token"):
        if name in given:
            return str(given[name])
    return None


def lab_options(port: int, token: str, lang: str, root: Path) -> dict[str, str]:
    """This command's own JupyterLab settings (an argument after ``--`` replaces the one it names)."""
    return {
        "ServerApp.root_dir": str(root),
        # overrides.json: chapters open as notebooks, and JupyterLab's own menus speak the copies' language
        "LabApp.app_settings_dir": str(SETTINGS / lang),
        "LabApp.extra_labextensions_path": str(EXTENSIONS),  # the plugin that tells chapters apart
        # jupytext's contents manager, serving chapters with the kernel's language_info (opened unmodified)
        "ServerApp.contents_manager_class": "tools.lab_contents.ChapterContentsManager",
        "ServerApp.port": str(port),
        "ServerApp.port_retries": "0",  # the port printed is the port used, or JupyterLab stops
        "IdentityProvider.token": token,
        "ServerApp.default_url": default_url(lang),
    }


def lab_command(port: int, token: str, lang: str, extra: list[str], root: Path = ROOT) -> list[str]:
    """The JupyterLab command line (the tests start the server with it too)."""
    given = jupyterlab_arguments(extra)
    ours = lab_options(port, token, lang, root)
    if given_token(given) is not None:
        ours.pop("IdentityProvider.token")
    command = [sys.executable, "-m", "jupyterlab"]
    command += [f"--{name}={value}" for name, value in ours.items() if name not in given]
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in extra:
        command.append("--allow-root")  # containers and cloud machines run as root
    return command + extra


def free_port(start: int) -> int:
    for port in range(start, start + 100):
        if port_is_free(port):
            return port
    raise RuntimeError(f"no free port in {start}-{start + 99}")


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def server_for(lang: str, first_port: int, given: dict[str, object]) -> Server:
    """The server JupyterLab will run, given the arguments after ``--``; raises if their port is taken."""
    if "ServerApp.port" in given:
        try:
            port = int(given["ServerApp.port"])
        except ValueError:
            raise LabArgumentError(f"the port given after -- is not a number: {given['ServerApp.port']}") from None
        if not port_is_free(port):
            raise LabArgumentError(f"port {port} (given after --) is in use: give another one, or leave it out "
                                   "to take the first free port from 8888")
    else:
        port = free_port(first_port)
    token = given_token(given)
    return Server(port=port, token=secrets.token_hex(24) if token is None else token, lang=lang,
                  ip=str(given.get("ServerApp.ip", "localhost")), base_url=str(given.get("ServerApp.base_url", "/")),
                  default_url=str(given.get("ServerApp.default_url", "")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Read the book in JupyterLab, one language at a time.")
    parser.add_argument("lang", nargs="?", choices=LANGUAGES, default="en", help="the reading copies to open")
    parser.add_argument("--port", type=int, default=8888, help="the first port to try (default 8888)")
    parser.add_argument("--print-only", action="store_true", help="write the copies, print the command, exit")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)  # a copy of the book (tests)
    parser.epilog = ("Arguments after -- go to JupyterLab and win over this command's own, "
                     "e.g. -- --ip=0.0.0.0 --port 8899 --no-browser")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    root = args.root.resolve()
    try:
        server = server_for(args.lang, args.port, jupyterlab_arguments(extra))
    except LabArgumentError as error:
        print(f"lab: {error}; JupyterLab was not started", file=sys.stderr)
        return 2
    copies = write_reading_copies(root)
    if not args.print_only:
        try:
            trust(copies.generated)
        except (OSError, sqlite3.Error) as error:  # a Jupyter data folder we cannot write: read on, untrusted
            print(f"lab: could not sign the reading copies as trusted ({error}): their players will play and their "
                  "figures show once you run them, or after the command palette's Trust Notebook", file=sys.stderr)
    print(f"lab: {len(copies.copies)} reading copies in read/en/ (English) and read/zh/ (中文), one per chapter"
          + (f"; {len(copies.written)} written from their chapters" if copies.written else ""))
    for line in copies.report(root) + copies.outputs_report():
        print(line)
    print("lab: the chapters (notebooks/*.py, both languages) open as notebooks; edit the book there")
    command = lab_command(server.port, server.token, args.lang, extra, root)
    print(f"lab: JupyterLab {'would start' if args.print_only else 'is starting'} at {server.url()}", flush=True)
    if args.print_only:
        print(" ".join(command))
        return 0
    if Path.cwd().resolve() != ROOT:  # `python tools/lab.py` run elsewhere: the server imports tools.lab_contents
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.execv(sys.executable, command)  # JupyterLab takes over this process (and Ctrl-C)
    return 0


if __name__ == "__main__":
    sys.exit(main())
