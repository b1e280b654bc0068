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
# # A · Seeing the engine: the visualization toolkit
#
# **Goal.** By the end of this appendix you can *watch* the scheduler and the block manager work,
# step by step: which blocks a step allocates, which ones two requests share, which freed block a
# prefix-cache hit brings back, how a long prompt is prefilled in chunks, and how a tiny pool
# survives a preemption storm. You will build three tools, used by the other chapters too:
#
# - a **recorder** that observes the scheduler and writes down each step as plain data;
# - a **player** that turns a recording into a self-contained HTML + SVG + JavaScript animation
#   (no kernel, no CDN: it plays in JupyterLab, in VS Code and on the static site alike);
# - a **live panel** (ipywidgets) that drives a scheduler from buttons in JupyterLab.
#
# Every picture on this page is backed by assertions on the recorded data, so what you see is
# what the engine did.

# %% [markdown] tags=["zh"]
# # A · 看见引擎：可视化工具箱
#
# **目标：** 读完本附录，你就能一步一步地*看着*调度器和块管理器工作：每一步分配了哪些块、两个请求共享了哪些块、
# 前缀缓存命中让哪个已释放的块复活、长提示词如何分块 prefill，以及一个很小的块池如何熬过一连串抢占。
# 我们要构建三个工具，其他章节也会用到它们：
#
# - **记录器**：观察调度器，把每一步记成普通数据；
# - **播放器**：把一份记录变成自包含的 HTML + SVG + JavaScript 动画（不需要内核，也不依赖 CDN：在 JupyterLab、
#   VS Code 和静态网站上都能播放）；
# - **实时面板**（ipywidgets）：在 JupyterLab 里用按钮驱动调度器。
#
# 本页的每一幅图都有针对记录数据的断言作支撑，所以你看到的就是引擎真正做过的事。

# %% [markdown] tags=["en"]
# ## The idea: an observer, frames of plain data, and a drawing per frame
#
# The scheduler (chapter 04) has one optional hook, `scheduler.observer`, which is `None` by
# default: then it costs one `if` per event. When it is set, the scheduler calls
# `observer(event, payload)` at three moments:
#
# - `"add"`: a request arrives; payload `{"seq"}`.
# - `"schedule"`: a batch was chosen (blocks allocated, cache hits found, sequences preempted);
#   payload `{"seqs", "is_prefill", "preempted", "cache_hits"}`.
# - `"postprocess"`: tokens were appended, full blocks published, finished sequences freed;
#   payload `{"seqs", "token_ids", "finished"}`.
#
# The recorder answers each call with a **frame**: a snapshot of the whole state, made only of
# dicts, lists, strings, numbers, booleans and `None`, so it survives `json.dumps` unchanged.
#
# - `index`, `step`, `phase`: the frame number; engine steps begun so far; one of `start`, `add`,
#   `schedule`, `postprocess`, `preempt`.
# - `event`, what happened: `added`; or `is_prefill`, `scheduled` (`seq`, `num_tokens`),
#   `preempted`, `cache_hits` (`seq`, `blocks`); or `tokens` (`seq`, `token`, `appended`), `finished`.
# - `blocks`, per block: `id`, `state` (`free`, `used`, or `cached`: free but still findable by its
#   hash), `ref_count`, `hash` (16 hex digits, or `null` before it is published), `num_tokens`,
#   `owners` (ids of the sequences whose block tables hold it).
# - `free_list`: the free block ids, in the order the block manager will hand them out.
# - `waiting`, `running`: sequence ids, head of the queue first.
# - `seqs`, per sequence seen so far: `id`, `status`, `num_tokens`, `num_prompt_tokens`,
#   `num_cached_tokens`, `num_scheduled_tokens`, `block_table`.
#
# A recording is `{"format": "nanovllm-viz", "version": 1, "block_size", "num_blocks", "frames"}`.
# The player never looks at engine objects, only at this data: a recording saved as JSON
# yesterday plays the same today.

# %% [markdown] tags=["zh"]
# ## 思路：一个观察者、由普通数据构成的帧、每帧一幅图
#
# 调度器（第 04 章）有一个可选的钩子 `scheduler.observer`，默认是 `None`：此时每个事件只多花一次 `if` 判断。
# 设置之后，调度器会在三个时刻调用 `observer(event, payload)`：
#
# - `"add"`：新请求到达；载荷为 `{"seq"}`。
# - `"schedule"`：选定了一个批次（已分配块、找到缓存命中、抢占了序列）；
#   载荷为 `{"seqs", "is_prefill", "preempted", "cache_hits"}`。
# - `"postprocess"`：追加了 token、发布了写满的块、释放了已完成的序列；
#   载荷为 `{"seqs", "token_ids", "finished"}`。
#
# 记录器对每次调用都记下一**帧**：整个状态的快照，只由字典、列表、字符串、数字、布尔值和 `None` 组成，
# 所以经过 `json.dumps` 也不会变样。
#
# - `index`、`step`、`phase`：帧编号；到目前为止开始过的引擎步数；`start`、`add`、`schedule`、
#   `postprocess`、`preempt` 之一。
# - `event`，发生了什么：`added`；或 `is_prefill`、`scheduled`（`seq`、`num_tokens`）、`preempted`、
#   `cache_hits`（`seq`、`blocks`）；或 `tokens`（`seq`、`token`、`appended`）、`finished`。
# - `blocks`，每个块的：`id`、`state`（`free` 空闲、`used` 已用，或 `cached`：空闲但仍可按哈希找到）、
#   `ref_count`（引用计数）、`hash`（16 位十六进制；发布之前为 `null`）、`num_tokens`、
#   `owners`（块表中含有它的序列编号）。
# - `free_list`：空闲块编号，按块管理器分配它们的顺序排列。
# - `waiting`、`running`：序列编号，队头在前。
# - `seqs`，到目前为止见过的每个序列：`id`、`status`、`num_tokens`、`num_prompt_tokens`、
#   `num_cached_tokens`、`num_scheduled_tokens`、`block_table`。
#
# 一份记录是 `{"format": "nanovllm-viz", "version": 1, "block_size", "num_blocks", "frames"}`。
# 播放器从不查看引擎对象，只读这些数据：昨天存成 JSON 的记录，今天照样能播放。

# %% [markdown] tags=["en"]
# ## Build it: the recorder
#
# `snapshot` reads the block manager and the two queues. Two things deserve a comment. A block's
# **owners** are computed from the live block tables, so the drawing can check the block
# manager: a used block's ref count must equal its number of owners. And a free block is shown
# as **cached** only if the hash table still points at *this* block; a free block whose old hash
# entry now points elsewhere is plain free (chapter 03 explains why that difference matters).

# %% [markdown] tags=["zh"]
# ## 动手：记录器
#
# `snapshot` 读取块管理器和两个队列。有两点值得说明。块的**持有者**是根据活跃序列的块表算出来的，
# 所以图本身就能检验块管理器：已用块的引用计数必须等于它的持有者个数。另外，只有当哈希表仍然指向*这个*块时，
# 空闲块才显示为 **cached**；如果一个空闲块的旧哈希条目已经指向别的块，它就只是普通的空闲块
# （第 03 章解释了这一区别为何重要）。

# %% default module
#| default_exp viz.recorder

# %% recorder: snapshot
#| export
from __future__ import annotations

from typing import Any

RECORDING_FORMAT = "nanovllm-viz"
RECORDING_VERSION = 1
_U64 = (1 << 64) - 1


def hash_hex(value: int) -> str | None:
    """A block hash as 16 hex digits, or None for an unpublished block (hash -1)."""
    # zh: 块的哈希，写成 16 位十六进制数；未发布的块（哈希为 -1）为 None。
    return None if value == -1 else format(value & _U64, "016x")


def seq_state(seq: Any) -> dict:
    """The counters and block table of one sequence, as plain data."""
    # zh: 一个序列的计数器和块表，作为普通数据。
    return {
        "id": seq.seq_id,
        "status": seq.status.name,
        "num_tokens": seq.num_tokens,
        "num_prompt_tokens": seq.num_prompt_tokens,
        "num_cached_tokens": seq.num_cached_tokens,
        "num_scheduled_tokens": seq.num_scheduled_tokens,
        "block_table": list(seq.block_table),
        # en: Parallel sampling: the request it samples for, and which sample it is.
        # zh: 并行采样（第 05 章）：它为哪个请求采样，以及它是第几个样本。
        "request_id": seq.request_id,
        "sample_index": seq.sample_index,
    }


def snapshot(scheduler: Any, known: list[Any] = ()) -> dict:
    """The scheduler's state as plain data: blocks, free list, queues and sequences.

    known: every sequence seen so far (finished ones included), in arrival order; the live ones
    (waiting, running) are always included.
    """
    # zh: 调度器的状态，作为普通数据：块、空闲队列、各队列和各序列。
    # zh:
    # zh: known：到目前为止见过的每个序列（包括已结束的），按到达顺序；活跃的序列（等待中、运行中）总是包括在内。
    bm = scheduler.block_manager
    block_size = bm.block_size
    running, waiting = list(scheduler.running), list(scheduler.waiting)
    seqs = {s.seq_id: s for s in known}
    seqs.update((s.seq_id, s) for s in running + waiting)
    # en: Owners: which live block tables hold each block (a finished or preempted sequence holds none).
    # zh: 持有者：哪些活跃序列的块表持有该块（已完成或被抢占的序列不持有任何块）。
    owners: dict[int, list[int]] = {}
    tokens: dict[int, int] = {}
    for seq in running + waiting:
        for j, block_id in enumerate(seq.block_table):
            owners.setdefault(block_id, []).append(seq.seq_id)
            tokens[block_id] = max(tokens.get(block_id, 0), min(block_size, max(0, seq.num_tokens - j * block_size)))
    blocks = []
    for block in bm.blocks:
        if block.block_id in bm.used_block_ids:
            state = "used"
        elif block.hash != -1 and bm.hash_to_block_id.get(block.hash) == block.block_id:
            # en: Free, but the prefix cache still points at it: a later hit can revive it.
            # zh: 空闲，但前缀缓存仍指向它：之后的命中可以让它复活。
            state = "cached"
        else:
            state = "free"
        blocks.append({
            "id": block.block_id,
            "state": state,
            "ref_count": block.ref_count,
            "hash": hash_hex(block.hash),
            "num_tokens": tokens.get(block.block_id, len(block.token_ids) if state == "cached" else 0),
            "owners": sorted(owners.get(block.block_id, [])),
        })
    return {
        "blocks": blocks,
        "free_list": list(bm.free_block_ids),
        "waiting": [s.seq_id for s in waiting],
        "running": [s.seq_id for s in running],
        "seqs": [seq_state(s) for s in sorted(seqs.values(), key=lambda s: s.seq_id)],
    }

