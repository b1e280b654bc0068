"""No chapter's exported code may import what a later chapter creates (issue 37, item 1).

``tools.forward_imports`` computes them over every chapter's exported cells. A chapter builds what it uses, or a
first version that a later chapter extends (a seam it fills, a method it adds); none imports ahead.
"""

from pathlib import Path

from tools.forward_imports import ForwardImport, forward_imports

ROOT = Path(__file__).resolve().parents[2]


def test_no_chapter_imports_what_a_later_chapter_creates():
    found = forward_imports(ROOT)
    assert found == [], "forward imports: " + "; ".join(
        f"{item.chapter} imports {item.module}, which {item.creator} creates" for item in found)


def test_a_planted_forward_import_is_found(tmp_path):
    """The check itself: a chapter whose exported cell imports a module that only a later chapter creates."""
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "01_first.py").write_text(
        '# %% uses\n#| export first\nfrom nanovllm.second import thing\n\nTHING = thing\n')
    (tmp_path / "notebooks" / "02_second.py").write_text('# %% makes\n#| export second\nthing = 1\n')
    assert forward_imports(tmp_path) == [ForwardImport("01_first", "second", "02_second")]
