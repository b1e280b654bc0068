"""Checks on the built sites (run by `./dev test` after `python -m tools.book all`).

Not collected with the main suite (the file name does not start with test_): the sites must
exist first.
"""

from __future__ import annotations

import functools
import http.server
import json
import re
import socketserver
import threading
import time
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_viz_browser import CHROMIUM, Browser, step_player_in_page
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
    printed = {"en": ("the worked example holds", "all exercise answers check out"),
               "zh": ("算例成立", "练习答案全部验证通过")}  # each site shows its own run (tools/book.py)
    assert all(text in html for text in printed[lang])
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


# ---- the site keeps the reader's place and speaks one language: in a real browser -------------------

WINDOW = {"width": 1280, "height": 900}
MAX_COLUMNS = 120  # the book's line length (ruff): code and traces up to this width must fit unwrapped
CJK_JS = r"/[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]/"
# A block's widest line: its natural width (unwrapped) against the room it has.
MEASURE_JS = """(p => { const room = p.clientWidth, was = [p.style.whiteSpace, p.style.width];
  p.style.whiteSpace = "pre"; p.style.width = "max-content";
  const r = {text: p.textContent, natural: p.getBoundingClientRect().width, room: room};
  [p.style.whiteSpace, p.style.width] = was; return r; })"""
BLOCKS = ".jp-OutputArea-output pre, .highlight-ipynb pre, .jp-MarkdownCell pre"  # outputs, code, prose code


def columns(line: str) -> int:
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """The built sites over HTTP on this machine, as a reader (or a static host) would see them."""
    handler = functools.partial(QuietHandler, directory=str(SITE))
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{server.server_address[1]}"
        server.shutdown()


@pytest.fixture()
def browser() -> Iterator[Browser]:
    assert CHROMIUM, "the site's browser checks need Chromium (./dev test installs Debian's chromium)"
    chromium = Browser(CHROMIUM)
    chromium.page("Emulation.setDeviceMetricsOverride", deviceScaleFactor=1, mobile=False, **WINDOW)
    try:
        yield chromium
    finally:
        chromium.close()


def wait_for(browser: Browser, expression: str, timeout_s: float = 15) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = browser.js(expression)
        except RuntimeError:  # the page is being replaced
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(expression)


def switch_language(browser: Browser, lang: str) -> None:
    """Open the language menu and click a language, with real mouse events."""
    browser.hover(".md-header__option .md-select .md-header__button")
    link = f'.md-select__link[hreflang="{lang}"]'
    wait_for(browser, f"document.querySelector('{link}').getBoundingClientRect().height > 0")
    browser.click(link)


def test_the_language_switcher_keeps_the_page(browser: Browser, served: str) -> None:
    chapter = "chapters/04_scheduler/"
    browser.open(f"{served}/{chapter}")
    switch_language(browser, "zh")
    assert wait_for(browser, f"location.pathname.replace(/\\/$/, '') === '/zh/{chapter[:-1]}'"
                             " && document.readyState === 'complete'")
    assert browser.js("document.documentElement.lang") == "zh" and "调度器" in browser.js("document.title")
    switch_language(browser, "en")
    assert wait_for(browser, f"location.pathname.replace(/\\/$/, '') === '/{chapter[:-1]}'"
                             " && document.readyState === 'complete'")
    assert browser.js("document.documentElement.lang") == "en" and "The scheduler" in browser.js("document.title")


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_players_speak_only_the_language_of_their_site(browser: Browser, served: str, chapter: str) -> None:
    texts = {}
    for lang, prefix in (("en", ""), ("zh", "zh/")):
        browser.open(f"{served}/{prefix}chapters/{chapter}/")
        texts[lang] = browser.js("[...document.querySelectorAll('.nvv')].map(p => p.textContent)")
    assert len(texts["en"]) == len(texts["zh"])
    cjk = [t for t in texts["en"] if browser.js(f"{CJK_JS}.test({json.dumps(t)})")]
    assert cjk == [], f"{chapter}: Chinese in an English player: {cjk[0][:200]!r}"
    for text in texts["zh"]:
        assert "块池" in text or "实时面板" in text, f"{chapter}: a player on the Chinese site shows no Chinese"
        assert "block pool" not in text and "Back" not in text


def test_the_chinese_player_shows_chinese_on_screen(browser: Browser, served: str) -> None:
    browser.open(f"{served}/zh/chapters/02_block_manager/")
    seen = browser.js("(() => { const p = document.querySelector('.nvv[id]'); p.scrollIntoView();"
                      " return p.innerText; })()")
    for chinese in ("后退", "播放", "单步", "块池", "空闲队列"):
        assert chinese in seen, chinese