# %% recorder: the observer
#| export
class Recorder:
    """Observes a scheduler and records one frame of plain data per event.

    Frames: "start" (when attached), "add" (consecutive adds share one frame), "schedule" (after
    the scheduler chose a batch: allocations, cache hits, preemptions are visible),
    "postprocess" (after tokens were appended, hashes published and finished sequences freed),
    "drafts" and "verified" (speculative decoding: drafts reserved, then what the model kept and the
    blocks given back) and "preempt" (a preemption forced by hand, outside the scheduler).
    ``recording`` is a JSON-serializable dict; ``player_html`` draws it.
    """
    # zh: 观察一个调度器，每个事件记录一帧普通数据。
    # zh:
    # zh: 帧："start"（挂上时），"add"（连续的 add 共用一帧），"schedule"（调度器选好一个批次之后：分配、缓存命中、
    # zh: 抢占都看得见），"postprocess"（追加了 token、发布了哈希、释放了已结束的序列之后），
    # zh: "drafts" 和 "verified"（投机解码：预留草稿，然后是模型保留了什么、交还了哪些块），以及 "preempt"
    # zh: （在调度器之外手动强制的抢占）。
    # zh: ``recording`` 是一个可序列化为 JSON 的字典；``player_html`` 把它画出来。

    def __init__(self, scheduler: Any, *, attach: bool = True) -> None:
        self.scheduler = scheduler
        self.frames: list[dict] = []
        self.step = 0
        self._seqs: dict[int, Any] = {}
        bm = scheduler.block_manager
        self._add_frame("start", {"num_blocks": len(bm.blocks), "block_size": bm.block_size})
        if attach:
            scheduler.observer = self

    def detach(self) -> None:
        if getattr(self.scheduler, "observer", None) is self:
            self.scheduler.observer = None

    def _add_frame(self, phase: str, event: dict) -> dict:
        frame = {"index": len(self.frames), "step": self.step, "phase": phase, "event": event}
        frame.update(snapshot(self.scheduler, list(self._seqs.values())))
        self.frames.append(frame)
        return frame

    def __call__(self, event: str, payload: dict) -> None:
        if event == "add":
            seq = payload["seq"]
            self._seqs[seq.seq_id] = seq
            last = self.frames[-1]
            # en: Consecutive adds share one frame
            # zh: 连续的 add 共用一帧
            if last["phase"] == "add":
                added = [*last["event"]["added"], seq.seq_id]
                self.frames.pop()
                self._add_frame("add", {"added": added})
            else:
                self._add_frame("add", {"added": [seq.seq_id]})
        elif event == "schedule":
            self.step += 1
            for seq in payload["seqs"]:
                self._seqs.setdefault(seq.seq_id, seq)
            self._add_frame("schedule", {
                "is_prefill": bool(payload["is_prefill"]),
                "scheduled": [{"seq": s.seq_id, "num_tokens": s.num_scheduled_tokens} for s in payload["seqs"]],
                "preempted": [s.seq_id for s in payload.get("preempted", [])],
                "cache_hits": [{"seq": int(seq_id), "blocks": list(blocks)}
                               for seq_id, blocks in payload.get("cache_hits", {}).items() if blocks],
                # en: Copy-on-write: a sequence about to write into a shared block got a fresh one.
                # zh: 写时复制（第 05 章）：要写入共享块的序列换到了一个新块。
                "copies": [{"seq": s.seq_id, "from": source, "to": destination}
                           for s in payload["seqs"] for source, destination in s.blocks_to_copy],
            })
        elif event == "postprocess":
            before = {s["id"]: s["num_tokens"] for s in self.frames[-1]["seqs"]}
            # en: Sequences the recorder has not seen are siblings this step forked.
            # zh: 记录器没见过的序列，是这一步分叉出来的兄弟序列（第 05 章）。
            forked: dict[int, list[int]] = {}
            for s in payload["seqs"]:
                if s.seq_id not in self._seqs:
                    self._seqs[s.seq_id] = s
                    forked.setdefault(s.request_id, [s.request_id]).append(s.seq_id)
            tokens = [{"seq": s.seq_id, "token": int(t),
                       "appended": s.seq_id not in before or s.num_tokens > before[s.seq_id]}
                      for s, t in zip(payload["seqs"], payload["token_ids"], strict=True)]
            self._add_frame("postprocess", {
                "tokens": tokens,
                "finished": [s.seq_id for s in payload["finished"]],
                "forked": [{"seq": request, "into": ids} for request, ids in forked.items()],
            })
        elif event == "drafts":
            # en: Speculative decoding: drafts appended to a decode step, with the blocks they need.
            # zh: 投机解码（第 25 章）：草稿追加到 decode 步里，连同它们需要的块。
            self._add_frame("drafts", {"drafts": [{"seq": s.seq_id, "count": s.num_draft_tokens}
                                                  for s in payload["seqs"] if s.num_draft_tokens]})
        elif event == "verified":
            # en: What the model kept of each sequence's drafts; the rest was rolled back, its blocks freed.
            # zh: 模型保留了每个序列的哪些草稿；其余的已经回滚，它们的块也释放了。
            before = {s["id"]: s["block_table"] for s in self.frames[-1]["seqs"]}
            self._add_frame("verified", {"verified": [
                {"seq": s.seq_id, "drafted": drafted, "kept": kept,
                 "freed": before.get(s.seq_id, [])[len(s.block_table):]}
                for s, drafted, kept in zip(payload["seqs"], payload["drafted"], payload["kept"], strict=True)
                if drafted]})
        elif event == "preempt":
            # en: Not a scheduler event: a tool (the live panel) preempted a sequence by hand.
            # zh: 这不是调度器发出的事件：是工具（实时面板）手动抢占了一个序列。
            self._add_frame("preempt", {"preempted": [s.seq_id for s in payload["seqs"]]})
        else:
            raise ValueError(f"Recorder got an unknown scheduler event {event!r}")

    @property
    def recording(self) -> dict:
        """Everything recorded so far, as plain JSON-serializable data."""
        # zh: 到目前为止记录下的一切，作为可序列化为 JSON 的普通数据。
        bm = self.scheduler.block_manager
        return {
            "format": RECORDING_FORMAT,
            "version": RECORDING_VERSION,
            "block_size": bm.block_size,
            "num_blocks": len(bm.blocks),
            "frames": list(self.frames),
        }

# %% [markdown] tags=["en"]
# ## Build it: a fake model to drive the scheduler
#
# Recordings need an engine that runs, but not a model: the scheduler only needs *some* token id
# per scheduled sequence. `FakeEngine` wires a scheduler, a recorder and a deterministic fake
# sampler together (schedule → fake tokens → postprocess), so every demo below runs on a CPU in
# milliseconds. Requests ignore EOS, so each one generates exactly `max_tokens` tokens.

# %% [markdown] tags=["zh"]
# ## 动手：用假模型驱动调度器
#
# 录制需要一个能运行的引擎，但不需要模型：调度器只要求每个被调度的序列拿到*某个* token id。
# `FakeEngine` 把调度器、记录器和一个确定性的假采样器连在一起（调度 → 假 token → 后处理），
# 所以下面每个演示都能在 CPU 上几毫秒跑完。请求忽略 EOS，因此每个请求恰好生成 `max_tokens` 个 token。

# %% driver: a fake model
#| export viz.driver
from __future__ import annotations

from collections.abc import Sequence as ListLike
from typing import Any

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, sibling_samples
from nanovllm.sampling_params import SamplingParams
from nanovllm.viz.recorder import Recorder


def fake_token(seq: Sequence, sample_index: int = 0) -> int:
    """A deterministic "sampled" token: depends only on the sequence id, its length and which sample draws it."""
    # zh: 一个确定性的“采样” token：只取决于序列 id、它的长度，以及是哪个样本在抽取它。
    return 1000 + (seq.seq_id * 31 + seq.num_tokens * 7 + sample_index * 13) % 97


class FakeEngine:
    """A scheduler, a recorder and a fake model: schedule → fake tokens → postprocess, on CPU, instantly."""
    # zh: 一个调度器、一个记录器和一个假模型：调度 → 假 token → 后处理，在 CPU 上瞬间完成。

    def __init__(self, *, num_kvcache_blocks: int, kvcache_block_size: int, max_num_seqs: int = 4,
                 max_num_batched_tokens: int = 64, enable_prefix_caching: bool = True) -> None:
        self.config = {
            "num_kvcache_blocks": num_kvcache_blocks,
            "kvcache_block_size": kvcache_block_size,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "enable_prefix_caching": enable_prefix_caching,
        }
        self.scheduler = Scheduler(**self.config)
        self.recorder = Recorder(self.scheduler)
        self.seqs: list[Sequence] = []
        self.steps = 0

    def add(self, token_ids: ListLike[int], max_tokens: int = 4, n: int = 1) -> Sequence:
        """Add a request; it ignores EOS, so it generates exactly ``max_tokens`` tokens (in each of its ``n``
        samples: after its prefill it forks)."""
        # zh: 添加一个请求；它忽略 EOS，所以恰好生成 ``max_tokens`` 个 token（它的 ``n`` 个样本各生成这么多：
        # zh: prefill 之后它会分叉）。
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)
        seq = Sequence(list(token_ids), params, block_size=self.config["kvcache_block_size"])
        self.scheduler.check_fits(seq)
        self.scheduler.add(seq)
        self.seqs.append(seq)
        return seq

    def step(self) -> tuple[list[Sequence], bool]:
        """One engine step with the fake model. Returns what was scheduled."""
        # zh: 用假模型运行引擎的一步。返回调度了什么。
        seqs, is_prefill = self.scheduler.schedule()
        tokens = [fake_token(s, s.sample_index) for s in seqs]
        # en: A request that forks gets its siblings' first tokens after the step's own, as from the runner.
        # zh: 要分叉的请求，其兄弟序列的第一个 token 排在本步各序列的 token 之后，和执行器给出的一样。
        tokens += [fake_token(seqs[i], k) for i, k in sibling_samples(seqs)]
        self.scheduler.postprocess(seqs, tokens, is_prefill)
        self.steps += 1
        return seqs, is_prefill

    def preempt_newest(self) -> Sequence | None:
        """Preempt the newest running sequence by hand, as decode does when it runs out of blocks."""
        # zh: 手动抢占最新的运行序列，就像 decode 用完了块时那样。
        if not self.scheduler.running:
            return None
        seq = self.scheduler.running.pop()
        # en: Exactly what the scheduler does to a decode victim; the scheduler does not
        # en: announce it, since no schedule() call happened, so the recorder is told directly.
        # zh: 与调度器处理 decode 时被抢占序列的做法完全相同（第 04 章）；由于没有调用 schedule()，
        # zh: 调度器不会发出事件，所以直接通知记录器。
        self.scheduler._preempt(seq)
        self.recorder("preempt", {"seqs": [seq]})
        return seq

    def run(self, max_steps: int = 1000) -> int:
        """Step until every request finished (or ``max_steps``); returns the number of steps taken."""
        # zh: 一步一步运行，直到每个请求都结束（或者达到 ``max_steps``）；返回走了多少步。
        taken = 0
        while not self.scheduler.is_finished() and taken < max_steps:
            self.step()
            taken += 1
        return taken

    @property
    def recording(self) -> dict[str, Any]:
        return self.recorder.recording

# %% [markdown] tags=["en"]
# ## Build it: the player
#
# The player draws each frame **in Python**, as SVG, and ships all the frames in one HTML
# snippet; a small script only shows one frame at a time and reacts to the buttons, the slider,
# the arrow keys and the mouse. This split has three benefits: the drawing is plain Python that
# the tests can inspect; the live panel reuses the exact same drawing (a widget's HTML does not run
# scripts); and where scripts do not run at all (an untrusted notebook), the first frame still
# shows, with a note.
#
# In each frame: the **block pool** as a grid (grey: free; blue: used; dashed green: free but
# still cached; the big number is the ref count, the bar at the bottom how many tokens the block
# holds, the small squares the colors of its owners; orange outline: a cache hit in this step;
# dark blue: newly allocated; red: just freed), the **block tables** (one row per live sequence,
# one cell per block id), the **running** and **waiting** queues, and the **free list** in the
# order blocks will be handed out. Hovering a block or a sequence lights up the related cells and
# prints the details under the drawing.
#
# Every element id a player uses is unique (`nvv-` + 12 random hex digits) and every script
# works only inside its own element, so any number of players can share a page.

# %% [markdown] tags=["zh"]
# ## 动手：播放器
#
# 播放器**在 Python 里**把每一帧画成 SVG，并把所有帧放进同一段 HTML；一小段脚本只负责每次显示其中一帧，
# 并响应按钮、滑块、方向键和鼠标。这样划分有三个好处：绘图是普通 Python 代码，测试可以直接检查；
# 实时面板复用完全相同的绘图（控件里的 HTML 不会运行脚本）；在根本不运行脚本的地方（未受信任的 notebook），
# 仍然会显示第一帧，并附上一条说明。
#
# 每一帧包括：**块池**网格（灰色：空闲；蓝色：已用；绿色虚线：空闲但仍被缓存；大数字是引用计数，
# 底部横条表示块中有多少 token，小方块是持有者的颜色；橙色边框：本步的缓存命中；深蓝边框：新分配；
# 红色边框：刚释放）、**块表**（每个活跃序列一行，每个块编号一格）、**运行**与**等待**队列，
# 以及按分配顺序排列的**空闲队列**。把鼠标移到块或序列上，相关的格子会高亮，详情显示在图的下方。
#
# 播放器使用的元素 id 都是唯一的（`nvv-` 加 12 位随机十六进制数），每段脚本只在自己的元素内部工作，
# 所以同一页面上可以放任意多个播放器。

# %% [markdown] tags=["en"]
# ### One language at a time
#
# Every word the player shows exists in English and in Chinese, and `lang` picks: `"en"` or
# `"zh"` draws one language, `"both"` draws both. A reader sees one language (the site of their
# language, or a reading copy in JupyterLab, which starts with `set_language("en")` or `"zh"`),
# but the book's chapters are executed **once**, in `"both"`, and that one output must serve
# both sites. So in `"both"` each piece of text is wrapped in an HTML comment that names its
# language, `<!--lang:zh-->块池<!--/lang-->`, and `keep_language(html, "zh")` keeps the Chinese
# pieces and cuts the rest. Comments are invisible in a page, they may sit anywhere in HTML and
# SVG (inside a `<title>`, a button, an SVG `<text>`), and cutting them is one regular expression,
# because the player writes them and never nests them. The test that matters:
# `keep_language(player_html(r, lang="both"), "zh") == player_html(r, lang="zh")`.
#
# Two details follow from this. No text may live in an attribute (a comment cannot sit inside a
# tag), so the hover details come from each cell's `<title>` and the Play/Pause button holds both
# labels and lets a CSS class choose. And the buttons draw their arrows as tiny inline SVG icons:
# the "⏸" character is missing from many fonts and shows as an empty box.
#
# The player itself does not know what a frame shows: `slides_html` puts the controls, the keys
# and the static view around any list of (caption, SVG) pairs, and `player_html` is the block
# tables' use of it. Chapter 26 plays a router's choices with it.

