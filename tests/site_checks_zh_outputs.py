"""Checks on the built sites: what the chapters print speaks the reader's language (issue 23, item 6).

Run by `./dev test` after the sites are built, like tests/site_checks.py (the file name does not start
with test_: the sites must exist first). Each site is built from its own run of the chapters
(tools/book.py sets NANOVLLM_BOOK_LANG for the kernel), so the printed traces, tables and charts of
the Chinese site are Chinese, and the English site's are what they always were.
"""

from __future__ import annotations

import base64
import functools
import re

import pytest
from bs4 import BeautifulSoup

from tests.site_checks import CHAPTERS, PAGES, page

SVG_DATA = "data:image/svg+xml;base64,"
CJK = re.compile(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]")

# What stays English on the Chinese site, by the start of its output: the engine's own messages (errors
# and refusals, shown as raised), a command line's help, a model's English text, data and identifiers.
# An output that starts otherwise and holds no Chinese fails the check.
ENGLISH_ON_PURPOSE = {
    "00_tour": (">>> What is the capital of France?", "0 True", "2 [3, -1] __init__", "Knobs(size=3"),
    "01_sequence": ("SamplingParams(temperature=", "RuntimeError: sequence 0: illegal status change"),
    "02_block_manager": ("AssertionError: sequence",),
    "04_scheduler": ("extendleft:", "ValueError: request"),
    "05_model": ("['.nanovllm-tiny'", "ModelLoadError:"),
    "06b_triton_attention": ("device: cpu",),
    "07_sampling": ("device: cpu",),
    "08_model_runner": ("input_ids    [",),
    "09_cuda_graphs": ("input_ids    [", "('cpu', 'torch') -> device is 'cpu'"),
    "10_tensor_parallel": ("ValueError: number of key/value heads",),
    "11_engine": ("usage: python -m nanovllm", ">>> What is the capital of France?"),
}

# What holds Chinese on the English site on purpose, by the start of its output: data, not words of the book.
# Chapter 15 cuts a Chinese greeting into tokens and stops a stream at a Chinese stop string; 15b asks SmolLM2 a
# question in Chinese (it answers "北京, ..."). An English output that starts otherwise and holds Chinese fails.
CHINESE_ON_PURPOSE = {
    "15_serving": ("7 characters, 11 tokens: [", "sent, token by token: ["),
    "15b_openai_server": ("non-streamed: '",),
}

