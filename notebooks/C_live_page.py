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
# # C · The live page: the player on a running server
#
# **Goal.** Put appendix A's player on the server of chapter 22: `GET /dashboard` shows the KV
# cache of the running server as it changes (the block pool with reference counts, each live
# request's block table, the queues, prefix-cache hits, preemptions and frees), in English or in
# Chinese, with nothing fetched from elsewhere. Chapter 22 left the server two hooks for it,
# `live_page_hub` and `live_page_recorder`, which return None there (a server without a live
# page); this appendix builds what they return and adds the page's routes.

# %% [markdown] tags=["zh"]
# # C · 实时页面：运行中服务器上的播放器
#
# **目标：** 把附录 A 的播放器放到第 22 章的服务器上：`GET /dashboard` 实时展示运行中服务器的 KV 缓存（带引用计数的
# 块池、每个活跃请求的块表、各个队列、前缀缓存命中、抢占和释放），中文或英文皆可，不从别处加载任何东西。第 22 章给
# 服务器留了两个接缝：`live_page_hub` 和 `live_page_recorder`，在那里它们返回 None（没有实时页面的服务器）；本附录
# 构建它们要返回的东西，并加上这个页面的路由。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "frames published: {frames}": "发布的帧：{frames}",
    "GET /dashboard: {status}, {kind}; lang=fr: {refused}": "GET /dashboard：{status}，{kind}；lang=fr：{refused}",
    "all exercise answers check out": "练习答案全部验证通过",
})

# %% [markdown] tags=["en"]
# ## The idea: frames as events
#
# The page is `GET /dashboard` (`/` redirects there; `?lang=zh` asks for it in Chinese). The first
# page to open has the driver attach a `LiveRecorder` to the scheduler (between two steps); the last
# one to close detaches it, so a server that nobody watches pays nothing (an open page costs a
# snapshot per scheduler event, a few per step). The recorder keeps only its last frame and
# forgets finished sequences: a server runs for days. The frames travel as server-sent events,
# drawn on the server by the player's own `caption` and `frame_svg`, into a page that holds the
# player's buttons, legend and style, and no CDN. "Play" follows the server; "Pause", "Back" and
# "Step" look at earlier frames.
#
# The page shows one frame per step: the step's last frame, with the captions of all its frames
# (scheduled, preempted, finished). `DashboardHub` draws it once for every language that an open
# page reads, on a thread of its own, and offers the drawing to every page. A page keeps only the
# newest drawing it has not sent: one that stops reading (a stalled connection) holds one frame, not
# a backlog, and a step that comes while a drawing is made replaces the one waiting to be drawn. So
# a hundred open pages cost the event loop no more than one.

# %% [markdown] tags=["zh"]
# ## 思路：把帧当作事件发送
#
# 页面就是 `GET /dashboard`（`/` 会重定向到这里；`?lang=zh` 请求中文版）。第一个打开的页面让驱动在两步之间给
# 调度器挂上一个 `LiveRecorder`；最后一个关闭的页面把它摘下，所以没人观看的服务器什么也不付出（打开的页面每个调度器
# 事件要做一次快照，每步几次）。记录器只保留最后一帧，并忘掉已完成的序列：服务器一运行就是好几天。各帧作为服务器发送
# 事件传送，在服务器上用播放器自己的 `caption` 和 `frame_svg` 画好，送进一个包含播放器按钮、图例和样式的页面，不用
# 任何 CDN。“播放”跟随服务器；“暂停”、“后退”和“单步”查看之前的帧。
#
# 页面每步显示一帧：这一步的最后一帧，配上这一步所有帧的说明文字（调度、抢占、完成）。`DashboardHub` 为打开的页面
# 用到的每种语言各画一次，在单独的线程里画，再把画好的图交给每个页面。每个页面只保留它还没发出的最新一帧：停止读取
# 的页面（一条卡住的连接）只留一帧，不会积压；画图期间到来的一步，会顶替正在等着画的那一步。所以开着一百个页面，
# 事件循环的负担也不比开一个多。

