"""Read the book in JupyterLab, one language at a time: ``./dev lab [en|zh]``.

``python -m tools.lab [en|zh] [--port N] [--print-only] [-- JUPYTERLAB ARGS...]``

1. Writes the **reading copies**: ``read/en/NN_topic.en.ipynb`` and ``read/zh/NN_topic.zh.ipynb``,
   one per chapter and language (the language is in the name, so that a tab says which one it
   shows), generated from ``notebooks/*.py`` the same way the sites are (tools/book.py's
   ``localize``: that language's prose and code comments only, exercise answers folded, ``#| hide``
   cells' code folded). Each starts with a note that says where edits go and a cell that makes the
   players and the live panel speak that language. ``read/`` is ignored by git.

   A reader's notes in a copy are kept. Each copy records a fingerprint of its cells as generated;
   a copy whose cells (their text, not their outputs) no longer match it was edited by the reader,
   and is never rewritten: ``./dev lab`` says so when it starts, and says when its chapter has
   changed since (delete or rename the copy to get the new version). An unedited copy is
   rewritten when its chapter changes, and otherwise left alone (with the outputs it was saved
   with). The copies carry the kernel's ``language_info``, so that opening one and starting its
   kernel leaves it unmodified (no "unsaved" mark, nothing for autosave to write).

2. Starts JupyterLab at the repository root, in a workspace of that language's own
   (``nanovllm-en``, ``nanovllm-zh``: the tabs of one language never reopen in the other), and
   prints the URL that opens it. Only the chapters open as notebooks on a double-click: a small
   plugin in ``tools/jupyterlab/labextensions`` gives them a file type of their own (see its
   comment for why a folder cannot decide it), and ``tools/jupyterlab/overrides.json`` (JupyterLab's
   settings overrides, found through ``LabApp.app_settings_dir``) makes jupytext's notebook its
   default viewer; every other ``.py`` file (the generated package, the tools, the tests) opens
   in the text editor. The overrides also turn off fetching Jupyter's news feed, so nothing asks
   to reach the internet. Its contents manager (tools/lab_contents.py: jupytext's, which also gives a
   chapter the kernel's ``language_info``) makes a chapter open unmodified, as the copies do. As root
   it passes ``--allow-root``.

   Arguments after ``--`` go to JupyterLab and win over this command's own settings: read with
   JupyterLab's own command-line parser, a ``--port`` (or a token, an ip, a base URL) given there
   replaces the one this command would pass, and the URL printed is built from what JupyterLab
   will use. A port given there that is taken, or an argument JupyterLab rejects, stops this
   command before anything starts. Without a port, the first free one from 8888 is taken.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import secrets
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

import jupytext
import nbformat

if __package__ in (None, ""):  # run as `python tools/lab.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.book import localize
from tools.tangle import ROOT, chapter_files

SETTINGS = ROOT / "tools" / "jupyterlab"
EXTENSIONS = SETTINGS / "labextensions"
LANGUAGES = ("en", "zh")
NOTE = {
    "en": ("**Reading copy** of the chapter [`notebooks/{name}.py`](../../notebooks/{name}.py), in English only. "
           "Run and try things here, and write notes if you like: `./dev lab` keeps a copy you edited as it is "
           "(delete or rename it to get a newer version of the chapter), and replaces an unedited one when its "
           "chapter changes. To change the book itself, edit the chapter (both languages side by side; "
           "`python -m tools.tangle` afterwards). 中文版：[`read/zh/{name}.zh.ipynb`](../zh/{name}.zh.ipynb)."),
    "zh": ("这是章节 [`notebooks/{name}.py`](../../notebooks/{name}.py) 的**中文阅读副本**。可以在这里运行、尝试，"
           "也可以写笔记：你改过的副本，`./dev lab` 会原样保留（删除或改名后才会生成该章的新版本）；没改过的副本，"
           "章节一改就会被替换。要修改本书，请编辑章节本身（中英两种语言并排其中；改完运行 `python -m tools.tangle`）。"
           "English: [`read/en/{name}.en.ipynb`](../en/{name}.en.ipynb)."),
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
# Where a copy records what it was generated as; FORMAT changes when the generator does.
RECORD, FORMAT = "nanovllm_reading_copy", 2


def copy_name(chapter: Path, lang: str) -> str:
    """``04_scheduler.py`` -> ``04_scheduler.en.ipynb``: the language shows in JupyterLab's tab."""
    return f"{chapter.stem}.{lang}.ipynb"


