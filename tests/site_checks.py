"""Checks on the built sites (run by `./dev test` after `python -m tools.book all`).

Not collected with the main suite (the file name does not start with test_): the sites must
exist first.
"""

from __future__ import annotations

import functools
import html as html_module
import http.server
import json
import re
import socketserver
import threading
import time
import unicodedata
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bs4 import BeautifulSoup, Comment, NavigableString

from tests.core.test_viz_browser import CHROMIUM, Browser, step_player_in_page
from tools import tangle
from tools.parts import TITLES

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
# A script that builds such a request itself: the address of a script, style or font in a string. mkdocs-jupyter's
# widget renderer came from unpkg on the pages whose outputs held ipywidgets (issue 33, part 3).
SCRIPTED_FETCH = re.compile(r"""["'](?:https?:)?//[^"'\s]+\.(?:m?js|css|woff2?|ttf|otf)(?:[?#][^"'\s]*)?["']""", re.I)
# mkdocs-material's bundle holds one (mermaid.js from unpkg), fetched only for a page with a mermaid diagram.
MATERIAL_BUNDLE = re.compile(r"bundle\.[0-9a-f]+\.min\.js")


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
               "zh": ("例子核对无误", "练习答案全部验证通过")}  # each site shows its own run (tools/book.py)
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
    """One table per part of the book (tools/parts.py), each under its part's title, together linking every chapter."""
    html = page(lang)
    tables = "".join(html[start : html.index("</table>", start)] for start in
                     (m.start() for m in re.finditer("<table>", html)))
    assert [c for c in CHAPTERS if f'href="chapters/{c}/"' not in tables] == []
    titles = [title for title in TITLES[lang].values() if title in html]
    assert titles == list(TITLES[lang].values()), titles


def test_landing_pages_and_glossary() -> None:
    assert "./dev run" in page("en") and "./dev run" in page("zh")
    for lang in PAGES:
        glossary = page(lang, "glossary")
        assert "prefix caching" in glossary and "前缀缓存" in glossary


def test_no_page_loads_anything_from_another_host() -> None:
    offenders = {}
    for path in SITE.rglob("*"):
        if path.suffix in {".html", ".css", ".js"}:
            text = path.read_text(encoding="utf-8", errors="replace")
            found = EXTERNAL_FETCH.findall(text)
            if not MATERIAL_BUNDLE.fullmatch(path.name):
                found += SCRIPTED_FETCH.findall(text)
            if path.suffix == ".html" and 'class="mermaid"' in text:
                found.append("a mermaid diagram: the theme would fetch mermaid.js from unpkg")
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


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    """One Chromium for the module's browser checks (starting one takes a second or two)."""
    assert CHROMIUM, "the site's browser checks need Chromium (./dev test installs Debian's chromium)"
    chromium = Browser(CHROMIUM)
    try:
        yield chromium
    finally:
        chromium.close()


@pytest.fixture()
def browser(chromium: Browser) -> Browser:
    """A new page in a browser context of its own: no test sees another's storage (the palette a test chose),
    cookies, cache or window size."""
    chromium.fresh_page()
    chromium.page("Emulation.setDeviceMetricsOverride", deviceScaleFactor=1, mobile=False, **WINDOW)
    return chromium


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


# A chapter's prose headings in order, each with the id of its twin in the other language (tools/mkdocs_hooks.py).
TWIN_HEADING = re.compile(r'<h[1-6] data-twin-(?P<lang>en|zh)="(?P<twin>[^"]*)" id="(?P<id>[^"]*)"')


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_each_chapter_heading_names_its_twin_in_the_other_language(chapter: str) -> None:
    """Issue 59, item 2: the heading ids of the two languages, mapped in order when the sites are built."""
    headings = {}
    for lang in PAGES:
        found = TWIN_HEADING.finditer(page(lang, "chapters", chapter))
        headings[lang] = [(urllib.parse.unquote(m["twin"]), m["id"]) for m in found]
    assert len(headings["en"]) >= 5, f"{chapter}: its headings name no twin"
    assert headings["zh"] == [(en, zh) for zh, en in headings["en"]]