# %% default module
#| default_exp serve.dashboard

# %% live recorder
#| export
"""The live page: the book's player (appendix A), fed frame by frame from the running server."""
# zh: 实时页面：本书的播放器（附录 A），由运行中的服务器逐帧喂给它。

from __future__ import annotations

import asyncio
import html
import json
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nanovllm.viz.player import caption, controls_html, frame_svg, lang_text, legend_html, style_html
from nanovllm.viz.recorder import Recorder

_logger = logging.getLogger("nanovllm.serve")


class LiveRecorder(Recorder):
    """A `Recorder` for a server that runs for days: it hands each frame to ``publish`` as it is made, keeps only
    the last one (the next frame is drawn against it) and forgets finished sequences once they are drawn.
    Frames keep counting (``index``) as if all were kept; one that replaces the previous (consecutive adds
    share a frame) has the same index. It also draws what the scheduler does not announce: an "abort"."""
    # zh: 为一连运行好几天的服务器准备的 `Recorder`：每帧一做好就交给 ``publish``，只保留最后一帧
    # zh: （下一帧要对照它来画），已结束的序列画过之后就忘掉。帧的编号（``index``）照常往上数，就像每帧都保留了
    # zh: 一样；替换上一帧的帧（连续的 add 共用一帧）编号相同。它还会画出调度器不会宣布的事情："abort"。

    def __init__(self, scheduler: Any, publish: Callable[[dict], None]) -> None:
        self.publish, self.dropped = publish, 0
        super().__init__(scheduler, attach=False)

    def _add_frame(self, phase: str, event: dict) -> dict:
        frame = super()._add_frame(phase, event)
        frame["index"] += self.dropped
        self.publish(frame)
        extra = len(self.frames) - 1
        del self.frames[:extra]
        self.dropped += extra
        self._seqs = {seq_id: seq for seq_id, seq in self._seqs.items() if not seq.is_finished}
        return frame

    def __call__(self, event: str, payload: dict) -> None:
        if event == "abort":
            self._add_frame("abort", {"aborted": list(payload["seq_ids"])})
        else:
            super().__call__(event, payload)


def live_caption(frame: dict, lang: str) -> str:
    """The player's caption, and the live page's own phase: a request whose client went away."""
    # zh: 播放器的说明文字，以及实时页面自己的阶段：一个客户端已经离开的请求。
    if frame["phase"] != "abort":
        return caption(frame, lang)
    ids = ", ".join(map(str, frame["event"]["aborted"]))
    if lang == "zh":
        return f"第 {frame['step'] + 1} 步之前：客户端已断开，中止序列 {ids}（释放其块）"
    return f"before step {frame['step'] + 1}: client gone, aborted seq {ids} (blocks freed)"


def frame_piece(frame: dict, prev: dict | None, block_size: int, lang: str, story: list[dict] | None = None) -> str:
    """One frame as the player draws it: a ``.nvv-frame`` with its caption and drawing. ``story``: the frames whose
    captions it shows (default: its own); the live page draws a step's last frame with every caption of the step."""
    # zh: 按播放器的画法画出的一帧：一个带说明文字和图的 ``.nvv-frame``。``story``：要显示其说明文字的那些帧（默认只有
    # zh: 它自己）；实时页面画一步的最后一帧，配上这一步所有帧的说明文字。
    captions = "".join(f'<div lang="{lang}">{html.escape(live_caption(told, lang))}</div>' for told in story or [frame])
    svg = frame_svg(frame, block_size, prev, lang)
    return (f'<div class="nvv-frame" data-frame="{frame["index"]}" hidden><div class="nvv-cap">{captions}</div>'
            f"{svg}</div>")