# %% [markdown] tags=["zh"]
# ### 一次只显示一种语言
#
# 播放器显示的每个词都有英文和中文两个版本，由 `lang` 选择：`"en"` 或 `"zh"` 只画一种语言，`"both"` 两种都画。
# 读者一次只看一种语言（自己语言的网站，或 JupyterLab 里的阅读副本，副本开头会调用 `set_language("en")` 或 `"zh"`），
# 但书中各章只执行**一次**，用的是 `"both"`，这一份输出必须同时供两个网站使用。所以在 `"both"` 模式下，
# 每段文字都包在一个注明语言的 HTML 注释里：`<!--lang:zh-->块池<!--/lang-->`，`keep_language(html, "zh")`
# 保留中文片段、去掉其余部分。注释在页面上不可见，可以出现在 HTML 和 SVG 的任何位置（`<title>` 里、按钮里、
# SVG 的 `<text>` 里）；而且注释由播放器自己写、从不嵌套，所以去掉它们只需一个正则表达式。关键的测试是：
# `keep_language(player_html(r, lang="both"), "zh") == player_html(r, lang="zh")`。
#
# 由此带来两处细节。文字不能放在属性里（注释不能出现在标签内部），所以悬停详情取自每个格子的 `<title>`，
# 播放/暂停按钮同时包含两个标签、由一个 CSS 类决定显示哪个。另外，按钮上的箭头画成很小的内联 SVG 图标：
# 很多字体里没有 “⏸” 这个字符，它会显示成一个空方框。
#
# 播放器本身并不知道一帧里画的是什么：`slides_html` 把控制按钮、快捷键和静态视图套在任意一组（说明，SVG）上，
# `player_html` 只是块表对它的一种用法。第 26 章用它播放路由器的选择。

# %% player: one language at a time
#| export viz.player
from __future__ import annotations

import html
import re
import uuid

LANGS = ("en", "zh", "both")
# en: The language players and panels use when none is given; the reading copies set it first thing.
# zh: 未指定语言时播放器和面板使用的语言；阅读副本一开始就会设置它。
_default = {"lang": "both"}
# en: A piece of text in one language (or a separator only "both" shows): <!--lang:zh-->块池<!--/lang-->.
# zh: 某种语言的一段文字（或只在 "both" 中出现的分隔符）：<!--lang:zh-->块池<!--/lang-->。
LANG_PIECE = re.compile(r"<!--lang:(en|zh|both)-->(.*?)<!--/lang-->", re.S)


def check_lang(lang: str | None) -> str:
    """The language asked for ("en", "zh" or "both"; None: the default, see ``set_language``), or a ValueError."""
    # zh: 要求的语言（"en"、"zh" 或 "both"；None：默认值，见 ``set_language``），否则抛出 ValueError。
    lang = _default["lang"] if lang is None else lang
    if lang not in LANGS:
        raise ValueError(f"lang must be one of {LANGS}, got {lang!r}")
    return lang


def set_language(lang: str) -> None:
    """The default language of players and panels from now on: "en", "zh" or "both"."""
    # zh: 从现在起播放器和面板的默认语言："en"、"zh" 或 "both"。
    _default["lang"] = check_lang(lang)


def reading_language() -> str:
    """The default language of players and panels ("both" unless ``set_language`` changed it)."""
    # zh: 播放器和面板的默认语言（除非 ``set_language`` 改过，否则为 "both"）。
    return _default["lang"]


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def pick_lang(en: str, zh: str, lang: str | None = None, sep: str = "") -> str:
    """Markup in one language, or both: each marked so that ``keep_language`` can cut one out."""
    # zh: 一种语言或两种语言的标记：每一段都带着标记，让 ``keep_language`` 能剪掉其中一种。
    lang = check_lang(lang)
    if lang != "both":
        return en if lang == "en" else zh
    joint = f"<!--lang:both-->{sep}<!--/lang-->" if sep else ""
    return f"<!--lang:en-->{en}<!--/lang-->{joint}<!--lang:zh-->{zh}<!--/lang-->"


def lang_text(en: str, zh: str, lang: str | None = None, sep: str = " ") -> str:
    """A short text as HTML in the reading language (both, marked, when ``lang`` is "both")."""
    # zh: 一小段文字，写成阅读语言的 HTML（``lang`` 为 "both" 时两种都有，带标记）。
    return pick_lang(_esc(en), _esc(zh), lang, _esc(sep))


def keep_language(markup: str, lang: str) -> str:
    """Cut bilingual markup down to one language: keep ``lang``'s pieces, drop the others'."""
    # zh: 把双语标记剪成一种语言：保留 ``lang`` 的部分，丢掉其他的。
    if lang not in ("en", "zh"):
        raise ValueError(f"keep_language keeps 'en' or 'zh', got {lang!r}")
    return LANG_PIECE.sub(lambda m: m[2] if m[1] == lang else "", markup)

# %% player: captions
#| export viz.player
def _seq_list(ids: list[int], zh: bool) -> str:
    return ("、" if zh else ", ").join(str(i) for i in ids)


def speculation_caption(phase: str, event: dict, zh: bool) -> list[str]:
    """What a speculative decoding frame says: the drafts a step verifies, or what it kept of them."""
    # zh: 投机解码的一帧说了什么：一步要验证的草稿，或者它从中保留了什么。
    if phase == "drafts":
        items = [(d["seq"], d["count"]) for d in event["drafts"]]
        return [("草稿：" + "、".join(f"序列 {i}（+{n} 个 token）" for i, n in items)) if zh
                else "drafts: " + ", ".join(f"seq {i} (+{n} token{'s' if n > 1 else ''})" for i, n in items)]
    verified = [(v["seq"], v["kept"], v["drafted"]) for v in event["verified"]]
    parts = [("验证：" + "、".join(f"序列 {i} 保留 {k}/{n} 个草稿" for i, k, n in verified)) if zh
             else "verified: " + ", ".join(f"seq {i} kept {k} of {n} drafts" for i, k, n in verified)]
    for v in event["verified"]:
        if v["freed"]:
            blocks = _seq_list(v["freed"], zh)
            parts.append(f"序列 {v['seq']} 交还只为被拒绝的草稿分配的块 {blocks}" if zh
                         else f"seq {v['seq']} gives back block {blocks}, allocated for rejected drafts only")
    return parts


def start_caption(frame: dict, event: dict, zh: bool) -> list[str]:
    """The pool a recording starts from."""
    # zh: 一段记录开始时的块池。
    n, bs = event["num_blocks"], event["block_size"]
    states = [block["state"] for block in frame["blocks"]]
    used, cached = states.count("used"), states.count("cached")
    if not (used or cached):
        return [f"空的块池：{n} 个块，每块 {bs} 个 token" if zh else f"empty pool: {n} blocks of {bs} tokens"]
    # en: Attached to an engine that has already run (the server's live page): say what the pool holds.
    # zh: 挂到已经跑过的引擎上（服务器的实时页面）：说出块池里现在有什么。
    free = n - used - cached
    return [f"块池：{n} 个块，每块 {bs} 个 token；{used} 个在用，{cached} 个已缓存，{free} 个空闲" if zh
            else f"pool of {n} blocks of {bs} tokens: {used} in use, {cached} cached, {free} free"]


def schedule_caption(event: dict, seqs: dict[int, dict], zh: bool) -> list[str]:
    """What a schedule chose: the batch, its cache hits, preemptions and copy-on-write copies."""
    # zh: 一次调度选了什么：批次、它的缓存命中、抢占和写时复制。
    scheduled, parts = event["scheduled"], []
    if not scheduled:
        parts.append("没有可调度的序列" if zh else "nothing to schedule")
    elif event["is_prefill"]:
        items = []
        for item in scheduled:
            s, n = seqs[item["seq"]], item["num_tokens"]
            left = s["num_tokens"] - s["num_cached_tokens"] - n
            if left > 0:
                items.append(f"序列 {s['id']}（分块 {n} 个 token，还剩 {left} 个）" if zh
                             else f"seq {s['id']} (chunk of {n} tokens, {left} left)")
            else:
                items.append(f"序列 {s['id']}（{n} 个 token）" if zh else f"seq {s['id']} ({n} tokens)")
        parts.append(("prefill：" + "、".join(items)) if zh else ("prefill: " + ", ".join(items)))
    else:
        ids = _seq_list([item["seq"] for item in scheduled], zh)
        parts.append(f"decode：序列 {ids}（各 1 个 token）" if zh else f"decode: seq {ids} (1 token each)")
    for hit in event["cache_hits"]:
        blocks = _seq_list(hit["blocks"], zh)
        word = "block" if len(hit["blocks"]) == 1 else "blocks"
        parts.append(f"缓存命中：块 {blocks}（序列 {hit['seq']}）" if zh
                     else f"cache hit on {word} {blocks} (seq {hit['seq']})")
    if event["preempted"]:
        ids = _seq_list(event["preempted"], zh)
        parts.append(f"抢占序列 {ids}" if zh else f"preempted seq {ids}")
    for copy in event.get("copies", []):
        parts.append(f"写时复制：序列 {copy['seq']} 把共享的块 {copy['from']} 拷贝到块 {copy['to']}" if zh
                     else f"copy-on-write: seq {copy['seq']} copies shared block {copy['from']} "
                          f"into block {copy['to']}")
    return parts


def postprocess_caption(event: dict, zh: bool) -> list[str]:
    """What a step's tokens did: forks, tokens appended or not yet, finished sequences."""
    # zh: 一步的 token 做了什么：分叉、已追加或尚未追加的 token、结束的序列。
    parts = []
    for fork in event.get("forked", []):
        ids = _seq_list(fork["into"], zh)
        parts.append(f"序列 {fork['seq']} 分叉为序列 {ids}，共享它的块" if zh
                     else f"seq {fork['seq']} forked into seq {ids}, sharing its blocks")
    appended = [t["seq"] for t in event["tokens"] if t["appended"]]
    discarded = [t["seq"] for t in event["tokens"] if not t["appended"]]
    if appended:
        ids = _seq_list(appended, zh)
        each = "各" if len(appended) > 1 else ""
        parts.append(f"序列 {ids} {each}追加 1 个 token" if zh else f"appended a token to seq {ids}")
    if discarded:
        ids = _seq_list(discarded, zh)
        parts.append(f"序列 {ids} 的分块未完成，暂不产生 token" if zh else f"seq {ids}: partial chunk, no token yet")
    if event["finished"]:
        ids = _seq_list(event["finished"], zh)
        parts.append(f"序列 {ids} 完成（释放其块）" if zh else f"finished seq {ids} (blocks freed)")
    return parts


def caption(frame: dict, lang: str = "en") -> str:
    """One line that says what happened in ``frame``, in English (``"en"``) or Chinese (``"zh"``)."""
    # zh: 用一行文字说出 ``frame`` 中发生了什么，用英文（``"en"``）或中文（``"zh"``）。
    if check_lang(lang) == "both":
        raise ValueError("caption() speaks one language at a time: lang must be 'en' or 'zh'")
    zh = lang == "zh"
    phase, event, step = frame["phase"], frame["event"], frame["step"]
    seqs = {s["id"]: s for s in frame["seqs"]}
    if phase == "start":
        parts = start_caption(frame, event, zh)
    elif phase == "add":
        items = [(i, seqs[i]["num_prompt_tokens"]) for i in event["added"]]
        parts = [("新请求：" + "、".join(f"序列 {i}（提示词 {n} 个 token）" for i, n in items)) if zh
                 else "added " + ", ".join(f"seq {i} (prompt {n} tokens)" for i, n in items)]
    elif phase == "schedule":
        parts = schedule_caption(event, seqs, zh)
    elif phase in ("drafts", "verified"):
        parts = speculation_caption(phase, event, zh)
    elif phase == "preempt":
        ids = _seq_list(event["preempted"], zh)
        parts = [f"手动抢占序列 {ids}（释放其块，回到等待队列队头）" if zh
                 else f"forced preemption of seq {ids} (blocks freed, back to the head of waiting)"]
    elif phase == "postprocess":
        parts = postprocess_caption(event, zh)
    else:
        raise ValueError(f"unknown frame phase {phase!r}")
    if phase in ("schedule", "drafts", "verified"):
        head = f"第 {step} 步" if zh else f"step {step}"
    elif phase == "postprocess":
        head = f"第 {step} 步完成" if zh else f"step {step} done"
    else:
        head = f"第 {step + 1} 步之前" if zh else f"before step {step + 1}"
    return head + ("：" if zh else ": ") + ("；" if zh else " · ").join(parts)

# %% player: drawing one frame
#| export viz.player
# en: Pool grid: distance between cells, cell size (px)
# zh: 块池网格：格子间距、格子大小（px）
PITCH, CELL = 42, 38
# en: Block-table cells
# zh: 块表的格子
ROW_CELL = 30
# en: Where block-table cells start (room for "序列 12：130 token")
# zh: 块表格子的起始位置（给“序列 12：130 token”留出空间）
TABLE_X = 140
# en: Sequence colors cycle through nvv-c0 ... nvv-c7
# zh: 序列颜色在 nvv-c0 ... nvv-c7 之间循环
NUM_COLORS = 8
STATE_ZH = {"free": "空闲", "used": "已用", "cached": "已缓存"}


