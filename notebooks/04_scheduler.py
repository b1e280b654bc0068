# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown] tags=["en"]
# # 04 · The scheduler
#
# **Goal.** By the end of this chapter you can predict, for any set of requests, what each step
# of the engine computes: which sequences, how many tokens of each, whether it is a prefill or a
# decode step, and who gets preempted when the cache runs out. You will build the `Scheduler`:
# two queues, a prefill-first policy with a token budget and chunked prefill, decode with
# preemption, and the postprocess that turns a step's sampled tokens into progress.
#
# The engine loop (chapter 10) is three lines, and this chapter owns two of them:
#
# ```python
# seqs, is_prefill = scheduler.schedule()
# token_ids = model_runner.run(seqs, is_prefill)   # chapter 09
# scheduler.postprocess(seqs, token_ids, is_prefill)
# ```

# %% [markdown] tags=["zh"]
# # 04 · 调度器
#
# **目标：** 读完本章，对任意一组请求，你都能预测引擎每一步计算什么：哪些序列、各算多少个 token、是 prefill 步还是
# decode 步，以及缓存不够时谁会被抢占。本章构建 `Scheduler`（调度器）：两个队列、带 token 预算和
# 分块 prefill（chunked prefill）的 prefill 优先策略、带抢占的 decode，以及把一步的采样结果变成进度的后处理。
#
# 引擎主循环（第 10 章）只有三行，其中两行属于本章：
#
# ```python
# seqs, is_prefill = scheduler.schedule()
# token_ids = model_runner.run(seqs, is_prefill)   # 第 09 章
# scheduler.postprocess(seqs, token_ids, is_prefill)
# ```

# %% [markdown] tags=["en"]
# ## The idea: two queues and one decision per step
#
# ```
#            add                 prefill (budget, blocks)                 EOS / max_tokens
#   request ─────► waiting ───────────────────────────────► running ───────────────────────► finished
#                  ▲  head                                     │ tail
#                  └────────── preempt: free all blocks ◄──────┘  (newest first, recompute later)
# ```
#
# Every step is **either all-prefill or all-decode**, and prefill comes first:
#
# - **Prefill.** Take sequences from the head of `waiting` while the step has room: at most
#   `max_num_seqs` sequences and `max_num_batched_tokens` tokens (the **token budget**), and the
#   block manager can give the head sequence its blocks (cache hits lower both costs). If the
#   head's remaining prompt does not fit the budget left, it gets a **chunk**: as many tokens as
#   fit. That sequence is then the last one of the step, keeps its blocks and stays at the head
#   of `waiting`; the next step continues it. A chunk yields no new token: its last logits
#   predict a position *inside* the prompt, so the model runner (chapter 09) does not sample
#   them (it returns `-1`) and postprocess appends nothing.
# - **Decode**, when nothing could be prefilled: every running sequence (up to `max_num_seqs`,
#   and never more than the token budget) computes its last token. If one needs a new block and
#   none is free, the scheduler **preempts** from the *tail* of `running`, the newest sequence
#   first, until a block is free, down to the sequence itself. A preempted sequence gives back
#   all its blocks, returns to WAITING at the *head* of `waiting` and is prefilled again later
#   (**recompute**); prefix caching may find many of its old blocks still intact.
# - **Postprocess** marks the computed tokens as cached, publishes full blocks (chapter 03),
#   appends each sampled token whose prompt is complete, and finishes sequences that sampled an
#   end-of-sequence token (unless `ignore_eos`) or reached `max_tokens`.
#
# One more rule, the **admission check**: a request whose KV could **never** fit the whole
# cache is refused by `check_fits`, which the engine runs once, where a request enters (chapter
# 10). Upstream nano-vllm accepts it and then crashes or loops forever:
# alone in the cache, the sequence needs a block, no victim is left, it preempts itself, is
# prefilled again, and runs out at the same point again. The sequence writes KV for its prompt
# and for every sampled token but the last, so it needs at most
# `ceil((prompt + max_tokens - 1) / block_size)` blocks; `check_fits` requires that many to exist. (A
# weaker check, "the prompt plus one token fits", would let exactly the looping requests
# through.)

# %% [markdown] tags=["zh"]
# ## 思路：两个队列，每步一个决定
#
# ```
#          add（加入）            prefill（预算、块）                     EOS / max_tokens
#   请求 ─────────► waiting ───────────────────────────────► running ───────────────────────► finished
#                  ▲ 队头                                      │ 队尾
#                  └────────── 抢占：释放所有块 ◄──────────────┘  （最新的先被抢占，之后重算）
# ```
#
# 每一步**要么全是 prefill，要么全是 decode**，而且 prefill 优先：
#
# - **Prefill：** 只要这一步还有余量，就从 `waiting` 队头取序列：最多 `max_num_seqs` 个序列、
#   `max_num_batched_tokens` 个 token（即 **token 预算**），并且块管理器能给队头序列分配块（缓存命中会同时降低
#   这两种开销）。如果队头序列剩余的提示词超出剩余预算，它就得到一个**分块**：预算能容纳多少 token 就算多少。
#   这个序列于是成为本步的最后一个，保留它的块，并留在 `waiting` 队头；下一步接着算。分块不产生新 token：它最后一行
#   logits 预测的是提示词*内部*的某个位置，所以模型执行器（第 09 章）不对它采样（返回 `-1`），后处理也不追加任何东西。
# - **Decode：** 没有序列可以 prefill 时，每个运行中的序列（最多 `max_num_seqs` 个，也不超过 token 预算）计算
#   它的最后一个 token。
#   如果某个序列需要新块而没有空闲块，调度器就从 `running` 的*队尾*开始**抢占**——最新的序列先被抢占——直到腾出
#   一个块，最坏情况下抢占它自己。被抢占的序列归还所有块，回到 WAITING，排在 `waiting` 的*队头*，之后重新
#   prefill（**重算**）；前缀缓存可能发现它的许多旧块仍然完好。
# - **后处理**把算过的 token 记为已缓存，发布写满的块（第 03 章），为提示词已算完的序列追加采样得到的 token，
#   并结束那些采样到结束符（除非 `ignore_eos`）或达到 `max_tokens` 的序列。
#
# 还有一条规则，即**准入检查**：如果一个请求的 KV **永远**放不进整个缓存，`check_fits` 就拒绝它；
# 引擎只在请求进入时（第 10 章）做一次这项检查。上游 nano-vllm 会接受这种请求，然后崩溃或陷入死循环：
# 缓存里只剩它一个序列时，它需要新块，却没有可抢占的对象，只能抢占自己，重新 prefill，又在同一个地方用完缓存。
# 序列要为提示词和除最后一个以外的每个采样 token 写 KV，所以它最多需要
# `ceil((prompt + max_tokens - 1) / block_size)` 个块；`check_fits` 要求缓存至少有这么多块。
# （更弱的检查“提示词加一个 token 放得下”恰好会把那些会死循环的请求放进来。）

# %% [markdown] tags=["en"]
# The same decision, drawn. The left half is `_schedule_prefill`, the right half
# `_schedule_decode`, which runs only when the left half scheduled nothing; either way the step
# goes to the model runner, and `postprocess` records its results. The code below fills in
# each box.
#
# The drawing shows this book's rules. The first article, the line-by-line annotation, draws
# upstream's `schedule` too, and its figure differs in two places. It has one more box, "the
# rest of the prompt does not fit and this is not the step's first sequence → stop": upstream
# lets only the first sequence of a step be a chunk, where ours chunks whichever sequence runs
# out the budget ("Which sequence may be chunked?" below compares the two). And its decode loop
# stops at `max_num_seqs`, where ours stops at `min(max_num_seqs, budget)` ("The decode cap").

# %% [markdown] tags=["zh"]
# 同一个决定，画成图。左半边是 `_schedule_prefill`；右半边是 `_schedule_decode`，只有左半边什么也没调度时才运行。
# 无论哪种情况，这一步都交给模型执行器，再由 `postprocess` 记录结果。后面的代码逐一实现图中的每个方框。
#
# 图中画的是本书的规则。第一篇文章（逐行注解上游代码的那篇）也画了上游 `schedule` 的流程图，和这张图有
# 两处不同。它多一个方框：“剩余的提示词放不下，且不是本步的第一个序列 → 停止”：上游只允许一步中的第一个序列
# 成为分块，本书则让用完预算的那个序列分块（下文“哪个序列可以被分块？”一节比较了两者）。另外，它的 decode
# 循环以 `max_num_seqs` 为上限，本书则以 `min(max_num_seqs, 预算)` 为上限（见“decode 的上限”一节）。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases, display_width

say = Phrases({
    "step": "步",
    "kind": "类型",
    "scheduled": "本步调度",
    "preempted": "被抢占",
    "cache hits": "缓存命中",
    "finished": "完成",
    "waiting": "等待",
    "running": "运行",
    "free": "空闲",
    "chunks {chunks}; storm: {preempted} preemptions, all 4 requests finished":
        "分块 {chunks}；抢占风暴：{preempted} 次抢占，4 个请求全部完成",
    "prompt: {tokens} tokens; blocks {table}, the first a hit on {published}":
        "提示词：{tokens} 个 token；块 {table}，第一块命中了 {published}",
    "cached": "已缓存",
    "status": "状态",
    "computed after": "步后已计算",
    "len after": "步后长度",
    "the trace holds, and every completion equals the request's solo run":
        "轨迹成立，且每个生成结果都与该请求单独运行时相同",
    "{steps} steps, {preempted} preemptions, {chunked} chunked prefill steps":
        "{steps} 步，{preempted} 次抢占，{chunked} 个分块 prefill 步",
    "four sequences, four blocks:": "四个序列，四个块：",
    "two sequences, three blocks:": "两个序列，三个块：",
    "decode batch sizes: {sizes} (max_num_seqs=8, budget 3)": "decode 批大小：{sizes}（max_num_seqs=8，预算 3）",
    "batch": "批大小",
    "ms per step": "每步毫秒",
    "µs per token": "每 token 微秒",
    "µs per token against batch 1: {ratios}": "每 token 微秒数与批大小 1 之比：{ratios}",
    "budget 10, prompts of 6 and 8 tokens, {rule}: first step schedules {scheduled}":
        "预算 10，提示词 6 和 8 个 token，{rule}：第一步调度 {scheduled}",
    "ours": "本书",
    "upstream": "上游",
    "16 prompts of 3-14 tokens, budget 10": "16 个 3-14 token 的提示词，预算 10",
    "steps": "步数",
    "prefill steps": "prefill 步数",
    "budget used per prefill step": "每个 prefill 步用掉的预算",
    "mean steps to first token": "到第一个 token 的平均步数",
    "chunked prefills": "分块 prefill 次数",
    "half-prefilled block-steps": "prefill 到一半时占用的块·步",
    "most half-prefilled at once": "同时 prefill 到一半的最多序列数",
    "preempt the newest: {thrown} tokens thrown away, requests finish at steps {finish}":
        "抢占最新的：丢弃 {thrown} 个 token，请求在第 {finish} 步完成",
    "preempt the oldest: {thrown} tokens thrown away, requests finish at steps {finish}":
        "抢占最早的：丢弃 {thrown} 个 token，请求在第 {finish} 步完成",
    "all exercise answers check out": "练习答案全部验证通过",
    # en: the flowchart of schedule()
    # zh: schedule() 的流程图
    "schedule()": "schedule()",
    "① waiting non-empty, fewer than max_num_seqs,": "① waiting 非空、序列数少于 max_num_seqs、",
    "budget left, and the head gets its blocks?": "还有预算，且队头能分到块？",
    "allocate (cache hits count as computed);": "allocate（缓存命中算作已计算）；",
    "schedule min(rest of prompt, budget left)": "调度 min(剩余提示词, 剩余预算)",
    "② the rest of the prompt fits?": "② 剩余的提示词放得下？",
    "head → running": "队头 → running",
    "(RUNNING)": "（RUNNING）",
    "a chunk: keeps its blocks,": "分块：保留它的块，",
    "stays at the head": "留在队头",
    "prefilled anything?": "prefill 了吗？",
    "③ running non-empty and the batch": "③ running 非空，且批大小",
    "< min(max_num_seqs, budget)?": "< min(max_num_seqs, 预算)？",
    "seq ← front of running (the oldest)": "seq ← running 队头（最旧的）",
    "④ can_append(seq)?": "④ can_append(seq)？",
    "may_append(seq);": "may_append(seq)；",
    "schedule 1 token": "调度 1 个 token",
    "preempt the newest (tail of": "抢占最新的（running 队尾），",
    "running), or seq itself if none:": "没有别的就抢占 seq 自己：",
    "free blocks, head of waiting": "释放块，回到 waiting 队头",
    "the model runner computes the step (chapter 09), then postprocess: cache the computed tokens,":
        "模型执行器计算这一步（第 09 章），然后 postprocess：把算完的 token 计入缓存，",
    "publish full blocks, append each sampled token (not for a chunk), finish at EOS or max_tokens":
        "发布写满的块，追加每个采样出的 token（分块不追加），遇到 EOS 或 max_tokens 时结束",
    "yes": "是",
    "no": "否",
    "next head": "下一个队头",
    "yes: a prefill step": "是：一个 prefill 步",
    "retry": "重试",
    "next seq": "下一个 seq",
    "itself: next seq": "抢占自己：下一个 seq",
    "no: a decode step": "否：一个 decode 步",
    "prefill first: _schedule_prefill": "先 prefill：_schedule_prefill",
    "else decode: _schedule_decode": "否则 decode：_schedule_decode",
})