class LivePage:
    """One open view of the live page: the newest drawing in its language that it has not sent yet, never more than
    one. A view that stops reading (a stalled connection) holds one frame, not a backlog, and gets the present when
    it reads again."""
    # zh: 实时页面的一个打开着的视图：它还没发出的、用它的语言画好的最新一帧，从不多于一帧。停止读取的视图（一条卡住的
    # zh: 连接）只留一帧，不会积压；它再读时，拿到的是当下。

    def __init__(self, lang: str) -> None:
        self.lang = lang
        self.drawing: str | None = None
        self.ready = asyncio.Event()
        self.closed = False

    def offer(self, drawing: str) -> None:
        # en: Replaces the one not sent yet
        # zh: 替换掉还没发出的那一帧
        self.drawing = drawing
        self.ready.set()

    def end(self) -> None:
        self.closed = True
        self.ready.set()

    async def next(self) -> str | None:
        """The next drawing to send, once there is one; None once the view is closed."""
        # zh: 下一帧要发的图，等到有了才返回；视图关闭后返回 None。
        while self.drawing is None and not self.closed:
            await self.ready.wait()
            self.ready.clear()
        if self.closed:
            return None
        drawing, self.drawing = self.drawing, None
        return drawing


class DashboardHub:
    """The live pages that are open, on the event loop's side. The first page to open has the driver attach a
    `LiveRecorder` to the scheduler (between two steps, wherever the driver runs); the last one to close has it
    detached, so a server that nobody watches records nothing. Each step's newest frame is drawn once for every
    language that an open page reads, on a thread of its own, and offered to every page: the event loop only hands
    text on, however many pages are open, and a step that comes while a drawing is made waits as one frame, the
    newest."""
    # zh: 事件循环这一侧打开着的实时页面。第一个打开的页面会让驱动进程把一个 `LiveRecorder` 挂到调度器上
    # zh: （在两步之间，不管驱动进程在哪里运行）；最后一个关闭的页面会让它卸下，所以没人看的服务器什么都不记录。
    # zh: 每一步的最新一帧，按打开的页面用到的每种语言各画一次，在单独的线程里画，再交给每个页面：不管开着多少个页面，
    # zh: 事件循环只是把文本转交出去；画图期间到来的步，只作为一帧（最新的那帧）排队。

    def __init__(self, engine: Any) -> None:
        # en: An `EngineClient`
        # zh: 一个 `EngineClient`
        self.engine = engine
        self.pages: set[LivePage] = set()
        # en: The newest step's frames, not drawn yet; the last frame drawn (the next is drawn against it) and its
        # en: drawings
        # zh: 最新一步还没画的各帧；上一次画的帧（下一帧要对照它来画）以及它按语言画好的图
        self.newest: list[dict] | None = None
        self.drawn: dict | None = None
        self.drawings: dict[str, str] = {}
        self.painter = ThreadPoolExecutor(1, thread_name_prefix="nanovllm-live-page")
        self.painting: asyncio.Future | None = None
        # en: Counts the recorders attached: a drawing of an earlier one, still being made, is dropped
        # zh: 给挂上的记录器计数：还在画的、属于之前那个记录器的图，画完就丢掉
        self.recording = 0
        engine.on_frame = self.publish

    def publish(self, frames: list[dict]) -> None:
        """A step's frames, as they arrive (on the event loop): the step is drawn next, as its last frame with the
        captions of all of them, in place of a step that was waiting to be drawn."""
        # zh: 一步的各帧，到达时调用（在事件循环上）：接下来画这一步：画它的最后一帧，配上所有帧的说明文字；如果有一步
        # zh: 还在等着画，就顶替它。
        self.newest = frames
        self._paint_soon()

    def _paint_soon(self) -> None:
        if self.newest is not None and self.pages and (self.painting is None or self.painting.done()):
            self.painting = asyncio.ensure_future(self._paint())

    async def _paint(self) -> None:
        loop = asyncio.get_running_loop()
        while self.newest is not None and self.pages:
            step, self.newest, recording = self.newest, None, self.recording
            languages = sorted({page.lang for page in self.pages})
            try:
                drawings = await loop.run_in_executor(self.painter, self.draw, step, self.drawn, languages)
            except Exception:
                # en: A frame the player cannot draw is a bug of the book's, not the server's: said, and skipped
                # zh: 播放器画不出来的帧是本书的 bug，不是服务器的：说出来，然后跳过
                _logger.exception("the live page could not draw a frame")
                continue
            if recording != self.recording:
                continue
            self.drawings, self.drawn = drawings, step[-1]
            for page in self.pages:
                if page.lang in drawings:
                    page.offer(drawings[page.lang])

    def draw(self, step: list[dict], prev: dict | None, languages: list[str]) -> dict[str, str]:
        """A step's frames as each language's pages receive them: a server-sent event ``{"index", "html"}``."""
        # zh: 每种语言的页面收到的一步的各帧：一个服务器发送事件 ``{"index", "html"}``。
        frame, block_size = step[-1], self.engine.info.kvcache_block_size
        return {lang: "data: " + json.dumps({"index": frame["index"],
                                             "html": frame_piece(frame, prev, block_size, lang, step)}) + "\n\n"
                for lang in languages}

    def open(self, lang: str = "en") -> LivePage:
        page = LivePage(lang)
        if not self.pages:
            self.newest, self.drawn, self.drawings = None, None, {}
            self.recording += 1
            self.engine.watch(True)
        elif lang in self.drawings:
            page.offer(self.drawings[lang])
        elif self.drawn is not None and self.newest is None:
            # en: The first page in its language: the last frame is drawn again, in its language too
            # zh: 这种语言的第一个页面：把最后一帧再画一遍，也画出它的语言
            self.newest = [self.drawn]
        self.pages.add(page)
        self._paint_soon()
        return page

    def close(self, page: LivePage) -> None:
        self.pages.discard(page)
        if not self.pages:
            self.engine.watch(False)

    def close_all(self) -> None:
        """The server stops: every page's stream ends."""
        # zh: 服务器停止：每个页面的流都结束。
        for page in self.pages:
            page.end()
        self.painter.shutdown(wait=False, cancel_futures=True)

    async def stream(self, lang: str) -> AsyncIterator[str]:
        """Server-sent events for one page: the frames drawn in ``lang``, the newest at each read."""
        # zh: 一个页面的服务器发送事件：按 ``lang`` 画好的帧，每次读取时给最新的那一帧。
        page = self.open(lang)
        try:
            while (drawing := await page.next()) is not None:
                yield drawing
        finally:
            self.close(page)

