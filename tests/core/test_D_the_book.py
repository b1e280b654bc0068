"""Appendix D: the book's parts (tools/parts.py) and `python -m tools.book parts`."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from tools.parts import PARTS, TITLES, part_of, reading_position

ROOT = Path(__file__).resolve().parents[2]


def test_every_chapter_belongs_to_exactly_one_part() -> None:
    chapters = sorted(path.stem for path in (ROOT / "notebooks").glob("*.py"))
    listed = [chapter for part in PARTS.values() for chapter in part]
    assert sorted(listed) == chapters and len(set(listed)) == len(listed)
    assert {lang: set(titles) for lang, titles in TITLES.items()} == {lang: set(PARTS) for lang in TITLES}
    with pytest.raises(KeyError, match="belongs to no part"):
        part_of("99_nowhere")


def test_the_parts_keep_the_chapter_numbers_in_order() -> None:
    """Core is 00-10, speed and beyond continue the numbers; a lettered chapter (17b) continues the chapter of its
    number and comes right after it; the appendices of a part come at its end."""
    numbered = [c for part in ("core", "speed", "beyond") for c in PARTS[part] if c[:2].isdigit()]
    whole = [c for c in numbered if c[2] == "_"]
    assert [int(c[:2]) for c in whole] == list(range(len(whole)))
    for before, chapter in itertools.pairwise(numbered):
        assert chapter[2] == "_" or (chapter[2].isalpha() and before[:2] == chapter[:2]), chapter
    assert whole[:11][-1] == "10_engine" and PARTS["core"][-2:] == ("A_visualization", "D_the_book")
    order = sorted(listed := [c for part in PARTS.values() for c in part], key=reading_position)
    assert order == listed and reading_position("toy") > reading_position("B_from_nano_vllm")


def test_book_parts_prints_one_line_per_part() -> None:
    out = subprocess.run([sys.executable, "-m", "tools.book", "parts"], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.splitlines()
    assert [line.split(":")[0] for line in out] == list(PARTS)
    assert out[0].startswith("core: 00_tour.py 01_sequence.py 02_block_manager.py")
    assert "10_engine.py" in out[0] and "11_triton_attention.py" in out[1]