# %% schedule flowchart
#| hide
from html import escape

from IPython.display import SVG, display

import nanovllm.engine.block_manager as block_manager_module
import nanovllm.engine.scheduler as scheduler_module

FLOW_INK = "#37474f"


def schedule_flow_svg() -> str:
    """schedule() as a flowchart: the prefill loop, the decode loop, then the model runner and postprocess."""
    # zh: 把 schedule() 画成流程图：prefill 循环、decode 循环，然后是模型执行器和后处理。
    # en: (key, shape, centre x, centre y, width, lines); a decision is drawn as a hexagon.
    # zh: （键、形状、中心 x、中心 y、宽度、各行文字）；判断画成六边形。
    nodes = [
        ("start", "terminal", 220, 28, 150, ["schedule()"]),
        ("p1", "decision", 220, 115, 340, ["① waiting non-empty, fewer than max_num_seqs,",
                                           "budget left, and the head gets its blocks?"]),
        ("p3", "process", 220, 195, 310, ["allocate (cache hits count as computed);",
                                          "schedule min(rest of prompt, budget left)"]),
        ("p4", "decision", 220, 270, 220, ["② the rest of the prompt fits?"]),
        ("p5", "process", 95, 350, 150, ["head → running", "(RUNNING)"]),
        ("p6", "process", 345, 350, 170, ["a chunk: keeps its blocks,", "stays at the head"]),
        ("q", "decision", 345, 440, 170, ["prefilled anything?"]),
        ("d1", "decision", 680, 115, 320, ["③ running non-empty and the batch", "< min(max_num_seqs, budget)?"]),
        ("d2", "process", 680, 195, 260, ["seq ← front of running (the oldest)"]),
        ("d3", "decision", 680, 270, 200, ["④ can_append(seq)?"]),
        ("d4", "process", 580, 350, 150, ["may_append(seq);", "schedule 1 token"]),
        ("d6", "process", 780, 360, 230, ["preempt the newest (tail of", "running), or seq itself if none:",
                                          "free blocks, head of waiting"]),
        ("run", "process", 460, 510, 720, [
            "the model runner computes the step (chapter 09), then postprocess: cache the computed tokens,",
            "publish full blocks, append each sampled token (not for a chunk), finish at EOS or max_tokens",
        ]),
    ]
    line_height = 15
    box, shapes = {}, []
    for key, shape, x, y, w, lines in nodes:
        h = 14 + line_height * len(lines) + (8 if shape == "decision" else 0)
        box[key] = (x, y, w, h)
        left, top = x - w / 2, y - h / 2
        if shape == "decision":
            corners = [(left, y), (left + h / 2, top), (left + w - h / 2, top), (left + w, y),
                       (left + w - h / 2, top + h), (left + h / 2, top + h)]
            points = " ".join(f"{px:g},{py:g}" for px, py in corners)
            shapes.append(f'<polygon points="{points}" fill="#fff8e1" stroke="{FLOW_INK}" stroke-width="1.5"/>')
        else:
            fill = "#e8f5e9" if key == "run" else "#e3f2fd"
            rx = h / 2 if shape == "terminal" else 6
            shapes.append(f'<rect x="{left:g}" y="{top:g}" width="{w}" height="{h}" rx="{rx:g}" fill="{fill}" '
                          f'stroke="{FLOW_INK}" stroke-width="1.5"/>')
        first = y - line_height * (len(lines) - 1) / 2 + 4
        for i, text in enumerate(lines):
            shapes.append(f'<text x="{x}" y="{first + i * line_height:g}" text-anchor="middle" '
                          f'font-family="sans-serif" font-size="12">{escape(say(text))}</text>')

    def at(key: str, side: str, dx: float = 0) -> tuple[float, float]:
        x, y, w, h = box[key]
        return {"top": (x + dx, y - h / 2), "bottom": (x + dx, y + h / 2), "left": (x - w / 2, y),
                "right": (x + w / 2, y)}[side]

    d6_top = at("d6", "top")[1]
    # en: Each arrow: its corners, and its label (text, x, y, anchor) or None.
    # zh: 每条箭头：各个拐点，以及它的标签（文字、x、y、对齐方式），没有标签时为 None。
    arrows = [
        ([at("start", "bottom"), at("p1", "top")], None),
        ([at("p1", "bottom"), at("p3", "top")], ("yes", 226, 158, "start")),
        ([at("p3", "bottom"), at("p4", "top")], None),
        ([at("p4", "left"), (95, 270), at("p5", "top")], ("yes", 80, 264, "end")),
        ([at("p4", "right"), (345, 270), at("p6", "top")], ("no", 352, 264, "start")),
        ([at("p5", "left"), (14, 350), (14, 115), at("p1", "left")], ("next head", 20, 395, "start")),
        ([at("p1", "right"), (438, 115), (438, 400), (345, 400)], ("no", 398, 108, "start")),
        ([at("p6", "bottom"), at("q", "top")], None),
        ([at("q", "bottom"), at("run", "top", -115)], ("yes: a prefill step", 351, 478, "start")),
        ([at("q", "right"), (472, 440), (472, 115), at("d1", "left")], ("no", 434, 434, "start")),
        ([at("d1", "bottom"), at("d2", "top")], ("yes", 686, 158, "start")),
        ([at("d2", "bottom"), at("d3", "top")], None),
        ([(620, 288), at("d4", "top", 40)], ("yes", 626, 302, "start")),
        ([at("d3", "right"), (820, 270), (820, d6_top)], ("no", 786, 264, "start")),
        ([(740, d6_top), (740, 288)], ("retry", 746, 314, "start")),
        ([at("d4", "left"), (490, 350), (490, 115)], ("next seq", 496, 394, "start")),
        ([at("d6", "bottom"), (780, 428), (490, 428), (490, 350)], ("itself: next seq", 786, 420, "start")),
        ([at("d1", "right"), (905, 115), (905, 510), at("run", "right")], ("no: a decode step", 899, 458, "end")),
    ]
    parts = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="920" height="550" viewBox="0 0 920 550">',
        '<title lang="en">The scheduler\'s decision each step. Prefill first: while waiting is non-empty, the step '
        "has fewer than max_num_seqs sequences and budget left, and the head of waiting gets its blocks, allocate "
        "it and schedule as much of its prompt as the budget allows; if the rest of the prompt fits, the head moves "
        "to running, otherwise it is a chunk and the step ends. If nothing was prefilled, decode: take running "
        "sequences oldest first, up to min(max_num_seqs, budget); each that needs a block it cannot get preempts "
        "the newest running sequence, or itself when none is left. Then the model runner computes the step and "
        "postprocess records it.</title>"
        '<title lang="zh">调度器每一步的决定。先 prefill：只要 waiting 非空、本步序列数少于 max_num_seqs、'
        "还有预算，并且 waiting 队头能分到块，就为它分配块，并在预算之内调度它尽可能多的提示词；"
        "剩下的提示词放得下，队头就进入 running，否则它是一个分块，本步到此为止。"
        "如果什么都没 prefill，就 decode：从最旧的开始取运行序列，最多 min(max_num_seqs, 预算) 个；"
        "需要新块却拿不到的序列抢占最新的运行序列，没有别的序列时抢占它自己。"
        "然后模型执行器计算这一步，postprocess 记录结果。</title>",
        '<defs><marker id="flow-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        f'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="{FLOW_INK}"/></marker></defs>',
        '<rect x="8" y="52" width="442" height="418" rx="10" fill="#fafafa" stroke="#cfd8dc"/>',
        '<rect x="460" y="52" width="452" height="418" rx="10" fill="#fafafa" stroke="#cfd8dc"/>',
        '<text x="18" y="70" font-family="monospace" font-size="12" fill="#1565c0">'
        f'{say("prefill first: _schedule_prefill")}</text>',
        '<text x="470" y="70" font-family="monospace" font-size="12" fill="#1565c0">'
        f'{say("else decode: _schedule_decode")}</text>',
    ]
    for corners, _ in arrows:
        path = " L".join(f"{x:g},{y:g}" for x, y in corners)
        parts.append(f'<path d="M{path}" fill="none" stroke="{FLOW_INK}" stroke-width="1.5" '
                     'marker-end="url(#flow-arrow)"/>')
    parts += shapes
    for _, label in arrows:
        if label:
            text, x, y, anchor = label
            parts.append(f'<text x="{x}" y="{y}" text-anchor="{anchor}" font-family="sans-serif" font-size="11" '
                         f'fill="#6a1b9a">{escape(say(text))}</text>')
    parts.append("</svg>")
    return "".join(parts)


# en: The drawing names the code: every method it shows must exist.
# zh: 图中写的是代码里的名字：它画出的每个方法都必须存在。
assert all(hasattr(scheduler_module.Scheduler, name) for name in ("schedule", "_schedule_prefill",
                                                                   "_schedule_decode", "_preempt", "postprocess"))
assert all(hasattr(block_manager_module.BlockManager, name) for name in ("can_allocate", "allocate", "can_append",
                                                                         "may_append"))
display(SVG(schedule_flow_svg()))

# %% [markdown] tags=["en"]
# ## Build it: admission
#
# `max_kv_tokens`, a property this chapter gives chapter 01's `Sequence`, is the rule above in one
# line. The settings are not checked again here: the
# engine builds the scheduler from a `Config` that checked every number where it entered
# (chapter 09), so the scheduler states its own invariants as plain `assert`s, as upstream does.

# %% [markdown] tags=["zh"]
# ## 动手：准入检查
#
# `max_kv_tokens` 是本章给第 01 章的 `Sequence` 加上的一个属性，用一行代码表达上面的规则。这里不再重复检查配置：
# 引擎用 `Config` 构建调度器，而 `Config`（第 09 章）在接收每个数值时就已检查过；所以调度器自己的不变量只用
# 普通的 `assert` 表达，上游也是这样做的。

# %% default module
#| default_exp engine.scheduler

# %% admission
#| export
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus

# en: The observer hook: called as observer(event, data) with event in "add", "schedule", "postprocess" (and the
# en: events later features add, such as speculative decoding's "drafts" and "verified").
# zh: 观察者钩子：以 observer(event, data) 的形式调用，event 为 "add"、"schedule"、"postprocess" 之一（以及后续功能
# zh: 新增的事件，比如投机解码的 "drafts" 和 "verified"）。
Observer = Callable[[str, dict], None]

# %% most kv tokens
#| export engine.sequence
from nanovllm.book.literate import add_to_class
from nanovllm.engine.sequence import Sequence


@add_to_class(Sequence)
@property
def max_kv_tokens(self) -> int:
    """The most tokens whose KV this sequence will ever hold: the prompt and all sampled tokens but the last."""
    # zh: 这个序列的 KV 最多会装下多少个 token：提示词，加上除最后一个之外的所有采样出的 token。
    return self.num_prompt_tokens + self.sampling_params.max_tokens - 1

