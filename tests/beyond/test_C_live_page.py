"""Appendix C: the server's live page, through the hooks that chapter 22 leaves (``live_page_hub``,
``live_page_recorder``) and the routes the appendix adds. The page in a real browser is tested with the server,
in tests/beyond/test_21_serving.py."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import nanovllm.serve.app as server
from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.llm import LLM
from nanovllm.serve.dashboard import DashboardHub, LiveRecorder

ENGINE = {"device": "cpu", "num_kvcache_blocks": 32, "kvcache_block_size": 16, "max_model_len": 256}


@pytest.fixture(scope="module")
def llm():
    engine = LLM(str(build_tiny_model("qwen3")), **ENGINE)
    yield engine
    engine.exit()


def test_the_hooks_give_the_server_its_hub_and_its_recorder(llm):
    app = server.create_app(llm, model_name="tiny")
    assert isinstance(app.state.api.hub, DashboardHub)
    assert server.live_page_recorder() is LiveRecorder
    with TestClient(app) as http:
        page = http.get("/dashboard?lang=zh")
        assert page.status_code == 200 and '<html lang="zh">' in page.text and "EventSource" in page.text
        refused = http.get("/dashboard?lang=fr")
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "lang"
        home = http.get("/", follow_redirects=False)
        assert home.status_code in (302, 307) and home.headers["location"] == "/dashboard"


def test_a_server_without_a_live_page_starts_serves_and_stops(llm, monkeypatch):
    """Chapter 22's server on its own: the hooks return None, no recorder is handed to the driver, and the
    lifespan has no views to close when the server stops."""
    monkeypatch.setattr(server, "live_page_hub", lambda client: None)
    monkeypatch.setattr(server, "live_page_recorder", lambda: None)
    app = server.create_app(llm, model_name="tiny")
    assert app.state.api.hub is None and app.state.api.client.driver.make_recorder is None
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 200
    assert llm.is_finished()


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_live_drawing_keeps_its_text_legible_on_a_phone(lang, tmp_path):
    """Issue 59, item 3: on a 390-pixel phone the live page's drawing shrank to about 0.4 of its size (block ids
    under 4 px). It keeps its natural size, scale 1, and scrolls sideways inside the player's box."""
    from nanovllm.serve.dashboard import frame_piece, page_html
    from nanovllm.viz.driver import FakeEngine
    from tests.core.test_viz_browser import CHROMIUM, Browser

    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    engine = FakeEngine(num_kvcache_blocks=64, kvcache_block_size=16)
    for i in range(3):
        engine.add(list(range(1, 40 + 10 * i)), max_tokens=4)
    engine.run()
    frames = engine.recording["frames"]
    # The page as the server sends it, with the frame that its script would add from /dashboard/events, shown
    shown = frame_piece(frames[-2], frames[-3], 16, lang).replace(" hidden>", ">", 1)
    live = page_html("tiny", 64, 16, lang).replace('<div class="nvv-frames"></div>',
                                                  f'<div class="nvv-frames">{shown}</div>')
    (tmp_path / "live.html").write_text(live, encoding="utf-8")
    browser = Browser(CHROMIUM)
    try:
        browser.page("Emulation.setDeviceMetricsOverride", deviceScaleFactor=1, mobile=True, width=390, height=844)
        browser.open((tmp_path / "live.html").as_uri())
        drawn = browser.js("""(() => { const svg = document.querySelector('.nvv-frame:not([hidden]) .nvv-svg');
          const box = document.querySelector('#live');
          const text = [...svg.querySelectorAll('text')].map(t => parseFloat(getComputedStyle(t).fontSize)
            * t.getScreenCTM().a);
          return {scale: svg.getBoundingClientRect().width / svg.width.baseVal.value, smallest: Math.min(...text),
                  scrolls: box.scrollWidth > box.clientWidth, page: document.documentElement.scrollWidth}; })()""")
    finally:
        browser.close()
    assert drawn["scale"] > 0.999 and drawn["smallest"] >= 9, drawn
    assert drawn["scrolls"] and drawn["page"] <= 390, drawn