@pytest.mark.parametrize("lang", PAGES)
@pytest.mark.parametrize("chapter", ["02_block_manager", "04_scheduler"])
def test_traces_and_code_fit_a_1280_pixel_window(browser: Browser, served: str, lang: str, chapter: str) -> None:
    prefix = "" if lang == "en" else "zh/"
    browser.open(f"{served}/{prefix}chapters/{chapter}/")
    blocks = browser.js(f"[...document.querySelectorAll({json.dumps(BLOCKS)})].map({MEASURE_JS})")
    narrow = [b for b in blocks if max(map(columns, b["text"].splitlines() or [""])) <= MAX_COLUMNS]
    widest = max(narrow, key=lambda b: b["natural"])
    assert max(map(columns, widest["text"].splitlines())) > 100, "the chapter's widest trace was not measured"
    too_wide = [(b["natural"], b["room"], b["text"][:60]) for b in narrow if b["natural"] > b["room"]]
    assert too_wide == [], f"{chapter} ({lang}): blocks that wrap or scroll at 1280 px: {too_wide}"
    # Not only today's traces: a full 120-column line fits an output block and a code cell.
    for selector in (".jp-OutputArea-output pre", ".highlight-ipynb pre"):
        probe = browser.js(f"(() => {{ const p = document.querySelector({json.dumps(selector)});"
                           f" p.textContent = 'm'.repeat({MAX_COLUMNS}); return {MEASURE_JS}(p); }})()")
        assert probe["natural"] <= probe["room"], f"{selector}: {MAX_COLUMNS} columns need {probe}"


@pytest.mark.parametrize("lang", PAGES)
def test_answers_are_folded(browser: Browser, served: str, lang: str) -> None:
    prefix = "" if lang == "en" else "zh/"
    browser.open(f"{served}/{prefix}chapters/04_scheduler/")
    folded = browser.js("[...document.querySelectorAll('details.answers')].map(d => ({open: d.open,"
                        " summary: d.querySelector('summary').innerText, cells: d.querySelectorAll('.jp-Cell').length,"
                        " shown: d.querySelector('.jp-Cell').checkVisibility()}))")
    assert len(folded) == 1 and folded[0]["cells"] >= 1
    assert folded[0]["open"] is False and folded[0]["shown"] is False
    assert ("答案" in folded[0]["summary"]) == (lang == "zh")
    browser.click("details.answers > summary")
    assert browser.js("document.querySelector('details.answers .jp-Cell').checkVisibility()") is True


@pytest.mark.parametrize("lang", PAGES)
def test_screenshot_of_chapter_04(browser: Browser, served: str, lang: str) -> None:
    """The step table (chapter 04's widest trace) in a 1280-pixel window, kept under build/ to look at."""
    prefix = "" if lang == "en" else "zh/"
    browser.open(f"{served}/{prefix}chapters/04_scheduler/")
    browser.js("[...document.querySelectorAll('.jp-OutputArea-output pre')]"
               ".find(p => p.textContent.includes('A:12+2 B:4+2')).scrollIntoView({block: 'center'})")
    time.sleep(0.6)  # the header's title fades in after a scroll
    shot = ROOT / "build" / f"site-04-{lang}.png"
    browser.screenshot(shot)
    assert shot.stat().st_size > 10_000
    browser.click(".nvv[id] [data-act=step]")  # the first player, one step in
    time.sleep(0.6)
    player = ROOT / "build" / f"site-04-player-{lang}.png"
    browser.screenshot(player)
    assert player.stat().st_size > 10_000


@pytest.mark.parametrize("lang", PAGES)
def test_figures_have_alt_text_in_the_page_language(lang: str) -> None:
    alts = {chapter: re.findall(r'<img\b[^>]*\balt="([^"]*)"', page(lang, "chapters", chapter)) for chapter in CHAPTERS}
    assert [(c, a) for c, found in alts.items() for a in found if not a or "No description" in a] == []
    state_machine = alts["01_sequence"][0]
    assert ("WAITING becomes RUNNING" in state_machine) == (lang == "en")
    assert ("被调度" in state_machine) == (lang == "zh")


@pytest.mark.parametrize("lang", PAGES)
def test_titles_navigation_and_contents_keep_their_code_and_their_anchors(lang: str) -> None:
    for chapter in CHAPTERS:
        html = page(lang, "chapters", chapter)
        title = re.search(r"<title>([^<]*)</title>", html)[1]
        assert not re.search(r"[:：]\s*[,、]|,\s*,|、、", title), f"{chapter}: a code span fell out of {title!r}"
        ids = set(re.findall(r'\bid="([^"]+)"', html))
        targets = re.findall(r'<a href="#([^"]*)" class="md-nav__link">', html)
        assert targets and all(t and t in ids for t in targets), f"{chapter}: contents links without a target"
    engine = page(lang, "chapters", "11_engine")
    title = re.search(r"<title>([^<]*)</title>", engine)[1]
    assert "LLMEngine" in title and "LLMEngine" in re.sub(r"<[^>]+>", "", engine[engine.index("md-nav--primary"):])
