"""Execute the chapters and build the English and Chinese sites.

``python -m tools.book execute [chapter.py ...]``
    runs every chapter (or the ones named) top to bottom in a fresh kernel and writes the
    executed notebooks to ``build/executed/``. A cell that raises stops the build with the
    chapter's name and the error (exit status 1).
``python -m tools.book site``
    turns the executed notebooks into one docs tree per language (``build/docs/en``,
    ``build/docs/zh``: markdown cells of the other language and its code comments removed,
    ``#| hide`` cells' code hidden) and runs ``mkdocs build --strict`` on both:
    English into ``build/site/``, Chinese into ``build/site/zh/``.
``python -m tools.book all``
    both of the above.

mkdocs-static-i18n does not work with mkdocs-jupyter, hence one filtered tree per language.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

if __package__ in (None, ""):  # run as `python tools/book.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.tangle import DIRECTIVE, ROOT, chapter_files

BUILD = ROOT / "build"
LANGUAGES = {"en": "mkdocs.yml", "zh": "mkdocs.zh.yml"}
COMMENT = re.compile(r"^(?P<indent>\s*)# (?P<lang>en|zh): ?(?P<text>.*)$")
CELL_TIMEOUT_S = 900


class ChapterError(Exception):
    """A chapter raised while it was executed."""


def execute(chapters: list[Path], out_dir: Path) -> list[Path]:
    """Run each chapter in a fresh kernel from the project root; write the executed notebooks."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for chapter in chapters:
        notebook = jupytext.read(chapter, fmt="py:percent")
        client = NotebookClient(
            notebook,
            timeout=CELL_TIMEOUT_S,
            kernel_name="python3",
            allow_errors=False,
            resources={"metadata": {"path": str(ROOT)}},
        )
        print(f"book: executing {chapter.name}", flush=True)
        try:
            client.execute()
        except CellExecutionError as error:
            raise ChapterError(f"{chapter.name} raised while executing:\n{error}") from error
        target = out_dir / chapter.with_suffix(".ipynb").name
        nbformat.write(notebook, target)
        written.append(target)
    return written


def localize_code(source: str, lang: str) -> str:
    """Keep the bilingual comments of one language, as plain comments, in a code cell."""
    lines = []
    for line in source.splitlines():
        match = COMMENT.match(line)
        if match is None:
            lines.append(line)
        elif match["lang"] == lang:
            lines.append(f"{match['indent']}# {match['text']}".rstrip())
    return "\n".join(lines)


def localize(notebook: nbformat.NotebookNode, lang: str) -> nbformat.NotebookNode:
    """The notebook as readers of ``lang`` see it (outputs are shared by both languages)."""
    cells = []
    for cell in notebook.cells:
        tags = cell.metadata.get("tags", [])
        if cell.cell_type == "markdown":
            if lang in tags:
                cells.append(cell)
            continue
        if cell.cell_type == "code":
            first_lines = cell.source.splitlines()[:4]
            if any((m := DIRECTIVE.match(line)) and m["name"] == "hide" for line in first_lines):
                cell.metadata["tags"] = [*tags, "hide"]
            cell.source = localize_code(cell.source, lang)
        cells.append(cell)
    notebook.cells = cells
    return notebook


def docs_tree(lang: str, executed: list[Path]) -> Path:
    """Assemble ``build/docs/<lang>``: landing pages, glossary, assets and chapters."""
    target = BUILD / "docs" / lang
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(ROOT / "docs" / lang, target)
    shutil.copytree(ROOT / "docs" / "assets", target / "assets")
    shutil.copy(ROOT / "docs" / "glossary.md", target / "glossary.md")
    chapters = target / "chapters"
    chapters.mkdir()
    for path in executed:
        notebook = localize(nbformat.read(path, as_version=4), lang)
        nbformat.write(notebook, chapters / path.name)
    return target


def build_sites(executed: list[Path]) -> None:
    if not executed:
        raise ChapterError("no executed chapters under build/executed: run `python -m tools.book execute` first")
    site = BUILD / "site"
    if site.exists():
        shutil.rmtree(site)
    for lang, config in LANGUAGES.items():  # English first: it would clean the zh/ subfolder
        docs_tree(lang, executed)
        print(f"book: building the {lang} site", flush=True)
        command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / config)]
        subprocess.run(command, check=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    print(f"book: sites in {site.relative_to(ROOT)}/ (English) and {site.relative_to(ROOT)}/zh/ (Chinese)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Execute the book and build its sites.")
    parser.add_argument("action", choices=["execute", "site", "all"])
    parser.add_argument("chapters", nargs="*", type=Path, help="chapters to execute (default: all)")
    parser.add_argument("--out", type=Path, default=BUILD / "executed", help="where executed notebooks go")
    args = parser.parse_args(argv)
    try:
        if args.action in ("execute", "all"):
            execute([c.resolve() for c in args.chapters] or chapter_files(ROOT), args.out)
        if args.action in ("site", "all"):
            build_sites(sorted(args.out.glob("*.ipynb")))
    except ChapterError as error:
        print(f"book: error: {error}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as error:
        print(f"book: error: {' '.join(error.cmd)} failed with exit status {error.returncode}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
