"""GPU figures are recorded, not typed: a chapter quotes a GPU's figure only from a run it loads from
notebooks/data/recorded/ (card, date, command) or from a cell that asserts it (appendix D, `nanovllm.book.recorded`)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from nanovllm.book.recorded import RECORDED, recorded
from tools.tangle import chapter_files, read_chapter

ROOT = Path(__file__).resolve().parents[2]
# A paragraph that names one of these cards quotes a GPU's figures.
CARD = re.compile(r"\bH[12]00\b")
# A figure: a number with the unit of a measurement (sizes such as "80 GB" describe a card, not a run).
FIGURE = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?\s?(ms|µs|us|tok/s|TB/s|GB/s|×|%)(?!\w)")


def cells(chapter: Path, kind: str) -> list[str]:
    """The sources of ``chapter``'s cells of ``kind`` ("code", or "markdown": the English prose)."""
    notebook = read_chapter(chapter)
    return [cell.source for cell in notebook.cells if cell.cell_type == kind
            and (kind == "code" or "en" in cell.metadata.get("tags", []))]


def prose_paragraphs(chapter: Path) -> Iterator[str]:
    """The English prose of ``chapter``, paragraph by paragraph (a list item is a paragraph of its own)."""
    for source in cells(chapter, "markdown"):
        paragraph: list[str] = []
        for line in [*source.splitlines(), ""]:
            starts_item = line.lstrip().startswith(("- ", "| ")) or re.match(r"\s*\d+\. ", line)
            if not line.strip() or starts_item:
                if paragraph:
                    yield " ".join(paragraph)
                paragraph = [line.strip()] if line.strip() else []
            else:
                paragraph.append(line.strip())


def quoted_figures(chapter: Path) -> list[tuple[float, int, str, str]]:
    """(value, decimals, unit, paragraph) of every figure that a paragraph naming a card quotes."""
    figures = []
    for paragraph in prose_paragraphs(chapter):
        if CARD.search(paragraph):
            for whole, fraction, unit in FIGURE.findall(paragraph):
                decimals = len(fraction) - 1 if fraction else 0
                figures.append((float(whole.replace(",", "") + fraction), decimals, unit, paragraph))
    return figures


def numbers(value: object) -> Iterator[float]:
    """Every number inside a JSON value."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield float(value)
    elif isinstance(value, dict):
        for item in value.values():
            yield from numbers(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from numbers(item)


def asserted_numbers(chapter: Path) -> set[float]:
    """The numbers written in the chapter's assert statements."""
    found = set()
    for source in cells(chapter, "code"):
        for line in source.splitlines():
            if line.lstrip().startswith("assert") or " assert " in line:
                found |= {float(n) for n in re.findall(r"(?<![\w.])\d+(?:\.\d+)?", line)}
    return found


def covered(value: float, decimals: int, unit: str, candidates: set[float]) -> bool:
    """Whether a prose figure shown with ``decimals`` decimals is one of ``candidates``, as rounded for the prose
    (a percentage may be stored as a share)."""
    def same(candidate: float) -> bool:
        return round(candidate, decimals) == value or abs(candidate - value) < 10 ** -decimals / 2
    return any(same(c) or (unit == "%" and same(100 * c)) for c in candidates)


CHAPTERS = [path for path in chapter_files(ROOT) if quoted_figures(path)]


def test_every_recorded_file_loads_with_a_card_a_date_and_a_command() -> None:
    files = sorted(RECORDED.glob("*.json"))
    assert files, "no recorded GPU runs"
    for path in files:
        runs = recorded(path.stem)
        assert runs, f"{path.name} records no run"
        for run in runs.values():
            assert "H100" in run.card or "H200" in run.card, f"{path.name}, {run.name}: a card is named by its model"
        assert (ROOT / "notebooks" / f"{path.stem}.py").exists(), f"{path.name} belongs to no chapter"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda path: path.stem)
def test_a_chapter_quotes_a_gpu_figure_only_from_its_recorded_runs_or_an_assert(chapter: Path) -> None:
    path = RECORDED / f"{chapter.stem}.json"
    assert path.exists(), f"{chapter.name} quotes GPU figures but records none in {path.relative_to(ROOT)}"
    code = "\n".join(cells(chapter, "code"))
    assert f'recorded("{chapter.stem}")' in code, f"{chapter.name} does not load its recorded runs"
    runs = json.loads(path.read_text(encoding="utf-8"))["runs"]
    candidates = {n for run in runs.values() for n in numbers(run["figures"])} | asserted_numbers(chapter)
    missing = [f"{value:g} {unit}: {paragraph[:100]}..." for value, decimals, unit, paragraph in quoted_figures(chapter)
               if not covered(value, decimals, unit, candidates)]
    assert not missing, f"{chapter.name}: GPU figures in the prose that no recorded run holds:\n" + "\n".join(missing)
    unused = [name for name in runs if name not in code]
    assert not unused, f"{chapter.name} records runs it never reads: {unused}"


def test_the_check_finds_a_typed_figure_and_accepts_a_recorded_one() -> None:
    quoted = [(value, decimals, unit) for value, decimals, unit, _ in [
        (float(w.replace(",", "") + f), len(f) - 1 if f else 0, u, "") for w, f, u in
        FIGURE.findall("On an H200 a step took 1.87 ms, 1,838.5 tok/s, 94 % of the bound, 2.35× the plain one.")]]
    assert quoted == [(1.87, 2, "ms"), (1838.5, 1, "tok/s"), (94.0, 0, "%"), (2.35, 2, "×")]
    assert covered(94.0, 0, "%", {0.9404}) and covered(1.87, 2, "ms", {1.8712}) and not covered(1.87, 2, "ms", {1.9})
