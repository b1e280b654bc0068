"""Checks on the built sites (run by `./dev test` after `python -m tools.book all`).

Not collected with the main suite (the file name does not start with test_): the sites must
exist first.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_viz_browser import CHROMIUM, step_player_in_page
from tools import tangle

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "build" / "site"
CHAPTERS = [p.stem for p in tangle.chapter_files(ROOT)]
PAGES = {"en": SITE, "zh": SITE / "zh"}
# Anything a browser would fetch from another host when the page is viewed.
EXTERNAL_FETCH = re.compile(
    r"""<script[^>]+src=["']?(?:https?:)?//|<link[^>]+href=["']?(?:https?:)?//[^>]*>|"""
    r"""url\(\s*["']?(?:https?:)?//|@import\s+["']?(?:https?:)?//|import\(\s*["'](?:https?:)?//""",
    re.I,
)


def page(lang: str, *parts: str) -> str:
    path = PAGES[lang].joinpath(*parts, "index.html")
    assert path.exists(), f"{path} was not built"
    return path.read_text(encoding="utf-8")


def test_site_was_built() -> None:
    assert (SITE / "index.html").exists() and (SITE / "zh" / "index.html").exists()


@pytest.mark.parametrize("lang", PAGES)
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_chapter_page_exists_in_both_languages(lang: str, chapter: str) -> None:
    assert "jupyter-wrapper" in page(lang, "chapters", chapter)


@pytest.mark.parametrize("lang", PAGES)
def test_chapter_01_shows_executed_outputs_and_the_state_machine(lang: str) -> None:
    html = page(lang, "chapters", "01_sequence")
    assert "the worked example holds" in html and "all exercise answers check out" in html
    assert "<svg" in html and "WAITING" in html and "preempt" in html  # the drawing is an output
    assert "def state_machine_svg" not in html  # its code cell is #| hide


def test_each_language_shows_its_own_prose_and_comments() -> None:
    en, zh = page("en", "chapters", "01_sequence"), page("zh", "chapters", "01_sequence")
    assert "A request's life" in en and "一个请求的一生" not in en
    assert "一个请求的一生" in zh and "A request's life" not in zh
    assert "bool 是 int 的子类" in zh and "bool 是 int 的子类" not in en
    assert "is a subclass of int" in en and "is a subclass of int" not in zh
    assert "# en:" not in en + zh and "# zh:" not in en + zh


def test_language_switcher_links_both_sites() -> None:
    for lang in PAGES:
        html = page(lang)
        assert 'hreflang="en"' in html and 'hreflang="zh"' in html
    assert 'lang="zh"' in page("zh") and 'lang="en"' in page("en")


@pytest.mark.parametrize("lang", PAGES)
def test_the_landing_page_table_links_every_chapter(lang: str) -> None:
    html = page(lang)
    table = html[html.index("<table>") : html.index("</table>")]  # one table: a blank line would split it
    assert [c for c in CHAPTERS if f'href="chapters/{c}/"' not in table] == []


def test_landing_pages_and_glossary() -> None:
    assert "./dev run" in page("en") and "./dev run" in page("zh")
    for lang in PAGES:
        glossary = page(lang, "glossary")
        assert "prefix caching" in glossary and "前缀缓存" in glossary


def test_no_page_loads_anything_from_another_host() -> None:
    offenders = {}
    for path in SITE.rglob("*"):
        if path.suffix in {".html", ".css", ".js"}:
            found = EXTERNAL_FETCH.findall(path.read_text(encoding="utf-8", errors="replace"))
            if found:
                offenders[str(path.relative_to(SITE))] = found[:3]
    assert offenders == {}


@pytest.mark.parametrize("lang", PAGES)
def test_the_chapter_02_player_steps_in_a_real_browser(lang: str) -> None:
    assert CHROMIUM, "the site's browser check needs Chromium (./dev test installs Debian's chromium)"
    url = (PAGES[lang] / "chapters" / "02_block_manager" / "index.html").as_uri()
    shot = ROOT / "build" / f"site-02-player-{lang}.png"
    _, before, after = step_player_in_page(url, shot)
    assert before["ready"] == "1", "the player's script did not run on the built page"
    assert after["frame"] == before["frame"] + 1 and after["caption"] != before["caption"]
    assert after["count"] != before["count"] and after["visible"] == 1
    assert shot.stat().st_size > 1000