def svg_label(en: str, zh: str, lang: str | None) -> str:
    """An SVG label. Its Chinese half is a <tspan lang="zh">, which the "both" drawing hides (no room for two)."""
    # zh: 一个 SVG 标签。它的中文那一半是一个 <tspan lang="zh">，"both" 画法会把它藏起来（放不下两种）。
    return pick_lang(_esc(en), f'<tspan lang="zh">{_esc(zh)}</tspan>', lang, " ")


def block_info(block: dict, block_size: int, lang: str | None = "en") -> str:
    """The hover text of a block: id, state, ref count, hash, owners, tokens (HTML-escaped, language-marked)."""
    # zh: 块的悬停文字：id、状态、引用计数、哈希、持有者、token（已做 HTML 转义，带语言标记）。
    owners = ", ".join(str(s) for s in block["owners"]) or "-"
    hash_ = block["hash"] or "null"
    en = (f"block {block['id']} · {block['state']} · ref {block['ref_count']} · hash {hash_} · seqs {owners} · "
          f"{block['num_tokens']}/{block_size} tokens")
    zh = (f"块 {block['id']} · {STATE_ZH.get(block['state'], block['state'])} · 引用计数 {block['ref_count']} · "
          f"哈希 {hash_} · 序列 {owners} · {block['num_tokens']}/{block_size} 个 token")
    return lang_text(en, zh, lang, "\n")


def seq_info(seq: dict, lang: str | None = "en") -> str:
    """The hover text of a sequence row: status and counters (HTML-escaped, language-marked)."""
    # zh: 序列那一行的悬停文字：状态和计数器（已做 HTML 转义，带语言标记）。
    s = seq
    en = (f"seq {s['id']} · {s['status']} · {s['num_tokens']} tokens (prompt {s['num_prompt_tokens']}) · "
          f"cached {s['num_cached_tokens']} · scheduled {s['num_scheduled_tokens']}")
    zh = (f"序列 {s['id']} · {s['status']} · {s['num_tokens']} 个 token（提示词 {s['num_prompt_tokens']} 个）· "
          f"已缓存 {s['num_cached_tokens']} · 本步调度 {s['num_scheduled_tokens']}")
    return lang_text(en, zh, lang, "\n")


