"""Read the book in JupyterLab, one language at a time: ``./dev lab [en|zh]``.

``python -m tools.lab [en|zh] [--port N] [--print-only] [-- JUPYTER ARGS...]``

1. Writes the **reading copies**: ``read/en/NN_topic.ipynb`` and ``read/zh/NN_topic.ipynb``,
   one per chapter and language, generated from ``notebooks/*.py`` the same way the sites are
   (tools/book.py's ``localize``: that language's prose and code comments only, exercise
   answers folded, ``#| hide`` cells' code folded). Each starts with a note that says where
   edits go and a cell that makes the players and the live panel speak that language. They are
   rewritten whenever they differ from their chapter, so they are for reading and running, not
   for editing; ``read/`` is ignored by git.
2. Starts JupyterLab at the repository root and prints its URL (opening the chosen language's
   folder). The bilingual chapters themselves open as notebooks on a double-click: the default
   viewer of Python files is jupytext's notebook, set in ``tools/jupyterlab/overrides.json``
   (JupyterLab's settings overrides, found through ``LabApp.app_settings_dir``; it also turns
   off fetching Jupyter's news feed, so nothing asks to reach the internet). As root it
   passes ``--allow-root``; it picks the first free port from 8888 and a token of its own, so
   the URL it prints is the one that works.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
from pathlib import Path

import jupytext
import nbformat

if __package__ in (None, ""):  # run as `python tools/lab.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.book import localize
from tools.tangle import ROOT, chapter_files

READ = ROOT / "read"
SETTINGS = ROOT / "tools" / "jupyterlab"
LANGUAGES = ("en", "zh")
OTHER = {"en": "zh", "zh": "en"}
NOTE = {
    "en": ("**Reading copy** of [`notebooks/{name}.py`](../../notebooks/{name}.py), in English only. "
           "`./dev lab` rewrites it whenever the chapter changes: run and try things here, but edit "
           "the chapter itself (both languages; `python -m tools.tangle` afterwards) to change the book. "
           "中文版：[`read/zh/{name}.ipynb`](../zh/{name}.ipynb)."),
    "zh": ("这是 [`notebooks/{name}.py`](../../notebooks/{name}.py) 的**中文阅读副本**。每当该章改动，`./dev lab` "
           "都会重新生成它：可以在这里运行、尝试，但要修改本书，请编辑章节本身（中英两种语言都在其中；"
           "改完运行 `python -m tools.tangle`）。English: [`read/en/{name}.ipynb`](../en/{name}.ipynb)."),
}
SETUP = {
    "en": "# Players and the live panel speak English in this copy.\n"
          "from nanovllm.viz import set_language\n\nset_language(\"en\")",
    "zh": "# 本副本中的播放器和实时面板使用中文。\n"
          "from nanovllm.viz import set_language\n\nset_language(\"zh\")",
}
ANSWERS = {
    "en": "**Answers** (folded: click the bar below to open them; try the exercises first).",
    "zh": "**答案**（已折叠：点击下方的折叠条展开；先自己做练习）。",
}
# A folded cell still shows its first line: this one, rather than the first answer.
FOLDED_FIRST_LINE = {"en": "# Answers: click ••• to unfold.", "zh": "# 答案：点击 ••• 展开。"}
FOLDED = {"source_hidden": True, "outputs_hidden": True}


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
    return notebook


def write_reading_copies(out: Path = READ) -> list[Path]:
    """Write every chapter's reading copies under ``out``; leave unchanged files alone, drop stale ones."""
    chapters = chapter_files(ROOT)
    written = []
    for lang in LANGUAGES:
        folder = out / lang
        folder.mkdir(parents=True, exist_ok=True)
        wanted = {c.stem for c in chapters}
        for stale in folder.glob("*.ipynb"):
            if stale.stem not in wanted:
                stale.unlink()
        for chapter in chapters:
            target = folder / f"{chapter.stem}.ipynb"
            text = nbformat.writes(reading_copy(chapter, lang)) + "\n"
            if not target.exists() or target.read_text(encoding="utf-8") != text:
                target.write_text(text, encoding="utf-8")
            written.append(target)
    return written


def free_port(start: int) -> int:
    for port in range(start, start + 100):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) != 0:
                return port
    raise RuntimeError(f"no free port in {start}-{start + 99}")


def lab_command(port: int, token: str, lang: str, extra: list[str], root: Path = ROOT) -> list[str]:
    """The JupyterLab command line (the tests start the server with it too)."""
    command = [
        sys.executable, "-m", "jupyterlab",
        f"--ServerApp.root_dir={root}",
        f"--LabApp.app_settings_dir={SETTINGS}",  # overrides.json: .py chapters open as notebooks
        f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.default_url=/lab/tree/read/{lang}",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")  # containers and cloud machines run as root
    return command + extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Read the book in JupyterLab, one language at a time.")
    parser.add_argument("lang", nargs="?", choices=LANGUAGES, default="en", help="the reading copies to open")
    parser.add_argument("--port", type=int, default=8888, help="the first port to try (default 8888)")
    parser.add_argument("--print-only", action="store_true", help="write the copies, print the command, exit")
    parser.epilog = "Arguments after -- go to JupyterLab, e.g. -- --ip=0.0.0.0 --no-browser"
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    copies = write_reading_copies()
    port, token = free_port(args.port), secrets.token_hex(24)
    command = lab_command(port, token, args.lang, extra)
    print(f"lab: {len(copies)} reading copies in read/en/ (English) and read/zh/ (中文), one per chapter")
    print("lab: the chapters (notebooks/*.py, both languages) open as notebooks; edit them there")
    if args.print_only:
        print(" ".join(command))
        return 0
    print(f"lab: JupyterLab is starting at http://localhost:{port}/lab/tree/read/{args.lang}?token={token}",
          flush=True)
    os.execv(sys.executable, command)  # JupyterLab takes over this process (and Ctrl-C)
    return 0


if __name__ == "__main__":
    sys.exit(main())
