"""Execute the chapters and build the English and Chinese sites.

``python -m tools.book execute [chapter.py ...] [--lang en|zh]``
    runs every chapter (or the ones named) top to bottom in a fresh kernel (forked from one that has
    imported torch and transformers: tools/kernel_zygote.py), once per language, and
    writes the executed notebooks to ``build/executed/<lang>/``, printing each run's time. A chapter
    prints in the reader's language (``nanovllm.book.lang``: ``NANOVLLM_BOOK_LANG`` is set for the
    kernel), so each site gets its own run. A chapter whose cell raises is named with its error and
    left out; the others still run, and the exit status is 1. ``./dev test`` runs the chapters this
    way, once per language, and builds the sites from the same notebooks.
``python -m tools.book site``
    turns each language's executed notebooks into its docs tree (``build/docs/en``,
    ``build/docs/zh``: markdown cells of the other language, its code comments and its half of
    every bilingual output removed, docstrings in its language (a docstring's ``# zh:`` twin in its
    place on the Chinese site), ``#| hide`` cells' code hidden, exercise answers tagged to
    be folded, no stray spaces in Chinese prose (tools/cjk.py), no paths of the build machine
    in outputs (tools/machine_paths.py)) and runs ``mkdocs build --strict`` on both: English
    into ``build/site/``, Chinese into ``build/site/zh/``. A chapter that was not executed yet
    is built without outputs, with a warning, so that executing two chapters is enough to look
    at the site.
``python -m tools.book all``
    both of the above (no site when a chapter failed).
``python -m tools.book parts``
    the book's parts (tools/parts.py), one line each: ``core: 00_tour.py 01_sequence.py ...``.

mkdocs-static-i18n does not work with mkdocs-jupyter, hence one filtered tree per language.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jupytext
import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

if __package__ in (None, ""):  # run as `python tools/book.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.bilingual import Docstring, docstrings
from tools.cjk import tidy_cjk
from tools.kernel_zygote import Zygote
from tools.machine_paths import scrub
from tools.parts import PARTS
from tools.tangle import DIRECTIVE, ROOT, chapter_files, read_chapter

BUILD = ROOT / "build"
LANGUAGES = {"en": "mkdocs.yml", "zh": "mkdocs.zh.yml"}
# The variable that nanovllm.book.lang reads: the language a chapter prints its traces and tables in.
LANG_ENV = "NANOVLLM_BOOK_LANG"
COMMENT = re.compile(r"^(?P<indent>\s*)# (?P<lang>en|zh): ?(?P<text>.*)$")
# The heading of a chapter's exercises; the code cells right after that prose are the answers.
EXERCISES = re.compile(r"^#{2,3}\s+(Exercises|练习)\s*$", re.M)
# Outputs that may hold both languages, marked by nanovllm.viz (players, the live panel's note).
BILINGUAL_OUTPUTS = ("text/html", "image/svg+xml")
CELL_TIMEOUT_S = 900
# Every kernel's environment, beside the language: progress bars off (transformers' "Loading weights" among
# them): in an executed notebook they are ipywidgets, whose saved views make the site fetch a widget renderer
# from a CDN.
KERNEL_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}


class ChapterError(Exception):
    """A chapter raised while it was executed."""


def execute(chapters: list[Path], out_dir: Path, languages: tuple[str, ...] = tuple(LANGUAGES)) -> list[Path]:
    """Run each chapter in a fresh kernel from the project root, once per language; write the executed notebooks.

    ``out_dir/<lang>/<chapter>.ipynb`` holds the run whose printed traces and tables speak ``lang``. A
    chapter whose cell raises (in any language) is reported and left out of every language executed (an
    older executed copy of it is removed, so that no site shows stale outputs); the others still run,
    and ChapterError then names every failure. This is the book's only execution: `./dev test` checks
    the chapters with it and builds the sites from its notebooks.
    """
    for lang in languages:
        (out_dir / lang).mkdir(parents=True, exist_ok=True)
    written, failures = [], []
    began = time.monotonic()
    # Every kernel is forked from one process that has imported torch and transformers (tools/kernel_zygote.py).
    with Zygote({**os.environ, **KERNEL_ENV}, str(ROOT)) as zygote:
        for k, chapter in enumerate(chapters, start=1):
            print(f"book: [{k:>2}/{len(chapters)}] {chapter.name:<28}", end="", flush=True)
            targets = {lang: out_dir / lang / chapter.with_suffix(".ipynb").name for lang in languages}
            runs = {}
            try:
                for lang in languages:
                    started = time.monotonic()
                    runs[lang] = run_chapter(chapter, lang, zygote.kernel_spec_manager)
                    print(f" {lang} {time.monotonic() - started:5.1f} s", end="", flush=True)
            except ChapterError as error:
                print(f" {lang} failed", flush=True)
                for target in targets.values():
                    target.unlink(missing_ok=True)
                failures.append(str(error))
                continue
            print(flush=True)
            for lang, notebook in runs.items():
                nbformat.write(notebook, targets[lang])
                written.append(targets[lang])
    if len(chapters) > 1:
        print(f"book: executed {len(chapters)} chapters ({', '.join(languages)}) in "
              f"{minutes(time.monotonic() - began)}", flush=True)
    if failures:
        raise ChapterError("\n\n".join(failures))
    return written


def run_chapter(chapter: Path, lang: str, kernel_specs: KernelSpecManager) -> nbformat.NotebookNode:
    """The chapter executed top to bottom in a fresh kernel, printing in ``lang``; ChapterError if a cell raises.
    ``kernel_specs`` holds the ``python3`` kernel it runs in (a `Zygote`'s)."""
    notebook = read_chapter(chapter)  # parsed once for both languages
    # The kernel talks over Unix sockets in a private folder, not TCP: nothing listens on a
    # port, and ipykernel has no reason to warn about plain-text TCP on every chapter.
    with tempfile.TemporaryDirectory(prefix="book-kernel-") as sockets:
        kernel = KernelManager(kernel_name="python3", kernel_spec_manager=kernel_specs, transport="ipc",
                               ip=os.path.join(sockets, "k"))
        client = NotebookClient(notebook, km=kernel, timeout=CELL_TIMEOUT_S, allow_errors=False,
                                resources={"metadata": {"path": str(ROOT)}})
        try:
            client.execute(env={**os.environ, **KERNEL_ENV, LANG_ENV: lang})
        except (CellExecutionError, CellTimeoutError, DeadKernelError) as error:
            # A cell that raised, ran past CELL_TIMEOUT_S or took its kernel down: the chapter failed, the book goes on.
            what = "raised" if isinstance(error, CellExecutionError) else f"failed ({type(error).__name__})"
            raise ChapterError(f"{chapter.name} {what} while executing in {lang}:\n{error}") from error
        finally:  # nbclient leaves a kernel it did not create running
            if kernel.has_kernel:
                kernel.shutdown_kernel(now=True)
    return notebook


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s" if seconds >= 60 else f"{seconds:.1f} s"


def localize_code(source: str, lang: str) -> str:
    """Keep the bilingual comments of one language, as plain comments, in a code cell, and its docstrings in it.

    A docstring is English and its ``# zh:`` twin (right below it, tools/bilingual.py) Chinese: English keeps
    the docstring and drops the twin, as the package does; Chinese puts the twin's lines in the docstring's place.
    """
    source_lines = source.splitlines()
    if lang == "zh":
        for doc in reversed(docstrings(source)):
            if doc.twin:
                source_lines[doc.first - 1 : doc.end] = chinese_docstring(doc, source_lines)
    lines = []
    for line in source_lines:
        match = COMMENT.match(line)
        if match is None:
            lines.append(line)
        elif match["lang"] == lang:
            lines.append(f"{match['indent']}# {match['text']}".rstrip())
    return "\n".join(lines)


def chinese_docstring(doc: Docstring, lines: list[str]) -> list[str]:
    """The lines of ``doc`` with its twin's Chinese in place of its English, quoted and laid out as it was."""
    prefix, quotes = re.match(r"(?i)([rbu]*)(\"\"\"|'''|\"|')", doc.literal).groups()
    # The closing quotes get a line of their own when the English had one, or when the Chinese is longer.
    closing_alone = doc.first == doc.last or doc.literal.splitlines()[-1].strip() == quotes
    quotes = quotes[0] * 3 if len(doc.twin) > 1 else quotes
    before, after = lines[doc.first - 1][: doc.column], lines[doc.last - 1][doc.end_column :]
    text = [f"{before}{prefix}{quotes}{doc.twin[0]}", *(f"{' ' * doc.column}{t}".rstrip() for t in doc.twin[1:])]
    if len(text) > 1 and closing_alone:
        return [*text, f"{' ' * doc.column}{quotes}{after}"]
    return [*text[:-1], f"{text[-1]}{quotes}{after}"]


def answer_cells(cells: list) -> set[int]:
    """Positions of the exercise answers: the code cells right after prose headed "Exercises" / "练习"."""
    answers, after_exercises = set(), False
    for i, cell in enumerate(cells):
        if cell.cell_type == "markdown":
            after_exercises = bool(EXERCISES.search(cell.source))
        elif cell.cell_type == "code" and after_exercises:
            answers.add(i)
    return answers


def localize_outputs(outputs: list, lang: str) -> None:
    """Keep one language of the bilingual outputs (the book is executed once, for both sites)."""
    if not outputs:
        return
    from nanovllm.viz.player import keep_language  # the player defines the marks it writes

    for output in outputs:
        data = output.get("data", {})
        for mime in BILINGUAL_OUTPUTS:
            if isinstance(data.get(mime), str):
                data[mime] = keep_language(data[mime], lang)
    scrub_outputs(outputs)


def scrub_outputs(outputs: list) -> None:
    """The build machine's paths out of printed text and text-like outputs (tools/machine_paths.py)."""
    for output in outputs:
        if isinstance(output.get("text"), str):
            output["text"] = scrub(output["text"])
        data = output.get("data", {})
        for mime, value in data.items():
            if isinstance(value, str) and (mime.startswith("text/") or mime == "image/svg+xml"):
                data[mime] = scrub(value)


def localize(notebook: nbformat.NotebookNode, lang: str) -> nbformat.NotebookNode:
    """The notebook as readers of ``lang`` see it: its prose, comments and outputs, answers tagged."""
    answers = answer_cells(notebook.cells)
    cells = []
    for i, cell in enumerate(notebook.cells):
        tags = cell.metadata.get("tags", [])
        if cell.cell_type == "markdown":
            if lang in tags:
                cell.source = tidy_cjk(cell.source)
                cells.append(cell)
            continue
        if cell.cell_type == "code":
            first_lines = cell.source.splitlines()[:4]
            if any((m := DIRECTIVE.match(line)) and m["name"] == "hide" for line in first_lines):
                tags = [*tags, "hide"]
            if i in answers:
                tags = [*tags, "answers"]
            if tags:
                cell.metadata["tags"] = tags
            cell.source = localize_code(cell.source, lang)
            localize_outputs(cell.get("outputs", []), lang)
        cells.append(cell)
    notebook.cells = cells
    return notebook


NOT_EXECUTED = {
    "en": "> **Built without outputs**: this chapter was not executed for this build "
          "(`python -m tools.book execute notebooks/{name}.py`).",
    "zh": "> **未执行，没有输出**：构建本网站时没有执行这一章（`python -m tools.book execute notebooks/{name}.py`）。",
}


def chapter_notebooks(executed_dir: Path) -> dict[str, nbformat.NotebookNode]:
    """Every chapter, executed where ``executed_dir`` (one language's) has it, else as its source with a banner."""
    notebooks, missing, stale = {}, [], []
    for chapter in chapter_files(ROOT):
        path = executed_dir / chapter.with_suffix(".ipynb").name
        if path.exists():
            notebooks[chapter.stem] = nbformat.read(path, as_version=4)
            if path.stat().st_mtime < chapter.stat().st_mtime:
                stale.append(chapter.stem)
            continue
        notebook = jupytext.read(chapter, fmt="py:percent")
        banners = [nbformat.v4.new_markdown_cell(text.format(name=chapter.stem), metadata={"tags": [lang]})
                   for lang, text in NOT_EXECUTED.items()]
        notebook.cells = banners + notebook.cells
        notebooks[chapter.stem] = notebook
        missing.append(chapter.stem)
    if missing:
        print(f"book: warning: not executed in {executed_dir.name}, built without outputs: {', '.join(missing)}",
              flush=True)
    if stale:
        print(f"book: warning: executed in {executed_dir.name} before their chapter last changed: {', '.join(stale)}",
              flush=True)
    return notebooks


def glossary(lang: str) -> str:
    """docs/glossary.md as one site shows it: its title, introduction and meanings in ``lang``.

    The glossary is written once, in both languages: "# Glossary · 术语表", an English and a Chinese
    introduction, and a table of terms (English | 中文 | meaning · 含义). Each site keeps both terms
    and its own half of the rest, so that its navigation, heading and prose speak its language.
    """
    half = 1 if lang == "zh" else 0
    text = (ROOT / "docs" / "glossary.md").read_text(encoding="utf-8")
    head, table = text.split("\n|", 1)
    title, *intro = head.split("\n")
    chinese_line = re.compile(r"[\u4e00-\u9fff]")
    kept = [line for line in intro if not line.strip() or bool(chinese_line.search(line)) == (lang == "zh")]
    rows = []
    for row in ("|" + table).split("\n"):
        *terms, meaning, end = row.split("|") if row.startswith("|") else (row, "", "")
        halves = meaning.split(" · ")
        rows.append("|".join([*terms, f" {halves[half].strip()} ", end]) if len(halves) == 2 else row)
    return "\n".join([f"# {title.removeprefix('# ').split(' · ')[half]}", *kept, *rows])


def docs_tree(lang: str, notebooks: dict[str, nbformat.NotebookNode]) -> Path:
    """Assemble ``build/docs/<lang>``: landing pages, glossary, assets and chapters."""
    target = BUILD / "docs" / lang
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(ROOT / "docs" / lang, target)
    shutil.copytree(ROOT / "docs" / "assets", target / "assets")
    (target / "glossary.md").write_text(glossary(lang), encoding="utf-8")
    for page in target.rglob("*.md"):  # the landing page, the glossary and the Guide's pages
        page.write_text(tidy_cjk(page.read_text(encoding="utf-8")), encoding="utf-8")
    chapters = target / "chapters"
    chapters.mkdir()
    for name, notebook in notebooks.items():
        nbformat.write(localize(copy.deepcopy(notebook), lang), chapters / f"{name}.ipynb")
    return target


def build_sites(executed_dir: Path) -> None:
    site, beside = BUILD / "site", BUILD / "site-zh"
    for folder in (site, beside):
        if folder.exists():
            shutil.rmtree(folder)
    # Every language's docs tree before any site: a chapter's headings name their twins in the other language's
    # tree (tools/mkdocs_hooks.py), so that the language menu keeps the reader's section.
    for lang in LANGUAGES:
        docs_tree(lang, chapter_notebooks(executed_dir / lang))  # each site from its own language's run
    # Both sites at once, a process each. The English build empties build/site/ when it starts, so the Chinese
    # site is built beside it and moved into build/site/zh/ once both are done.
    builds = []
    for lang, config in LANGUAGES.items():
        print(f"book: building the {lang} site", flush=True)
        command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / config)]
        command += ["-d", str(beside)] if lang == "zh" else []
        builds.append(subprocess.Popen(command, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}))
    failed = [build for build in builds if build.wait() != 0]  # both have ended before either fails the book
    if failed:
        raise subprocess.CalledProcessError(failed[0].returncode, failed[0].args)
    beside.rename(site / "zh")
    print(f"book: sites in {site.relative_to(ROOT)}/ (English) and {site.relative_to(ROOT)}/zh/ (Chinese)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Execute the book and build its sites.")
    parser.add_argument("action", choices=["execute", "site", "all", "parts"])
    parser.add_argument("chapters", nargs="*", type=Path, help="chapters to execute (default: all)")
    parser.add_argument("--out", type=Path, default=BUILD / "executed",
                        help="where executed notebooks go (one folder per language)")
    parser.add_argument("--lang", choices=list(LANGUAGES), action="append",
                        help="execute in this language only (repeatable; default: every language)")
    args = parser.parse_args(argv)
    if args.action == "parts":
        for part, chapters in PARTS.items():
            print(f"{part}: {' '.join(f'{chapter}.py' for chapter in chapters)}")
        return 0
    # A shell without job control starts a background job (./dev test runs the chapters beside the
    # tests) with Ctrl-C ignored, and kernels would inherit that: chapter 20 interrupts its engine on
    # purpose. A Python handler is reset to the default in each kernel, an ignored signal is not.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if args.action in ("execute", "all"):
            languages = tuple(args.lang or LANGUAGES)
            execute([c.resolve() for c in args.chapters] or chapter_files(ROOT), args.out, languages)
        if args.action in ("site", "all"):
            build_sites(args.out)
    except ChapterError as error:
        print(f"book: error: {error}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as error:
        print(f"book: error: {' '.join(error.cmd)} failed with exit status {error.returncode}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
