"""mkdocs hooks: the site keeps the reader's place, shows whole titles, and loads nothing remote.

* The language switcher links each page to the same page in the other language (Material's
  own "stay on page" needs a ``site_url`` and a sitemap, and then only works on that host), and
  on a chapter to the section being read: each heading carries the id of its twin in the other
  language (``data-twin-zh``), which docs/assets/javascripts/sections.js adds to the link.
* mkdocs-jupyter takes titles and the table of contents from a markdown export that drops code
  spans ("The engine: , , the demo") and gives Chinese headings empty ids; both are rebuilt here
  from the rendered headings, which get unique, non-empty ids.
* Exercise answers (cells that tools/book.py tagged ``answers``) are folded in ``<details>``.
* Formulas ($$…$$ and $…$ in prose) become MathML when the site is built; the browser draws them, and
  nothing is loaded to do it (mkdocs-jupyter's MathJax configuration, which loaded nothing, is removed).
* A figure shrinks with the column only until its smallest text is 9 px on screen, then scrolls sideways
  in its output box (on a phone, figures shrank to a third of their size).
* Figures get alt text from their SVG ``<title>`` (or their labels) instead of nbconvert's
  "No description has been provided for this image".
* The chapters are grouped by the book's parts (tools/parts.py: core, speed, beyond, appendices), each
  part a section of the navigation titled in the site's language; the order of the pages, and so
  the previous / next links, stay the reading order.
* The Guide's pages come in the order a user needs them (GUIDE_ORDER), not in their names' order.
* The "Chapters" section heading speaks the site's language, and the landing page's entry in the
  navigation is "Introduction" / "简介": under the site's title, which the navigation shows as
  its heading, the site's title again read as a doubled line.
* Code cells stay out of the search index: a search finds the prose that explains a thing, not
  ``#| export`` lines, code comments or the copy button's "Copied!" (titles outrank text in
  Material's index, so a chapter's title is the first hit for its subject). The terms a section
  sets in bold, where the book introduces them, go into the index as a field of their own
  (``defines``), which weighs as much as a title; the pages load Material's search worker through
  docs/assets/javascripts/workers/search_words.js, which cuts a Chinese query into whole words.
* Material's script fetches ``sitemap.xml`` next to every ``<link rel="alternate">`` of the
  page's head, to find the same page in the other language; those links point at the same page
  in the other language (not at its site's root), so the fetches went to ``<page>/sitemap.xml``
  and failed. The language menu's own links do that job, so the head's alternate links are dropped.
* mkdocs-jupyter's page template carries a module script that would import mermaid.js from a
  CDN if a notebook held a mermaid diagram; the book has none and loads nothing from the
  internet, so the script is removed.
* The site has no fixed address (readers build it and serve it wherever they like: no
  ``site_url``), so mkdocs' ``sitemap.xml`` would list no page at all; an empty sitemap is worse
  than none, so neither it nor its ``.gz`` is shipped.

HTML is edited with BeautifulSoup (nbconvert already parses and re-serializes every page with
it), except on the final page, where two regular expressions are enough.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import math
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

import nbformat
from bs4 import BeautifulSoup, Comment, NavigableString
from latex2mathml.converter import convert as convert_tex
from mkdocs.plugins import event_priority
from mkdocs.structure.nav import Section
from mkdocs.structure.toc import get_toc
from nbconvert.filters.markdown_mistune import markdown2html_mistune

if __package__ in (None, ""):  # mkdocs loads this file by its path: make `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.parts import TITLES, part_of

try:  # Material's search segments Chinese with jieba when it is installed; its log is noise in the build
    import jieba

    jieba.setLogLevel(logging.WARNING)
except ImportError:
    jieba = None

NOT_SCRIPT_END = r"(?:(?!</script>).)*"
CDN_MODULE_SCRIPT = re.compile(rf'<script type="module">{NOT_SCRIPT_END}https://cdnjs\.{NOT_SCRIPT_END}</script>', re.S)
ALTERNATE_TAG = re.compile(r'<a\b[^>]*\bhreflang="(?P<lang>[^"]+)"[^>]*>')
ALTERNATE_HEAD_LINK = re.compile(r'\s*<link rel="alternate" href="[^"]*" hreflang="[^"]*">')
HREF = re.compile(r'\bhref="[^"]*"')
NO_ALT = "No description has been provided for this image"
PROSE_HEADINGS = ", ".join(f".jp-MarkdownCell h{level}" for level in range(1, 7))
TOC_DEPTH = 3
WORDS = {
    "en": {"answers": "Answers (try the exercises first)", "figure": "Figure", "home": "Introduction"},
    "zh": {"answers": "答案（先自己做练习）", "figure": "图", "home": "简介", "Chapters": "章节", "Guide": "指南"},
}


def language(config: Any) -> str:
    return config["theme"]["language"]


def word(config: Any, key: str) -> str:
    return WORDS.get(language(config), WORDS["en"]).get(key, key)


# ---- titles, ids and the table of contents ------------------------------------------------------


def slug(text: str) -> str:
    """An anchor id that keeps letters of every script (Chinese headings included)."""
    return re.sub(r"[\s-]+", "-", re.sub(r"[^\w\s-]", "", text.lower())).strip("-") or "section"


def heading_text(heading: Any) -> str:
    return "".join(t for t in heading.find_all(string=True) if t.parent.name != "a" or t != "¶").strip()


def nest(flat: list[dict]) -> list[dict]:
    """Python-Markdown's nested toc tokens from a flat list of headings."""
    root: list[dict] = []
    stack: list[dict] = []
    for token in flat:
        while stack and stack[-1]["level"] >= token["level"]:
            stack.pop()
        (stack[-1]["children"] if stack else root).append(token)
        stack.append(token)
    return root