# %% live page
#| export
LIVE_JS = """
(function () {
  var root = document.getElementById("live"), box = root.querySelector(".nvv-frames");
  var slider = root.querySelector(".nvv-slider"), count = root.querySelector(".nvv-count");
  var info = root.querySelector(".nvv-info"), status = document.getElementById("status");
  var follow = true, cur = -1, MAX = +root.getAttribute("data-keep");
  root.classList.add("nvv-playing");
  function show(k) {
    var fs = box.children, n = fs.length;
    if (!n) return;
    cur = Math.max(0, Math.min(n - 1, k));
    for (var i = 0; i < n; i++) fs[i].hidden = (i !== cur);
    slider.max = n - 1; slider.value = cur;
    count.textContent = (cur + 1) + " / " + n;
    root.setAttribute("data-frame", fs[cur].getAttribute("data-frame"));
  }
  function setFollow(on) {
    follow = on;
    root.classList.toggle("nvv-playing", on);
    if (on) show(box.children.length - 1);
  }
  root.addEventListener("click", function (e) {
    var b = e.target.closest ? e.target.closest("[data-act]") : null;
    if (!b) return;
    var act = b.getAttribute("data-act");
    if (act === "play") { setFollow(!follow); return; }
    setFollow(false);
    if (act === "first") show(0);
    else if (act === "back") show(cur - 1);
    else if (act === "step") show(cur + 1);
    else if (act === "last") show(box.children.length - 1);
  });
  slider.addEventListener("input", function () { setFollow(false); show(+slider.value); });
  root.addEventListener("keydown", function (e) {
    if (e.target === slider) return;
    if (e.key === "ArrowRight") { setFollow(false); show(cur + 1); e.preventDefault(); }
    else if (e.key === "ArrowLeft") { setFollow(false); show(cur - 1); e.preventDefault(); }
    else if (e.key === " ") { setFollow(!follow); e.preventDefault(); }
  });
  function hover(e, on) {
    var g = e.target.closest ? e.target.closest("[data-b],[data-s]") : null;
    if (!g || cur < 0) return;
    var frame = box.children[cur], b = g.getAttribute("data-b"), s = g.getAttribute("data-s"), i, els;
    if (b !== null) {
      els = frame.querySelectorAll('[data-b="' + b + '"]');
      for (i = 0; i < els.length; i++) els[i].classList.toggle("nvv-lit", on);
      var t = frame.querySelector('.nvv-blk[data-b="' + b + '"] title');
      if (on && t) info.textContent = t.textContent;
    } else {
      els = frame.querySelectorAll(".nvv-blk");
      for (i = 0; i < els.length; i++) {
        var owners = " " + els[i].getAttribute("data-o") + " ";
        if (owners.indexOf(" " + s + " ") >= 0) els[i].classList.toggle("nvv-lit", on);
      }
      var u = frame.querySelector('.nvv-seq[data-s="' + s + '"] title');
      if (on && u) info.textContent = u.textContent;
    }
  }
  root.addEventListener("mouseover", function (e) { hover(e, true); });
  root.addEventListener("mouseout", function (e) { hover(e, false); });
  var source = new EventSource("/dashboard/events?lang=" + root.getAttribute("data-lang"));
  source.onopen = function () { status.textContent = status.getAttribute("data-live"); };
  source.onerror = function () { status.textContent = status.getAttribute("data-lost"); };
  source.onmessage = function (e) {
    var data = JSON.parse(e.data), t = document.createElement("template");
    t.innerHTML = data.html;
    var el = t.content.firstElementChild, last = box.lastElementChild;
    if (last && last.getAttribute("data-frame") === String(data.index)) box.replaceChild(el, last);
    else box.appendChild(el);
    while (box.children.length > MAX) { box.removeChild(box.firstElementChild); cur--; }
    root.setAttribute("data-received", +(root.getAttribute("data-received") || 0) + 1);
    show(follow ? box.children.length - 1 : cur);
  };
})();
"""