# %% [markdown] tags=["en"]
# ## Build it: the scheduler
#
# One class, read it top to bottom:
#
# - `__init__` builds the block manager and the two queues. `observer` is `None` by default; when
#   set (the visualizations of the appendix do), `_notify` calls it at the end of `add`,
#   `schedule` and `postprocess` with plain data. When it is `None` nothing at all is collected for it.
# - `check_fits` refuses what can never run; `add` queues the rest and asserts that it is new.
# - `schedule` tries a prefill step and falls back to a decode step. Note how little the chunk
#   needs: a sequence that still holds blocks at the head of `waiting` is a chunked prefill in
#   progress, so it is not allocated again, and `num_cached_tokens` says where it stopped.
# - `_preempt` is recompute preemption: free everything, back to the head of `waiting`.
# - `postprocess` is chapter 01's `finish_step`, plus publishing and finishing: `_reached_end`
#   says whether a sampled token ends its sequence, and `_finish` frees the sequence's blocks.
#
# This is upstream's `scheduler.py`, method for method, with one change of rule (which sequence
# may be chunked, discussed at the end) and the admission check. Two later chapters add to this
# class: chapter 05 fills the two hooks that `postprocess` calls, `_fork_siblings` (a request
# forks into its n samples; here no sequence forks) and the block manager's `forget_copies` (the
# step made the copy-on-write copies planned for it; here none is planned), and chapter 18 splits
# `postprocess` in two for the asynchronous engine.

# %% [markdown] tags=["zh"]
# ## 动手：调度器
#
# 只有一个类，从上往下读：
#
# - `__init__` 构造块管理器和两个队列。`observer` 默认为 `None`；设置之后（附录中的可视化会设置它），`_notify`
#   会在 `add`、`schedule` 和 `postprocess` 的末尾调用它，传入普通数据。为 `None` 时，什么都不为它收集。
# - `check_fits` 拒绝永远无法运行的请求；`add` 把其余的排入队列，并断言它是新请求。
# - `schedule` 先尝试 prefill 步，不行再做 decode 步。分块几乎不需要额外的处理：`waiting` 队头的序列如果还持有块，
#   那就是一个做到一半的分块 prefill，所以不必再分配，`num_cached_tokens` 记着它停在哪里。
# - `_preempt` 是重算式抢占：释放一切，回到 `waiting` 队头。
# - `postprocess` 就是第 01 章的 `finish_step`，再加上发布和结束处理：`_reached_end` 判断一个采样出的 token
#   是否让序列结束，`_finish` 释放序列的块。
#
# 这就是上游的 `scheduler.py`，方法一一对应；只改了一条规则（哪个序列可以分块，本章末尾讨论），并加上了准入检查。
# 后面有两章会扩展这个类：第 05 章填上 `postprocess` 调用的两个接缝，`_fork_siblings`（一个请求分叉成它的 n 个样本；
# 这里没有序列分叉）和块管理器的 `forget_copies`（这一步已做完为该序列安排的写时复制；这里没有安排任何复制），第 18 章为
# 异步引擎把 `postprocess` 一分为二。