# Where the English site prints a word, a heading or a label, the Chinese site prints the glossary's
# Chinese: (English, Chinese) pairs, each printed (or drawn) by the chapter on its own site.
TRANSLATED = {
    "00_tour": [
        ("ch. 11", "第 11 章"), ("step 1: prefill  computed 16 tokens", "第 1 步：prefill  计算了 16 个 token"),
        ("exercise 2: the same seed gives the same answer", "练习 2：同一个种子给出同样的回答"),
    ],
    "01_sequence": [
        ("prefill chunk 1", "prefill 分块 1"), ("the worked example holds", "例子核对无误"),
        ("preempt (free blocks, recompute later)", "抢占（释放块，之后重算）"),
    ],
    "02_block_manager": [
        ("causal mask", "因果掩码"), ("requests fit", "个请求"), ("free A", "释放 A"), ("free=[", "空闲队列=["),
        ("free list: [7, 1, 3", "空闲队列：[7, 1, 3"), ("ref counts:", "引用计数："),
        ("trace and invariants hold", "轨迹与不变量均成立"), ("F needs 12 adjacent slots", "F 需要 12 个相邻槽位"),
        ("empty slots per sequence", "个空槽位"), ("modulo rule agrees", "与取模规则一致"),
        ("Physical KV blocks", "物理 KV 块"),  # the paging figure
    ],
    "03_prefix_caching": [
        ("A prefilled, hits []", "A prefill 完毕，命中 []"), ("shared-prefix claims hold", "共享前缀的论断成立"),
        ("backward free", "倒序释放"), ("wrong positions", "出错的位置"),
    ],
    "04_scheduler": [
        ("step kind     scheduled", "  步 类型     本步调度"), ("cache hits", "缓存命中"),
        ("scheduled A,B,C,D    preempted -    running A,B,C,D", "本步调度 A,B,C,D    被抢占 -    运行 A,B,C,D"),
        ("four sequences, four blocks:", "四个序列，四个块："), ("chunked prefill steps", "个分块 prefill 步"),
        ("mean steps to first token", "到第一个 token 的平均步数"), ("preempt the newest", "抢占最新的"),
        ("budget left, and the head gets its blocks?", "还有预算，且队头能分到块？"),  # the flowchart
    ],
    "04b_parallel_sampling": [
        ("after the prefill and the fork", "prefill 并分叉之后"),
        ("A1: table [0(ref 2), 1(ref 2)]", "A1：块表 [0（引用 2）"),
        ("    block 0: Four score and seven", "    块 0：Four score and seven"),
        ("free blocks after each remaining step", "空闲块数"), ("forks: {", "分叉：{"),
        ("sample 0: [", "样本 0：["),
    ],
    "05_model": [("ours == transformers for Qwen3", "我们的结果 == transformers"), ("all finite", "全部有限")],
    "06_attention": [("paged attention matches dense attention", "分页注意力与稠密注意力一致")],
    "06b_triton_attention": [
        ("cache B's prefix", "缓存 B 的前缀"), ("prefill with a prefix", "带前缀的 prefill"),
        ("caches identical", "缓存完全相同"),
    ],
    "06c_attention_benchmarks": [
        ("batch context  plain", "批大小  上下文   普通"),
        # the chart: its title, axes and series
        ("% of copy bandwidth", "占拷贝带宽的 %"), ("batch size (sequences)", "批大小（序列数）"),
        ("plain, ctx 1024", "普通，上下文 1024"), ("heuristic, ctx 8192", "启发式，上下文 8192"),
        ("the heuristic is within 10 %", "启发式规则在每个形状上"), ("128 keys", "128 个键"),
        ("MiB of KV per layer", "MiB 的 KV"),
    ],
    "07_sampling": [("chi-square =", "卡方 ="), ("tokens drawn:", "抽到的 token："), ("two calls:", "两次调用：")],
    "08_model_runner": [("misspelled key", "拼错的键"), ("Config checks hold", "Config 的检查成立")],
    "09_cuda_graphs": [("all checks passed", "全部检查通过"), ("it never preempts", "它从不抢占")],
    "10_tensor_parallel": [
        ("every layer kind reassembles exactly", "每种层都能精确拼回原样"),
        ("own heads + KV", "自己的头 + KV"),  # the drawing
        ("all exercise answers check out", "练习答案全部验证通过"),
    ],
    "10b_tp_runtime": [("ranks alive:", "rank 仍存活："), ("all exercise answers check out", "练习答案全部验证通过")],
    "11_engine": [
        ("step  1 prefill [seq 0: 12", "第  1 步 prefill [序列 0: 12"), ("preempted [", "抢占 ["),
        ("greedy tokens match transformers", "贪心解码的 token 与 transformers 完全一致"),
        ("model directory:", "模型目录："), ("all exercise answers check out", "练习答案全部验证通过"),
    ],
    "12_async_scheduling": [("the tokens equal the synchronous run's", "token 与同步运行的相同")],
    "13_robustness": [("three threads, one engine", "三个线程，一个引擎"), ("empty prompt", "空提示词")],
    "14_benchmark": [
        ("benchmark checks hold", "基准测试的检查成立"), ("peer batch:", "对照组批次："),
        ("peak blocks", "峰值占用块数"), ("4 identical requests", "4 个相同的请求"),
        ("forked / independent", "分叉 / 独立"),
    ],
    "15_serving": [
        ("req 0.0 +[", "请求 0.0 +["), ("blocks in use while it runs", "运行期间占用的块"),
        ("each token decoded alone", "每个 token 单独解码"), ("all exercise answers check out", "练习答案全部验证通过"),
    ],
    "15b_openai_server": [
        ("during the stream", "流进行中"), ("the server exited with status 0", "服务器已退出，退出状态 0"),
    ],
    "15c_serving_benchmark": [
        ("4 streams", "4 个流"), ("decode step", "decode 步"),
        ("the server exited with status 0", "服务器已退出，退出状态 0"),
    ],
    "16_fp8_kv_cache": [
        ("KV share", "KV 占比"), ("254 finite codes", "254 个有限编码"), ("worst layer V", "最差一层的 V"),
        ("per (token, head), max -> 448", "每个（token，头），最大值 -> 448"), ("refused: ", "被拒绝："),
        ("perplexity, en, 256 tokens: float32 cache", "困惑度，en，256 个 token：float32 缓存"),
        ("% of its bound)", "（其上限的 "), ("8-bit K only", "只有 K 为 8 位"),
    ],
    "17_speculative_decoding": [
        ("tokens per step for k", "时每步的 token 数"), ("drafts reserved", "预留草稿之后"),
        ("identical to plain decoding: True", "与普通 decode 完全相同：True"), ("refused: ", "被拒绝："),
    ],
    "18_mixture_of_experts": [
        ("greedy tokens match transformers", "贪心解码的 token 与 transformers 完全一致"),
        ("layer 0: experts", "第 0 层：专家"), ("all exercise answers check out", "练习答案全部验证通过"),
        ("8 layers, fused: ", "8 层，融合："), ("sort, batch of  1: align_by_expert", "排序，批大小  1："),
    ],
    "A_visualization": [("before step 1: empty pool", "第 1 步之前：空的块池"), ("frames checked", "帧")],
    "B_from_nano_vllm": [("three chained block hashes equal upstream's", "三个链式块哈希与上游的相同")],
    "C_live_page": [("frames published", "发布的帧"), ("all exercise answers check out", "练习答案全部验证通过")],
}