PAGE_CSS = ("body{font:14px/1.5 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:16px 24px;color:#263238}"
            "h1{font-size:20px;margin:0 0 4px}.meta{color:#546e7a;margin:0 0 8px}.meta a{margin-left:8px}")


def page_html(model_name: str, num_blocks: int, block_size: int, lang: str, keep: int = 400) -> str:
    """The live page: the player's controls, legend and style, an empty list of frames, and the script that fills
    it from ``/dashboard/events``. Everything is in the page: no CDN, no fonts."""
    # zh: 实时页面：播放器的控件、图例和样式，一个空的帧列表，以及从 ``/dashboard/events`` 填充它的脚本。
    # zh: 一切都在页面里：不用 CDN，不用字体。
    def t(en: str, zh: str) -> str:
        return lang_text(en, zh, lang)

    title = t("nano-vllm · the KV cache, live", "nano-vllm · 实时 KV 缓存")
    meta = t(f"model {model_name} · {num_blocks} blocks of {block_size} tokens",
             f"模型 {model_name} · {num_blocks} 个块，每块 {block_size} 个 token")
    live, lost = t("live", "实时"), t("connection lost, reconnecting…", "连接中断，正在重连…")
    other = '<a href="/dashboard?lang=zh">中文</a>' if lang == "en" else '<a href="/dashboard?lang=en">English</a>'
    hint = t("Play follows the server; Pause, Back and Step look at earlier frames. Hover a block for details.",
             "播放：跟随服务器；暂停、后退、单步：查看之前的帧。把鼠标移到块上可查看详情。")
    return (
        # en: A phone lays the page out at its own width; the icon is inline, so no /favicon.ico is asked for (a 404).
        # zh: 手机按自己的宽度排版这个页面；图标内联在页面里，所以浏览器不会去请求 /favicon.ico（那会是 404）。
        f'<!doctype html><html lang="{lang}"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">'
        f"<title>{title}</title>"
        f"<style>{PAGE_CSS}</style></head><body><h1>{title}</h1>"
        f'<p class="meta">{meta} · <span id="status" data-live="{live}" data-lost="{lost}">…</span>{other}</p>'
        f'<div class="nvv" id="live" tabindex="0" data-lang="{lang}" data-keep="{keep}">{style_html(lang)}'
        f'{controls_html(lang, 1, 0)}<div class="nvv-frames"></div><div class="nvv-info">{hint}</div>'
        f"{legend_html(lang)}"
        f"</div><script>{LIVE_JS}</script></body></html>"
    )

