"""A chapter's sections across the two sites, and what the search index learns from them (issue 59, items 2 and 5).

tools/mkdocs_hooks.py's rules on a small chapter; the built sites are checked in a browser in tests/site_checks.py
(the language menu lands on the same section, a search for a term lists the chapter that introduces it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote

import nbformat
from bs4 import BeautifulSoup
from nbconvert.filters.markdown_mistune import markdown2html_mistune

from tools import mkdocs_hooks as hooks

# The same chapter's prose in the two languages: twin cells, headings in the same order and at the same levels.
PROSE = {
    "en": ["# 02 · Paged `KV` memory\n\nA **reference count** per block.", "## The idea: why pages?",
           "## Check it\n\nNothing new.\n\n### Exercises"],
    "zh": ["# 02 · 分页 `KV` 显存\n\n每块一个**引用计数**。", "## 思路：为什么要分页？",
           "## 验证\n\n没有新东西。\n\n### 练习"],
}
PAGE = SimpleNamespace(file=SimpleNamespace(src_uri="chapters/02_block_manager.ipynb"),
                       url="chapters/02_block_manager/")


def docs_trees(root: Path, prose: dict[str, list[str]]) -> None:
    """Each language's docs tree with the chapter, as tools/book.py assembles them before building the sites."""
    for lang, cells in prose.items():
        chapter = root / lang / PAGE.file.src_uri
        chapter.parent.mkdir(parents=True)
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(c) for c in cells]), chapter)


def rendered(cells: list[str]) -> tuple[BeautifulSoup, list[dict]]:
    """The chapter's page as mkdocs-jupyter renders its prose, with the headings' ids that the hooks give them."""
    soup = BeautifulSoup("".join(f'<div class="jp-MarkdownCell">{markdown2html_mistune(cell)}</div>'
                                 for cell in cells), "html.parser")
    return soup, hooks.fix_headings(soup)


def config(root: Path, lang: str) -> dict:
    return {"theme": {"language": lang}, "docs_dir": str(root / lang), "site_dir": str(root / "site"),
            "extra": {"alternate": [{"lang": "en", "link": "./"}, {"lang": "zh", "link": "zh/"}]}}


def test_each_heading_names_its_twin_in_the_other_language(tmp_path: Path) -> None:
    docs_trees(tmp_path, PROSE)
    for lang, other in (("en", "zh"), ("zh", "en")):
        soup, tokens = rendered(PROSE[lang])
        hooks.link_twin_headings(soup, tokens, PAGE, config(tmp_path, lang))
        twins = [unquote(heading[f"data-twin-{other}"]) for heading in soup.select(hooks.PROSE_HEADINGS)]
        assert twins == [token["id"] for token in rendered(PROSE[other])[1]]
    assert twins == ["02-paged-kv-memory", "the-idea-why-pages", "check-it", "exercises"]
    # The English page's source holds no Chinese: its twins' ids are written as in an address.
    soup, tokens = rendered(PROSE["en"])
    hooks.link_twin_headings(soup, tokens, PAGE, config(tmp_path, "en"))
    assert soup.h1["data-twin-zh"] == "02-%E5%88%86%E9%A1%B5-kv-%E6%98%BE%E5%AD%98"


def test_a_chapter_whose_languages_have_other_headings_is_reported(tmp_path: Path, caplog) -> None:
    docs_trees(tmp_path, {**PROSE, "zh": [*PROSE["zh"][:2], "### 一个多出来的小节", *PROSE["zh"][2:]]})
    soup, tokens = rendered(PROSE["en"])
    with caplog.at_level(logging.WARNING, logger="mkdocs.hooks.book"):
        hooks.link_twin_headings(soup, tokens, PAGE, config(tmp_path, "en"))
    assert "its headings in en and zh differ" in caplog.text  # a warning fails mkdocs build --strict
    assert soup.select("[data-twin-zh]") == []


def test_the_terms_a_section_sets_in_bold_go_into_its_search_entry(tmp_path: Path) -> None:
    for lang, term in (("en", "reference count"), ("zh", "引用\u200b计数")):  # Chinese cut into words, as Material does
        soup, _ = rendered(PROSE[lang])
        hooks.note_defined_terms(soup, PAGE.url)
        section = soup.h1["id"]
        index = tmp_path / lang / "site" / "search" / "search_index.json"
        index.parent.mkdir(parents=True)
        index.write_text(json.dumps({"config": {}, "docs": [
            {"location": PAGE.url, "title": "", "text": ""}, {"location": f"{PAGE.url}#{section}", "title": "",
                                                               "text": ""}]}), encoding="utf-8")
        hooks.index_defined_terms({"site_dir": str(index.parent.parent)})
        docs = json.loads(index.read_text(encoding="utf-8"))["docs"]
        assert [doc.get("defines") for doc in docs] == [None, term]