def pool_svg(frame: dict, block_size: int, prev: dict | None, lang: str) -> tuple[list[str], int, int]:
    """The block pool as a grid of cells: (its SVG elements, the y below it, its width)."""
    # zh: 把块池画成格子：（它的 SVG 元素，它下方的 y，它的宽度）。
    blocks = frame["blocks"]
    hits = {b for hit in frame["event"].get("cache_hits", []) for b in hit["blocks"]}
    # en: Copy-on-write: the fresh blocks copies go into, and the shared blocks they come from.
    # zh: 写时复制（第 05 章）：拷贝写入的新块，以及被拷贝的共享块。
    copy_into = {c["to"] for c in frame["event"].get("copies", [])}
    copy_from = {c["from"] for c in frame["event"].get("copies", [])}
    prev_state = {b["id"]: b["state"] for b in prev["blocks"]} if prev else {}
    cols = max(1, min(16, len(blocks)))
    out: list[str] = []
    y = 14
    out.append(f'<text x="4" y="{y}" class="nvv-h">{svg_label("block pool", "块池", lang)}</text>')
    top = y + 6
    for k, block in enumerate(blocks):
        x, yy = 4 + (k % cols) * PITCH, top + (k // cols) * PITCH
        classes = ["nvv-blk", f"nvv-{block['state']}"]
        before = prev_state.get(block["id"])
        if block["id"] in copy_into:
            classes.append("nvv-copy")
        elif block["id"] in copy_from:
            classes.append("nvv-copysrc")
        elif block["id"] in hits:
            classes.append("nvv-hit")
        elif before is not None and before != "used" and block["state"] == "used":
            classes.append("nvv-new")
        elif before == "used" and block["state"] != "used":
            classes.append("nvv-freed")
        owners = " ".join(str(s) for s in block["owners"])
        # en: The <title> is the tooltip, and the script copies it under the drawing on hover.
        # zh: <title> 是悬停提示，脚本在悬停时也会把它抄到图的下方。
        out.append(f'<g class="{" ".join(classes)}" data-b="{block["id"]}" data-o="{owners}">'
                   f"<title>{block_info(block, block_size, lang)}</title>")
        out.append(f'<rect class="nvv-box" x="{x}" y="{yy}" width="{CELL}" height="{CELL}" rx="4"/>')
        out.append(f'<text class="nvv-bid" x="{x + 3}" y="{yy + 10}">{block["id"]}</text>')
        if block["state"] != "free":
            out.append(f'<text class="nvv-rc" x="{x + CELL // 2}" y="{yy + 26}">{block["ref_count"]}</text>')
        if block["num_tokens"]:
            width = round((CELL - 6) * min(block["num_tokens"], block_size) / block_size, 1)
            out.append(f'<rect class="nvv-fill" x="{x + 3}" y="{yy + CELL - 6}" width="{width}" height="3"/>')
        for j, seq_id in enumerate(block["owners"][:3]):
            out.append(f'<rect class="nvv-c{seq_id % NUM_COLORS}" x="{x + CELL - 8 - 7 * j}" y="{yy + 3}" '
                       f'width="5" height="5"/>')
        out.append("</g>")
    y = top + ((len(blocks) + cols - 1) // cols) * PITCH + 16
    return out, y, 8 + cols * PITCH


def tables_svg(frame: dict, lang: str, y: int, width: int) -> tuple[list[str], int, int]:
    """The live sequences' block tables from ``y`` on: (SVG elements, the y below them, the width so far)."""
    # zh: 从 ``y`` 开始画活跃序列的块表：（SVG 元素，它们下方的 y，到目前为止的宽度）。
    out: list[str] = []
    copy_into = {c["to"] for c in frame["event"].get("copies", [])}
    seqs = {s["id"]: s for s in frame["seqs"]}
    live = [seqs[i] for i in frame["running"] + frame["waiting"]]
    out.append(f'<text x="4" y="{y}" class="nvv-h">{svg_label("block tables", "块表", lang)}</text>')
    y += 8
    hit_by_seq = {hit["seq"]: set(hit["blocks"]) for hit in frame["event"].get("cache_hits", [])}
    for s in live:
        color = f"nvv-c{s['id'] % NUM_COLORS}"
        row = svg_label(f"seq {s['id']}: {s['num_tokens']} tok", f"序列 {s['id']}：{s['num_tokens']} token", lang)
        out.append(f'<g class="nvv-seq" data-s="{s["id"]}"><title>{seq_info(s, lang)}</title>')
        out.append(f'<rect class="{color}" x="4" y="{y + 4}" width="10" height="12" rx="2"/>')
        out.append(f'<text x="18" y="{y + 15}">{row}</text></g>')
        for j, block_id in enumerate(s["block_table"]):
            x = TABLE_X + j * (ROW_CELL + 2)
            hit = " nvv-hit" if block_id in hit_by_seq.get(s["id"], ()) else ""
            hit += " nvv-copy" if block_id in copy_into else ""
            out.append(f'<g class="nvv-ref{hit}" data-b="{block_id}"><rect class="{color}" x="{x}" y="{y}" '
                       f'width="{ROW_CELL}" height="20" rx="3"/>'
                       f'<text x="{x + ROW_CELL // 2}" y="{y + 14}" class="nvv-mid">{block_id}</text></g>')
        width = max(width, TABLE_X + len(s["block_table"]) * (ROW_CELL + 2) + 4)
        y += 24
    if not live:
        out.append(f'<text x="18" y="{y + 14}" class="nvv-dim">{svg_label("(none)", "（无）", lang)}</text>')
        y += 24
    return out, y, width


def queues_svg(frame: dict, lang: str, y: int, width: int) -> tuple[list[str], int, int]:
    """The running and waiting queues and the free list from ``y`` on: (SVG elements, the y below, the width)."""
    # zh: 从 ``y`` 开始画运行队列、等待队列和空闲队列：（SVG 元素，下方的 y，宽度）。
    out: list[str] = []
    # en: Queues as chips, in queue order (the head is on the left).
    # zh: 队列画成一串小标签，按队列顺序排列（队头在左）。
    y += 10
    queues = (("running", svg_label("running", "运行", lang)), ("waiting", svg_label("waiting", "等待", lang)))
    for name, label in queues:
        out.append(f'<text x="4" y="{y + 14}" class="nvv-h">{label}</text>')
        for j, seq_id in enumerate(frame[name]):
            x = TABLE_X + j * 44
            out.append(f'<g class="nvv-chip" data-s="{seq_id}"><rect class="nvv-c{seq_id % NUM_COLORS}" x="{x}" '
                       f'y="{y}" width="40" height="20" rx="10"/>'
                       f'<text x="{x + 20}" y="{y + 14}" class="nvv-mid">s{seq_id}</text></g>')
        width = max(width, TABLE_X + len(frame[name]) * 44 + 4)
        y += 24
    out.append(f'<text x="4" y="{y + 14}" class="nvv-h">{svg_label("free list", "空闲队列", lang)}</text>')
    shown = frame["free_list"][:24]
    for j, block_id in enumerate(shown):
        x = TABLE_X + j * 24
        out.append(f'<g class="nvv-fl" data-b="{block_id}"><rect x="{x}" y="{y + 2}" width="22" height="16" rx="3"/>'
                   f'<text x="{x + 11}" y="{y + 14}" class="nvv-mid">{block_id}</text></g>')
    if len(frame["free_list"]) > len(shown):
        out.append(f'<text x="{TABLE_X + len(shown) * 24 + 2}" y="{y + 14}">… +{len(frame["free_list"]) - 24}</text>')
    width = max(width, TABLE_X + len(shown) * 24 + 40, 420)
    y += 26
    return out, y, width


def frame_svg(frame: dict, block_size: int, prev: dict | None = None, lang: str | None = None) -> str:
    """Draw one frame: the block pool, the block tables, the queues and the free list."""
    # zh: 画一帧：块池、各块表、各队列和空闲队列。
    lang = check_lang(lang)
    pool, y, width = pool_svg(frame, block_size, prev, lang)
    # en: Block tables: one row per live sequence, running ones first.
    # zh: 块表：每个活跃序列一行，运行中的在前。
    tables, y, width = tables_svg(frame, lang, y, width)
    queues, y, width = queues_svg(frame, lang, y, width)
    out = pool + tables + queues
    # en: The drawing's accessible name says what it shows; the caption above it says what happened.
    # zh: 图的无障碍名称说明它画了什么；图上方的说明文字讲发生了什么。
    name = lang_text("block pool, block tables, queues and free list", "块池、块表、队列与空闲队列", lang, "\n")
    return (f'<svg class="nvv-svg" width="{width}" height="{y}" viewBox="0 0 {width} {y}" role="img">'
            f'<title>{name}</title>{"".join(out)}</svg>')

# %% player: style and script
#| export viz.player
# en: One stylesheet for every player; class names start with "nvv-" so they cannot clash with the page.
# en: A drawing keeps its natural size (its block ids are 9 px: shrunk to a phone's width they were 4 px);
# en: one wider than the page scrolls sideways inside the player's box.
# zh: 所有播放器共用一份样式表；类名都以 "nvv-" 开头，不会与页面冲突。
# zh: 图保持原始大小（块号只有 9 px，缩到手机宽度时只剩 4 px）；比页面宽的图在播放器框内左右滚动。
PLAYER_CSS = """
.nvv{font:13px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#263238;background:#fff;
  border:1px solid #cfd8dc;border-radius:6px;padding:8px 10px;margin:6px 0;max-width:100%;overflow-x:auto}
.nvv:focus{outline:2px solid #90caf9}
.nvv-bar{display:flex;gap:6px;align-items:center;flex-wrap:wrap;margin-bottom:4px}
.nvv-bar button{font:inherit;padding:1px 8px;border:1px solid #90a4ae;border-radius:4px;background:#eceff1;
  color:#263238;cursor:pointer;white-space:nowrap}
.nvv-bar button:hover{background:#cfd8dc}
.nvv-ico{width:10px;height:10px;fill:currentColor;vertical-align:-1px;display:inline-block}
.nvv-playing .nvv-when-stopped,.nvv:not(.nvv-playing) .nvv-when-playing{display:none}
.nvv-sr{position:absolute;width:1px;height:1px;overflow:hidden;clip:rect(0 0 0 0);white-space:nowrap}
.nvv-slide{flex:1;min-width:120px;display:flex}
.nvv-slider{flex:1;min-width:0}
.nvv-count{font-family:ui-monospace,Menlo,Consolas,monospace;min-width:5em}
.nvv-frame[hidden]{display:none}
.nvv-cap{min-height:2.9em;margin:2px 0 4px}
.nvv-info{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;color:#37474f;min-height:1.5em}
.nvv-nojs{font-size:12px;color:#8d6e63}
.nvv-svg{display:block;height:auto}
.nvv-svg text{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:11px;fill:#263238}
.nvv-svg text.nvv-h{font-family:system-ui,sans-serif;font-weight:600;fill:#455a64}
.nvv-svg text.nvv-mid,.nvv-svg text.nvv-rc{text-anchor:middle}
.nvv-svg text.nvv-rc{font-size:15px;font-weight:700}
.nvv-svg text.nvv-bid{font-size:9px;fill:#607d8b}
.nvv-svg text.nvv-dim{fill:#90a4ae}
.nvv-box{stroke-width:1.5}
.nvv-free .nvv-box{fill:#f5f5f5;stroke:#b0bec5}
.nvv-used .nvv-box{fill:#d6e6fb;stroke:#1e5aa8}
.nvv-cached .nvv-box{fill:#e3f4e6;stroke:#2e7d32;stroke-dasharray:4 2}
.nvv-cached text.nvv-rc{fill:#81a784}
.nvv-new .nvv-box{stroke:#0d47a1;stroke-width:3}
.nvv-freed .nvv-box{stroke:#c62828;stroke-width:2.5}
.nvv-hit .nvv-box,.nvv-ref.nvv-hit rect{stroke:#ef6c00;stroke-width:3}
.nvv-copy .nvv-box,.nvv-ref.nvv-copy rect{stroke:#6a1b9a;stroke-width:3}
.nvv-copysrc .nvv-box{stroke:#6a1b9a;stroke-width:2.5;stroke-dasharray:3 2}
.nvv-fill{fill:#1e5aa8}
.nvv-fl rect{fill:#fafafa;stroke:#b0bec5}
.nvv .nvv-lit .nvv-box,.nvv .nvv-ref.nvv-lit rect,.nvv .nvv-chip.nvv-lit rect{stroke:#d81b60;stroke-width:3}
.nvv-c0{fill:#ffcc80}.nvv-c1{fill:#90caf9}.nvv-c2{fill:#a5d6a7}.nvv-c3{fill:#ce93d8}
.nvv-c4{fill:#ef9a9a}.nvv-c5{fill:#80cbc4}.nvv-c6{fill:#fff59d}.nvv-c7{fill:#bcaaa4}
.nvv-legend{font-size:12px;color:#546e7a;margin-top:4px}
.nvv-legend span{display:inline-block;width:11px;height:11px;border-radius:2px;margin:0 3px -1px 8px;
  border:1.5px solid #b0bec5;background:#f5f5f5}
.nvv-legend .nvv-l-used{background:#d6e6fb;border-color:#1e5aa8}
.nvv-legend .nvv-l-cached{background:#e3f4e6;border:1.5px dashed #2e7d32}
.nvv-legend .nvv-l-hit{border:2.5px solid #ef6c00}
.nvv-legend .nvv-l-new{border:2.5px solid #0d47a1}
.nvv-legend .nvv-l-freed{border:2.5px solid #c62828}
.nvv-legend .nvv-l-copy{border:2.5px solid #6a1b9a}
.nvv-legend .nvv-l-copysrc{border:2.5px dashed #6a1b9a}
"""
# en: Only a drawing in both languages carries this style (keep_language cuts it): the Chinese caption is
# en: greyed, and the SVG labels show English only, since a label has room for one language.
# zh: 只有双语绘图带有这段样式（keep_language 会把它去掉）：中文说明文字显示为灰色，
# zh: SVG 标签只显示英文，因为一个标签只放得下一种语言。
BOTH_CSS = (".nvv:has(>style.nvv-both) .nvv-cap [lang=zh]{color:#546e7a}"
            ".nvv:has(>style.nvv-both) .nvv-svg [lang=zh]{display:none}")

# en: Icons drawn as SVG paths: glyphs such as ⏸ are missing from many fonts (an empty box instead).
# zh: 图标用 SVG 路径画出：⏸ 这类字符在很多字体里没有（会显示成空方框）。
ICONS = {
    "first": "M1 1h1.6v8H1zM9 1v8L3 5z",
    "back": "M8 1v8L2 5z",
    "play": "M2 1v8l7-4z",
    "pause": "M2 1h2.2v8H2zM5.8 1H8v8H5.8z",
    "last": "M1 1v8l6-4zM7.4 1H9v8H7.4z",
}


def _icon(name: str) -> str:
    return f'<svg class="nvv-ico" viewBox="0 0 10 10" aria-hidden="true"><path d="{ICONS[name]}"/></svg>'


# en: The player's behaviour. "__ROOT__" is replaced by the player's own element id, so each player on a page
# en: drives only its own frames. Everything it needs is already in the page: no network, no kernel, and no
# en: text (the labels of both languages are in the HTML, so keep_language can pick one).
# zh: 播放器的行为。"__ROOT__" 会被替换为该播放器自己的元素 id，因此同一页面上的每个播放器只控制自己的帧。
# zh: 它需要的一切都已在页面里：不联网，不需要内核，也不含文字
# zh: （两种语言的标签都在 HTML 里，keep_language 才能挑出一种）。
PLAYER_JS = """
(function () {
  var root = document.getElementById("__ROOT__");
  if (!root || root.getAttribute("data-ready")) return;
  root.setAttribute("data-ready", "1");
  var frames = root.querySelectorAll(".nvv-frame"), n = frames.length, cur = 0, timer = null;
  var slider = root.querySelector(".nvv-slider"), count = root.querySelector(".nvv-count");
  var info = root.querySelector(".nvv-info");
  var nojs = root.querySelector(".nvv-nojs");
  if (nojs) nojs.parentNode.removeChild(nojs);
  function show(k) {
    cur = Math.max(0, Math.min(n - 1, k));
    for (var i = 0; i < n; i++) frames[i].hidden = (i !== cur);
    slider.value = cur;
    count.textContent = (cur + 1) + " / " + n;
    root.setAttribute("data-frame", cur);
  }
  function stop() {
    if (timer) clearInterval(timer);
    timer = null;
    root.classList.remove("nvv-playing");
  }
  function start() {
    if (cur >= n - 1) show(0);
    root.classList.add("nvv-playing");
    timer = setInterval(function () { if (cur >= n - 1) stop(); else show(cur + 1); },
                        +root.getAttribute("data-interval"));
  }
  root.addEventListener("click", function (e) {
    var b = e.target.closest ? e.target.closest("[data-act]") : null;
    if (!b) return;
    var act = b.getAttribute("data-act");
    if (act === "play") { if (timer) stop(); else start(); return; }
    stop();
    if (act === "first") show(0);
    else if (act === "back") show(cur - 1);
    else if (act === "step") show(cur + 1);
    else if (act === "last") show(n - 1);
  });
  slider.addEventListener("input", function () { stop(); show(+slider.value); });
  root.addEventListener("keydown", function (e) {
    if (e.target === slider) return;
    if (e.key === "ArrowRight") { stop(); show(cur + 1); e.preventDefault(); }
    else if (e.key === "ArrowLeft") { stop(); show(cur - 1); e.preventDefault(); }
    else if (e.key === " ") { if (timer) stop(); else start(); e.preventDefault(); }
  });
  function light(sel, on) {
    var els = frames[cur].querySelectorAll(sel);
    for (var i = 0; i < els.length; i++) els[i].classList.toggle("nvv-lit", on);
  }
  function tell(g) {
    var t = g && g.querySelector("title");
    if (t) info.textContent = t.textContent;
  }
  function hover(e, on) {
    var g = e.target.closest ? e.target.closest("[data-b],[data-s]") : null;
    if (!g) return;
    var b = g.getAttribute("data-b"), s = g.getAttribute("data-s");
    if (b !== null) {
      light('[data-b="' + b + '"]', on);
      if (on) tell(frames[cur].querySelector('.nvv-blk[data-b="' + b + '"]'));
    } else {
      var owned = frames[cur].querySelectorAll(".nvv-blk");
      for (var i = 0; i < owned.length; i++) {
        if ((" " + owned[i].getAttribute("data-o") + " ").indexOf(" " + s + " ") >= 0)
          owned[i].classList.toggle("nvv-lit", on);
      }
      if (on) tell(frames[cur].querySelector('.nvv-seq[data-s="' + s + '"]'));
    }
  }
  root.addEventListener("mouseover", function (e) { hover(e, true); });
  root.addEventListener("mouseout", function (e) { hover(e, false); });
  show(+root.getAttribute("data-start"));
})();
"""

# %% player: the html
#| export viz.player
def _frame_index(frames: list, index: int, name: str) -> int:
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"{name} must be an int, got {type(index).__name__}")
    if not -len(frames) <= index < len(frames):
        raise ValueError(f"{name}={index} is out of range for a recording of {len(frames)} frames")
    return index % len(frames)


def _check_recording(recording: object) -> dict:
    if not isinstance(recording, dict):
        raise TypeError(f"recording must be a dict (see Recorder.recording), got {type(recording).__name__}")
    frames = recording.get("frames")
    if not isinstance(frames, list) or not frames:
        raise ValueError("recording has no frames: record at least the start frame (Recorder does)")
    if not isinstance(recording.get("block_size"), int) or recording["block_size"] < 1:
        raise ValueError(f"recording['block_size'] must be a positive int, got {recording.get('block_size')!r}")
    return recording


def _caption_html(frame: dict, lang: str) -> str:
    en, zh = (f'<div lang="{x}">{_esc(caption(frame, x))}</div>' for x in ("en", "zh"))
    return f'<div class="nvv-cap">{pick_lang(en, zh, lang)}</div>'


def legend_html(lang: str) -> str:
    """The legend under a frame: what each block colour means, and the count and bar on a block."""
    # zh: 一帧下面的图例：每种块颜色的含义，以及块上的计数和色条。
    items = [("free", "free", "空闲"), ("used", "used", "已用"), ("cached", "cached", "空闲但仍被缓存"),
             ("hit", "hit", "缓存命中"), ("new", "new", "新分配"), ("freed", "freed", "刚释放"),
             ("copy", "copy", "写时复制的副本"), ("copysrc", "copied from", "被复制的块")]
    parts = "".join(f'<span class="nvv-l-{key}"></span>{lang_text(en, zh, lang)}' for key, en, zh in items)
    note = lang_text("number = ref count; bar = tokens in the block", "数字 = 引用计数；横条 = 块中的 token 数", lang)
    return f'<div class="nvv-legend">{parts} · {note}</div>'


def style_html(lang: str) -> str:
    """The player's CSS as a <style> element (with "both", also the rules that set the two languages' text apart)."""
    # zh: 播放器的 CSS，作为一个 <style> 元素（"both" 时还包括把两种语言的文字区分开来的规则）。
    both = f'<!--lang:both--><style class="nvv-both">{BOTH_CSS}</style><!--/lang-->' if lang == "both" else ""
    return f"<style>{PLAYER_CSS}</style>{both}"


def frame_html(recording: dict, index: int = -1, lang: str | None = None, since: int | None = None) -> str:
    """One frame as static HTML (captions, drawing, legend): no script, so it also works inside widgets.

    since: also caption the frames from ``since`` up to ``index`` (what one action of the live panel did).
    """
    # zh: 把一帧写成静态 HTML（说明文字、图、图例）：没有脚本，所以在小部件里也能用。
    # zh:
    # zh: since：还为从 ``since`` 到 ``index`` 的各帧加上说明文字（实时面板的一次操作做了什么）。
    frames = _check_recording(recording)["frames"]
    lang = check_lang(lang)
    index = _frame_index(frames, index, "index")
    since = index if since is None else _frame_index(frames, since, "since")
    prev = frames[index - 1] if index > 0 else None
    svg = frame_svg(frames[index], recording["block_size"], prev, lang)
    captions = "".join(_caption_html(frames[k], lang) for k in range(min(since, index), index + 1))
    return f'<div class="nvv">{style_html(lang)}{captions}{svg}{legend_html(lang)}</div>'


def _button(act: str, inner: str) -> str:
    return f'<button type="button" data-act="{act}">{inner}</button>'


def controls_html(lang: str, frames: int, start: int) -> str:
    """The buttons, the slider and the frame counter: every label in the page's language, every arrow an icon."""
    # zh: 按钮、滑块和帧计数器：每个标签都用页面的语言，每个箭头都是图标。
    def t(en: str, zh: str) -> str:
        return lang_text(en, zh, lang)

    # en: A name for screen readers where the button shows only an icon
    # zh: 按钮只显示图标时，给屏幕阅读器读的名字
    def hidden(en: str, zh: str) -> str:
        return f'<span class="nvv-sr">{t(en, zh)}</span>'

    play = (f'<span class="nvv-when-stopped">{_icon("play")} {t("Play", "播放")}</span>'
            f'<span class="nvv-when-playing">{_icon("pause")} {t("Pause", "暂停")}</span>')
    return (
        '<div class="nvv-bar">'
        + _button("first", _icon("first") + hidden("first frame", "第一帧"))
        + _button("back", f'{_icon("back")} {t("Back", "后退")}')
        + _button("play", play)
        + _button("step", f'{t("Step", "单步")} {_icon("play")}')
        + _button("last", _icon("last") + hidden("last frame", "最后一帧"))
        + f'<label class="nvv-slide">{hidden("frame", "帧")}<input class="nvv-slider" type="range" min="0" '
          f'max="{frames - 1}" value="{start}"></label>'
        + f'<span class="nvv-count">{start + 1} / {frames}</span></div>'
    )


def player_html(recording: dict, *, lang: str | None = None, start: int = 0, interval_ms: int = 900,
                player_id: str | None = None) -> str:
    """A self-contained HTML + SVG + JS player of ``recording`` (no CDN, no fonts, no kernel).

    lang: "en", "zh", or "both" (each piece of text marked with its language, for ``keep_language``);
    by default the reading language (see ``set_language``).
    start: the frame shown first (and the only one shown where scripts do not run).
    """
    # zh: ``recording`` 的自包含 HTML + SVG + JS 播放器（不用 CDN、不用字体、不用内核）。
    # zh:
    # zh: lang："en"、"zh" 或 "both"（每段文字都标上它的语言，供 ``keep_language`` 使用）；
    # zh: 默认是阅读语言（见 ``set_language``）。
    # zh: start：最先显示的帧（在不运行脚本的地方，也是唯一显示的帧）。
    frames = _check_recording(recording)["frames"]
    lang = check_lang(lang)
    slides = [(_caption_html(frame, lang), frame_svg(frame, recording["block_size"], frames[k - 1] if k else None,
                                                     lang)) for k, frame in enumerate(frames)]
    hint = lang_text("Hover a block for details.", "把鼠标移到块上可查看详情。", lang)
    return slides_html(slides, lang=lang, start=start, interval_ms=interval_ms, player_id=player_id, hint=hint,
                       legend=legend_html(lang))


def slides_html(slides: list[tuple[str, str]], *, lang: str | None = None, start: int = 0, interval_ms: int = 900,
                player_id: str | None = None, hint: str = "", legend: str = "") -> str:
    """The player around ready-made frames, each a (caption HTML, SVG) pair: the same controls, keys and static
    view as `player_html`, which is one of its uses; ``hint`` goes under the frames, then ``legend``."""
    # zh: 包着现成各帧的播放器，每帧是一个（说明文字 HTML，SVG）对：与 `player_html` 相同的控件、按键和静态视图，
    # zh: `player_html` 就是它的一种用法；``hint`` 放在各帧下面，然后是 ``legend``。
    lang = check_lang(lang)
    if isinstance(interval_ms, bool) or not isinstance(interval_ms, int) or interval_ms < 50:
        raise ValueError(f"interval_ms must be an int >= 50, got {interval_ms!r}")
    if not slides:
        raise ValueError("a player needs at least one frame")
    start = _frame_index(slides, start, "start")
    root = player_id or f"nvv-{uuid.uuid4().hex[:12]}"
    if not root.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"player_id may hold letters, digits, '-' and '_' only, got {root!r}")
    body = []
    for k, (caption_html, svg) in enumerate(slides):
        hidden = "" if k == start else " hidden"
        body.append(f'<div class="nvv-frame" data-frame="{k}"{hidden}>{caption_html}{svg}</div>')
    nojs = lang_text("Static view: JavaScript did not run here (run the cell, or trust the notebook).",
                     "静态视图：这里没有运行 JavaScript（请运行该单元，或信任此 notebook）。", lang)
    return (
        f'<div class="nvv" id="{root}" tabindex="0" data-start="{start}" data-interval="{interval_ms}">'
        f"{style_html(lang)}{controls_html(lang, len(slides), start)}{''.join(body)}"
        f'<div class="nvv-info">{hint}</div>{legend}'
        f'<div class="nvv-nojs">{nojs}</div>'
        f"<script>{PLAYER_JS.replace('__ROOT__', root)}</script></div>"
    )