def fix_headings(soup: BeautifulSoup) -> list[dict]:
    """Give every prose heading a unique id; return them as flat toc tokens."""
    seen: dict[str, int] = {}
    tokens = []
    for heading in soup.select(PROSE_HEADINGS):
        text = heading_text(heading)
        base = slug(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchor = base if n == 0 else f"{base}_{n}"
        heading["id"] = anchor
        link = heading.find("a", class_="anchor-link")
        if link is not None:
            link["href"] = f"#{anchor}"
        tokens.append({"level": int(heading.name[1]), "id": anchor, "name": html.escape(text), "children": []})
    return tokens


# ---- answers and figures --------------------------------------------------------------------------


def fold_answers(soup: BeautifulSoup, summary: str) -> None:
    """Wrap each run of answer cells in one closed <details>."""
    for cell in soup.select("div.jp-Cell.celltag_answers"):
        if cell.find_parent("details") is not None:
            continue
        run = [cell]
        nxt = cell.find_next_sibling()
        while nxt is not None and "celltag_answers" in (nxt.get("class") or []):
            run.append(nxt)
            nxt = nxt.find_next_sibling()
        details = soup.new_tag("details", attrs={"class": "answers"})
        label = soup.new_tag("summary")
        label.string = summary
        details.append(label)
        cell.insert_before(details)
        for member in run:
            details.append(member.extract())


def figure_alt(svg: str, lang: str, figure: str) -> str:
    """The SVG's <title> in the page's language (or its first), else its labels."""
    titles = re.findall(r'<title(?:\s+lang="([^"]*)")?\s*>(.*?)</title>', svg, re.S)
    chosen = next((t for lang_, t in titles if lang_ == lang), titles[0][1] if titles else "")
    text = re.sub(r"<[^>]+>", "", chosen).strip()
    if not text:
        labels = dict.fromkeys(re.sub(r"<[^>]+>", "", t).strip() for t in re.findall(r"<text\b[^>]*>(.*?)</text>", svg))
        text = ", ".join(label for label in labels if label)[:200]
    return f"{figure}: {html.unescape(text)}" if text else figure


def describe_figures(soup: BeautifulSoup, lang: str, figure: str) -> None:
    prefix = "data:image/svg+xml;base64,"
    for img in soup.select("img"):
        if img.get("alt") not in (None, "", NO_ALT):
            continue
        src = img.get("src", "")
        svg = base64.b64decode(src[len(prefix):]).decode("utf-8", "replace") if src.startswith(prefix) else ""
        img["alt"] = figure_alt(svg, lang, figure)


# ---- math and figure sizes ------------------------------------------------------------------------

# TeX in prose, read as JupyterLab reads it: $$…$$ on its own, or $…$ with no space inside its dollars and
# no letter or digit outside them (so "$5 and $10" stays text).
TEX = re.compile(r"\$\$(?P<display>.+?)\$\$|(?<![\\$\w])\$(?P<inline>[^\s$](?:[^$\n]*?[^\s\\$])?)\$(?![\w$])", re.S)
# Text in a figure is drawn no smaller than this on screen: a wide figure shrinks with the column only so far,
# then keeps that width and scrolls sideways in its output box (issue 59: at 390 px, labels were 4-5 px).
LEGIBLE_PX = 9
PX = {"": 1.0, "px": 1.0, "pt": 4 / 3}  # CSS pixels per unit (sizes in em or % are not read)
SVG_ROOT = re.compile(r"<svg\b[^>]*>")
SVG_WIDTH = re.compile(r'\swidth\s*=\s*"([\d.]+)(px|pt)?"')
SVG_VIEWBOX_WIDTH = re.compile(r'\sviewBox\s*=\s*"\s*[-\d.]+[\s,]+[-\d.]+[\s,]+([\d.]+)')
FONT_SIZE = re.compile(r"font-size\s*[:=]\s*[\"']?\s*([\d.]+)(px|pt)?(?![\w.%])")


def render_math(soup: BeautifulSoup) -> None:
    """Prose TeX becomes MathML at build time, which browsers draw natively (Chromium since 109, Firefox, Safari).

    Chosen over vendoring a script renderer: KaTeX 0.19.1 is 273 kB of script, 25 kB of CSS and 20 font files
    (296 kB) to ship and load, and draws nothing without JavaScript, for the book's one formula (chapter 25);
    the converter (latex2mathml, pure Python, no dependencies) runs only when the site is built, and the page
    carries a few hundred bytes of MathML. The notebooks keep their TeX, which JupyterLab renders itself.
    mkdocs-jupyter's MathJax loader and configuration go: they loaded nothing (an empty address, no CDN).
    """
    for node in soup.find_all(string=re.compile(r"\$")):
        if type(node) is not NavigableString or node.find_parent(class_="jp-MarkdownCell") is None:
            continue
        if node.find_parent(["code", "pre", "script", "style", "math"]) is not None:
            continue
        pieces, at = [], 0
        for match in TEX.finditer(node):
            tex = match["display"] or match["inline"]
            display = "block" if match["display"] else "inline"
            pieces += [node[at:match.start()], BeautifulSoup(convert_tex(tex.strip(), display=display), "html.parser")]
            at = match.end()
        if pieces:
            node.replace_with(*[p for p in [*pieces, node[at:]] if p])
    for script in soup.select('script[type="text/x-mathjax-config"], script[src=""]'):
        script.decompose()
    for comment in soup.find_all(string=lambda s: isinstance(s, Comment) and "mathjax" in s.lower()):
        comment.extract()


def legible_width(svg: str) -> float | None:
    """The narrowest width (CSS px) at which an SVG drawing's smallest text is still LEGIBLE_PX on screen.

    None: the drawing may shrink freely (it has no text, or no width of its own to scale from).
    """
    root = SVG_ROOT.search(svg)
    width = root and SVG_WIDTH.search(root[0])
    if not width or "<text" not in svg:
        return None
    natural = float(width[1]) * PX[width[2] or ""]
    box = SVG_VIEWBOX_WIDTH.search(root[0])
    scale = natural / float(box[1]) if box and float(box[1]) > 0 else 1.0  # CSS px per user unit
    # A size of 0 draws nothing (and would divide by zero); SVG's default size is 16 px.
    sizes = [size for n, unit in FONT_SIZE.findall(svg) if (size := float(n) * PX[unit or ""]) > 0] or [16.0]
    return natural * min(1.0, LEGIBLE_PX / (min(sizes) * scale))


def png_width(data: str) -> int:
    """A base64 PNG's width in pixels: the first 4 bytes of its IHDR chunk, bytes 16-19 of the file (8 of signature,
    4 of length, 4 of chunk type). 44 base64 characters decode to the first 33 bytes."""
    return int.from_bytes(base64.b64decode(data[:44])[16:20], "big")


def keep_figures_legible(soup: BeautifulSoup) -> None:
    """Give each figure (an <img> output) a min-width at which its smallest text is LEGIBLE_PX on screen.

    Its output box scrolls sideways (mkdocs-jupyter's overflow-x: auto), so a figure wider than a phone's column
    stays readable and is swiped through; one that fits its column looks as before. A PNG's text size is unknown:
    it keeps its natural width.
    """
    for img in soup.select(".jp-OutputArea-output img"):
        kind, _, data = img.get("src", "").partition(";base64,")
        if kind == "data:image/svg+xml":
            floor = legible_width(base64.b64decode(data).decode("utf-8", "replace"))
        elif kind == "data:image/png":
            floor = float(img.get("width") or png_width(data))
        else:
            floor = None
        if floor:
            img["style"] = f"min-width: {math.ceil(floor)}px"


# ---- the reader's section in the other language ---------------------------------------------------

log = logging.getLogger("mkdocs.hooks.book")


def chapter_headings(notebook: Path) -> list[dict]:
    """A chapter's prose headings as toc tokens, ids as fix_headings gives them on its page.

    Read from the chapter's notebook, its markdown cells rendered by nbconvert's filter (mkdocs-jupyter's), so that
    a site can name the headings of the other language's page without building it.
    """
    cells = nbformat.read(notebook, as_version=4).cells
    prose = "".join(f'<div class="jp-MarkdownCell">{markdown2html_mistune(cell.source)}</div>'
                    for cell in cells if cell.cell_type == "markdown")
    return fix_headings(BeautifulSoup(prose, "html.parser"))


def link_twin_headings(soup: BeautifulSoup, tokens: list[dict], page: Any, config: Any) -> None:
    """Give each prose heading the id of its twin in the other language: ``data-twin-zh`` on the English site.

    docs/assets/javascripts/sections.js adds that id to the language menu's link, so that switching languages
    lands on the section being read. The id is URL-encoded, as in an address (the English page's source holds no
    Chinese). The en and zh markdown cells are twins, so their headings correspond in order; tools/book.py
    assembles every language's docs tree before it builds a site. A chapter whose two languages have different
    headings (in number or level) is reported: a warning, which fails the strict build.
    """
    here, trees = language(config), Path(config["docs_dir"]).parent
    for lang in (alternate["lang"] for alternate in config["extra"].get("alternate", [])):
        twin = trees / lang / page.file.src_uri
        if lang == here or not twin.is_file():
            continue
        twins = chapter_headings(twin)
        if [t["level"] for t in twins] != [t["level"] for t in tokens]:
            log.warning(f"{page.file.src_uri}: its headings in {here} and {lang} differ, so the language menu cannot "
                        f"keep the reader's section: {[t['id'] for t in tokens]} against {[t['id'] for t in twins]}")
            continue
        for heading, token in zip(soup.select(PROSE_HEADINGS), twins, strict=True):
            heading[f"data-twin-{lang}"] = quote(token["id"], safe="")


# ---- search: Chinese words, and the terms a section introduces ------------------------------------

HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")
# The terms each section sets in bold, the book's mark for a term it introduces: page url -> heading id ("" for
# the text before the first heading) -> terms. Filled page by page, written into the search index after the build.
DEFINED: dict[str, dict[str, list[str]]] = {}
# Material's search worker, which the pages load through docs/assets/javascripts/workers/search_words.js.
SEARCH_WORKER = re.compile(r'(?P<path>"search": "[^"]*/workers/)(?P<worker>search\.[0-9a-f]+\.min\.js)"')


def note_defined_terms(soup: BeautifulSoup, url: str) -> None:
    """Note the terms in bold of each section of the page, as Material's search divides a page into sections."""
    DEFINED[url] = sections = {}
    for strong in soup.select(".jp-MarkdownCell strong, .jp-MarkdownCell b"):
        heading = strong.find_previous(re.compile(r"^h[1-6]$"), id=True)  # Material's parser: a heading with an id
        sections.setdefault(heading["id"] if heading else "", []).append(strong.get_text(" ", strip=True))


def cut_chinese(text: str) -> str:
    """Chinese cut into words parted by U+200B, as Material's search plugin cuts the rest of the index."""
    if jieba is None:
        return text
    return HAN.sub(lambda run: "\u200b" + "\u200b".join(jieba.cut(run[0])) + "\u200b", text).strip("\u200b")


def index_defined_terms(config: Any) -> None:
    """Give each section of the search index the terms it introduces, in a field of its own: ``defines``.

    mkdocs.yml weighs that field as Material weighs a title, so that "reference count" lists first the chapter
    that introduces it (02), not those whose headings hold one of its words ("the reference backend", "the
    counters"); 引用计数 likewise.
    """
    path = Path(config["site_dir"]) / "search" / "search_index.json"
    if not path.is_file() or not DEFINED:
        return
    index = json.loads(path.read_text(encoding="utf-8"))
    for doc in index["docs"]:
        url, _, anchor = doc["location"].partition("#")
        terms = DEFINED.get(url, {}).get(anchor)
        if terms:
            doc["defines"] = cut_chinese(" · ".join(dict.fromkeys(terms)))
    path.write_text(json.dumps(index, separators=(",", ":")), encoding="utf-8")


# ---- mkdocs events --------------------------------------------------------------------------------


def keep_code_out_of_search(soup: BeautifulSoup) -> None:
    """Wrap each code cell in a <section data-search-exclude>, which Material's search skips.

    Not the cell's own <div>: the search parser tells elements apart by tag name only, so the
    first nested </div> would end the exclusion (and the rest of the cell would be indexed).
    Nothing inside a cell is a <section>.
    """
    for cell in soup.select("div.jp-CodeCell"):
        if cell.find_parent("div", class_="jp-CodeCell") is None:
            cell.wrap(soup.new_tag("section", attrs={"class": "code-cell", "data-search-exclude": "code"}))


def on_page_content(content: str, page: Any, config: Any, files: Any) -> str:
    if page.is_homepage:
        page.title = word(config, "home")  # its entry in the navigation; the browser's title stays the site's
    if not page.file.src_uri.endswith(".ipynb"):
        return content
    soup = BeautifulSoup(content, "html.parser")
    tokens = fix_headings(soup)
    first = next((t for t in tokens if t["level"] == 1), None)
    if first is not None:
        page.title = html.unescape(first["name"])
    page.toc = get_toc(nest([t for t in tokens if t["level"] <= TOC_DEPTH]))
    fold_answers(soup, word(config, "answers"))
    describe_figures(soup, language(config), word(config, "figure"))
    render_math(soup)
    keep_figures_legible(soup)
    keep_code_out_of_search(soup)
    link_twin_headings(soup, tokens, page, config)
    note_defined_terms(soup, page.url)
    return str(soup)


def on_nav(nav: Any, config: Any, files: Any) -> Any:
    for item in nav.items:
        if item.is_section:
            if item.title == "Chapters":
                group_by_part(item, TITLES.get(language(config), TITLES["en"]))
            elif item.title == "Guide":
                item.children.sort(key=lambda page: GUIDE_ORDER.index(Path(page.file.src_uri).stem))
            item.title = word(config, item.title)
    return nav


# The Guide's pages in the order a user needs them (the file names' order is alphabetical).
GUIDE_ORDER = ["index", "using", "serving", "gpu", "benchmarks", "ledger", "working"]


def group_by_part(chapters: Any, titles: dict[str, str]) -> None:
    """Put the pages of the "Chapters" section into one section per part of the book, in reading order."""
    sections: dict[str, Section] = {}
    for page in chapters.children:
        part = part_of(Path(page.file.src_uri).stem)
        if part not in sections:
            sections[part] = Section(titles[part], [])
            sections[part].parent = chapters
        sections[part].children.append(page)
        page.parent = sections[part]
    chapters.children = list(sections.values())


def alternate_href(page_url: str, root: str) -> str:
    """The same page in another language's site, relative to this page (any host, any prefix).

    root: that site's root relative to this one ("zh/" from English, "../" from Chinese).
    """
    up = "../" * page_url.count("/")
    return (up + root.removeprefix("./") + page_url) or "./"


def search_through_words(output: str, where: str) -> str:
    """Have the page load Material's search worker through search_words.js. A page whose configuration no longer names
    the worker as SEARCH_WORKER expects (a Material upgrade) is reported: the strict build fails, rather than search
    going back to cutting Chinese queries apart in silence."""
    output, found = SEARCH_WORKER.subn(r'\g<path>search_words.js?\g<worker>"', output)
    if not found and '"search":' in output:
        log.warning(f"{where}: Material's search worker is not named as expected; search_words.js is not used")
    return output


def on_post_page(output: str, page: Any, config: Any) -> str:
    output = CDN_MODULE_SCRIPT.sub("", output)
    output = search_through_words(output, page.file.src_uri)
    output = ALTERNATE_HEAD_LINK.sub("", output)
    roots = {alt["lang"]: alt["link"] for alt in config["extra"].get("alternate", [])}

    def relink(match: re.Match) -> str:
        if match["lang"] not in roots:
            return match[0]
        return HREF.sub(f'href="{alternate_href(page.url, roots[match["lang"]])}"', match[0], count=1)

    return ALTERNATE_TAG.sub(relink, output)


def on_post_template(output: str, template_name: str, config: Any) -> str:
    """The 404 page's search, as every page's (on_post_page)."""
    return search_through_words(output, template_name) if template_name == "404.html" else output


@event_priority(-100)  # after Material's search plugin has written the index
def on_post_build(config: Any) -> None:
    if not config.get("site_url"):
        for name in ("sitemap.xml", "sitemap.xml.gz"):
            (Path(config["site_dir"]) / name).unlink(missing_ok=True)
    index_defined_terms(config)
