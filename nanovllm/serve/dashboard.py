"""The live page: the book's player (appendix A), fed frame by frame from the running server."""

from __future__ import annotations

import asyncio
import html
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from nanovllm.viz.player import _controls, _legend, _style, caption, frame_svg, lang_text
from nanovllm.viz.recorder import Recorder


class LiveRecorder(Recorder):
    """A `Recorder` for a server that runs for days: it hands each frame to ``publish`` as it is made, keeps only
    the last one (the next frame is drawn against it) and forgets finished sequences once they are drawn.
    Frames keep counting (``index``) as if all were kept; one that replaces the previous (consecutive adds
    share a frame) has the same index. It also draws what the scheduler does not announce: an "abort"."""

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
    if frame["phase"] != "abort":
        return caption(frame, lang)
    ids = ", ".join(map(str, frame["event"]["aborted"]))
    if lang == "zh":
        return f"第 {frame['step'] + 1} 步之前：客户端已断开，中止序列 {ids}（释放其块）"
    return f"before step {frame['step'] + 1}: client gone, aborted seq {ids} (blocks freed)"


def frame_piece(frame: dict, prev: dict | None, block_size: int, lang: str) -> str:
    """One frame as the player draws it: a ``.nvv-frame`` with its caption and drawing."""
    text = html.escape(live_caption(frame, lang))
    svg = frame_svg(frame, block_size, prev, lang)
    return (f'<div class="nvv-frame" data-frame="{frame["index"]}" hidden><div class="nvv-cap">'
            f'<div lang="{lang}">{text}</div></div>{svg}</div>')


class DashboardHub:
    """The live pages that are open, on the event loop's side. The first page to open attaches a `LiveRecorder`
    to the scheduler (on the driver's thread, between steps); the last one to close detaches it, so a server
    that nobody watches records nothing."""

    def __init__(self, driver: Any, keep: int = 2000) -> None:
        self.driver, self.keep = driver, keep
        self.pages: set[asyncio.Queue] = set()
        self.last: dict | None = None
        driver.on_frame = self.publish

    def publish(self, frames: list[dict]) -> None:
        self.last = frames[-1]
        for page in self.pages:
            for frame in frames:
                if page.qsize() >= self.keep:  # a page that cannot keep up loses its oldest frames
                    page.get_nowait()
                page.put_nowait(frame)

    def open(self) -> asyncio.Queue:
        page: asyncio.Queue = asyncio.Queue()
        if not self.pages:
            self.last = None
            self.driver.call(self._attach)
        elif self.last is not None:
            page.put_nowait(self.last)
        self.pages.add(page)
        return page

    def close(self, page: asyncio.Queue) -> None:
        self.pages.discard(page)
        if not self.pages:
            self.driver.call(self._detach)

    def close_all(self) -> None:
        """The server stops: every page's stream ends."""
        for page in self.pages:
            page.put_nowait(None)

    def _attach(self) -> None:  # on the driver's thread
        self.driver.watch.recorder = LiveRecorder(self.driver.engine.scheduler, self.driver.frames.append)

    def _detach(self) -> None:  # on the driver's thread
        self.driver.watch.recorder = None

    async def stream(self, lang: str) -> AsyncIterator[str]:
        """Server-sent events for one page: each frame drawn in ``lang``, as ``{"index", "html"}``."""
        page = self.open()
        block_size = self.driver.engine.config.kvcache_block_size
        prev = None
        try:
            while (frame := await page.get()) is not None:
                piece = frame_piece(frame, prev, block_size, lang)
                prev = frame
                yield f"data: {json.dumps({'index': frame['index'], 'html': piece})}\n\n"
        finally:
            self.close(page)


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
        f'<!doctype html><html lang="{lang}"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{PAGE_CSS}</style></head><body><h1>{title}</h1>"
        f'<p class="meta">{meta} · <span id="status" data-live="{live}" data-lost="{lost}">…</span>{other}</p>'
        f'<div class="nvv" id="live" tabindex="0" data-lang="{lang}" data-keep="{keep}">{_style(lang)}'
        f'{_controls(lang, 1, 0)}<div class="nvv-frames"></div><div class="nvv-info">{hint}</div>{_legend(lang)}'
        f"</div><script>{LIVE_JS}</script></body></html>"
    )