class Player:
    """A recording shown as a player: displays itself in Jupyter, VS Code and executed notebooks."""
    # zh: 以播放器显示的一段记录：在 Jupyter、VS Code 和执行过的 notebook 里都能显示自己。

    def __init__(self, recording: dict, **options: object) -> None:
        self.recording = recording
        self.html = player_html(recording, **options)

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return f"Player({len(self.recording['frames'])} frames)"

# %% the package's front door
#| export viz.__init__
from nanovllm.viz.driver import FakeEngine, fake_token
from nanovllm.viz.panel import LivePanel, parse_prompt
from nanovllm.viz.player import Player, caption, frame_html, frame_svg, keep_language, player_html, set_language
from nanovllm.viz.recorder import Recorder, snapshot

__all__ = [
    "FakeEngine",
    "LivePanel",
    "Player",
    "Recorder",
    "caption",
    "fake_token",
    "frame_html",
    "frame_svg",
    "keep_language",
    "parse_prompt",
    "player_html",
    "set_language",
    "snapshot",
]

# %% [markdown] tags=["en"]
# A first recording: one request of 6 tokens, blocks of 4 tokens, two tokens to generate.

# %% [markdown] tags=["zh"]
# 第一份记录：一个 6 个 token 的请求，每块 4 个 token，生成两个 token。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases, reading_language

say = Phrases({
    "step {hit}: blocks {blocks} have ref count 2; step {done}: A finished, they have ref count 1":
        "第 {hit} 步：块 {blocks} 的引用计数为 2；第 {done} 步：A 完成，它们的引用计数为 1",
    "blocks {blocks}: cached after C finished, revived by D's cache hit in step {step}":
        "块 {blocks}：C 完成后仍被缓存，在第 {step} 步被 D 的缓存命中复活",
    "chunks: {chunks}": "分块：{chunks}",
    "{steps} steps, {count} preemptions (seq ids {seqs}), all 4 requests finished":
        "{steps} 步，{count} 次抢占（序列 {seqs}），4 个请求全部完成",
    "{frames} frames checked": "检查了 {frames} 帧",
    "pool of 3: {error}": "3 个块的块池：{error}",
    "all exercise answers check out": "练习答案全部验证通过",
})

# %%
import json

from nanovllm.viz.driver import FakeEngine
from nanovllm.viz.player import Player, caption

engine = FakeEngine(num_kvcache_blocks=6, kvcache_block_size=4)
first = engine.add(list(range(1, 7)), max_tokens=2)
engine.run()
recording = engine.recording
for frame in recording["frames"]:
    print(f"{frame['index']:2}  {caption(frame, reading_language())}")
print(json.dumps(recording["frames"][2]["blocks"][:2]))
Player(recording)

# %%
# en: Plain data, through JSON and back
# zh: 普通数据：转成 JSON 再转回来，保持不变
assert json.loads(json.dumps(recording)) == recording
phases = [f["phase"] for f in recording["frames"]]
assert phases == ["start", "add", "schedule", "postprocess", "schedule", "postprocess"]
assert recording["frames"][-1]["seqs"][0]["status"] == "FINISHED"

# %% [markdown] tags=["en"]
# ## See it: two requests sharing a prefix
#
# Request A has a prompt of 10 tokens; request B arrives one step later with the same first 8
# tokens (two full blocks) and a different tail. A's full blocks were **published** (hashed) in
# the postprocess of step 1, so B's prefill finds them: two cache hits, and those two blocks have
# **ref count 2**, owned by A and B. When A finishes, its blocks are released: the shared ones
# drop back to **ref count 1** (B still holds them), A's private block becomes free.

# %% [markdown] tags=["zh"]
# ## 看它运行：两个请求共享前缀
#
# 请求 A 的提示词有 10 个 token；请求 B 晚一步到达，前 8 个 token（两个写满的块）与 A 相同，结尾不同。
# A 的写满的块在第 1 步的后处理中已经**发布**（算出了哈希），所以 B 做 prefill 时能找到它们：两次缓存命中，
# 这两个块的**引用计数变为 2**，由 A 和 B 共同持有。A 完成后释放它的块：共享块的**引用计数回到 1**
# （B 仍持有它们），A 独有的块变为空闲。

# %%
def block_of(frame: dict, block_id: int) -> dict:
    return frame["blocks"][block_id]


def seq_of(frame: dict, seq_id: int) -> dict:
    return next(s for s in frame["seqs"] if s["id"] == seq_id)


prefix = [11, 12, 13, 14, 15, 16, 17, 18]
shared = FakeEngine(num_kvcache_blocks=8, kvcache_block_size=4)
a = shared.add([*prefix, 19, 20], max_tokens=3)
shared.step()
b = shared.add([*prefix, 30, 31, 32], max_tokens=5)
shared.run()
sharing = shared.recording
Player(sharing)

# %%
frames = sharing["frames"]
hit_frame = next(f for f in frames if f["phase"] == "schedule" and f["event"]["cache_hits"])
a_blocks = seq_of(hit_frame, a.seq_id)["block_table"]
assert hit_frame["event"]["cache_hits"] == [{"seq": b.seq_id, "blocks": a_blocks[:2]}]
for block_id in a_blocks[:2]:
    assert block_of(hit_frame, block_id)["ref_count"] == 2
    assert block_of(hit_frame, block_id)["owners"] == [a.seq_id, b.seq_id]
# en: A's own tail block
# zh: A 自己的尾块
assert block_of(hit_frame, a_blocks[2])["ref_count"] == 1
# en: B prefills only its 3 new tokens
# zh: B 只需 prefill 它的 3 个新 token
assert seq_of(hit_frame, b.seq_id)["num_cached_tokens"] == 8
a_done = next(f for f in frames if f["phase"] == "postprocess" and a.seq_id in f["event"]["finished"])
assert a_done["step"] > hit_frame["step"]
for block_id in a_blocks[:2]:
    assert block_of(a_done, block_id)["ref_count"] == 1
    assert block_of(a_done, block_id)["owners"] == [b.seq_id]
assert block_of(a_done, a_blocks[2])["state"] != "used" and block_of(a_done, a_blocks[2])["ref_count"] == 0
print(say("step {hit}: blocks {blocks} have ref count 2; step {done}: A finished, they have ref count 1",
          hit=hit_frame["step"], blocks=a_blocks[:2], done=a_done["step"]))

# %% [markdown] tags=["en"]
# ## See it: a cache hit revives a freed block
#
# Request C runs alone and finishes: all its blocks are freed, but its two full blocks keep their
# hashes, so they are **free but cached** (dashed green). Request D arrives with the same first 8
# tokens: the hits take those very blocks back out of the free list, with ref count 1. D's
# prompt is 10 tokens long, so its last block is new (the last block of a prompt is never a hit:
# at least one token must be computed to get the logits).

# %% [markdown] tags=["zh"]
# ## 看它运行：缓存命中让已释放的块复活
#
# 请求 C 单独运行并完成：它的块全部释放，但两个写满的块保留了哈希，因此处于**空闲但仍被缓存**的状态（绿色虚线）。
# 请求 D 到达，前 8 个 token 与 C 相同：命中会把正是这两个块从空闲队列中取回，引用计数为 1。
# D 的提示词长 10 个 token，它的最后一块是新分配的（提示词的最后一块永远不算命中：
# 至少要计算一个 token 才能得到 logits）。

# %%
revive = FakeEngine(num_kvcache_blocks=8, kvcache_block_size=4)
c = revive.add([*prefix, 21], max_tokens=1)
revive.run()
d = revive.add([*prefix, 40, 41], max_tokens=2)
revive.run()
reviving = revive.recording
Player(reviving)

# %%
frames = reviving["frames"]
c_done = next(f for f in frames if f["phase"] == "postprocess" and c.seq_id in f["event"]["finished"])
c_blocks = seq_of(next(f for f in frames if f["phase"] == "schedule"), c.seq_id)["block_table"]
for block_id in c_blocks[:2]:
    assert block_of(c_done, block_id)["state"] == "cached" and block_of(c_done, block_id)["ref_count"] == 0
    assert block_of(c_done, block_id)["hash"] is not None and block_id in c_done["free_list"]
# en: A partial block is never published
# zh: 未写满的块从不发布
assert block_of(c_done, c_blocks[2])["state"] == "free"
d_hit = next(f for f in frames if f["phase"] == "schedule" and f["event"]["cache_hits"])
assert d_hit["event"]["cache_hits"] == [{"seq": d.seq_id, "blocks": c_blocks[:2]}]
assert seq_of(d_hit, d.seq_id)["block_table"][:2] == c_blocks[:2]
for block_id in c_blocks[:2]:
    assert block_of(d_hit, block_id)["state"] == "used" and block_of(d_hit, block_id)["ref_count"] == 1
    assert block_id not in d_hit["free_list"]
print(say("blocks {blocks}: cached after C finished, revived by D's cache hit in step {step}", blocks=c_blocks[:2],
          step=d_hit["step"]))

# %% [markdown] tags=["en"]
# ## See it: a long prompt prefilled in chunks
#
# A prompt of 20 tokens with a budget of `max_num_batched_tokens=8` tokens per step: the prefill
# is **chunked** into 8 + 8 + 4 tokens. Between chunks the sequence stays at the head of the
# *waiting* queue and keeps its blocks; a partial chunk appends no token (postprocess ignores
# the fake model's value for it).