# %% scheduler
#| export
class Scheduler:
    """Decides what each step computes: prefill first, a token budget, chunked prefill, preemption."""
    # zh: 决定每一步计算什么：prefill 优先、token 预算、分块 prefill、抢占。

    def __init__(self, *, num_kvcache_blocks: int, kvcache_block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, eos_token_ids: Iterable[int] = (), enable_prefix_caching: bool = True):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_kvcache_blocks, kvcache_block_size, enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.observer: Observer | None = None

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    # en: ---- admission -----------------------------------------------------------
    # zh: ---- 准入 ---------------------------------------------------------------
    def check_fits(self, seq: Sequence) -> None:
        """Raise ValueError when ``seq`` could never run: its KV cannot fit the cache even alone."""
        # zh: ``seq`` 永远无法运行时抛出 ValueError：即使只有它一个，它的 KV 也放不进缓存。
        bm = self.block_manager
        blocks = -(-seq.max_kv_tokens // bm.block_size)
        if blocks > bm.num_blocks:
            raise ValueError(
                f"request {seq.seq_id} can never fit the KV cache: its {seq.num_prompt_tokens} prompt tokens and "
                f"max_tokens={seq.sampling_params.max_tokens} need up to {blocks} blocks of {bm.block_size} tokens, "
                f"but the cache has {bm.num_blocks}; shorten the prompt, lower max_tokens or enlarge the cache"
            )

    def add(self, seq: Sequence) -> None:
        """Queue a new request. Admission is `check_fits`, run once where a request enters (the engine's
        ``make_sequence``): what reaches ``add`` fits, and ``add`` only asserts the queue's invariants."""
        # zh: 把一个新请求排进队列。准入检查是 `check_fits`，在请求进入的地方（引擎的 ``make_sequence``）运行一次：
        # zh: 到达 ``add`` 的请求都放得下，``add`` 只断言队列的不变量。
        # en: The one place the block size is compared: every sequence enters the engine here.
        # zh: 唯一比较块大小的地方：每个序列都从这里进入引擎。
        assert seq.block_size == self.block_manager.block_size, "the sequence and the KV cache use other block sizes"
        assert seq.status is SequenceStatus.WAITING and not seq.block_table, f"sequence {seq.seq_id} is not new"
        self.waiting.append(seq)
        self._notify("add", {"seq": seq})

    # en: ---- one step ------------------------------------------------------------
    # zh: ---- 一步 ----------------------------------------------------------------
    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick this step's sequences and set their ``num_scheduled_tokens``; True if it is a prefill step."""
        # zh: 挑出这一步的序列并设置它们的 ``num_scheduled_tokens``；如果这是 prefill 步，返回 True。
        assert not self.is_finished(), "nothing to schedule"
        seqs, cache_hits = self._schedule_prefill()
        is_prefill, preempted = bool(seqs), []
        if not is_prefill:
            seqs, preempted = self._schedule_decode()
        assert seqs, "nothing can run: was a request added without check_fits?"
        self._notify("schedule",
                     {"seqs": list(seqs), "is_prefill": is_prefill, "preempted": preempted, "cache_hits": cache_hits})
        return seqs, is_prefill

    def _schedule_prefill(self) -> tuple[list[Sequence], dict[int, list[int]]]:
        scheduled: list[Sequence] = []
        cache_hits: dict[int, list[int]] = {}
        budget = self.max_num_batched_tokens
        while self.waiting and len(scheduled) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not seq.block_table:
                # en: New or preempted: it needs its blocks (a chunk in progress already has them).
                # zh: 新来的或被抢占过的序列需要分配块（正在分块 prefill 的序列已经有块了）。
                if not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
                if self.observer is not None and seq.num_cached_tokens:
                    cache_hits[seq.seq_id] = seq.block_table[: seq.num_cached_blocks]
            remaining = len(seq) - seq.num_cached_tokens
            seq.num_scheduled_tokens = min(remaining, budget)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if seq.num_scheduled_tokens < remaining:
                # en: A chunk: the budget is spent, and seq stays at the head of waiting.
                # zh: 这是一个分块：预算用完了，seq 留在 waiting 的队头。
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return scheduled, cache_hits

    def _schedule_decode(self) -> tuple[list[Sequence], list[Sequence]]:
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []
        limit = min(self.max_num_seqs, self.max_num_batched_tokens)
        while self.running and len(scheduled) < limit:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                # en: Out of blocks: preempt the newest running sequence, or seq itself if it is the last.
                # zh: 块用完了：抢占最新的运行序列；如果只剩它自己，就抢占它自己。
                victim = self.running.pop() if self.running else seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.may_append(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, preempted

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    # en: ---- after the step ------------------------------------------------------
    # zh: ---- 这一步之后 -----------------------------------------------------------
    def postprocess(self, seqs: list[Sequence], token_ids: list[int], is_prefill: bool) -> list[Sequence]:
        """Record a step's results: cache the computed tokens, publish full blocks, append each sampled token,
        finish sequences. ``token_ids`` has one token per sequence, then one per sibling that the step's sequences
        fork (`_fork_siblings`); returns the sequences that finished."""
        # zh: 记下一步的结果：缓存算好的 token，发布写满的块，给每个序列追加采样出的 token，结束该结束的序列。
        # zh: ``token_ids`` 里每个序列一个 token，然后是这一步的序列分叉出的每个兄弟序列一个（`_fork_siblings`）；
        # zh: 返回结束了的序列。
        seqs = [*seqs, *self._fork_siblings(seqs)]
        assert len(token_ids) == len(seqs) and all(seq.num_scheduled_tokens for seq in seqs), "not this step's tokens"
        finished: list[Sequence] = []
        for seq, token_id in zip(seqs, token_ids, strict=True):
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            # en: The step wrote these tokens' KV: full blocks can be published, and the copies planned
            # en: for it (copy-on-write) were made before it wrote.
            # zh: 这一步已写入这些 token 的 KV：写满的块可以发布了（第 03 章）；为这一步安排的复制（写时复制）
            # zh: 在写入之前就已做完。
            self.block_manager.publish_full_blocks(seq)
            self.block_manager.forget_copies(seq)
            if seq.num_cached_tokens < len(seq):
                # en: A partial prefill chunk samples nothing (the model runner passes -1).
                # zh: 只算了部分提示词的 prefill 分块不采样（模型执行器传入 -1）。
                continue
            seq.append_token(token_id)
            if self._reached_end(seq, token_id, len(seq)):
                self._finish(seq)
                finished.append(seq)
        self._notify("postprocess", {"seqs": seqs, "token_ids": list(token_ids), "finished": finished})
        return finished

    def _fork_siblings(self, seqs: list[Sequence]) -> list[Sequence]:
        """The siblings that a step's sequences fork, each recorded with its own first token: here, none (a hook
        that parallel sampling fills)."""
        # zh: 这一步的序列分叉出的兄弟序列，每个都带着自己的第一个 token：这里没有（这是一个钩子，由并行采样来填）。
        return []

    def _notify(self, event: str, data: dict) -> None:
        # en: Always the last thing a method does: the observer sees, and may interrupt, only a whole change.
        # zh: 总放在方法的最后：观察者看到的（以及可能打断的）总是一次完整的改动。
        if self.observer is not None:
            self.observer(event, data)

    def _reached_end(self, seq: Sequence, token_id: int, num_tokens: int) -> bool:
        """Whether ``token_id``, the ``num_tokens``-th token of ``seq``, ends it: an end-of-sequence token (unless
        ``ignore_eos``), or the last token that ``max_tokens`` allows."""
        # zh: ``token_id``（``seq`` 的第 ``num_tokens`` 个 token）是否让它结束：它是序列结束 token（除非
        # zh: ``ignore_eos``），或者是 ``max_tokens`` 允许的最后一个 token。
        params = seq.sampling_params
        eos = not params.ignore_eos and token_id in self.eos_token_ids
        return eos or num_tokens - seq.num_prompt_tokens >= params.max_tokens

    def _finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.block_manager.deallocate(seq)
        self.running.remove(seq)

# %% [markdown] tags=["en"]
# ### Two Python idioms in `_schedule_decode`
#
# **`while … else`.** The `else` block of a loop runs when the loop ends because its condition
# became false, and is skipped when `break` leaves it. In `_schedule_decode` the inner loop
# preempts until `can_append(seq)` holds: if it gets there, the `else` block gives `seq` its
# block and schedules it; if `seq` had to preempt itself, `break` skips that block, and `seq`,
# now back in `waiting`, is not scheduled.
#
# **`extendleft(reversed(...))`.** `deque.extendleft` inserts its items one at a time at the
# front, so they end up in reverse order; reversing them first keeps their order.
# `_schedule_decode` pops the sequences it schedules off the front of `running` and puts them
# back in front at the end, in their order: `running` stays oldest first, newest at the tail,
# where preemption takes its victims.

# %% [markdown] tags=["zh"]
# ### `_schedule_decode` 里的两个 Python 写法
#
# **`while … else`：** 循环的 `else` 块在循环因条件变为假而结束时执行；如果是 `break` 跳出的，就跳过它。
# `_schedule_decode` 的内层循环不断抢占，直到 `can_append(seq)` 成立：走到这一步，`else` 块就给 `seq` 分配块并
# 调度它；如果 `seq` 只能抢占自己，`break` 会跳过这个块，已回到 `waiting` 的 `seq` 就不会被调度。
#
# **`extendleft(reversed(...))`：** `deque.extendleft` 把元素逐个插到队头，结果顺序正好反过来；先反转一次，
# 就能保持原来的顺序。`_schedule_decode` 从 `running` 队头逐个弹出要调度的序列，最后再按原顺序放回队头：
# `running` 始终是最旧的在前、最新的在队尾，而抢占正是从队尾挑选对象。

# %%
from collections import deque


def make_room(blocks_needed: int, victims: list[str]) -> str:
    """The shape of `_schedule_decode`'s inner loop, with names instead of sequences."""
    # zh: `_schedule_decode` 内层循环的骨架，用名字代替序列。
    preempted = []
    while len(preempted) < blocks_needed:
        if not victims:
            # en: Nobody left to preempt: the else block is skipped.
            # zh: 没有可抢占的序列了：else 子句不会执行。
            break
        preempted.append(victims.pop())
    else:
        return f"scheduled, preempted {preempted}"
    return "preempted itself"


assert make_room(0, ["B"]) == "scheduled, preempted []"
assert make_room(1, ["B", "C"]) == "scheduled, preempted ['C']"
assert make_room(1, []) == "preempted itself"

front_first = deque(["D", "E"])
front_first.extendleft(["A", "B", "C"])
order_kept = deque(["D", "E"])
order_kept.extendleft(reversed(["A", "B", "C"]))
print(f"extendleft:           {list(front_first)}")
print(f"extendleft(reversed): {list(order_kept)}")
assert list(front_first) == ["C", "B", "A", "D", "E"] and list(order_kept) == ["A", "B", "C", "D", "E"]

# %% [markdown] tags=["en"]
# ## See it: three requests, a small cache, every mechanism at once
#
# A stand-in for the model: `fake_model` returns, for each scheduled sequence, a token computed
# from the tokens up to the last one this step computes, the way a real model's greedy choice
# depends only on its input. Three requests share a 4-token system prompt; A's prompt is long.
# The cache has 7 blocks of 4 tokens, a step may take 3 sequences and 12 tokens. We attach an
# observer that just records, and print one row per step: `A:12+2` means A had 12 tokens
# cached and this step computes 2 more.

# %% [markdown] tags=["zh"]
# ## 看它运行：三个请求、一个小缓存，所有机制同时登场
#
# 用 `fake_model` 代替模型：对每个被调度的序列，它取从开头到本步计算的最后一个 token 为止的所有 token，
# 由此算出一个 token，就像真实模型的贪心选择只取决于输入一样。三个请求共享一个 4 个 token 的系统提示词；
# A 的提示词很长。缓存有 7 个块、每块 4 个 token，每步最多 3 个序列、12 个 token。我们挂上一个只做记录的观察者，
# 每步打印一行：`A:12+2` 表示 A 已缓存 12 个 token，本步再算 2 个。

# %%
import xxhash

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams


def fake_model(seqs: list[Sequence], is_prefill: bool) -> list[int]:
    """A deterministic 'next token' from the tokens up to the last one each sequence computes."""
    # zh: 一个确定性的“下一个 token”，由每个序列直到它计算的最后一个 token 为止的那些 token 得出。
    out = []
    for seq in seqs:
        context = seq.token_ids[: seq.num_cached_tokens + seq.num_scheduled_tokens]
        out.append(xxhash.xxh64(str(context).encode()).intdigest() % 50)
    return out


def run(sched: Scheduler, names: dict[int, str], show: bool = True) -> list[dict]:
    """Drive the scheduler to the end; return one record per step."""
    # zh: 把调度器一直运行到结束；每一步返回一条记录。
    events: list[tuple[str, dict]] = []
    sched.observer = lambda event, data: events.append((event, data))
    steps = []
    while not sched.is_finished():
        seqs, is_prefill = sched.schedule()
        planned = [(names[s.seq_id], s.num_cached_tokens, s.num_scheduled_tokens) for s in seqs]
        sched.postprocess(seqs, fake_model(seqs, is_prefill), is_prefill)
        schedule_event, post_event = events[-2][1], events[-1][1]
        steps.append({
            "kind": "prefill" if is_prefill else "decode",
            "planned": planned,
            "preempted": [names[s.seq_id] for s in schedule_event["preempted"]],
            "hits": {names[i]: blocks for i, blocks in schedule_event["cache_hits"].items()},
            "finished": [names[s.seq_id] for s in post_event["finished"]],
            "waiting": [names[s.seq_id] for s in sched.waiting],
            "running": [names[s.seq_id] for s in sched.running],
            "free": sched.block_manager.num_free_blocks,
        })
        if show:
            r = steps[-1]
            planned_text = " ".join(f"{n}:{c}+{k}" for n, c, k in planned)
            print(f"{len(steps):>4} {r['kind']:<8} {planned_text:<24} {','.join(r['preempted']) or '-':<9} "
                  f"{r['hits'] or '-'!s:<20} {','.join(r['finished']) or '-':<8} {r['waiting']!s:<16} "
                  f"{r['running']!s:<16} {r['free']}")
    sched.observer = None
    return steps


sched = Scheduler(num_kvcache_blocks=7, kvcache_block_size=4, max_num_seqs=3, max_num_batched_tokens=12)
params = SamplingParams(max_tokens=6, ignore_eos=True)
system = [31, 32, 33, 34]
prompts = {"A": [*system, *range(1, 11)], "B": [*system, 11, 12], "C": [*system, 13, 14, 15]}
seqs = {name: Sequence(p, params, block_size=4) for name, p in prompts.items()}
names = {seq.seq_id: name for name, seq in seqs.items()}
for seq in seqs.values():
    sched.add(seq)
print(f"{say('step'):>4} {say('kind'):<8} {say('scheduled'):<24} {say('preempted'):<9} {say('cache hits'):<20} "
      f"{say('finished'):<8} {say('waiting'):<16} {say('running'):<16} {say('free')}")
steps = run(sched, names)

# %% [markdown] tags=["en"]
# Step by step:
#
# - **Step 1.** A's 14-token prompt does not fit the 12-token budget: a **chunk** of 12. A stays
#   at the head of `waiting` and gets no token (postprocess ignores what our fake model returns
#   for it). Its three full blocks are
#   published.
# - **Step 2.** A's last 2 prompt tokens, then B and C, which find the system prompt's block in
#   the cache (`hits`) and compute only their own tokens. All three start running.
# - **Steps 3 and 4.** Decode steps. Step 4 takes the last free block.
# - **Step 5.** A needs a new block and none is free: C, the newest, is **preempted** (blocks
#   freed, back to `waiting`); A and B go on. No prefill happens while the cache is full: C
#   cannot be allocated until A and B finish at step 7.
# - **Step 8.** C is prefilled again: its 10 tokens, minus the system-prompt block found in the
#   cache. Its own old blocks were overwritten in the meantime, so they are recomputed.

# %% [markdown] tags=["zh"]
# 逐步来看：
#
# - **第 1 步：** A 的 14 个 token 的提示词超出 12 个 token 的预算：先算一个 12 个 token 的**分块**。A 留在
#   `waiting` 队头，没有得到 token（后处理忽略我们的假模型为它返回的值）。写满的三个块随即发布。
# - **第 2 步：** A 剩下的 2 个提示词 token，然后是 B 和 C：它们在缓存中找到系统提示词的块（`hits`），
#   只计算自己的 token。三个序列都开始运行。
# - **第 3、4 步：** decode 步。第 4 步用掉了最后一个空闲块。
# - **第 5 步：** A 需要新块，却没有空闲块：最新的 C 被**抢占**（块被释放，回到 `waiting`）；A 和 B 继续。
#   缓存满着的时候不会有 prefill：直到 A 和 B 在第 7 步结束，C 才能分配到块。
# - **第 8 步：** C 重新 prefill：它的 10 个 token，减去在缓存中找到的系统提示词块。它自己的旧块在此期间已被
#   覆盖，所以要重算。

# %% [markdown] tags=["en"]
# ### Animated: a chunked prefill, then a preemption storm
#
# Two recordings of this scheduler with a fake model (the player comes from appendix A). First,
# a 20-token prompt with a budget of 8 tokens per step: chunks of 8 + 8 + 4, the sequence
# waiting at the head of the queue between chunks. Second, four requests in a pool of six
# 4-token blocks: decode keeps needing blocks, the newest running sequence is preempted again
# and again, and still every request finishes.

# %% [markdown] tags=["zh"]
# ### 动画：分块 prefill，然后是一场抢占风暴
#
# 下面是本调度器配合假模型录下的两段过程（播放器来自附录 A）。第一段：20 个 token 的提示词，每步预算 8 个 token，
# 分块为 8 + 8 + 4，分块之间，序列在等待队列队头等候。第二段：4 个请求挤在 6 个块（每块 4 个 token）的块池里：
# decode 不断需要新块，最新的运行序列一次又一次被抢占，但所有请求最终都完成了。

# %% animations
from IPython.display import display

from nanovllm.viz import FakeEngine, Player

chunky = FakeEngine(num_kvcache_blocks=10, kvcache_block_size=4, max_num_batched_tokens=8)
chunky.add(list(range(50, 70)), max_tokens=2)
chunky.run()
display(Player(chunky.recording))
chunks = [f["event"]["scheduled"][0]["num_tokens"] for f in chunky.recording["frames"]
          if f["phase"] == "schedule" and f["event"]["is_prefill"]]
assert chunks == [8, 8, 4]

storm = FakeEngine(num_kvcache_blocks=6, kvcache_block_size=4)
for i in range(4):
    storm.add([100 * (i + 1) + t for t in range(6)], max_tokens=8)
storm.run()
display(Player(storm.recording))
storm_frames = storm.recording["frames"]
preemptions = [s for f in storm_frames if f["phase"] == "schedule" for s in f["event"]["preempted"]]
assert len(preemptions) >= 2 and all(s["status"] == "FINISHED" for s in storm_frames[-1]["seqs"])
print(say("chunks {chunks}; storm: {preempted} preemptions, all 4 requests finished",
          chunks=chunks, preempted=len(preemptions)))

# %% [markdown] tags=["en"]
# ### The article's worked example: a cache hit, then two chunks
#
# The line-by-line annotation of upstream's `sequence.py` and `scheduler.py` follows one request
# through a prefix-cache hit and chunked prefill, with numbers. Blocks of 256 tokens, a step
# budget (`max_num_batched_tokens`) of 200 tokens, and a 600-token prompt whose first block is
# already in the cache:
#
# 1. **The first step is scheduled.** `allocate` finds the first block in the cache, so
#    `num_cached_tokens` is 256 before anything runs. Of the 344 tokens left, the budget takes
#    200: `num_scheduled_tokens` is 200. The rest does not fit, so this is a chunk: the request
#    holds all three of its blocks and stays WAITING at the head of `waiting`.
# 2. **After the step**, postprocess moves the scheduled tokens to the cached ones:
#    256 + 200 = 456 tokens computed. Nothing is appended: the chunk's last logits predict
#    position 456, which is inside the prompt.
# 3. **The next step** schedules the remaining 600 − 456 = 144 tokens. They fit, so the request
#    moves to `running` and becomes RUNNING. After the step all 600 prompt tokens are computed
#    and the first new token is appended: 601 tokens.
# 4. **The first decode step** computes token 601 (it was sampled, but its KV was never
#    computed), so 601 tokens are computed after it, and it appends the second new token.
#
# For the hit, an earlier request must have published that block: one with the same first 256
# tokens (the same system prompt, say) ran and finished, and left its first block free but still
# cached. Below, the real scheduler runs both, with `fake_model` for the tokens.

# %% [markdown] tags=["zh"]
# ### 文章的例子：一次缓存命中，然后两个分块
#
# 逐行注解上游 `sequence.py` 和 `scheduler.py` 的那篇文章，用具体数字跟踪一个请求走过前缀缓存命中和分块 prefill。
# 每块 256 个 token，每步预算（`max_num_batched_tokens`）200 个 token，一个 600 个 token 的提示词，它的第一块
# 已经在缓存里：
#
# 1. **调度第一步。** `allocate` 在缓存里找到第一块，所以还没计算任何东西，`num_cached_tokens` 就是 256。剩下的
#    344 个 token 中，预算取走 200 个：`num_scheduled_tokens` 为 200。其余的放不下，所以这是一个分块：请求持有
#    它全部三个块，保持 WAITING，留在 `waiting` 队头。
# 2. **这一步之后**，后处理把调度的 token 计入已缓存的 token：256 + 200 = 456 个 token 已算完。不追加任何 token：
#    分块最后一行 logits 预测的是位置 456，还在提示词内部。
# 3. **下一步**调度剩下的 600 − 456 = 144 个 token。它们放得下，于是请求进入 `running`，状态变为 RUNNING。这一步
#    之后，600 个提示词 token 全部算完，并追加第一个新 token：共 601 个 token。
# 4. **第一个 decode 步**计算第 601 个 token（它已被采样出来，但它的 KV 还没算过），所以这一步之后已算完 601 个
#    token，并追加第二个新 token。
#
# 要命中缓存，先得有请求发布过这一块：一个前 256 个 token 相同的请求（比如系统提示词相同）已经运行并结束，它的
# 第一块虽已空闲，但仍在缓存中。下面用真正的调度器把两个请求都跑一遍，token 由 `fake_model` 给出。

# %% the article's worked example
worked = Scheduler(num_kvcache_blocks=8, kvcache_block_size=256, max_num_seqs=4, max_num_batched_tokens=200)
# en: One block of 256 tokens.
# zh: 一个 256 个 token 的块。
shared_prefix = list(range(1000, 1256))
earlier = Sequence([*shared_prefix, 7], SamplingParams(max_tokens=1), block_size=256)
worked.add(earlier)
run(worked, {earlier.seq_id: "earlier"}, show=False)
# en: The earlier request's first block.
# zh: 先前那个请求的第一个块。
published = list(worked.block_manager.hash_to_block_id.values())

request = Sequence([*shared_prefix, *range(2000, 2344)], SamplingParams(max_tokens=3, ignore_eos=True),
                   block_size=256)
worked.add(request)
worked_steps = []
for _ in range(3):
    batch, is_prefill = worked.schedule()
    planned = {"kind": "prefill" if is_prefill else "decode", "cached": request.num_cached_tokens,
               "scheduled": request.num_scheduled_tokens, "status": request.status.name,
               "at the head": bool(worked.waiting) and worked.waiting[0] is request,
               "blocks": list(request.block_table)}
    worked.postprocess(batch, fake_model(batch, is_prefill), is_prefill)
    worked_steps.append({**planned, "computed after": request.num_cached_tokens, "len after": len(request)})
print(say("prompt: {tokens} tokens; blocks {table}, the first a hit on {published}",
          tokens=request.num_prompt_tokens, table=request.block_table, published=published))
print(f"{say('step'):>4} {say('kind'):<8} {say('cached'):>7} {say('scheduled'):>10} {say('status'):<8} "
      f"{say('computed after'):>15} {say('len after'):>10}")
for i, s in enumerate(worked_steps, start=1):
    print(f"{i:>4} {s['kind']:<8} {s['cached']:>7} {s['scheduled']:>10} {s['status']:<8} {s['computed after']:>15} "
          f"{s['len after']:>10}")

# %%
# en: The article's numbers: 256 cached + 200 scheduled, 456 computed; then 144 and RUNNING; 601 tokens.
# zh: 文章里的数字：256 个已缓存 + 200 个调度，算完 456 个；然后是 144 个，状态 RUNNING；601 个 token。
assert request.num_prompt_tokens == 600 and published == request.block_table[:1]
chunk_step, last_chunk, decode_step = worked_steps
# en: The chunk already holds all three blocks of its 600 tokens, the first the hit; the table never changes.
# zh: 分块时它已持有 600 个 token 所需的全部三个块，第一块就是命中的那块；块表此后不再改变。
assert len(chunk_step["blocks"]) == 3 and chunk_step["blocks"][0] == published[0]
assert chunk_step["blocks"] == last_chunk["blocks"] == decode_step["blocks"] == request.block_table
assert (chunk_step["kind"], chunk_step["cached"], chunk_step["scheduled"]) == ("prefill", 256, 200)
# en: A chunk keeps its place.
# zh: 分块的序列保持原位。
assert chunk_step["status"] == "WAITING" and chunk_step["at the head"]
# en: A chunk appends nothing.
# zh: 分块不追加 token。
assert chunk_step["computed after"] == 456 and chunk_step["len after"] == 600
assert (last_chunk["kind"], last_chunk["scheduled"], last_chunk["status"]) == ("prefill", 144, "RUNNING")
assert not last_chunk["at the head"] and request in worked.running
# en: The first new token.
# zh: 第一个新 token。
assert last_chunk["computed after"] == 600 and last_chunk["len after"] == 601
assert (decode_step["kind"], decode_step["scheduled"]) == ("decode", 1)
assert decode_step["computed after"] == 601 and decode_step["len after"] == 602

# %% [markdown] tags=["en"]
# ## Check it
#
# The story above, asserted. Then the strongest check of all: **scheduling is invisible in the
# output.** Chunking, sharing and preemption change *when* tokens are computed, never *which*
# tokens come out. Each request run alone, in a cache so large that nothing is ever chunked,
# shared or preempted, must produce exactly the same completion.

# %% [markdown] tags=["zh"]
# ## 验证
#
# 先用断言检查上面的叙述。然后是最有力的检查：**输出里看不出调度的痕迹。** 分块、共享和抢占改变的只是 token
# *何时*计算，而不是产出*哪些* token。让每个请求单独运行，缓存大到不会发生任何分块、共享或抢占，得到的生成内容
# 必须完全相同。

# %%
assert steps[0]["planned"] == [("A", 0, 12)] and steps[0]["waiting"][0] == "A"
assert steps[1]["planned"] == [("A", 12, 2), ("B", 4, 2), ("C", 4, 3)]
assert steps[1]["hits"] == {"B": [0], "C": [0]}
assert all(all(k == 1 for _, _, k in s["planned"]) for s in steps if s["kind"] == "decode")
preemptions = [(i + 1, s["preempted"]) for i, s in enumerate(steps) if s["preempted"]]
assert preemptions == [(5, ["C"])] and steps[4]["waiting"] == ["C"]
assert steps[7]["kind"] == "prefill" and steps[7]["planned"] == [("C", 4, 6)] and steps[7]["hits"] == {"C": [0]}
for s in steps:
    assert sum(k for _, _, k in s["planned"]) <= 12 and len(s["planned"]) <= 3
assert all(seq.status is SequenceStatus.FINISHED and seq.num_completion_tokens == 6 for seq in seqs.values())
assert sched.block_manager.num_free_blocks == 7 and sched.is_finished()


def alone(prompt: list[int], params: SamplingParams) -> list[int]:
    solo = Scheduler(num_kvcache_blocks=64, kvcache_block_size=4, max_num_seqs=1, max_num_batched_tokens=1024)
    seq = Sequence(prompt, params, block_size=4)
    solo.add(seq)
    run(solo, {seq.seq_id: "solo"}, show=False)
    return seq.completion_token_ids


for name, seq in seqs.items():
    assert seq.completion_token_ids == alone(prompts[name], params), name
print(say("the trace holds, and every completion equals the request's solo run"))

# %% [markdown] tags=["en"]
# The same on a busier workload, with end-of-sequence tokens this time: 12 requests with shared
# prefixes, a cache of 12 blocks of 2 tokens, a budget of 5 tokens. Preemptions and chunks are
# frequent, and still every completion matches its solo run, every request finishes, and the
# cache ends empty.

# %% [markdown] tags=["zh"]
# 在更繁忙的工作负载上再验证一次，这次带上结束符：12 个有共享前缀的请求，12 个块、每块 2 个 token 的缓存，每步预算
# 5 个 token。抢占和分块频繁发生，但每个生成结果仍与单独运行时一致，每个请求都会结束，缓存最后全部空闲。

# %%
import random

rng = random.Random(4)
busy = Scheduler(num_kvcache_blocks=12, kvcache_block_size=2, max_num_seqs=4, max_num_batched_tokens=5,
                 eos_token_ids=[7])
busy_prompts, busy_params, busy_seqs = {}, {}, {}
for i in range(12):
    name = f"r{i}"
    busy_prompts[name] = [1, 2, 3][: rng.randint(0, 3)] + [rng.randrange(50) for _ in range(rng.randint(1, 8))]
    busy_params[name] = SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=rng.random() < 0.5)
    busy_seqs[name] = Sequence(busy_prompts[name], busy_params[name], block_size=2)
    busy.add(busy_seqs[name])
busy_steps = run(busy, {s.seq_id: n for n, s in busy_seqs.items()}, show=False)
num_preempted = sum(len(s["preempted"]) for s in busy_steps)
num_chunks = sum(1 for s in busy_steps if s["kind"] == "prefill" and s["waiting"][:1] == [s["planned"][-1][0]])
print(say("{steps} steps, {preempted} preemptions, {chunked} chunked prefill steps",
          steps=len(busy_steps), preempted=num_preempted, chunked=num_chunks))
assert num_preempted > 0 and num_chunks > 0 and busy.block_manager.num_free_blocks == 12
for name, seq in busy_seqs.items():
    assert seq.is_finished and seq.completion_token_ids == alone(busy_prompts[name], busy_params[name]), name

# %% [markdown] tags=["en"]
# ### Preemption, one step at a time
#
# The line-by-line annotation of upstream's scheduler explains preemption with four running
# sequences, A, B, C and D (oldest first), no free block, and every one of them needing a new
# block for its next token. A takes the front and preempts D, the newest; D's block goes to A.
# B preempts C. C and D go back to the *head* of `waiting`: C in front, since it was preempted
# last and `_preempt` uses `appendleft`. The step decodes A and B only. Here it is, run by our
# scheduler: four 4-token prompts fill a pool of four 4-token blocks, and after the prefill step
# every sequence holds 5 tokens, so each needs a second block.
#
# A sequence can also **preempt itself**. Two sequences share three blocks of 2 tokens; after
# the prefill both need a block and one is free. A, in front, takes it. When B's turn comes,
# nothing behind it is left in `running` (A was popped and already got its block), so B
# preempts itself: it gives back its blocks, returns to `waiting` and is not scheduled. It is
# prefilled again once A has finished.

# %% [markdown] tags=["zh"]
# ### 抢占，一步一步看
#
# 逐行注解上游调度器的那篇文章，用四个运行中的序列讲解抢占：A、B、C、D（从旧到新），没有空闲块，而每个序列的下一个
# token 都需要一个新块。A 排在最前，它抢占最新的 D，D 的块归 A。B 抢占 C。C 和 D 回到 `waiting` 的*队头*：C 在前，
# 因为它最后被抢占，而 `_preempt` 用的是 `appendleft`。这一步只 decode A 和 B。下面用我们的调度器把它跑一遍：
# 四个 4 token 的提示词正好占满四个 4 token 的块；prefill 之后每个序列有 5 个 token，所以都需要第二个块。
#
# 序列还可能**抢占自己**。两个序列共用三个 2 token 的块；prefill 之后两者都需要新块，而空闲块只有一个。排在前面的
# A 拿走了它。轮到 B 时，`running` 里已经没有排在它后面的序列了（A 已被弹出，并且拿到了块），于是 B 抢占自己：
# 归还自己的块，回到 `waiting`，这一步不被调度。等 A 结束后，B 再重新 prefill。

# %%
def one_step(sched: Scheduler, names: dict[int, str]) -> dict:
    """Schedule and postprocess one step; what it scheduled and preempted, and the queues after it."""
    # zh: 调度并后处理一步；返回它调度了什么、抢占了什么，以及这一步之后的各个队列。
    events: list[tuple[str, dict]] = []
    sched.observer = lambda event, data: events.append((event, data))
    seqs, is_prefill = sched.schedule()
    sched.postprocess(seqs, fake_model(seqs, is_prefill), is_prefill)
    sched.observer = None
    preempted = next(data["preempted"] for event, data in events if event == "schedule")
    return {
        "kind": "prefill" if is_prefill else "decode",
        "scheduled": [names[s.seq_id] for s in seqs],
        "preempted": [names[s.seq_id] for s in preempted],
        "running": [names[s.seq_id] for s in sched.running],
        "waiting": [names[s.seq_id] for s in sched.waiting],
        "free": sched.block_manager.num_free_blocks,
    }


def show_step(step: dict) -> None:
    print(f"{step['kind']:<8} {say('scheduled')} {','.join(step['scheduled']):<10} {say('preempted')} "
          f"{','.join(step['preempted']) or '-':<4} {say('running')} {','.join(step['running']) or '-':<10} "
          f"{say('waiting')} {','.join(step['waiting']) or '-':<10} {say('free')} {step['free']}")


quad = Scheduler(num_kvcache_blocks=4, kvcache_block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
abcd = {name: Sequence([10 * i + t for t in range(4)], SamplingParams(max_tokens=3, ignore_eos=True), block_size=4)
        for i, name in enumerate("ABCD")}
abcd_names = {seq.seq_id: name for name, seq in abcd.items()}
for seq in abcd.values():
    quad.add(seq)
print(say("four sequences, four blocks:"))
quad_steps = [one_step(quad, abcd_names)]
assert quad_steps[0]["free"] == 0 and all(len(seq) % 4 == 1 for seq in abcd.values())
quad_steps.append(one_step(quad, abcd_names))
for step in quad_steps:
    show_step(step)

pair = Scheduler(num_kvcache_blocks=3, kvcache_block_size=2, max_num_seqs=2, max_num_batched_tokens=8,
                 enable_prefix_caching=False)
ab = {name: Sequence(prompt, SamplingParams(max_tokens=4, ignore_eos=True), block_size=2)
      for name, prompt in (("A", [1, 2]), ("B", [3, 4]))}
ab_names = {seq.seq_id: name for name, seq in ab.items()}
for seq in ab.values():
    pair.add(seq)
print(say("two sequences, three blocks:"))
pair_steps = []
while not pair.is_finished():
    pair_steps.append(one_step(pair, ab_names))
    show_step(pair_steps[-1])

# %%
# en: The annotation's example: A preempts D, B preempts C, and C, D wait at the head in that order.
# zh: 注解文章的例子：A 抢占 D，B 抢占 C，C、D 按这个顺序在队头等待。
assert quad_steps[1]["scheduled"] == ["A", "B"] and quad_steps[1]["preempted"] == ["D", "C"]
assert quad_steps[1]["running"] == ["A", "B"] and quad_steps[1]["waiting"] == ["C", "D"]
assert abcd["C"].block_table == [] and abcd["D"].status is SequenceStatus.WAITING
# en: Self-preemption: B has nobody left to preempt and gives up its own blocks; it finishes anyway.
# zh: 自我抢占：B 没有别人可抢占，只能交出自己的块；它最后照样完成。
assert pair_steps[1]["scheduled"] == ["A"] and pair_steps[1]["preempted"] == ["B"]
assert pair_steps[1]["waiting"] == ["B"] and ab["B"].block_table == []
assert all(seq.is_finished and seq.num_completion_tokens == 4 for seq in ab.values())

# %% [markdown] tags=["en"]
# ### The decode cap
#
# A decode step computes one token per sequence, and the token budget bounds every step, decode
# steps included: at most `min(max_num_seqs, max_num_batched_tokens)` sequences decode together.
# Upstream caps decode at `max_num_seqs` alone, so with a budget smaller than `max_num_seqs` its
# decode steps can be larger than any step the model runner measured in its warm-up forward
# when it sized the KV cache (chapter 09). Below, five sequences run with `max_num_seqs=8` and a
# budget of 3: every decode step takes three of them, and all five finish.

# %% [markdown] tags=["zh"]
# ### decode 的上限
#
# decode 步为每个序列计算一个 token，而 token 预算约束每一步，decode 步也不例外：同时 decode 的序列最多
# `min(max_num_seqs, max_num_batched_tokens)` 个。上游只用 `max_num_seqs` 限制 decode，所以当预算小于
# `max_num_seqs` 时，它的 decode 步可能比模型执行器在确定 KV 缓存大小时做的预热前向（第 09 章）还要大。
# 下面五个序列在 `max_num_seqs=8`、预算为 3 的设置下运行：每个 decode 步取其中三个，五个序列最终都完成了。

# %%
capped = Scheduler(num_kvcache_blocks=16, kvcache_block_size=4, max_num_seqs=8, max_num_batched_tokens=3)
five = {name: Sequence([i], SamplingParams(max_tokens=3, ignore_eos=True), block_size=4)
        for i, name in enumerate("VWXYZ")}
for seq in five.values():
    capped.add(seq)
capped_steps = []
while not capped.is_finished():
    capped_steps.append(one_step(capped, {seq.seq_id: name for name, seq in five.items()}))
decode_sizes = [len(step["scheduled"]) for step in capped_steps if step["kind"] == "decode"]
print(say("decode batch sizes: {sizes} (max_num_seqs=8, budget 3)", sizes=decode_sizes))
assert max(decode_sizes) == 3 and all(seq.is_finished for seq in five.values())

# %% [markdown] tags=["en"]
# ### Why batch, and why cap the batch: decode cost per token
#
# A decode step has a part that its tokens share and a part that each token adds. Shared: the
# step reads all the weights once and pays a fixed cost to start its work; on a GPU these two
# are most of a small decode step. Added: each token's own arithmetic and its own KV.
# Per token, the shared part shrinks like 1/batch and the added part does not, so against a lone
# sequence the cost per token falls fast over the first few sequences, then ever more slowly,
# and flattens toward what one more token adds. Where it flattens depends on that added cost: on
# a GPU one more token costs little next to reading the weights, so the cost per token keeps
# falling over far larger batches (chapter 19 times decode steps of 1 to 64 sequences on an H200);
# on a CPU running this tiny model, one more token adds a good share of a step, and the curve is
# already flattening at 16.
#
# Below, the engine of chapter 10 runs the tiny random Qwen3 of chapter 00's tour on the CPU and
# times decode steps of 1, 2, 4, 8 and 16 sequences (three runs of each, the median step). The
# cell asserts what no load can change: a step is one call of the model whatever its batch, so
# the weights are read once for all its tokens. The times are printed, not asserted. In one
# quiet run, the cost per token against batch 1 was 0.59 at 2, 0.35 at 4, 0.23 at 8 and 0.17 at
# 16. On a loaded machine, a CI runner with tests beside it, any step can be stretched and the
# ratios can come out anywhere, even rising between 4 and 16 (319 to 391 µs per token in one
# run). Chapter 19 measures on a GPU, properly.
#
# What bounds the batch is memory, which is why `max_num_seqs` exists: every running sequence
# holds its KV blocks, so more of them fill the cache sooner and preempt more often, and
# chapter 14 captures CUDA graphs for batch sizes up to `max_num_seqs` (512 at most), with input buffers sized
# for the largest.

# %% [markdown] tags=["zh"]
# ### 为什么要成批，又为什么要给批次设上限：每个 token 的 decode 开销
#
# 一个 decode 步的开销分两部分：一部分由这一步的所有 token 分摊，另一部分随每个 token 增加。分摊的部分：这一步要把
# 全部权重读一遍，还要付一笔启动计算的固定开销（在 GPU 上，小批次 decode 步的时间大多花在这两项上）。增加的部分：每个
# token 自己的计算和自己的 KV。摊到每个 token 上，分摊的部分与批大小成反比，增加的部分则不变；所以和单个序列相比，
# 每个 token 的开销在头几个序列时下降很快，之后越降越慢，趋于平坦，逼近多算一个 token 所增加的开销。曲线在哪里变平，
# 取决于这部分增加的开销：在 GPU 上，多算一个 token 的开销比读一遍权重小得多，批次大得多时每个 token 的开销仍在
# 下降（第 19 章在 H200 上给 1 到 64 个序列的 decode 步计时）；在 CPU 上跑这个小模型，多一个 token 就要多花一步中
# 相当大的一部分时间，到 16 时曲线已经在变平。
#
# 下面用第 10 章的引擎在 CPU 上运行第 00 章导览中的随机小 Qwen3，分别给 1、2、4、8、16 个序列的 decode 步计时（每种
# 跑三遍，取中位数）。单元断言的是任何负载都改变不了的事：无论批次多大，一步都只调用一次模型，权重只为这一步的所有
# token 读一遍。时间只打印、不断言。在一次机器比较空闲的运行中，每个 token 的开销相对批大小 1 的比例是：2 时 0.59，
# 4 时 0.35，8 时 0.23，16 时 0.17。在负载高的机器上（比如同时跑着测试的 CI 机器），任何一步都可能被拖慢，这些比例
# 什么样都可能，甚至从 4 到 16 反而上升（有一次每 token 从 319 µs 升到 391 µs）。第 19 章会在 GPU 上认真测量。
#
# 限制批大小的是显存，这正是 `max_num_seqs` 存在的原因：每个运行中的序列都持有自己的 KV 块，序列越多，缓存越早
# 被占满，抢占也越频繁；而且第 14 章要为不超过 `max_num_seqs`（最多 512）的一系列批大小捕获 CUDA Graph，输入缓冲区按其中
# 最大的那个分配。

# %% decode cost per token
import statistics
import time

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.engine.llm_engine import LLMEngine

tiny = LLMEngine(str(build_tiny_model("qwen3")), device="cpu", max_num_seqs=16, num_kvcache_blocks=64,
                 kvcache_block_size=16)


# en: Count the model's calls: a forward hook runs once per call of the model.
# zh: 数一数模型被调用了几次：前向钩子在每次调用模型时运行一次。
model_calls = [0]
tiny.model_runner.model.register_forward_hook(lambda *_: model_calls.__setitem__(0, model_calls[0] + 1))


def decode_step_times(batch: int, steps: int = 8) -> list[float]:
    """Seconds per decode step while `batch` requests of 4-token prompts decode together."""
    # zh: `batch` 个 4 token 提示词的请求一起 decode 时，每个 decode 步的秒数。
    for i in range(batch):
        tiny.add_request([1 + i, 2, 3, 4], SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    times = []
    while not tiny.is_finished():
        calls_before, started = model_calls[0], time.perf_counter()
        _, num_tokens, is_prefill = tiny.step()
        if not is_prefill:
            times.append(time.perf_counter() - started)
            # en: The whole batch decodes in one step, one call of the model (one read of the weights).
            # zh: 整批序列在同一步里完成 decode：只调用一次模型（权重只读一遍）。
            assert num_tokens == batch and model_calls[0] - calls_before == 1
    return times


# en: Warm up: the first steps of a fresh engine are slower.
# zh: 预热：新建引擎的头几步比较慢。
decode_step_times(16)
step_times: dict[int, list[float]] = {1: [], 2: [], 4: [], 8: [], 16: []}
for _ in range(3):
    for batch_size in step_times:
        step_times[batch_size] += decode_step_times(batch_size)
per_token = {batch_size: statistics.median(times) / batch_size for batch_size, times in step_times.items()}
print(f"{say('batch'):>6} {say('ms per step'):>12} {say('µs per token'):>13}")
for batch_size, times in step_times.items():
    print(f"{batch_size:>6} {statistics.median(times) * 1e3:>12.2f} {per_token[batch_size] * 1e6:>13.0f}")
# en: The cost per token against batch 1, printed, not asserted: a loaded machine can reorder these.
# zh: 每个 token 的开销相对批大小 1 的比例，只打印、不断言：机器负载高时它们的顺序可能颠倒。
print(say("µs per token against batch 1: {ratios}",
          ratios=", ".join(f"{b}: {per_token[b] / per_token[1]:.2f}x" for b in (2, 4, 8, 16))))

# %% [markdown] tags=["en"]
# ### Why admission stops at the head of the queue
#
# When the head of `waiting` cannot get its blocks, `_schedule_prefill` stops (`break`); it does
# not look further down the queue for a smaller request that would fit. Skipping ahead would
# fill the step better for a moment, but a long request could then wait forever: as long as
# short requests keep arriving, each block that running sequences give back would go to
# whichever short request fits, and the long one would never see enough free blocks at once.
# Stopping at the head makes `waiting` first-in, first-out: the head waits only for blocks that
# running sequences return as they finish (or are preempted), and nothing behind it can take
# them first. The head is never starved. Below, `Long` needs 3 blocks and `Short` 1, and 2 are
# free: `Short` would fit, but it waits behind `Long`.

# %% [markdown] tags=["zh"]
# ### 为什么准入在队头停下
#
# 当 `waiting` 队头分不到块时，`_schedule_prefill` 就停下（`break`），而不是继续往后找一个放得下的小请求。
# 跳过队头一时能把这一步填得更满，但长请求可能因此永远等下去：只要短请求源源不断地到来，运行序列每归还一个块，
# 都会被某个放得下的短请求拿走，长请求永远等不到足够多的空闲块同时出现。在队头停下，让 `waiting` 成为先进先出
# 的队列：队头只需等待运行序列结束（或被抢占）时归还的块，排在它后面的请求不能抢先拿走。队头永远不会被饿死。
# 下面 `Long` 需要 3 个块，`Short` 需要 1 个，空闲的有 2 个：`Short` 放得下，却要排在 `Long` 后面等。

# %%
fifo = Scheduler(num_kvcache_blocks=4, kvcache_block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                 enable_prefix_caching=False)
fifo_seqs = {
    "Old": Sequence(list(range(8)), SamplingParams(max_tokens=3, ignore_eos=True), block_size=4),
    "Long": Sequence(list(range(20, 32)), SamplingParams(max_tokens=1, ignore_eos=True), block_size=4),
    "Short": Sequence([40, 41], SamplingParams(max_tokens=2, ignore_eos=True), block_size=4),
}
fifo_names = {seq.seq_id: name for name, seq in fifo_seqs.items()}
fifo.add(fifo_seqs["Old"])
# en: Old is prefilled and holds 2 of the 4 blocks.
# zh: Old 完成 prefill，占用 4 个块中的 2 个。
first = one_step(fifo, fifo_names)
fifo.add(fifo_seqs["Long"])
fifo.add(fifo_seqs["Short"])
fifo_steps = [first]
while not fifo.is_finished():
    fifo_steps.append(one_step(fifo, fifo_names))
for step in fifo_steps:
    show_step(step)
assert fifo_steps[1]["kind"] == "decode" and fifo_steps[1]["waiting"] == ["Long", "Short"]
# en: Old's decode took one of the two free blocks; Short would have fit before.
# zh: Old 的 decode 用掉了两个空闲块中的一个；在此之前 Short 本来放得下。
assert fifo_steps[1]["free"] == 1
started = [next(i for i, step in enumerate(fifo_steps) if name in step["scheduled"]) for name in ("Long", "Short")]
# en: Short never starts before Long.
# zh: Short 从不会先于 Long 开始。
assert started[0] <= started[1]

# %% [markdown] tags=["en"]
# ### Recompute, not swap
#
# A preempted sequence loses its KV, and recomputes it when it is prefilled again. vLLM's
# original engine could instead *swap* the victim's blocks out to CPU memory and copy them back
# later. nano-vllm, and this book, only recompute, for three reasons. Simplicity: swapping
# needs a second block pool in host memory, copies on their own stream, and a third state for
# a sequence whose KV lives on the host. Cost: KV is large (Qwen3-0.6B keeps 2 × 28 layers × 8
# KV heads × 128 × 2 bytes = 112 KiB per token in bf16, so a 2,000-token sequence moves about
# 450 MiB over PCIe out and back), while prefill is the step a GPU computes fastest, thousands of
# tokens at a time. And prefix caching softens the blow: the victim's blocks keep their hashes
# when freed, so the first blocks of its prompt are often still in the cache when it returns
# (step 8 of the trace above found the system prompt's block). vLLM's current engine (V1)
# recomputes preempted requests too.

# %% [markdown] tags=["zh"]
# ### 重算，而不是换出
#
# 被抢占的序列会丢掉 KV，等再次 prefill 时重算。vLLM 最初的引擎还可以把被抢占序列的块*换出*到 CPU 内存，
# 以后再拷回来。nano-vllm 和本书只做重算，原因有三。一是简单：换出需要在主机内存里再建一个块池，需要在单独的
# 流上做拷贝，序列还要多一个“KV 在主机上”的状态。二是代价：KV 很大（Qwen3-0.6B 在 bf16 下每个 token 要存
# 2 × 28 层 × 8 个 KV 头 × 128 × 2 字节 = 112 KiB，一个 2,000 token 的序列换出再换入，要经 PCIe 搬运约 450 MiB），
# 而 prefill 恰恰是 GPU 算得最快的一种步，一次就能处理成千上万个 token。三是前缀缓存能减轻损失：被释放的块保留着
# 哈希值，序列回来时，它提示词开头的几块往往还在缓存里（上面轨迹的第 8 步就找到了系统提示词的块）。vLLM 现在的引擎
# （V1）同样对被抢占的请求做重算。

# %% [markdown] tags=["en"]
# ## Which sequence may be chunked? Upstream's rule and ours
#
# The two schedulers chunk differently, and it is worth saying so. Upstream nano-vllm lets only
# the **first** sequence of a step be a chunk (its comment: "only allow chunked prefill for the
# first seq"): when a later sequence does not fit the budget that is left, the step ends without
# it. Ours chunks **whichever** sequence runs out the budget. With a budget of 10 tokens and
# prompts of 6 and 8 tokens, ours schedules 6 + a 4-token chunk of the second; upstream
# schedules the 6 and leaves the second waiting for the next step. (The code the second article
# quotes predates both rules: it has no chunks at all, and it admits a prompt only if the whole
# prompt, cached blocks included, fits the budget left; appendix B, section "The code the second
# article quotes".)
#
# Below, upstream's rule is a small subclass that lives only in this chapter: the same
# `_schedule_prefill` with one more test, marked in the code. Both rules run on that example,
# then on 16 prompts of 3 to 14 tokens with a budget of 10.

# %% [markdown] tags=["zh"]
# ## 哪个序列可以被分块？上游的规则与我们的规则
#
# 两个调度器的分块方式不同，这一点值得说清楚。上游 nano-vllm 只允许一步中的**第一个**序列成为分块（它的注释是
# “only allow chunked prefill for the first seq”）：后面的序列如果放不进剩余预算，这一步就此结束，不再带上它。
# 我们的调度器则让**哪个**序列用完预算，就把哪个序列分块。预算 10 个 token，两个提示词分别有 6 和 8 个 token：
# 我们调度 6 个 token，再从第二个提示词切出 4 个 token 的分块；上游只调度那 6 个，第二个提示词留到下一步。
# （第二篇文章引用的代码比这两种规则都早：它根本不分块，而且只有整个提示词（连同已缓存的块）放得进剩余预算时
# 才接纳它；见附录 B 的“第二篇文章引用的代码”一节。）
#
# 下面用一个只存在于本章的小子类表示上游的规则：同样的 `_schedule_prefill`，只多了一个判断（代码中已标出）。
# 两种规则先在这个例子上各跑一遍，再在 16 个 3 到 14 个 token 的提示词上、以 10 个 token 的预算各跑一遍。

# %%
class FirstSeqChunkScheduler(Scheduler):
    """Upstream nano-vllm's rule: only the first sequence of a prefill step may be a chunk."""
    # zh: 上游 nano-vllm 的规则：prefill 步中只有第一个序列可以是分块。

    def _schedule_prefill(self) -> tuple[list[Sequence], dict[int, list[int]]]:
        scheduled: list[Sequence] = []
        cache_hits: dict[int, list[int]] = {}
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        while self.waiting and len(scheduled) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if seq.block_table:
                remaining = len(seq) - seq.num_cached_tokens
            else:
                if not bm.can_allocate(seq):
                    break
                hits = bm.prefix_cache.match(seq) if bm.prefix_cache is not None else []
                remaining = len(seq) - len(hits) * bm.block_size
            if remaining > budget and scheduled:
                # en: The one difference: a sequence that is not first must fit whole.
                # zh: 唯一的不同：不排在第一个的序列必须整个放进预算。
                break
            if not seq.block_table:
                bm.allocate(seq)
                if self.observer is not None and seq.num_cached_tokens:
                    cache_hits[seq.seq_id] = seq.block_table[: seq.num_cached_blocks]
            seq.num_scheduled_tokens = min(remaining, budget)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if seq.num_scheduled_tokens < remaining:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return scheduled, cache_hits


def first_prefill(rule: type[Scheduler]) -> list[tuple[int, int]]:
    """The first step of a budget of 10 on prompts of 6 and 8 tokens: (prompt length, tokens scheduled)."""
    # zh: token 预算为 10、提示词为 6 个和 8 个 token 时的第一步：（提示词长度，调度的 token 数）。
    sched = rule(num_kvcache_blocks=8, kvcache_block_size=4, max_num_seqs=4, max_num_batched_tokens=10)
    for length in (6, 8):
        sched.add(Sequence(list(range(length)), SamplingParams(max_tokens=2), block_size=4))
    seqs, _ = sched.schedule()
    return [(len(seq), seq.num_scheduled_tokens) for seq in seqs]


def chunking_stats(rule: type[Scheduler], prompts: list[list[int]], budget: int) -> dict[str, float]:
    """Run the prompts to the end; count steps, chunks, budget use and blocks held half-prefilled."""
    # zh: 把提示词运行到结束；统计步数、分块数、预算用量，以及 prefill 到一半的序列占着的块。
    sched = rule(num_kvcache_blocks=256, kvcache_block_size=4, max_num_seqs=8, max_num_batched_tokens=budget)
    seqs = [Sequence(p, SamplingParams(max_tokens=4, ignore_eos=True), block_size=4) for p in prompts]
    for seq in seqs:
        sched.add(seq)
    steps = prefill_steps = prefilled = chunks = held = most_at_once = 0
    first_token_step: dict[int, int] = {}
    while not sched.is_finished():
        batch, is_prefill = sched.schedule()
        steps += 1
        if is_prefill:
            prefill_steps += 1
            prefilled += sum(s.num_scheduled_tokens for s in batch)
            chunks += sum(s.num_cached_tokens + s.num_scheduled_tokens < len(s) for s in batch)
        sched.postprocess(batch, fake_model(batch, is_prefill), is_prefill)
        # en: A sequence in `waiting` that holds blocks is a chunked prefill in progress.
        # zh: `waiting` 中持有块的序列，就是进行到一半的分块 prefill。
        half_prefilled = [s for s in sched.waiting if s.block_table]
        held += sum(len(s.block_table) for s in half_prefilled)
        most_at_once = max(most_at_once, len(half_prefilled))
        for s in batch:
            if s.num_completion_tokens and s.seq_id not in first_token_step:
                first_token_step[s.seq_id] = steps
    return {
        "steps": steps,
        "prefill steps": prefill_steps,
        "budget used per prefill step": prefilled / prefill_steps / budget,
        "mean steps to first token": sum(first_token_step.values()) / len(seqs),
        "chunked prefills": chunks,
        "half-prefilled block-steps": held,
        "most half-prefilled at once": most_at_once,
    }


rules = {"ours": Scheduler, "upstream": FirstSeqChunkScheduler}
example = {name: first_prefill(rule) for name, rule in rules.items()}
width = max(display_width(say(name)) for name in rules)
for name, scheduled in example.items():
    print(say("budget 10, prompts of 6 and 8 tokens, {rule}: first step schedules {scheduled}",
              rule=f"{say(name):<{width}}", scheduled=scheduled))

chunk_rng = random.Random(7)
mixed_prompts = [[chunk_rng.randrange(50) for _ in range(chunk_rng.randint(3, 14))] for _ in range(16)]
stats = {name: chunking_stats(rule, mixed_prompts, budget=10) for name, rule in rules.items()}
print(f"\n{say('16 prompts of 3-14 tokens, budget 10'):<36}{say('ours'):>10}{say('upstream'):>10}")
for key in stats["ours"]:
    ours, upstream = stats["ours"][key], stats["upstream"][key]
    if key == "budget used per prefill step":
        print(f"{say(key):<36}{ours:>10.0%}{upstream:>10.0%}")
    else:
        print(f"{say(key):<36}{ours:>10.3g}{upstream:>10.3g}")

# %%
assert example["ours"] == [(6, 6), (8, 4)] and example["upstream"] == [(6, 6)]
ours, upstream = stats["ours"], stats["upstream"]
# en: Ours fills the budget, takes fewer steps and gives the first token sooner ...
# zh: 我们的规则填满预算，步数更少，第一个 token 来得更早……
assert ours["budget used per prefill step"] == 1 > upstream["budget used per prefill step"]
assert ours["steps"] < upstream["steps"] and ours["mean steps to first token"] < upstream["mean steps to first token"]
# en: ... at the price of more chunks and more blocks held by half-prefilled sequences; never more than one at a time.
# zh: ……代价是更多的分块，以及 prefill 到一半的序列占着的块更多；但同一时刻最多只有一个这样的序列。
assert ours["chunked prefills"] > upstream["chunked prefills"]
assert ours["half-prefilled block-steps"] > upstream["half-prefilled block-steps"]
assert ours["most half-prefilled at once"] == upstream["most half-prefilled at once"] == 1

# %% [markdown] tags=["en"]
# The trade-off, read from the table. Our rule spends every step's whole budget: fewer steps,
# and each request's first token comes sooner. Its price is more chunked prefills. A chunked
# sequence holds the blocks of its whole prompt while it waits for its next chunk, blocks that
# could have admitted another request; the logits of its partial step are thrown away; and the
# next chunk reads the first chunk's KV back from the cache. Upstream's rule chunks only a
# prompt that exceeds the whole budget by itself, and pays with steps that leave part of the
# budget unused.
#
# The book keeps its rule. A prefill step's cost hardly depends on whether it computes 7 or 10
# tokens when the weights have to be read anyway, so the unused budget is throughput given
# away. And the price is bounded: in both schedulers a chunk is the last sequence of its step
# and the first of the next, so at most one half-prefilled sequence exists at any time (the
# last row of the table) and its wait for the next chunk is a single step.

# %% [markdown] tags=["zh"]
# 从表中可以看出其中的取舍。我们的规则每一步都用满预算：步数更少，每个请求的第一个 token 来得更早。
# 代价是分块 prefill 更多。被分块的序列在等待下一个分块时，占着整个提示词所需的块，而这些块本可以接纳另一个
# 请求；只算了一部分的那一步，logits 要丢掉；下一个分块还要把前一个分块的 KV 从缓存里读回来。上游的规则只对
# 本身就超出整个预算的提示词分块，代价是有些步用不满预算。
#
# 本书保留自己的规则。反正每一步都要把权重读一遍，prefill 步算 7 个还是 10 个 token，成本几乎一样，用不满的预算就是
# 白白放弃的吞吐量。而且代价有上限：在两个调度器里，分块都是本步的最后一个序列、下一步的第一个序列，所以任何时刻
# 最多只有一个 prefill 到一半的序列（表的最后一行），它等下一个分块也只需等一步。

# %% [markdown] tags=["en"]
# ### The admission check
#
# A request that could never fit is refused by `check_fits` with a message that says what is
# wrong, and the scheduler keeps serving everything it accepted. Everything else a user types
# was checked before the scheduler sees it (the settings by `Config`, the prompt and the sampling
# parameters where they enter, chapters 09 and 10), so a sequence of another block size, or one
# that already ran, is a bug in the caller: it fails an `assert`.

# %% [markdown] tags=["zh"]
# ### 准入检查
#
# `check_fits` 拒绝永远放不下的请求，并在错误信息里说明原因；已经接受的请求，调度器照常处理。用户输入的其他东西在
# 到达调度器之前都已检查过（配置由 `Config` 检查，提示词和采样参数在进入的地方检查，见第 09 章和第 10 章），所以按
# 另一种块大小构造的序列、或者已经运行过的序列，都是调用方的 bug：会触发 `assert`。

# %%
door = Scheduler(num_kvcache_blocks=4, kvcache_block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
# en: 10 + 7 - 1 = 16 tokens: 4 blocks
# zh: 10 + 7 - 1 = 16 个 token：4 块
fits = Sequence(list(range(10)), SamplingParams(max_tokens=7), block_size=4)
door.check_fits(fits)
door.add(fits)
for error_type, bad_call in (
    (ValueError, lambda: door.check_fits(Sequence(list(range(10)), SamplingParams(max_tokens=8), block_size=4))),
    (ValueError, lambda: door.check_fits(Sequence(list(range(40)), SamplingParams(max_tokens=1), block_size=4))),
    (AssertionError, lambda: door.add(Sequence([1, 2], block_size=8))),
):
    try:
        bad_call()
        raise RuntimeError("bad input was accepted")
    except error_type as error:
        print(f"{type(error).__name__}: {error}")
run(door, {fits.seq_id: "fits"}, show=False)
assert fits.is_finished and fits.num_completion_tokens == 7
try:
    # en: A finished sequence cannot be queued again.
    # zh: 已完成的序列不能再次入队。
    door.add(fits)
    raise RuntimeError("a finished sequence was queued again")
except AssertionError as error:
    print(f"AssertionError: {error}")

# %% [markdown] tags=["en"]
# ## What we built
#
# - `seq.max_kv_tokens`: the most KV a request will ever need; `check_fits` refuses what the whole
#   cache could not hold.
# - `Scheduler`: `waiting` and `running` queues; `schedule` (prefill first under a token budget
#   and a sequence cap, at most one chunk per step, the last one; otherwise decode with
#   preemption from the newest); `postprocess` (cache, publish, append unless a chunk, finish on
#   EOS or `max_tokens`); `is_finished`; and the optional `observer(event, data)` hook.
#
# The model runner (chapter 09) reads what `schedule` leaves on each sequence:
# `block_table`, `num_cached_tokens`, `num_scheduled_tokens` and `scheduled_token_ids`. The
# test suite adds property tests over random workloads and the provenance fuzz of chapter 03.
#
# ## Exercises
#
# 1. `block_size=8`, a prompt of 30 tokens, `max_tokens=10`. What is the smallest cache, in
#    blocks, that `check_fits` accepts?
# 2. A single 20-token prompt, a budget of 8 tokens. In which step is its first token appended,
#    and how many steps ran before it without appending anything?
# 3. Why preempt the *newest* running sequence rather than the oldest? Think of what each has
#    already been given.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `seq.max_kv_tokens`：一个请求最多需要多少 KV；`check_fits` 拒绝整个缓存都装不下的请求。
# - `Scheduler`：`waiting` 和 `running` 两个队列；`schedule`（在 token 预算和序列数上限之内 prefill 优先，每步最多一个
#   分块且它是最后一个；否则 decode，从最新的序列开始抢占）；`postprocess`（记为已缓存、发布、除分块外追加 token、
#   遇到 EOS 或 `max_tokens` 时结束）；`is_finished`；以及可选的 `observer(event, data)` 钩子。
#
# 模型执行器（第 09 章）读取 `schedule` 留在每个序列上的信息：`block_table`、`num_cached_tokens`、
# `num_scheduled_tokens` 和 `scheduled_token_ids`。测试套件还包括随机工作负载上的性质测试，以及第 03 章的溯源模糊测试。
#
# ## 练习
#
# 1. `block_size=8`，提示词 30 个 token，`max_tokens=10`。`check_fits` 能接受的最小缓存是多少个块？
# 2. 一个 20 个 token 的提示词，预算 8 个 token。第一个 token 在第几步追加？在它之前有几步什么也没追加？
# 3. 为什么抢占*最新*的运行序列，而不是最旧的？想想每个序列已经得到了什么。

# %%
# en: Exercise 1: 30 + 10 - 1 = 39 tokens -> ceil(39 / 8) = 5 blocks.
# zh: 练习 1：30 + 10 - 1 = 39 个 token -> ceil(39 / 8) = 5 块。
for blocks, accepted in ((4, False), (5, True)):
    s = Scheduler(num_kvcache_blocks=blocks, kvcache_block_size=8, max_num_seqs=1, max_num_batched_tokens=64)
    try:
        s.check_fits(Sequence(list(range(30)), SamplingParams(max_tokens=10), block_size=8))
        assert accepted
    except ValueError:
        assert not accepted

# en: Exercise 2: chunks of 8 + 8 + 4: the token is appended after step 3; the two steps before it appended nothing.
# zh: 练习 2：分块为 8 + 8 + 4：第 3 步之后追加 token；之前的两步什么也没追加。
s = Scheduler(num_kvcache_blocks=8, kvcache_block_size=4, max_num_seqs=1, max_num_batched_tokens=8)
seq = Sequence(list(range(20)), SamplingParams(max_tokens=2), block_size=4)
s.add(seq)
step = 0
while seq.num_completion_tokens == 0:
    batch, is_prefill = s.schedule()
    s.postprocess(batch, [99] * len(batch), is_prefill)
    step += 1
assert step == 3 and seq.completion_token_ids == [99]

# en: Exercise 3: the newest sequence has been given the fewest steps, so its KV is the least work to
# en: throw away; the oldest has been given the most. Measured: the same arrivals under both rules,
# en: counting the computed tokens each preemption throws away (they are computed again later).
# zh: 练习 3：最新的序列得到的步数最少，扔掉它的 KV 损失的工作最少；最旧的序列得到的最多。下面实测：同样的请求
# zh: 按同样的时间到达，两种规则各跑一遍，统计每次抢占扔掉的已算 token（它们之后要重算）。
class CountingScheduler(Scheduler):
    """Our rule, counting the computed tokens that preemption throws away."""
    # zh: 我们的规则，同时统计抢占丢掉了多少已算好的 token。

    thrown_away = 0

    def _preempt(self, seq: Sequence) -> None:
        self.thrown_away += seq.num_cached_tokens
        super()._preempt(seq)


class OldestFirstScheduler(CountingScheduler):
    """Preempts from the front of `running`: the oldest sequence still waiting for its turn this step."""
    # zh: 从 `running` 的前端抢占：最老的、这一步还在等轮到自己的序列。

    def _schedule_decode(self) -> tuple[list[Sequence], list[Sequence]]:
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []
        limit = min(self.max_num_seqs, self.max_num_batched_tokens)
        while self.running and len(scheduled) < limit:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                # en: The one difference: the front.
                # zh: 唯一的不同：取队首的序列。
                victim = self.running.popleft() if self.running else seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.may_append(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, preempted


def staggered(rule: type[CountingScheduler]) -> tuple[int, list[int]]:
    """Four 6-token requests, one every 3 steps, 8 blocks of 4 tokens: tokens thrown away, finishing steps."""
    # zh: 四个 6 token 的请求，每 3 步来一个，8 个 4 token 的块：丢掉的 token 数，结束的步数。
    sched = rule(num_kvcache_blocks=8, kvcache_block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                 enable_prefix_caching=False)
    arrivals = [Sequence([10 * i + t for t in range(6)], SamplingParams(max_tokens=10, ignore_eos=True), block_size=4)
                for i in range(4)]
    finished_at, step = {}, 0
    while len(finished_at) < len(arrivals):
        if step % 3 == 0 and step // 3 < len(arrivals):
            sched.add(arrivals[step // 3])
        step += 1
        if not sched.is_finished():
            batch, is_prefill = sched.schedule()
            sched.postprocess(batch, fake_model(batch, is_prefill), is_prefill)
        finished_at.update({s.seq_id: step for s in arrivals if s.is_finished and s.seq_id not in finished_at})
    return sched.thrown_away, [finished_at[s.seq_id] for s in arrivals]


newest_rule, oldest_rule = staggered(CountingScheduler), staggered(OldestFirstScheduler)
print(say("preempt the newest: {thrown} tokens thrown away, requests finish at steps {finish}",
          thrown=newest_rule[0], finish=newest_rule[1]))
print(say("preempt the oldest: {thrown} tokens thrown away, requests finish at steps {finish}",
          thrown=oldest_rule[0], finish=oldest_rule[1]))
# en: The trace above: C, the newest, was the victim.
# zh: 上面的轨迹：被抢占的是最新的 C。
assert preemptions[0][1] == ["C"] and names[max(names)] == "C"
# en: Less work thrown away.
# zh: 扔掉的工作更少。
assert newest_rule[0] < oldest_rule[0]
# en: And requests finish in the order they came.
# zh: 而且请求按到达的顺序完成。
assert newest_rule[1] == sorted(newest_rule[1])
print(say("all exercise answers check out"))
