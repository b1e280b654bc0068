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
