"""No chapter's exported code may import what a later chapter creates (issue 37, item 1).

``tools.forward_imports`` computes them over every chapter's exported cells. The ones below are the debt
left to pay, each with what paying it takes; the test fails on any other forward import, and on a listed
one that is gone (so that the list only shrinks and never hides a fixed one).
"""

from pathlib import Path

from tools.forward_imports import ForwardImport, forward_imports

ROOT = Path(__file__).resolve().parent.parent

KNOWN = {
    # The server's live page draws with appendix A's recorder and player.
    ForwardImport("15b_openai_server", "viz.player", "A_visualization"),
    ForwardImport("15b_openai_server", "viz.recorder", "A_visualization"),
}


def test_no_forward_import_beyond_the_known_debt():
    found = set(forward_imports(ROOT))
    assert not found - KNOWN, f"new forward imports: {sorted(found - KNOWN)}"
    assert not KNOWN - found, f"paid, so remove them from KNOWN: {sorted(KNOWN - found)}"


def test_a_planted_forward_import_is_found(tmp_path):
    """The check itself: a chapter whose exported cell imports a module that only a later chapter creates."""
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "01_first.py").write_text(
        '# %% uses\n#| export first\nfrom nanovllm.second import thing\n\nTHING = thing\n')
    (tmp_path / "notebooks" / "02_second.py").write_text('# %% makes\n#| export second\nthing = 1\n')
    assert forward_imports(tmp_path) == [ForwardImport("01_first", "second", "02_second")]