def press(browser: Browser, selector: str) -> None:
    """A real click where the element is on screen, without scrolling the page (the reader's place must stay)."""
    x, y = browser.js(f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
                      " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
    for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
        browser.page("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)


# Where the heading with this id is, in the window: its top and bottom, and its place among the prose headings.
HEADING_JS = """(id => { const h = document.getElementById(id), r = h.getBoundingClientRect();
  return {top: r.top, bottom: r.bottom, text: h.textContent.replace('¶', '').trim(), height: window.innerHeight,
          header: document.querySelector('.md-header').getBoundingClientRect().bottom,
          place: [...document.querySelectorAll('[data-twin-en], [data-twin-zh]')].indexOf(h)}; })"""


@pytest.mark.parametrize(("size", "mobile"), [({"width": 1366, "height": 768}, False),
                                              ({"width": 390, "height": 844}, True)], ids=["1366px", "390px"])
def test_the_language_switch_keeps_the_section(browser: Browser, served: str, size: dict, mobile: bool) -> None:
    """Issue 59, item 2: the switch opened the other language's chapter at its top (9,000-37,000 px tall on a
    phone). Scrolled to a section, a reader who switches sees the same section's heading at the top of the window."""
    browser.page("Emulation.setDeviceMetricsOverride", deviceScaleFactor=1, mobile=mobile, **size)
    chapter = "chapters/02_block_manager/"
    browser.open(f"{served}/{chapter}")
    for lang, prefix, here, there in (("zh", "/zh/", "build-it-block-tables", "动手块表"),
                                      ("en", "/", "验证", "check-it")):
        before = browser.js(f"{HEADING_JS}({json.dumps(here)})")
        browser.js(f"window.scrollBy(0, {before['top'] - before['header'] - 40})")  # the section's first lines in view
        press(browser, ".md-header__option .md-select .md-header__button")
        link = f'.md-select__link[hreflang="{lang}"]'
        wait_for(browser, f"document.querySelector('{link}').getBoundingClientRect().height > 0")
        press(browser, link)
        assert wait_for(browser, f"location.pathname === '{prefix}{chapter}' && document.readyState === 'complete'")
        time.sleep(0.5)  # late layout (figures, players) must not move the section away
        assert browser.js("decodeURIComponent(location.hash)") == f"#{there}"
        after = browser.js(f"{HEADING_JS}({json.dumps(there)})")
        assert after["place"] == before["place"] >= 3, (before, after)
        assert after["header"] <= after["top"] and after["bottom"] <= after["height"] / 3, f"not in view: {after}"
    assert after["text"] == "Check it" and before["text"] == "验证"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_players_speak_only_the_language_of_their_site(browser: Browser, served: str, chapter: str) -> None:
    sources = {lang: page(lang, "chapters", chapter) for lang in PAGES}
    if not any("nvv" in source for source in sources.values()):
        # No player in either language's page (a player is static HTML, its class in the source): nothing to
        # open in the browser, which costs some 3 s a chapter.
        return
    texts = {}
    for lang, prefix in (("en", ""), ("zh", "zh/")):
        browser.open(f"{served}/{prefix}chapters/{chapter}/")
        texts[lang] = browser.js("[...document.querySelectorAll('.nvv')].map(p => p.textContent)")
    assert len(texts["en"]) == len(texts["zh"])
    cjk = [t for t in texts["en"] if browser.js(f"{CJK_JS}.test({json.dumps(t)})")]
    assert cjk == [], f"{chapter}: Chinese in an English player: {cjk[0][:200]!r}"
    for text in texts["zh"]:
        chinese = browser.js(f"{CJK_JS}.test({json.dumps(text)})")
        assert chinese, f"{chapter}: a player on the Chinese site shows no Chinese"
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
    engine = page(lang, "chapters", "10_engine")
    title = re.search(r"<title>([^<]*)</title>", engine)[1]
    assert "LLMEngine" in title and "LLMEngine" in re.sub(r"<[^>]+>", "", engine[engine.index("md-nav--primary"):])


# ---- reading without surprises (issue 23): Chinese as Chinese, one language, phones, paths, search, dark ----

CJK = "\u3000-\u303f\u4e00-\u9fff\uff00-\uffef"  # ideographs, CJK punctuation, fullwidth forms (as CJK_JS)
SPACE_BETWEEN_CJK = re.compile(f"[{CJK}]\\s+[{CJK}]")
PROSE = "p, li, td, th, h1, h2, h3, h4, h5, h6, dt, dd, summary, figcaption"
NOT_PROSE = {"pre", "code", "kbd", "script", "style", "svg"}
SITE_NAMES = {"en": "nano-vllm, literate edition", "zh": "nano-vllm 图解实现（文学编程版）"}


# What a page's text needs no parser for: scripts, styles, drawings, images. (Parsing whole pages, players
# included, would take seconds a page.)
HEAVY = re.compile(r"<(script|style|svg)\b.*?</\1>|data:image/[^\"')]+", re.S)
PRE = re.compile(r"<pre\b.*?</pre>", re.S)


def pages(lang: str) -> list[Path]:
    """Every content page of one site (the other site's folder, the 404 page and the redirects left out)."""
    found = sorted(PAGES[lang].rglob("index.html"))
    return [p for p in found if (lang == "zh" or "zh" not in p.relative_to(SITE).parts) and not redirect_of(p)]


def redirect_of(path: Path) -> str | None:
    """Where a redirect page (an old chapter's address, mkdocs.yml's redirect_maps) sends the reader; None for a
    page of content."""
    match = re.search(r'<meta http-equiv="refresh" content="0; url=([^"]+)">', path.read_text(encoding="utf-8"))
    return match[1] if match else None


@pytest.mark.parametrize("lang", PAGES)
def test_the_old_addresses_of_renumbered_chapters_lead_to_them(lang: str) -> None:
    """The chapters were renumbered into the book's three parts: a bookmark of an old address still works, in both
    languages, and lands on the chapter that took its place."""
    redirects = dict(re.findall(r"^ +(chapters/\w+\.md): (chapters/\w+\.ipynb)$",
                                (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), re.M))
    assert len(redirects) == 21
    for old, new in redirects.items():
        old_page = PAGES[lang] / old.removesuffix(".md") / "index.html"
        target = (old_page.parent / redirect_of(old_page)).resolve()
        assert target == (PAGES[lang] / new.removesuffix(".ipynb")).resolve(), (old, new)
        assert (target / "index.html").is_file() and not redirect_of(target / "index.html")


@functools.cache
def article(path: Path) -> str:
    """The page's article (its content, without the site's navigation), scripts and drawings left out."""
    html = path.read_text(encoding="utf-8")
    return HEAVY.sub("", html[html.index("<article") : html.index("</article>")])


def prose_text(element: Any) -> str:
    """An element's text as a reader sees it flow, with code (which keeps its spaces) as one opaque mark."""
    parts = []
    for child in element.children:
        if isinstance(child, NavigableString):
            parts.append("" if isinstance(child, Comment) else str(child))
        elif child.name in NOT_PROSE:
            parts.append("\ufffc")
        else:
            parts.append(prose_text(child))
    return "".join(parts)


def test_chinese_prose_has_no_space_between_chinese_characters() -> None:
    """A wrapped source line or a space typed after a bold label shows as "发生了 什么" (issue 23, item 5)."""
    found = []
    for path in pages("zh"):
        content = BeautifulSoup(PRE.sub("<pre></pre>", article(path)), "html.parser")  # code blocks are not prose
        for element in content.select(PROSE):
            if element.find(["p", "li", "table"]) is None:  # innermost blocks only: nothing counted twice
                found += [(path.parent.name, m) for m in SPACE_BETWEEN_CJK.findall(prose_text(element))]
    assert found == [], f"{len(found)} spaces between Chinese characters, e.g. {found[:8]}"


@pytest.mark.parametrize("lang", PAGES)
def test_the_navigation_speaks_one_language_and_names_the_site_once(lang: str) -> None:
    for path in (PAGES[lang] / "index.html", PAGES[lang] / "glossary" / "index.html",
                 PAGES[lang] / "chapters" / "04_scheduler" / "index.html"):
        html = path.read_text(encoding="utf-8")
        sidebar = html[html.index('<nav class="md-nav md-nav--primary') : html.index('<div class="md-content"')]
        nav = BeautifulSoup(sidebar, "html.parser").select_one("nav.md-nav--primary")
        entries = [e.get_text(" ", strip=True) for e in nav.select(".md-nav__link .md-ellipsis, .md-nav__title")]
        entries = [e for e in entries if e]
        assert entries.count(SITE_NAMES[lang]) == 1, f"{path}: the site's name in the navigation: {entries[:4]}"
        glossary = [e for e in entries if "Glossary" in e or "术语表" in e]
        assert glossary == ["术语表" if lang == "zh" else "Glossary"], glossary
        if lang == "en":
            assert [e for e in entries if re.search(f"[{CJK}]", e)] == []
        else:
            assert [e for e in entries if re.fullmatch(r"[A-Za-z ,.'-]+", e)] == []  # no English-only entry
    glossary_page = page(lang, "glossary")
    assert ("全书统一使用" in glossary_page) == (lang == "zh")
    assert ("The book uses these terms" in glossary_page) == (lang == "en")


# Absolute paths of a machine: a temporary folder, a home, a virtualenv's packages, a build folder.
MACHINE_PATH = re.compile(r"(?<![\w.~…/-])/(?:tmp|home|root|Users|usr|opt|var|work|__w|pytorch)/"
                          r"|(?<![\w.~…/-])/\S*?(?:site|dist)-packages/")


def test_no_page_shows_a_path_of_the_build_machine() -> None:
    """Temporary model folders, site-packages, torch's build folder (issue 23, item 9)."""
    found = {}
    for lang in PAGES:
        for path in pages(lang):
            text = html_module.unescape(re.sub(r"<[^>]+>", "", article(path)))
            paths = [text[max(0, m.start() - 20):m.end() + 30] for m in MACHINE_PATH.finditer(text)]
            paths += [str(ROOT)] * text.count(str(ROOT))
            if paths:
                found[str(path.relative_to(SITE))] = paths[:3]
    assert found == {}


@pytest.mark.parametrize("lang", PAGES)
def test_every_chapter_ends_with_links_to_the_previous_and_next_chapters(lang: str) -> None:
    """Issue 23, item 11: Material's navigation footer."""
    for k, chapter in enumerate(CHAPTERS):
        html = page(lang, "chapters", chapter)
        footer = html[html.find('<footer class="md-footer">') :]
        found = re.findall(r'<a href="([^"]*)" class="md-footer__link md-footer__link--(prev|next)"', footer)
        links = {direction: href for href, direction in found}
        assert links.get("prev") == (f"../{CHAPTERS[k - 1]}/" if k > 0 else "../../glossary/"), (chapter, links)
        if k + 1 < len(CHAPTERS):
            assert links.get("next") == f"../{CHAPTERS[k + 1]}/", (chapter, links)


@pytest.mark.parametrize("lang", PAGES)
def test_the_search_index_holds_prose_not_directives_or_buttons(lang: str) -> None:
    """Issue 23, item 12: no "#| export" code, no "Copied!", and Chinese segmented into words."""
    index = json.loads((PAGES[lang] / "search" / "search_index.json").read_text(encoding="utf-8"))
    texts = [doc["text"] for doc in index["docs"]]
    assert [t[:80] for t in texts if "Copied!" in t] == []
    assert [b[:80] for t in texts for b in re.findall(r"<pre>.*?</pre>", t, re.S) if "#|" in b] == []
    assert "\u200b" in "".join(doc["title"] for doc in index["docs"] if "05" in doc["location"]) or lang == "en"


# ---- in a real browser --------------------------------------------------------------------------------

PHONE = {"width": 390, "height": 844}
# Each printed output: its height as shown, and its height with its lines forced unwrapped (equal: no wrapping).
WRAPPED_OUTPUTS_JS = """[...document.querySelectorAll('.jp-OutputArea-output pre')].map(p => {
  const shown = p.getBoundingClientRect().height, was = p.style.whiteSpace;
  p.style.whiteSpace = 'pre'; const unwrapped = p.getBoundingClientRect().height; p.style.whiteSpace = was;
  return {shown, unwrapped, text: p.textContent.slice(0, 60)}; }).filter(o => o.shown > o.unwrapped + 1)"""
PAGE_WIDTH_JS = "[document.documentElement.scrollWidth, window.innerWidth]"
# The rendered height of a player's labels (11 px text: about 13 px tall when the drawing is not shrunk).
PLAYER_LABELS_JS = """(() => { const p = document.querySelector('.nvv[id]'); p.scrollIntoView();
  const labels = [...p.querySelectorAll('.nvv-frame:not([hidden]) .nvv-svg text')];
  return {smallest: Math.min(...labels.map(t => t.getBoundingClientRect().height)),
          width: p.querySelector('.nvv-frame:not([hidden]) .nvv-svg').getBoundingClientRect().width,
          scrolls: p.scrollWidth > p.clientWidth}; })()"""


def window(browser: Browser, size: dict, mobile: bool) -> None:
    browser.page("Emulation.setDeviceMetricsOverride", deviceScaleFactor=1, mobile=mobile, **size)


@pytest.mark.parametrize("lang", PAGES)
def test_outputs_keep_their_lines_and_players_stay_legible_on_a_phone(browser: Browser, served: str,
                                                                      lang: str) -> None:
    """Issue 23, items 8 and 9: outputs scroll instead of wrapping, at 1280 px (long lines broke mid-word:
    "max_num_" / "_batched_tokens" in chapter 09's Config) and at 390 px (traces wrapped into columns);
    on a phone the player keeps its size (its labels were 5-7 px tall) and scrolls."""
    prefix = "" if lang == "en" else "zh/"
    for size, mobile, chapters in ((WINDOW, False, ("09_model_runner", "10_engine")),
                                   (PHONE, True, ("02_block_manager", "04_scheduler"))):
        window(browser, size, mobile)
        for chapter in chapters:
            browser.open(f"{served}/{prefix}chapters/{chapter}/")
            assert browser.js(WRAPPED_OUTPUTS_JS) == [], f"{chapter}: outputs wrap at {size['width']} px"
            width, room = browser.js(PAGE_WIDTH_JS)
            assert width <= room, f"{chapter}: the page is {width} px wide in a {room}-pixel window"
            if mobile:
                labels = browser.js(PLAYER_LABELS_JS)
                assert labels["smallest"] >= 9, f"{chapter}: the player's labels are {labels['smallest']:.1f} px tall"
                assert labels["scrolls"], "a player wider than a phone scrolls sideways"
    browser.screenshot(ROOT / "build" / f"site-phone-04-{lang}.png")


def resources_that_failed(browser: Browser) -> list:
    """Every request of the page that got a 4xx or 5xx, once the page's own requests have settled."""
    expression = ("performance.getEntriesByType('navigation').concat(performance.getEntriesByType('resource'))"
                  ".map(e => [e.name, e.responseStatus])")
    seen, stable_since = None, time.monotonic()
    while time.monotonic() - stable_since < 0.5:  # Material fetches after load; wait until nothing new comes
        time.sleep(0.1)
        now = browser.js(expression)
        if now != seen:
            seen, stable_since = now, time.monotonic()
    return [(url, status) for url, status in seen if status >= 400]


@pytest.mark.parametrize("site", [SITE, SITE / "zh"], ids=["en", "zh"])
def test_no_empty_sitemap_is_shipped(site: Path) -> None:
    """Issue 33, part 3: without a site_url, mkdocs wrote a sitemap.xml that listed no page."""
    assert (site / "index.html").is_file()
    assert not (site / "sitemap.xml").exists() and not (site / "sitemap.xml.gz").exists()


def test_pages_make_no_failing_requests(browser: Browser, served: str) -> None:
    """Issue 23, item 10: the language switcher's script fetched <page>/sitemap.xml twice per page (404)."""
    for path in ("", "chapters/04_scheduler/", "zh/chapters/04_scheduler/"):
        browser.open(f"{served}/{path}")
        assert resources_that_failed(browser) == [], path


SEARCH_JS = """(() => { const input = document.querySelector('.md-search__input');
  input.focus(); input.value = %s; input.dispatchEvent(new Event('input', {bubbles: true})); })()"""
RESULTS_JS = "[...document.querySelectorAll('.md-search-result__item > a')].map(a => a.getAttribute('href'))"


@pytest.mark.parametrize(("lang", "query"), [("zh", "写时复制"), ("en", "copy-on-write")])
def test_a_search_finds_the_chapter_whose_title_it_is_first(browser: Browser, served: str, lang: str,
                                                            query: str) -> None:
    """Issue 23, item 12: in Chinese, chapter 11's code outranked chapter 05's title."""
    browser.open(f"{served}/{'zh/' if lang == 'zh' else ''}")
    wait_for(browser, "document.querySelector('.md-search__input') !== null")
    deadline = time.monotonic() + 20
    results: list = []
    while not results and time.monotonic() < deadline:  # the index loads in a worker after the page
        browser.js(SEARCH_JS % json.dumps(query))
        time.sleep(0.3)
        results = browser.js(RESULTS_JS)
    assert results, f"no result for {query!r}"
    assert "chapters/05_parallel_sampling/" in results[0], results[:3]


# The pages a search lists, in order: each one's address and its "missing: ..." line (empty when every word matched).
RESULT_PAGES_JS = """[...document.querySelectorAll('.md-search-result__item')].map(item => [
  item.querySelector('a').getAttribute('href').replace(/^.*?\\/(chapters\\/[^/]+\\/|glossary\\/).*$/, '$1'),
  [...item.querySelectorAll('.md-search-result__terms')].map(t => t.textContent).join(' ')])"""
FIRST_RESULTS = 3


@pytest.mark.parametrize(("lang", "query", "chapter"), [
    ("zh", "引用计数", "02_block_manager"), ("zh", "前缀缓存", "03_prefix_caching"),
    ("zh", "写时复制", "05_parallel_sampling"), ("zh", "抢占", "04_scheduler"),
    ("en", "reference count", "02_block_manager"),
])
def test_a_search_for_a_term_finds_the_chapter_that_introduces_it(browser: Browser, served: str, lang: str, query: str,
                                                                  chapter: str) -> None:
    """Issue 59, item 5: 引用计数 listed 37 pages, chapter 02 (which introduces it) not among them, each "缺少: 引用"
    (Material's search cut it into 引用 and 计, and 计 matched 计时器 and 计算 in headings); "reference count" listed
    chapter 02 after the first 10, under pages whose headings hold "reference" or "count". Typed into the search
    box, as a reader does: the chapter comes among the first results (the English one first), every word found."""
    browser.open(f"{served}/{'zh/' if lang == 'zh' else ''}")
    wait_for(browser, "document.querySelector('.md-search__input') !== null")
    deadline = time.monotonic() + 20
    results: list = []
    while not results and time.monotonic() < deadline:  # the index loads in a worker after the page
        browser.js(SEARCH_JS % json.dumps(query))
        time.sleep(0.3)
        results = browser.js(RESULT_PAGES_JS)
    first = [address for address, _ in results[:FIRST_RESULTS if lang == "zh" else 1]]
    assert f"chapters/{chapter}/" in first, f"{query!r}: {results[:5]}"
    missing = dict(results)[f"chapters/{chapter}/"]
    assert missing == "", f"{query!r}: {missing}"
    if query == "引用计数":  # the chapter that forks sequences and shares their blocks uses it as much
        assert "chapters/05_parallel_sampling/" in [address for address, _ in results[:5]], results[:5]


# WCAG's contrast ratio of each text's color against what is behind it (the nearest opaque background):
# the page's texts (outputs, code, tables, the players' HTML), the players' SVG labels, and the luminance
# behind each figure.
CONTRAST_JS = """(() => {
  const rgba = c => { const v = (c.match(/[\\d.]+/g) || []).map(Number); return v.length < 3 ? null
      : {r: v[0], g: v[1], b: v[2], a: v.length > 3 ? v[3] : 1}; };
  const lum = c => { const f = x => { x /= 255; return x <= 0.03928 ? x / 12.92 : ((x + 0.055) / 1.055) ** 2.4; };
      return 0.2126 * f(c.r) + 0.7152 * f(c.g) + 0.0722 * f(c.b); };
  const behind = el => { for (let e = el; e; e = e.parentElement) { const c = rgba(getComputedStyle(e).backgroundColor);
      if (c && c.a > 0.5) return c; } return rgba(getComputedStyle(document.body).backgroundColor); };
  const over = (fg, bg) => ({r: fg.r * fg.a + bg.r * (1 - fg.a), g: fg.g * fg.a + bg.g * (1 - fg.a),
      b: fg.b * fg.a + bg.b * (1 - fg.a)});
  const ratio = (a, b) => { const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p); return (x + 0.05) / (y + 0.05); };
  const contrast = (e, color, bg) => [String(e.getAttribute('class') || e.tagName), e.textContent.trim().slice(0, 30),
      ratio(over(rgba(color), bg), bg)];
  const texts = [...document.querySelectorAll('.jp-OutputArea-output pre, .nvv *, .md-typeset table th,'
      + ' .md-typeset table td, .highlight-ipynb pre, .highlight-ipynb pre span')]
      .filter(e => !(e instanceof SVGElement) && [...e.childNodes].some(n => n.nodeType === 3 && n.textContent.trim()));
  return {
    html: texts.map(e => contrast(e, getComputedStyle(e).color, behind(e))),
    svg: [...document.querySelectorAll('.nvv-svg text')].map(t => contrast(t, getComputedStyle(t).fill, behind(t))),
    figures: [...document.querySelectorAll('.jp-OutputArea-output img')].map(i => [i.alt.slice(0, 30), lum(behind(i))]),
  }; })()"""
LEGIBLE = 3.0  # WCAG's minimum contrast for large text and for the parts of a drawing


@pytest.mark.parametrize("lang", PAGES)
def test_a_dark_palette_keeps_the_book_legible(browser: Browser, served: str, lang: str) -> None:
    """Issue 23, item 13: Material's palette toggle, and the book's own colors readable in both schemes.

    Text of the page at WCAG's 3:1 at least; figures (dark labels drawn on a transparent background)
    on a light background; the players' labels no less legible in the dark than in the light.
    """
    prefix = "" if lang == "en" else "zh/"
    for chapter in ("01_sequence", "02_block_manager"):
        browser.open(f"{served}/{prefix}chapters/{chapter}/")
        toggle = "form[data-md-component=palette] label:not([hidden])"
        assert browser.js(f"document.querySelector('{toggle}') !== null"), "no palette toggle"
        seen = {}
        for scheme in ("default", "slate"):
            if browser.js("document.body.getAttribute('data-md-color-scheme')") != scheme:
                browser.click(toggle)
                assert wait_for(browser, f"document.body.getAttribute('data-md-color-scheme') === '{scheme}'")
            seen[scheme] = browser.js(CONTRAST_JS)
            assert len(seen[scheme]["html"]) > 100
            assert [t for t in seen[scheme]["html"] if t[2] < LEGIBLE] == [], f"{chapter} ({scheme})"
            assert [f for f in seen[scheme]["figures"] if f[1] < 0.8] == [], f"{chapter} ({scheme}): a dark figure"
        worse = [(light, dark[2]) for light, dark in zip(seen["default"]["svg"], seen["slate"]["svg"], strict=True)
                 if dark[2] < min(light[2], LEGIBLE) - 0.01]
        assert worse == [], f"{chapter}: player labels less legible in the dark"
    browser.screenshot(ROOT / "build" / f"site-dark-02-{lang}.png")


# ---- formulas and figures (issue 59, items 1 and 3) -----------------------------------------------------------

# TeX that a reader would see as text: display dollars, or a command of the book's formulas.
TEX_AS_TEXT = re.compile(r"\$\$|\\(?:frac|alpha|dots|sum|sqrt|cdot)\b")


@pytest.mark.parametrize("lang", PAGES)
def test_formulas_show_as_math_not_as_tex(lang: str) -> None:
    """Chapter 25's $$E = 1 + \\alpha + … = \\frac{…}$$ showed as TeX on both sites: no page's prose (code aside)
    may show TeX, and the formula is MathML, which the browser draws itself."""
    found = {}
    for path in pages(lang):
        content = BeautifulSoup(PRE.sub("<pre></pre>", article(path)), "html.parser")
        for code in content.select("code"):
            code.decompose()
        text = content.get_text()
        shown = [text[max(0, m.start() - 30):m.end() + 30] for m in TEX_AS_TEXT.finditer(text)]
        if shown:
            found[str(path.relative_to(SITE))] = shown[:3]
    assert found == {}
    formula = BeautifulSoup(page(lang, "chapters", "25_speculative_decoding"), "html.parser").select_one(
        'math[display="block"]')
    assert formula is not None and formula.select_one("mfrac") is not None


# Each figure (an <img> output) as drawn: its scale (shown width over natural width), its smallest text at natural
# size (read from an inline copy of the SVG, in CSS px; null for a PNG, whose text cannot be read), and its box.
FIGURES_JS = """[...document.querySelectorAll('.jp-OutputArea-output img')].map(img => {
  const shown = img.getBoundingClientRect().width, box = img.closest('.jp-OutputArea-output');
  let smallest = null;
  if (img.src.startsWith('data:image/svg+xml;base64,')) {
    const bytes = Uint8Array.from(atob(img.src.split(',')[1]), c => c.charCodeAt(0));
    const copy = document.createElement('div');  // an <img> shows its SVG as a document of its own: 16 px default
    copy.style.cssText = 'position:absolute;left:0;top:0;visibility:hidden;font-size:16px';
    copy.innerHTML = new TextDecoder().decode(bytes);
    document.body.append(copy);
    smallest = Math.min(...[...copy.querySelectorAll('text')].map(t => {  // rotated labels too: the matrix's scale
      const m = t.getScreenCTM(); return parseFloat(getComputedStyle(t).fontSize) * Math.hypot(m.a, m.b); }));
    copy.remove();
  }
  return {alt: img.alt.slice(0, 50), scale: shown / img.naturalWidth, smallest: smallest,
          wider: shown > box.clientWidth + 1, overflow: getComputedStyle(box).overflowX};
})"""
SMALLEST_TEXT_PX = 9


@pytest.mark.parametrize("lang", PAGES)
def test_figures_keep_their_text_legible_on_a_phone(browser: Browser, served: str, lang: str) -> None:
    """Issue 59, item 3: figures shrank to a phone's column (318 px from 660-1154), their labels 4-5 px. At 390 px
    (and at 1280) every figure's text is at least 9 px on screen; a figure wider than its column scrolls sideways
    in its own box, and the page itself does not."""
    prefix = "" if lang == "en" else "zh/"
    chapters = [c for c in CHAPTERS if re.search(r'<img\b[^>]*src="data:image/', page(lang, "chapters", c))]
    assert len(chapters) >= 5, chapters
    for size, mobile in ((PHONE, True), (WINDOW, False)):
        window(browser, size, mobile)
        scrolled = 0
        for chapter in chapters:
            browser.open(f"{served}/{prefix}chapters/{chapter}/")
            for figure in browser.js(FIGURES_JS):
                where = f"{chapter} at {size['width']} px: {figure}"
                if figure["smallest"] is None:  # a PNG: it keeps its natural size
                    assert figure["scale"] > 0.999, where
                else:
                    assert figure["smallest"] * figure["scale"] >= SMALLEST_TEXT_PX - 0.01, where
                if figure["wider"]:
                    assert figure["overflow"] in ("auto", "scroll"), where
                    scrolled += 1
            width, room = browser.js(PAGE_WIDTH_JS)
            assert width <= room, f"{chapter}: the page is {width} px wide in a {room}-pixel window"
        if mobile:
            assert scrolled >= 5, "the phone's column holds no wide figure: the check measured nothing"
    browser.screenshot(ROOT / "build" / f"site-figure-16-{lang}.png")


@pytest.mark.parametrize("lang", PAGES)
def test_the_formula_is_drawn_on_a_phone(browser: Browser, served: str, lang: str) -> None:
    """The MathML formula is laid out as math (the fraction's numerator above its denominator) and fits a phone."""
    window(browser, PHONE, True)
    prefix = "" if lang == "en" else "zh/"
    browser.open(f"{served}/{prefix}chapters/25_speculative_decoding/")
    drawn = browser.js("""(() => { const f = document.querySelector('math[display="block"] mfrac');
      if (!f) return null;
      f.scrollIntoView({block: 'center'});
      const [top, bottom] = [...f.children].map(c => c.getBoundingClientRect());
      return {stacked: top.bottom <= bottom.top + 1, height: f.getBoundingClientRect().height}; })()""")
    assert drawn is not None, "no MathML fraction on the page"
    assert drawn["stacked"] and drawn["height"] > 20, drawn
    width, room = browser.js(PAGE_WIDTH_JS)
    assert width <= room
    browser.screenshot(ROOT / "build" / f"site-formula-25-{lang}.png")