class WatchedClient:
    """What `DashboardHub` asks of an engine client: ``watch(on)``, ``on_frame`` and the cache's block size."""

    def __init__(self) -> None:
        self.watched: list[bool] = []
        self.info = type("Info", (), {"kvcache_block_size": 16})()
        self.on_frame = None

    def watch(self, on: bool) -> None:
        self.watched.append(on)


def test_a_step_is_drawn_once_for_all_pages_and_a_page_that_does_not_read_holds_one_frame(monkeypatch):
    """Issue 60, item 3: every frame was drawn on the event loop once per open page, and a page that stopped
    reading kept a backlog of up to 2,000 frames. Now a step's newest frame is drawn once per language, off the
    event loop, and each page holds at most one drawing: the newest."""
    import asyncio
    import threading

    import nanovllm.serve.dashboard as dashboard
    from nanovllm.viz.driver import FakeEngine

    engine = FakeEngine(num_kvcache_blocks=64, kvcache_block_size=16)
    for i in range(4):
        engine.add(list(range(1, 30 + 10 * i)), max_tokens=6)
    engine.run()
    frames = engine.recording["frames"]
    drawn, real_piece = [], dashboard.frame_piece

    def counted_piece(frame, prev, block_size, lang, story=None):
        drawn.append((frame["index"], lang, threading.current_thread() is threading.main_thread()))
        return real_piece(frame, prev, block_size, lang, story)

    monkeypatch.setattr(dashboard, "frame_piece", counted_piece)

    async def scenario():
        client = WatchedClient()
        hub = DashboardHub(client)
        idle = [hub.open("en") for _ in range(50)] + [hub.open("zh") for _ in range(50)]
        reader = hub.stream("en")
        for frame in frames:  # one step's message per frame, faster than any page reads
            client.on_frame([frame])
            await asyncio.sleep(0)
        while hub.painting is not None and not hub.painting.done():
            await hub.painting
        newest = f'"index": {frames[-1]["index"]},'
        # Each idle page holds exactly one drawing, the newest frame, in its own language.
        assert all(page.drawing is not None and newest in page.drawing for page in idle)
        assert all(('lang=\\"zh\\"' in page.drawing) == (page.lang == "zh") for page in idle)
        # A page that reads gets the newest drawing at once, and then waits for the next step.
        first = await asyncio.wait_for(reader.__anext__(), timeout=5)
        assert newest in first
        pending = asyncio.ensure_future(reader.__anext__())
        await asyncio.sleep(0.05)
        assert not pending.done()
        hub.close_all()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(pending, timeout=5)
        for page in idle:
            hub.close(page)
        assert client.watched == [True, False]

    asyncio.run(scenario())
    # Never once per page: at most once per step and language (steps that came during a drawing were skipped),
    # and never on the event loop's thread.
    assert 0 < len(drawn) <= 2 * len(frames) and len(set(drawn)) == len(drawn)
    assert not any(on_loop for _, _, on_loop in drawn)


def test_a_page_in_another_language_gets_the_last_frame_at_once():
    """A page that opens in a language no open page reads gets the last step drawn in its language without waiting
    for the next step (an idle server would leave it blank)."""
    import asyncio

    from nanovllm.viz.driver import FakeEngine

    engine = FakeEngine(num_kvcache_blocks=64, kvcache_block_size=16)
    engine.add(list(range(1, 30)), max_tokens=3)
    engine.run()
    frames = engine.recording["frames"]

    async def scenario():
        client = WatchedClient()
        hub = DashboardHub(client)
        english = hub.open("en")
        client.on_frame(frames[-3:])
        while hub.painting is not None and not hub.painting.done():
            await hub.painting
        chinese = hub.stream("zh")
        drawing = await asyncio.wait_for(chinese.__anext__(), timeout=5)
        assert 'lang=\\"zh\\"' in drawing and f'"index": {frames[-1]["index"]},' in drawing
        assert english.drawing is not None
        hub.close_all()

    asyncio.run(scenario())