# %% [markdown] tags=["zh"]
# ## 看它运行：长提示词的分块 prefill
#
# 提示词 20 个 token，每步预算 `max_num_batched_tokens=8` 个 token：prefill 被**分块**为 8 + 8 + 4 个 token。
# 分块之间，序列留在*等待*队列的队头并保留它的块；未完成的分块不追加 token（后处理忽略假模型为它给出的值）。

# %%
chunky = FakeEngine(num_kvcache_blocks=10, kvcache_block_size=4, max_num_batched_tokens=8)
long_seq = chunky.add(list(range(50, 70)), max_tokens=2)
chunky.run()
chunking = chunky.recording
Player(chunking)

# %%
frames = chunking["frames"]
prefills = [f for f in frames if f["phase"] == "schedule" and f["event"]["is_prefill"]]
assert [f["event"]["scheduled"][0]["num_tokens"] for f in prefills] == [8, 8, 4]
# en: The postprocess frame of each prefill step
# zh: 每个 prefill 步的 postprocess 帧
after = [frames[f["index"] + 1] for f in prefills]
assert [f["event"]["tokens"][0]["appended"] for f in after] == [False, False, True]
assert [seq_of(f, long_seq.seq_id)["num_cached_tokens"] for f in after] == [8, 16, 20]
for f in after[:2]:
    assert f["waiting"] == [long_seq.seq_id] and f["running"] == []
    assert len(seq_of(f, long_seq.seq_id)["block_table"]) >= seq_of(f, long_seq.seq_id)["num_cached_tokens"] // 4
assert after[2]["running"] == [long_seq.seq_id]
print(say("chunks: {chunks}", chunks=[f["event"]["scheduled"][0]["num_tokens"] for f in prefills]))

# %% [markdown] tags=["en"]
# ## See it: a preemption storm in a tiny pool
#
# Six blocks of 4 tokens, four requests of 6 tokens that each want 8 more. Prefill admits them
# while blocks last; during decode, each time a sequence needs a new block and none is free, the
# scheduler **preempts** the newest running sequence: its blocks go back to the free list and it
# returns to the head of the waiting queue, to be prefilled again later. Watch the queues
# shuffle, and the pool end empty with every request finished.

# %% [markdown] tags=["zh"]
# ## 看它运行：小块池里的抢占风暴
#
# 6 个块，每块 4 个 token；4 个请求，每个提示词 6 个 token，还要再生成 8 个。块还够用时，调度器就让它们 prefill；
# decode 时，每当某个序列需要新块而没有空闲块，调度器就**抢占**最新的运行序列：它的块回到空闲队列，
# 它回到等待队列的队头，之后重新 prefill。注意看队列如何来回变动，最后块池清空，所有请求都完成。

# %%
storm = FakeEngine(num_kvcache_blocks=6, kvcache_block_size=4)
victims = [storm.add([100 * (i + 1) + t for t in range(6)], max_tokens=8) for i in range(4)]
steps = storm.run()
storming = storm.recording
Player(storming, start=0)

# %%
frames = storming["frames"]
preempted = [seq_id for f in frames if f["phase"] == "schedule" for seq_id in f["event"]["preempted"]]
assert len(preempted) >= 2, preempted
final = frames[-1]
assert all(s["status"] == "FINISHED" and s["num_tokens"] == 6 + 8 for s in final["seqs"])
assert all(b["state"] != "used" and b["ref_count"] == 0 for b in final["blocks"])
assert sorted(final["free_list"]) == list(range(6)) and final["waiting"] == final["running"] == []
# en: A preempted sequence comes back: it is at the head of waiting right after its preemption.
# zh: 被抢占的序列会回来：被抢占后，它立刻位于等待队列的队头。
first_storm = next(f for f in frames if f["phase"] == "schedule" and f["event"]["preempted"])
assert first_storm["waiting"][0] == first_storm["event"]["preempted"][-1]
print(say("{steps} steps, {count} preemptions (seq ids {seqs}), all 4 requests finished", steps=steps,
          count=len(preempted), seqs=preempted))

# %% [markdown] tags=["en"]
# ## Check it: invariants in every frame of every recording
#
# The drawings are only worth something if the data is right. In every frame above: a used
# block's ref count equals the number of live block tables holding it; free and used blocks
# partition the pool and the free list holds exactly the non-used blocks, each once; a cached
# block has a hash; every live sequence holds at least the blocks its cached tokens need.
# Finally, a recording that went through JSON draws the same player (apart from the random id).

# %% [markdown] tags=["zh"]
# ## 验证：每份记录的每一帧都满足的不变量
#
# 图画得再好，数据不对也没有意义。上面每一帧都满足：已用块的引用计数等于持有它的活跃块表个数；
# 空闲块与已用块划分了整个块池，空闲队列恰好包含所有非已用块，且每块只出现一次；cached 块一定有哈希；
# 每个活跃序列持有的块至少够存放它已缓存的 token。最后，经过 JSON 往返的记录画出的播放器完全相同（随机 id 除外）。

# %%
from nanovllm.viz.player import player_html


def check_frame(frame: dict, block_size: int) -> None:
    free = frame["free_list"]
    assert len(free) == len(set(free))
    for block in frame["blocks"]:
        used = block["state"] == "used"
        assert used == (block["id"] not in free), block
        assert block["ref_count"] == len(block["owners"]), block
        assert used == (block["ref_count"] > 0), block
        assert block["state"] != "cached" or block["hash"] is not None, block
    for seq_id in frame["waiting"] + frame["running"]:
        s = seq_of(frame, seq_id)
        assert len(s["block_table"]) * block_size >= s["num_cached_tokens"], s


all_recordings = [recording, sharing, reviving, chunking, storming]
for rec in all_recordings:
    for frame in rec["frames"]:
        check_frame(frame, rec["block_size"])
    again = json.loads(json.dumps(rec))
    assert player_html(again, player_id="same") == player_html(rec, player_id="same")
print(say("{frames} frames checked", frames=sum(len(r["frames"]) for r in all_recordings)))

# %% [markdown] tags=["en"]
# ## The live panel (JupyterLab)
#
# `LivePanel()` shows buttons that drive a live scheduler with the fake model: **Step**, **Run to
# end**, **Add request** (type token ids; sharing a prefix with an earlier request shows cache
# hits), **Rebuild pool** with another number of blocks (everything done so far is replayed on
# the new pool: shrink it to force preemptions), and **Preempt newest**. Below the buttons, the
# same drawing as the player's, redrawn after each action.
#
# The panel needs a running kernel and a frontend. **On this static site it is inert**: you see
# a note instead of buttons (the cell creates the buttons only in JupyterLab or VS Code). Open the
# chapter in JupyterLab to use it. Its buttons call plain methods, so the cell after it drives it
# exactly like clicks would, then shows the session as a player, which does work here.

# %% [markdown] tags=["zh"]
# ## 实时面板（JupyterLab）
#
# `LivePanel()` 显示一组按钮，用假模型驱动一个实时的调度器：**单步**、**运行到底**、**添加请求**
# （输入 token id；与之前的请求共享前缀就能看到缓存命中）、**重建块池**（换一个块数；之前做过的一切会在新块池上重放：
# 把块池缩小就能迫使抢占发生），以及**抢占最新**。按钮下方是与播放器相同的图，每次操作后重画。
#
# 面板需要运行中的内核和前端。**在这个静态网站上它不会动**：你看到的是一条说明，而不是按钮
# （该单元只在 JupyterLab 或 VS Code 中创建按钮）。请在 JupyterLab 中打开本章来使用它。
# 它的按钮调用的是普通方法，所以紧随其后的单元会像点击一样驱动它，再把这段操作显示成播放器，而播放器在这里是能用的。

# %% panel
#| export viz.panel
from __future__ import annotations

import os
import re
from typing import Any

from nanovllm.viz.driver import FakeEngine
from nanovllm.viz.player import Player, check_lang, frame_html, lang_text


def parse_prompt(text: str) -> list[int]:
    """Token ids typed as "1 2 3" or "1, 2, 3"."""
    # zh: 输入为 "1 2 3" 或 "1, 2, 3" 的 token id。
    words = [w for w in re.split(r"[\s,]+", text.strip()) if w]
    if not words:
        raise ValueError("the prompt is empty: type token ids such as 1 2 3")
    try:
        return [int(w) for w in words]
    except ValueError:
        raise ValueError(f"the prompt must be token ids (integers), got {text!r}") from None


def interactive_frontend() -> bool:
    """True in a kernel started by JupyterLab / Jupyter Server or VS Code (not by nbclient or nbval)."""
    # zh: 在由 JupyterLab / Jupyter Server 或 VS Code（而不是 nbclient 或 nbval）启动的内核里为 True。
    return any(name in os.environ for name in ("JPY_SESSION_NAME", "VSCODE_PID", "VSCODE_CWD"))


def static_note(lang: str | None = None) -> str:
    """What shows instead of the buttons where no frontend can show them (an executed page, the site)."""
    # zh: 在没有前端能显示按钮的地方（执行过的页面、网站）代替按钮显示的内容。
    note = lang_text("LivePanel: open this chapter in JupyterLab to get its buttons.",
                     "实时面板：在 JupyterLab 中打开本章才会出现按钮。", lang, " · ")
    return f"<p><i>{note}</i></p>"


def rerun_hint(lang: str | None = None) -> str:
    """Shown above the buttons: they live in the kernel, so a saved copy reopened later shows JupyterLab's "model
    not found" where they were. A plain HTML output is saved with the notebook and stays readable then."""
    # zh: 显示在按钮上方：按钮活在内核里，所以保存下来的副本以后再打开时，按钮原来的位置会显示 JupyterLab 的
    # zh: “model not found”。普通的 HTML 输出随 notebook 一起保存，那时依然可读。
    note = lang_text("LivePanel: the buttons below live in the running kernel. Reopened later, a saved copy shows "
                     "“model not found” in their place: run this cell again to get them back.",
                     "实时面板：下面的按钮活在正在运行的内核里。以后重新打开保存过的副本时，那里会显示"
                     "“model not found”：重新运行本单元即可找回按钮。", lang, " · ")
    return f"<p><i>{note}</i></p>"