def fingerprint(cells: list) -> str:
    """What a reader can edit in a notebook: its cells' kinds and text (not outputs, ids or folding)."""
    text = json.dumps([(cell["cell_type"], cell["source"]) for cell in cells], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def reading_copy(chapter: Path, lang: str) -> nbformat.NotebookNode:
    """The chapter in one language, as a notebook to read and run in JupyterLab."""
    notebook = localize(jupytext.read(chapter, fmt="py:percent"), lang)
    cells = [
        nbformat.v4.new_markdown_cell(NOTE[lang].format(name=chapter.stem)),
        nbformat.v4.new_code_cell(SETUP[lang]),
    ]
    answers_announced = False
    for cell in notebook.cells:
        tags = cell.metadata.get("tags", [])
        if "answers" in tags:
            if not answers_announced:
                cells.append(nbformat.v4.new_markdown_cell(ANSWERS[lang]))
                answers_announced = True
            cell.metadata["jupyter"] = dict(FOLDED)
            cell.source = f"{FOLDED_FIRST_LINE[lang]}\n{cell.source}"
        elif "hide" in tags:
            cell.metadata["jupyter"] = {"source_hidden": True}
        cells.append(cell)
    for k, cell in enumerate(cells):  # stable ids: the same chapter gives the same file, byte for byte
        cell.id = f"{lang}-{k}"
    notebook.cells = cells
    notebook.metadata.pop("jupytext", None)  # a plain .ipynb, not paired with any text file
    notebook.metadata["language_info"] = dict(LANGUAGE_INFO)
    notebook.metadata[RECORD] = {"chapter": f"notebooks/{chapter.name}", "language": lang, "format": FORMAT,
                                 "cells": fingerprint(cells)}
    return notebook


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
    left: list[Path] = field(default_factory=list)  # not a current copy, may hold notes: left alone

    def report(self, root: Path) -> list[str]:
        lines = []
        for path in self.kept:
            since = (" Its chapter has changed since: delete or rename it to get the new version."
                     if path in self.outdated else "")
            lines.append(f"lab: {path.relative_to(root)} holds your edits: kept as it is.{since}")
        for path in self.left:
            lines.append(f"lab: {path.relative_to(root)} is not a reading copy of this book (an older one, "
                         "or one of a chapter that is gone) and may hold your notes: left as it is.")
        return lines


def write_reading_copies(root: Path = ROOT) -> Copies:
    """Write every chapter's reading copies under ``root/read``, keeping every copy a reader edited."""
    chapters = chapter_files(root)
    done = Copies()
    for lang in LANGUAGES:
        folder = root / "read" / lang
        folder.mkdir(parents=True, exist_ok=True)
        fresh = {copy_name(chapter, lang): reading_copy(chapter, lang) for chapter in chapters}
        for name, notebook in fresh.items():
            target = folder / name
            done.copies.append(target)
            if not target.exists():
                write_copy(target, notebook)
                done.written.append(target)
                continue
            existing = read_notebook(target)
            if existing is None or edited(existing):
                done.kept.append(target)
                if existing is None or existing.metadata.get(RECORD) != notebook.metadata[RECORD]:
                    done.outdated.append(target)
            elif existing.metadata.get(RECORD) != notebook.metadata[RECORD]:
                write_copy(target, notebook)
                done.written.append(target)
            # else: unedited and its chapter unchanged; left with whatever outputs it was saved with
        for stale in sorted(set(folder.glob("*.ipynb")) - {folder / name for name in fresh}):
            notebook = read_notebook(stale)
            if notebook is not None and RECORD in notebook.metadata and not edited(notebook):
                stale.unlink()  # a copy of a chapter that is gone, never touched by the reader
            elif notebook is not None and unedited_older_copy(notebook, stale, fresh, lang):
                stale.unlink()
            else:
                done.left.append(stale)
    return done


def write_copy(target: Path, notebook: nbformat.NotebookNode) -> None:
    target.write_text(nbformat.writes(notebook) + "\n", encoding="utf-8")


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
        "LabApp.app_settings_dir": str(SETTINGS),  # overrides.json: chapters open as notebooks
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
    print(f"lab: {len(copies.copies)} reading copies in read/en/ (English) and read/zh/ (中文), one per chapter"
          + (f"; {len(copies.written)} written from their chapters" if copies.written else ""))
    for line in copies.report(root):
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
