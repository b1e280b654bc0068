"""The player in a real browser: headless Chromium, driven over the DevTools protocol.

No Python dependency: Chromium is started with ``--remote-debugging-pipe`` and spoken to over
file descriptors 3 and 4 (NUL-terminated JSON messages). The clicks are real input events at
the buttons' on-screen positions. Skipped only when no Chromium is installed (Debian:
``apt-get install chromium``); ``CHROMIUM=/path/to/chrome`` picks another binary.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe", "--window-size=1000,1400"]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")


class Browser:
    """A headless Chromium with one page, spoken to over the DevTools pipe."""

    def __init__(self, binary: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="viz-chromium-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def wire_fds() -> None:  # runs in the child: Chromium reads fd 3 and writes fd 4
            a, b = os.dup(to_chrome_r), os.dup(from_chrome_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.process = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            preexec_fn=wire_fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buffer = b""
        self._next_id = 0
        self.target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=self.target, flatten=True)["sessionId"]
        self.context: str | None = None

    def fresh_page(self) -> None:
        """Replace the page with a new one in a browser context of its own (as a new incognito window): nothing
        of the pages before it (storage, cookies, cache, window size) is seen, without starting another Chromium."""
        target, context = self.target, self.context
        self.context = self.call("Target.createBrowserContext")["browserContextId"]
        self.target = self.call("Target.createTarget", url="about:blank", browserContextId=self.context)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=self.target, flatten=True)["sessionId"]
        self.call("Target.closeTarget", targetId=target)
        if context is not None:
            self.call("Target.disposeBrowserContext", browserContextId=context)

    def call(self, method: str, session: str | None = None, **params: object) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            while b"\0" not in self._buffer:
                chunk = os.read(self._from_chrome, 1 << 16)
                if not chunk:
                    raise RuntimeError("Chromium closed the DevTools pipe")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
        raise TimeoutError(f"no answer to {method}")

    def page(self, method: str, **params: object) -> dict:
        return self.call(method, self.session, **params)

    def js(self, expression: str) -> object:
        result = self.page("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        self.page("Page.enable")
        self.page("Page.navigate", url=url)
        deadline = time.monotonic() + 30
        while self.js("document.readyState") != "complete":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not load")
            time.sleep(0.05)

    def _center(self, selector: str) -> list[float]:
        """Scroll the element to the middle of the window (clear of sticky headers); return its centre."""
        return self.js("(() => { const e = document.querySelector(" + json.dumps(selector) + ");"
                       " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
                       " return [r.x + r.width / 2, r.y + r.height / 2]; })()")

    def click(self, selector: str) -> None:
        """A real mouse click at the centre of the element."""
        x, y = self._center(selector)
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.page("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def hover(self, selector: str) -> None:
        x, y = self._center(selector)
        self.page("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def screenshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.page("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        try:
            self.call("Browser.close")
            self.process.wait(timeout=10)
        except (RuntimeError, OSError, TimeoutError, subprocess.TimeoutExpired):
            self.process.kill()
        finally:
            os.close(self._to_chrome)
            os.close(self._from_chrome)
            shutil.rmtree(self.profile, ignore_errors=True)


# What a player shows: read from the page, never from Python.
STATE_JS = """(sel => { const p = document.querySelector(sel), f = +p.getAttribute("data-frame");
  const frame = p.querySelectorAll(".nvv-frame")[f];
  const blocks = [...frame.querySelectorAll(".nvv-blk")].map(g => ({
      id: +g.getAttribute("data-b"), cls: g.getAttribute("class"),
      rc: (g.querySelector(".nvv-rc") || {}).textContent || null}));
  return {frame: f, ready: p.getAttribute("data-ready"), caption: frame.querySelector(".nvv-cap").innerText,
          count: p.querySelector(".nvv-count").textContent, visible: [...p.querySelectorAll(".nvv-frame")]
          .filter(x => x.getBoundingClientRect().height > 0).length, blocks: blocks,
          info: p.querySelector(".nvv-info").textContent}; })"""


def player_state(browser: Browser, selector: str) -> dict:
    return browser.js(f"{STATE_JS}({json.dumps(selector)})")


def step_player_in_page(url: str, screenshot: Path, binary: str = CHROMIUM) -> tuple[dict, dict, dict]:
    """Open ``url``, click "step" on the last player of the page; return (other player, before, after).

    Usable on any page holding players, e.g. a chapter of the built site.
    """
    browser = Browser(binary)
    try:
        browser.open(url)
        count = browser.js("document.querySelectorAll('.nvv[id]').length")
        assert count >= 1, f"no player on {url}"
        last = browser.js("(() => { const ps = document.querySelectorAll('.nvv[id]');"
                          " return '#' + ps[ps.length - 1].id; })()")
        first = browser.js("'#' + document.querySelector('.nvv[id]').id")
        other_before = player_state(browser, first)
        before = player_state(browser, last)
        browser.click(f"{last} [data-act=step]")
        after = player_state(browser, last)
        browser.hover(f"{last} .nvv-frame:not([hidden]) .nvv-blk")
        after["info_after_hover"] = player_state(browser, last)["info"]
        browser.screenshot(screenshot)
        other_after = player_state(browser, first)
        return {"before": other_before, "after": other_after, "same": first == last}, before, after
    finally:
        browser.close()


def test_step_button_redraws_the_player(tmp_path):
    from nanovllm.viz.driver import FakeEngine
    from nanovllm.viz.player import player_html

    engine = FakeEngine(num_kvcache_blocks=8, kvcache_block_size=4)
    engine.add([1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=2)
    engine.run()
    recording = engine.recording
    # Start the second player on the "add" frame: one step later the prefill has allocated blocks.
    start = next(f["index"] for f in recording["frames"] if f["phase"] == "add")
    expected = recording["frames"][start + 1]
    page = tmp_path / "players.html"
    page.write_text("<!doctype html><html><head><meta charset='utf-8'><title>players</title></head><body>"
                    + player_html(recording) + player_html(recording, start=start) + "</body></html>",
                    encoding="utf-8")
    other, before, after = step_player_in_page(page.as_uri(), ROOT / "build" / "viz-step.png")

    assert before["ready"] == "1", "the player's script did not run"
    assert (before["frame"], after["frame"]) == (start, start + 1)
    assert after["count"] == f"{start + 2} / {len(recording['frames'])}"
    assert before["visible"] == after["visible"] == 1
    assert after["caption"] != before["caption"] and after["caption"].startswith("step 1: prefill")
    used = [b["id"] for b in expected["blocks"] if b["state"] == "used"]
    assert used
    for block_id in used:
        was, now = before["blocks"][block_id], after["blocks"][block_id]
        assert "nvv-free" in was["cls"] and was["rc"] is None
        assert "nvv-used" in now["cls"] and now["rc"] == str(expected["blocks"][block_id]["ref_count"])
    assert after["info_after_hover"].startswith("block ")
    # The first player on the page did not move.
    assert not other["same"] and other["before"]["frame"] == other["after"]["frame"] == 0
    assert (ROOT / "build" / "viz-step.png").stat().st_size > 1000
