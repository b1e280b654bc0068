"""mkdocs hooks: the site keeps the reader's place, shows whole titles, and loads nothing remote.

* The language switcher links each page to the same page in the other language (Material's
  own "stay on page" needs a ``site_url`` and a sitemap, and then only works on that host).
* mkdocs-jupyter takes titles and the table of contents from a markdown export that drops code
  spans ("The engine: , , the demo") and gives Chinese headings empty ids; both are rebuilt here
  from the rendered headings, which get unique, non-empty ids.
* Exercise answers (cells that tools/book.py tagged ``answers``) are folded in ``<details>``.
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
  Material's index, so a chapter's title is the first hit for its subject).
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
import logging
import re
import sys
from pathlib import Path
from typing import Any

from bs4 import BeautifulSoup
from mkdocs.structure.nav import Section
from mkdocs.structure.toc import get_toc

if __package__ in (None, ""):  # mkdocs loads this file by its path: make `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.parts import TITLES, part_of

try:  # Material's search segments Chinese with jieba when it is installed; its log is noise in the build
    import jieba

    jieba.setLogLevel(logging.WARNING)
except ImportError:
    pass

NOT_SCRIPT_END = r"(?:(?!</script>).)*"
CDN_MODULE_SCRIPT = re.compile(rf'<script type="module">{NOT_SCRIPT_END}https://cdnjs\.{NOT_SCRIPT_END}</script>', re.S)
ALTERNATE_TAG = re.compile(r'<a\b[^>]*\bhreflang="(?P<lang>[^"]+)"[^>]*>')
ALTERNATE_HEAD_LINK = re.compile(r'\s*<link rel="alternate" href="[^"]*" hreflang="[^"]*">')
HREF = re.compile(r'\bhref="[^"]*"')
NO_ALT = "No description has been provided for this image"
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
    for heading in soup.select(".jp-MarkdownCell h1, .jp-MarkdownCell h2, .jp-MarkdownCell h3, "
                               ".jp-MarkdownCell h4, .jp-MarkdownCell h5, .jp-MarkdownCell h6"):
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
    keep_code_out_of_search(soup)
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


def on_post_page(output: str, page: Any, config: Any) -> str:
    output = CDN_MODULE_SCRIPT.sub("", output)
    output = ALTERNATE_HEAD_LINK.sub("", output)
    roots = {alt["lang"]: alt["link"] for alt in config["extra"].get("alternate", [])}

    def relink(match: re.Match) -> str:
        if match["lang"] not in roots:
            return match[0]
        return HREF.sub(f'href="{alternate_href(page.url, roots[match["lang"]])}"', match[0], count=1)

    return ALTERNATE_TAG.sub(relink, output)


def on_post_build(config: Any) -> None:
    if not config.get("site_url"):
        for name in ("sitemap.xml", "sitemap.xml.gz"):
            (Path(config["site_dir"]) / name).unlink(missing_ok=True)