class LivePanel:
    """A control panel over a live scheduler driven by the fake model.

    Actions: ``step``, ``run`` (to the end), ``add_request``, ``rebuild`` (another pool size; the
    actions so far are replayed on the new pool) and ``preempt`` (the newest running sequence).
    ``html`` is the same drawing as the player's, as a static snapshot (a widget runs no script).
    ``widget`` builds the ipywidgets buttons on first use; each button calls one of the methods,
    which is how the tests drive the panel without a browser. ``lang`` is fixed when the panel is
    made (by default the reading language).
    """
    # zh: 一个控制面板，操纵一个由假模型驱动的实时调度器。
    # zh:
    # zh: 操作：``step``、``run``（运行到结束）、``add_request``、``rebuild``（换一个块池大小；到目前为止的操作
    # zh: 会在新块池上重放）和 ``preempt``（最新的运行序列）。
    # zh: ``html`` 与播放器的画法相同，是一张静态快照（小部件不运行脚本）。
    # zh: ``widget`` 在第一次使用时构建 ipywidgets 按钮；每个按钮调用其中一个方法，测试就是这样不用浏览器
    # zh: 操纵面板的。``lang`` 在创建面板时就固定下来（默认是阅读语言）。

    def __init__(self, *, num_kvcache_blocks: int = 8, kvcache_block_size: int = 4, max_num_seqs: int = 4,
                 max_num_batched_tokens: int = 16, lang: str | None = None) -> None:
        self.lang = check_lang(lang)
        self.options = {"kvcache_block_size": kvcache_block_size, "max_num_seqs": max_num_seqs,
                        "max_num_batched_tokens": max_num_batched_tokens}
        # en: What the user did, replayed by rebuild()
        # zh: 用户做过的操作，由 rebuild() 重放
        self.actions: list[tuple] = []
        self.engine = FakeEngine(num_kvcache_blocks=num_kvcache_blocks, **self.options)
        self.message = ""
        self.html = ""
        # en: Frames already shown
        # zh: 已经显示过的帧
        self._seen = 0
        self._widgets: dict[str, Any] | None = None
        self.redraw()

    def _text(self, en: str, zh: str) -> str:
        """A label for a widget: plain text, so "both" shows the two languages side by side."""
        # zh: 小部件的标签：纯文本，所以 "both" 会把两种语言并排显示。
        return {"en": en, "zh": zh}.get(self.lang, f"{en} {zh}")

    # en: ---- actions (the buttons call these) ---------------------------------------------------
    # zh: ---- 动作（按钮调用这些方法）------------------------------------------------------------
    def step(self) -> None:
        if self.engine.scheduler.is_finished():
            self.say("nothing to do: add a request first", "无事可做：请先添加请求")
            return
        self.engine.step()
        self.actions.append(("step",))
        self.redraw()

    def run(self) -> None:
        for _ in range(1000):
            if self.engine.scheduler.is_finished():
                break
            self.step()

    def add_request(self, prompt: str, max_tokens: int = 4, n: int = 1) -> None:
        """Add a request of ``n`` samples (n > 1: it forks after its prefill)."""
        # zh: 添加一个 ``n`` 个样本的请求（n > 1：它在 prefill 之后分叉）。
        try:
            tokens = parse_prompt(prompt)
            self.engine.add(tokens, max_tokens, n)
        except (TypeError, ValueError) as error:
            self.say(f"not added: {error}", f"未添加：{error}")
            return
        self.actions.append(("add", tokens, max_tokens, n))
        self.redraw()

    def preempt(self) -> None:
        if self.engine.preempt_newest() is None:
            self.say("no running sequence to preempt", "没有可抢占的运行序列")
            return
        self.actions.append(("preempt",))
        self.redraw()

    def rebuild(self, num_kvcache_blocks: int) -> None:
        """A new pool of ``num_kvcache_blocks`` blocks; the actions so far are replayed on it."""
        # zh: 一个有 ``num_kvcache_blocks`` 个块的新块池；到目前为止的操作会在它上面重放。
        self.engine = FakeEngine(num_kvcache_blocks=num_kvcache_blocks, **self.options)
        skipped = []
        for action in self.actions:
            if action[0] == "add":
                try:
                    self.engine.add(*action[1:])
                except ValueError as error:
                    skipped.append(str(error))
            elif action[0] == "step" and not self.engine.scheduler.is_finished():
                self.engine.step()
            elif action[0] == "preempt":
                self.engine.preempt_newest()
        # en: Caption only where the replay ended: one line per replayed frame would bury the drawing.
        # zh: 只给重放结束时的那一帧配说明：给每个重放的帧都配一行，会把图淹没。
        self._seen = len(self.engine.recorder.frames) - 1
        self.redraw()
        n = len(self.actions)
        en = f"rebuilt a pool of {num_kvcache_blocks} blocks and replayed {n} actions"
        zh = f"已重建 {num_kvcache_blocks} 个块的块池，并重放了 {n} 个操作"
        if skipped:
            en += "; skipped requests that cannot fit: " + "; ".join(skipped)
            zh += "；跳过放不下的请求：" + "；".join(skipped)
        self.say(en, zh)

    # en: ---- drawing -----------------------------------------------------------------------
    # zh: ---- 绘制 --------------------------------------------------------------------------
    def say(self, en: str, zh: str) -> None:
        self.message = f"<b>{lang_text(en, zh, self.lang, ' · ')}</b>"
        self._sync()

    def redraw(self) -> None:
        """Draw the current state, captioned with every frame the last action recorded."""
        # zh: 画出当前状态，并为上一次操作记录下的每一帧加上说明文字。
        frames = self.engine.recorder.frames
        self.message = ""
        self.html = frame_html(self.engine.recording, -1, self.lang, since=min(self._seen, len(frames) - 1))
        self._seen = len(frames)
        self._sync()

    def player(self, **options: Any) -> Player:
        """Everything done on the current pool, as a player."""
        # zh: 在当前块池上做过的一切，作为一个播放器。
        return Player(self.engine.recording, **{"lang": self.lang, **options})

    # en: ---- widgets -----------------------------------------------------------------------
    # zh: ---- 控件 --------------------------------------------------------------------------
    @property
    def widget(self) -> Any:
        """The ipywidgets panel (built on first use)."""
        # zh: ipywidgets 面板（第一次使用时构建）。
        return self._build()["box"]

    def _build(self) -> dict[str, Any]:
        if self._widgets is not None:
            return self._widgets
        # en: Imported here: only the live panel's buttons need ipywidgets.
        # zh: 在这里才导入：只有实时面板的按钮需要 ipywidgets。
        import ipywidgets as widgets

        w: dict[str, Any] = {}
        t = self._text
        # en: A label as wide as its text: the default width cuts "prompt 提示词" to "prompt 提…".
        # zh: 标签宽度随文字而定：默认宽度会把 “prompt 提示词” 截成 “prompt 提…”。
        wide = {"description_width": "initial"}

        def button(name: str, description: str, handler: Any) -> Any:
            w[name] = widgets.Button(description=description, layout=widgets.Layout(width="auto"))
            w[name].on_click(lambda _button: handler())
            return w[name]

        w["prompt"] = widgets.Text(value="1 2 3 4 5 6 7 8 9 10", description=t("prompt", "提示词"), style=wide)
        w["max_tokens"] = widgets.BoundedIntText(value=4, min=1, max=256, description="max_tokens", style=wide)
        w["n"] = widgets.BoundedIntText(value=1, min=1, max=8, description=t("samples n", "样本数 n"), style=wide)
        w["pool_size"] = widgets.BoundedIntText(value=len(self.engine.scheduler.block_manager.blocks), min=1,
                                                max=512, description=t("blocks", "块数"), style=wide)
        w["message"], w["view"] = widgets.HTML(), widgets.HTML()
        w["box"] = widgets.VBox([
            widgets.HBox([button("step", t("Step", "单步"), self.step),
                          button("run", t("Run to end", "运行到底"), self.run),
                          button("preempt", t("Preempt newest", "抢占最新"), self.preempt)]),
            widgets.HBox([w["prompt"], w["max_tokens"], w["n"], button(
                "add", t("Add request", "添加请求"),
                lambda: self.add_request(w["prompt"].value, w["max_tokens"].value, w["n"].value))]),
            widgets.HBox([w["pool_size"], button(
                "rebuild", t("Rebuild pool", "重建块池"), lambda: self.rebuild(w["pool_size"].value))]),
            w["message"],
            w["view"],
        ])
        self._widgets = w
        self._sync()
        return w

    def _sync(self) -> None:
        if self._widgets is not None:
            self._widgets["message"].value = self.message
            self._widgets["view"].value = self.html

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)


def show_panel(panel: LivePanel) -> None:
    """The panel's buttons with the hint above them, where a frontend can show them (`interactive_frontend`);
    elsewhere (an executed page, the site) `static_note`. No widget is made there: an executed notebook would keep
    the widgets' state, and the static site would then load a widget manager from a CDN."""
    # zh: 在前端能显示按钮的地方（`interactive_frontend`），显示面板的按钮以及按钮上方的提示；在其他地方
    # zh: （执行过的页面、网站）显示 `static_note`。那里不创建小部件：执行过的 notebook 会保留小部件的状态，
    # zh: 静态网站于是就会从 CDN 加载一个小部件管理器。
    # en: IPython only here, where a notebook shows the panel: the server imports this package for its live page
    # en: and must start where IPython is not installed (it comes with the book's extras, not the engine's).
    # zh: 只在这里导入 IPython，也就是笔记本显示面板的地方：服务器为它的实时页面导入这个包，在没有安装 IPython 的
    # zh: 地方也必须能启动（IPython 随本书的附加依赖安装，不随引擎安装）。
    from IPython.display import HTML, display

    if interactive_frontend():
        display(HTML(rerun_hint(panel.lang)), panel.widget)
    else:
        display(HTML(static_note(panel.lang)))


# %%
from nanovllm.viz.panel import LivePanel, show_panel

panel = LivePanel(num_kvcache_blocks=8, kvcache_block_size=4)
# en: Buttons only where a frontend can show them, with a hint for a copy reopened later (show_panel).
# zh: 只在能显示按钮的前端里创建按钮，并为以后重新打开的副本留一句提示（见 show_panel）。
show_panel(panel)

# %%
# en: The same actions as clicks on Add, Step, Add, Step, Preempt, Rebuild (5 blocks), Run to end.
# zh: 与依次点击“添加、单步、添加、单步、抢占、重建（5 个块）、运行到底”相同的操作。
panel.add_request("1 2 3 4 5 6 7 8 9", max_tokens=3)
panel.step()
panel.add_request("1 2 3 4 5 6 7 8 42 43", max_tokens=3)
panel.step()
panel.preempt()
panel.rebuild(5)
panel.run()
session = panel.engine.recording
assert [f["phase"] for f in session["frames"]].count("preempt") == 1
assert all(s["status"] == "FINISHED" for s in session["frames"][-1]["seqs"])
assert session["num_blocks"] == 5 and "nvv-blk" in panel.html
panel.player()

# %% [markdown] tags=["en"]
# ## What we built
#
# - `nanovllm.viz.recorder`: `snapshot(scheduler)` and `Recorder`, the scheduler's observer,
#   which records frames of plain, JSON-ready data.
# - `nanovllm.viz.driver`: `FakeEngine`, a scheduler driven by a deterministic fake model, for
#   recordings on a CPU in milliseconds.
# - `nanovllm.viz.player`: `caption`, `frame_svg`, `frame_html`, `player_html` and `Player`: a
#   self-contained animation with play, pause, step, slider and hover details, safe to put many
#   on one page; and `set_language`, `lang_text`, `keep_language`: one language at a time, from
#   one bilingual output.
# - `nanovllm.viz.panel`: `LivePanel`, buttons over a live scheduler in JupyterLab (and
#   `interactive_frontend()`, which tells whether buttons can be shown).
#
# ## Exercises
#
# 1. In the shared-prefix demo, make B's prompt share only the first 7 tokens with A. How many
#    cache hits does B get, and why?
# 2. In the storm, how many blocks does one request need at its longest? What is the smallest
#    pool on which all four requests can still finish?
# 3. Record a run with prefix caching switched off (`enable_prefix_caching=False`) on the
#    shared-prefix workload: what does the pool look like when B is prefilled?
#
# The cell below checks the answers; try first, then read it.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm.viz.recorder`：`snapshot(scheduler)` 与 `Recorder`（调度器的观察者），
#   把每一帧记录成可直接转成 JSON 的普通数据。
# - `nanovllm.viz.driver`：`FakeEngine`，用确定性的假模型驱动调度器，在 CPU 上几毫秒就能录好。
# - `nanovllm.viz.player`：`caption`、`frame_svg`、`frame_html`、`player_html` 与 `Player`：自包含的动画，
#   支持播放、暂停、单步、滑块和悬停详情，一个页面上放多少个都不会冲突；以及 `set_language`、`lang_text`、
#   `keep_language`：从同一份双语输出中，一次只取一种语言。
# - `nanovllm.viz.panel`：`LivePanel`，JupyterLab 中驱动实时调度器的按钮面板（以及判断能否显示按钮的
#   `interactive_frontend()`）。
#
# ## 练习
#
# 1. 在共享前缀的演示中，让 B 的提示词只与 A 共享前 7 个 token。B 会得到几次缓存命中？为什么？
# 2. 在抢占风暴中，一个请求最长时需要几个块？四个请求都能完成的最小块池是多大？
# 3. 在共享前缀的负载上关闭前缀缓存（`enable_prefix_caching=False`）再录一次：B 做 prefill 时块池是什么样子？
#
# 下面的单元会检查答案；先自己想，再看它。

# %%
# en: Exercise 1: only full blocks are hashed, and B's second block differs in its last token:
# en: one hit (the first block), the chain stops at the first miss.
# zh: 练习 1：只有写满的块才有哈希，B 的第二块最后一个 token 不同：只命中一次（第一块），链在第一次未命中处断开。
ex1 = FakeEngine(num_kvcache_blocks=8, kvcache_block_size=4)
ex1.add([*prefix, 19, 20], max_tokens=3)
ex1.step()
ex1_b = ex1.add([*prefix[:7], 99, 30, 31], max_tokens=2)
ex1.run()
ex1_hits = [h for f in ex1.recording["frames"] if f["phase"] == "schedule" for h in f["event"]["cache_hits"]]
assert ex1_hits == [{"seq": ex1_b.seq_id, "blocks": ex1_hits[0]["blocks"][:1]}]

# en: Exercise 2: 6 + 8 = 14 tokens -> 4 blocks at the longest; a pool of 4 blocks still lets every
# en: request finish (one at a time), a pool of 3 cannot hold even one of them.
# zh: 练习 2：6 + 8 = 14 个 token -> 最长时 4 块；4 个块的块池仍能让每个请求完成（一次一个），3 个块连一个都放不下。
ex2 = FakeEngine(num_kvcache_blocks=4, kvcache_block_size=4)
for i in range(4):
    ex2.add([100 * (i + 1) + t for t in range(6)], max_tokens=8)
ex2.run()
assert all(s["status"] == "FINISHED" for s in ex2.recording["frames"][-1]["seqs"])
try:
    FakeEngine(num_kvcache_blocks=3, kvcache_block_size=4).add(list(range(6)), max_tokens=8)
    raise AssertionError("a request that can never fit must be rejected")
except ValueError as error:
    print(say("pool of 3: {error}", error=error))

# en: Exercise 3: without prefix caching B gets no hits and fresh blocks: no block has ref count 2.
# zh: 练习 3：关闭前缀缓存后 B 没有命中，拿到全新的块：没有任何块的引用计数为 2。
ex3 = FakeEngine(num_kvcache_blocks=8, kvcache_block_size=4, enable_prefix_caching=False)
ex3.add([*prefix, 19, 20], max_tokens=3)
ex3.step()
ex3.add([*prefix, 30, 31, 32], max_tokens=5)
ex3.run()
assert all(not f["event"].get("cache_hits") for f in ex3.recording["frames"])
assert max(b["ref_count"] for f in ex3.recording["frames"] for b in f["blocks"]) == 1
print(say("all exercise answers check out"))