# %% [markdown] tags=["en"]
# ## Build it: the server's hooks, filled
#
# Chapter 22's `Api` asks `live_page_hub(client)` for its hub, its lifespan closes the hub's
# views when the server stops, and `create_app` and the command line hand the driver
# `live_page_recorder()`. Here the two hooks return the `DashboardHub` and the `LiveRecorder`
# class, and three routes join chapter 22's `server_routes`: `/dashboard` (the page),
# `/dashboard/events` (its frames) and `/`, which redirects to the page. The API key of chapter
# 22 already covers `/dashboard` (a browser may give it as HTTP Basic's password).

# %% [markdown] tags=["zh"]
# ## 动手：填上服务器的接缝
#
# 第 22 章的 `Api` 通过 `live_page_hub(client)` 得到它的 hub，它的 lifespan 在服务器停止时关闭 hub 的各个视图，
# `create_app` 和命令行则把 `live_page_recorder()` 交给驱动。这里两个接缝分别返回 `DashboardHub` 和 `LiveRecorder`
# 类，另有三个路由加入第 22 章的 `server_routes`：`/dashboard`（页面）、`/dashboard/events`（它的帧）和 `/`（重定向
# 到页面）。第 22 章的 API 密钥本来就保护 `/dashboard`（浏览器可以把它作为 HTTP Basic 认证的密码给出）。

# %% live page routes
#| export serve.app
from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse, StreamingResponse

import nanovllm.serve.app as app_module
from nanovllm.book.literate import add_to_class
from nanovllm.serve.app import api_of, server_routes
from nanovllm.serve.client import EngineClient
from nanovllm.serve.dashboard import DashboardHub, LiveRecorder, page_html
from nanovllm.serve.driver import Recorder
from nanovllm.serve.protocol import ServerError


@add_to_class(app_module)
def live_page_hub(client: EngineClient) -> DashboardHub:
    """What feeds the server's live page (the KV cache, drawn as it changes) to the views that are open."""
    # zh: 把服务器实时页面的内容（KV 缓存，随它的变化画出来）喂给打开着的视图的东西。
    return DashboardHub(client)


@add_to_class(app_module)
def live_page_recorder() -> Recorder:
    """What the engine's driver attaches to the scheduler while a live page is open."""
    # zh: 有实时页面打开时，引擎的驱动进程挂到调度器上的东西。
    return LiveRecorder


def check_lang(lang: str) -> None:
    if lang not in ("en", "zh"):
        raise ServerError(400, f"lang must be 'en' or 'zh', got {lang!r}", param="lang")


@server_routes.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/dashboard")


@server_routes.get("/dashboard")
async def dashboard(request: Request, lang: str = "en") -> HTMLResponse:
    check_lang(lang)
    api = api_of(request)
    return HTMLResponse(page_html(api.model_name, api.info.num_kvcache_blocks, api.info.kvcache_block_size, lang))