def svg_labels(src: str) -> str:
    """The labels a drawing or chart shows (an <img> whose src is an SVG data URI), one a line."""
    svg = BeautifulSoup(base64.b64decode(src.removeprefix(SVG_DATA)).decode("utf-8"), "html.parser")
    return "".join(label.get_text() + "\n" for label in svg.find_all("text"))


@functools.cache  # four tests read each page's outputs: a page is parsed once (a second or more each)
def printed(lang: str, chapter: str) -> tuple[str, ...]:
    """The text of each code cell's output area in a built page: printed text, SVG labels, players (not their
    scripts and styles, which a reader does not see)."""
    areas = []
    for area in BeautifulSoup(page(lang, "chapters", chapter), "html.parser").select("div.jp-Cell-outputArea"):
        for code in area.find_all(["script", "style"]):
            code.decompose()
        for img in area.find_all("img", src=lambda src: bool(src) and src.startswith(SVG_DATA)):
            img.replace_with(svg_labels(img["src"]))
        text = area.get_text()
        if text.strip():
            areas.append(text.strip("\n") + "\n")
    return tuple(areas)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_english_site_prints_no_chinese(chapter: str) -> None:
    chinese = [area for area in printed("en", chapter)
               if CJK.search(area) and not area.startswith(CHINESE_ON_PURPOSE.get(chapter, ()))]
    assert chinese == [], f"{chapter}: Chinese in an English output: {chinese[0][:200]!r}"


@pytest.mark.parametrize("chapter", TRANSLATED)
def test_the_chinese_site_prints_chinese_where_the_english_site_prints_english(chapter: str) -> None:
    en, zh = "\n".join(printed("en", chapter)), "\n".join(printed("zh", chapter))
    for english, chinese in TRANSLATED[chapter]:
        assert english in en, f"{chapter}: the English site no longer prints {english!r}"
        assert chinese in zh, f"{chapter}: the Chinese site does not print {chinese!r}"
        assert english not in zh, f"{chapter}: the Chinese site still prints {english!r}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_output_of_a_chinese_page_speaks_chinese(chapter: str) -> None:
    en, zh = printed("en", chapter), printed("zh", chapter)
    assert len(en) == len(zh), f"{chapter}: {len(en)} outputs on the English page, {len(zh)} on the Chinese one"
    english = [area for area in zh if not CJK.search(area)
               and not area.startswith(ENGLISH_ON_PURPOSE.get(chapter, ()))]
    assert english == [], f"{chapter}: {len(english)} of {len(zh)} outputs print English only: {english[0][:200]!r}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chinese_outputs_keep_prefill_and_decode_in_english(chapter: str) -> None:
    """The glossary keeps prefill and decode in English in Chinese text; the player's captions once said 预填充."""
    for area in printed("zh", chapter):
        assert "预填充" not in area and "解码：" not in area, f"{chapter}: {area[:200]!r}"


ALIGNMENT_JS = """(() => {
  const pre = [...document.querySelectorAll('.jp-OutputArea-output pre')].find(p => p.textContent.includes('A:12+2'));
  const range = document.createRange();
  const x = (index) => {  // the left edge of the character at index in the block's text
    const walk = document.createTreeWalker(pre, NodeFilter.SHOW_TEXT);
    for (let node, seen = 0; (node = walk.nextNode()); seen += node.length) {
      if (index < seen + node.length) {
        range.setStart(node, index - seen); range.setEnd(node, index - seen + 1);
        return range.getBoundingClientRect().left;
      }
    }
  };
  const [header, first] = pre.textContent.split('\\n');
  const row = header.length + 1;
  // the first row's waiting, running and free columns: ['A', 'B', 'C'], [] and 3
  return {header: ['等待', '运行', '空闲'].map(h => x(header.indexOf(h))),
          column: [first.indexOf("['A'"), first.indexOf('[]'), first.lastIndexOf('3')].map(i => x(row + i))};
})()"""


def test_chinese_headings_stay_over_their_columns_in_a_browser() -> None:
    """A Chinese character takes two monospace columns on the page too (docs/assets/extra.css), as the book pads it."""
    from tests.test_viz_browser import CHROMIUM, Browser

    assert CHROMIUM, "the browser check needs Chromium (./dev test installs Debian's chromium)"
    browser = Browser(CHROMIUM)
    try:
        browser.open((PAGES["zh"] / "chapters" / "04_scheduler" / "index.html").as_uri())
        where = browser.js(ALIGNMENT_JS)
    finally:
        browser.close()
    drift = [round(h - c, 1) for h, c in zip(where["header"], where["column"], strict=True)]
    assert all(abs(d) < 1 for d in drift), f"chapter 04's step table: headings off their columns by {drift} px"