@server_routes.get("/dashboard/events")
async def dashboard_events(request: Request, lang: str = "en") -> StreamingResponse:
    check_lang(lang)
    return StreamingResponse(api_of(request).hub.stream(lang), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

# %% [markdown] tags=["en"]
# ## See it: a live frame
#
# A live frame, made here on a tiny engine (chapter 06's random Qwen3): a first request runs and
# leaves its full blocks in the prefix cache; then the recorder is attached, a second request runs
# a step, and the frames it published are the ones a page would receive (it shows the prefix-cache
# hit: the second request's first two blocks were computed by the first).

# %% [markdown] tags=["zh"]
# ## 看它运行：一个实时帧
#
# 一个实时帧，这里在一个小引擎上生成（第 06 章随机权重的 Qwen3）：第一个请求运行完，把它的满块留在前缀缓存里；然后
# 挂上记录器，第二个请求运行一步，它发布的帧正是页面会收到的那些帧（画面中可以看到前缀缓存命中：第二个请求的前两个块
# 是第一个请求算出来的）。

# %%
from IPython.display import HTML

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams
from nanovllm.serve.dashboard import LiveRecorder
from nanovllm.viz.player import frame_html

llm = LLM(build_tiny_model("qwen3"), device="cpu", num_kvcache_blocks=32, kvcache_block_size=16)
llm.generate([list(range(10, 60))], SamplingParams(max_tokens=1), use_tqdm=False)
published: list[dict] = []
recorder = LiveRecorder(llm.scheduler, published.append)
llm.scheduler.observer = recorder
llm.add_request(list(range(10, 50)), SamplingParams(max_tokens=2))
llm.step_tokens()
llm.scheduler.observer = None
# en: The request's last step, unrecorded
# zh: 请求的最后一步，不记录
while not llm.is_finished():
    llm.step_tokens()
print(say("frames published: {frames}", frames=[f"{f['index']}: {f['phase']}" for f in published]))
assert [f["phase"] for f in published] == ["start", "add", "schedule", "postprocess"]
# en: 41 tokens in blocks of 16
# zh: 41 个 token，每块 16 个
assert sum(b["state"] == "used" for b in published[-1]["blocks"]) == 3
assert [len(hit["blocks"]) for hit in published[2]["event"]["cache_hits"]] == [2]
# en: The page draws each frame with the player's own functions; here, the last one as a static frame.
# zh: 页面用播放器自己的函数画每一帧；这里把最后一帧画成静态的一帧。
HTML(frame_html({"block_size": 16, "frames": published}))


# %% [markdown] tags=["en"]
# The hub only needs an engine client that can be told to watch (a stand-in here, the real
# `EngineClient` on a server).

# %% [markdown] tags=["zh"]
# hub 只需要一个能被告知“开始观察”的引擎客户端（这里用一个替身，服务器上是真正的 `EngineClient`）。

# %%
class FakeClient:
    """What `DashboardHub` asks of an engine client: ``watch(on)``, ``on_frame`` and the cache's block size."""
    # zh: `DashboardHub` 对引擎客户端的要求：``watch(on)``、``on_frame``，以及缓存的块大小。

    def __init__(self, watched: list[bool] | None = None) -> None:
        self.watched = [] if watched is None else watched
        self.info = type("Info", (), {"kvcache_block_size": 16})()
        self.on_frame = None

    def watch(self, on: bool) -> None:
        self.watched.append(on)

# %% [markdown] tags=["en"]
# ## Check it
#
# The same tiny engine behind the application of chapter 22, asked over HTTP in this process
# (FastAPI's `TestClient`): the page comes back as HTML with the player's buttons and its own
# script, a language the page does not speak is refused by name, and the server's hooks now hand
# out the hub and the recorder.

# %% [markdown] tags=["zh"]
# ## 验证
#
# 还是那个小引擎，放在第 22 章的应用后面，在本进程里通过 HTTP 访问（FastAPI 的 `TestClient`）：页面以 HTML 返回，
# 带有播放器的按钮和它自己的脚本；页面不支持的语言会被点名拒绝；服务器的接缝现在交出 hub 和记录器。

# %%
from fastapi.testclient import TestClient

import nanovllm.serve.app as server
from nanovllm.serve.dashboard import DashboardHub

with TestClient(server.create_app(llm, model_name="tiny-qwen3")) as http:
    page = http.get("/dashboard?lang=zh")
    refused = http.get("/dashboard?lang=fr")
    home = http.get("/", follow_redirects=False)
print(say("GET /dashboard: {status}, {kind}; lang=fr: {refused}", status=page.status_code,
          kind=page.headers["content-type"].split(";")[0], refused=refused.status_code))

# %%
assert page.status_code == 200 and 'class="nvv"' in page.text and "EventSource" in page.text
assert '<html lang="zh">' in page.text and "实时 KV 缓存" in page.text
assert refused.status_code == 400 and "lang" in refused.json()["error"]["message"]
assert home.status_code in (302, 307) and home.headers["location"] == "/dashboard"
assert server.live_page_recorder() is LiveRecorder and isinstance(server.live_page_hub(FakeClient()), DashboardHub)
llm.exit()

# %% [markdown] tags=["en"]
# ## What we built
#
# - `nanovllm/serve/dashboard.py`: `LiveRecorder` (appendix A's recorder for a server that runs for
#   days: it publishes each frame and keeps only the last), `DashboardHub` (the open views, fed as
#   server-sent events, drawn on the server by the player's own functions) and `page_html` (the
#   page, with the player's buttons, legend and style, and no CDN).
# - In `nanovllm/serve/app.py`: chapter 22's hooks `live_page_hub` and `live_page_recorder` filled,
#   and the routes `/dashboard`, `/dashboard/events` and `/`.
#
# ## Exercises
#
# 1. Nobody has the page open. What does the server record, and what does the first page to open
#    receive first?
# 2. Why does `LiveRecorder` keep only its last frame, and what does it need that frame for?
#
# The cell below checks the answers.

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - `nanovllm/serve/dashboard.py`：`LiveRecorder`（为一运行就是好几天的服务器准备的附录 A 记录器：每一帧都发布出去，
#   只保留最后一帧）、`DashboardHub`（打开着的各个视图，以服务器发送事件喂给它们，帧由播放器自己的函数在服务器上画好）
#   和 `page_html`（页面本身，带播放器的按钮、图例和样式，不用 CDN）。
# - 在 `nanovllm/serve/app.py` 中：填上第 22 章的接缝 `live_page_hub` 和 `live_page_recorder`，并加上路由
#   `/dashboard`、`/dashboard/events` 和 `/`。
#
# ## 练习
#
# 1. 没有人打开页面时，服务器记录什么？第一个打开的页面最先收到什么？
# 2. `LiveRecorder` 为什么只保留最后一帧？它要那一帧做什么？
#
# 下面的单元会检查答案。

# %%
# en: 1: nothing: the driver attaches a recorder only when the first view opens (hub.open asks it to watch),
# en: and that view's first frame is the recorder's "start" frame, the state of the pool at that moment.
# zh: 1：什么也不记录：第一个视图打开时（hub.open 让驱动开始观察），驱动才挂上记录器，这个视图收到的第一帧是记录器
# zh: 的 “start” 帧，也就是那一刻块池的状态。
watched: list[bool] = []
client = FakeClient(watched)
hub = DashboardHub(client)
assert watched == []
view = hub.open()
assert watched == [True]
hub.close(view)
assert watched == [True, False]
# en: 2: a server runs for days, so it keeps one frame, not all of them ...
# zh: 2：服务器一运行就是好几天，所以只保留一帧，而不是全部……
assert len(recorder.frames) == 1 and recorder.frames[0] is published[-1] and recorder.dropped == len(published) - 1
# en: ... and the next frame is drawn against it: the drawing marks what changed since the previous frame (here the
# en: block the schedule step took, beside its two cache hits).
# zh: ……而下一帧要对照它来画：画出来的图标出了自上一帧以来变了什么（这里是调度那一步拿到的新块，旁边是两个缓存命中）。
from nanovllm.serve.dashboard import frame_piece

against_previous, alone = frame_piece(published[2], published[1], 16, "en"), frame_piece(published[2], None, 16, "en")
assert "nvv-new" in against_previous and "nvv-new" not in alone
print(say("all exercise answers check out"))
