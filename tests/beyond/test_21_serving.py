"""Chapter 21: the OpenAI-compatible server, through the real `openai` client against a real server process.

One tiny-model server serves most tests (started once, on a free port); the backpressure and Ctrl-C test starts
its own. Each test fails if the feature broke: texts are compared with the offline engine token for token.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.engine.tp_runtime import process_state
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams
from nanovllm.serve.detokenize import IncrementalDetokenizer
from nanovllm.serve.process import ServerProcess

ENGINE = {"device": "cpu", "num_kvcache_blocks": 64, "kvcache_block_size": 16, "max_model_len": 512}
ARGS = ["--device", "cpu", "--num-kvcache-blocks", "64", "--kvcache-block-size", "16", "--max-model-len", "512"]
PROMPTS = ["The capital of France is", "Once upon a time there was", "你好，世界 🙂"]


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(build_tiny_model("qwen3"))


@pytest.fixture(scope="module")
def server(tiny):
    with ServerProcess(["--model", tiny, "--served-model-name", "tiny", *ARGS]) as process:
        yield process


@pytest.fixture(scope="module")
def offline(tiny):
    llm = LLM(tiny, **ENGINE)
    yield llm
    llm.exit()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^((?:nanovllm|vllm):\w+)\{[^}]*\} (\S+)$", text, re.M)}


def wait_idle(server: ServerProcess, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(server)
        if values["nanovllm:num_requests_running"] == 0 and values["nanovllm:kv_cache_usage_perc"] == 0:
            return values
        if time.monotonic() > deadline:
            raise AssertionError(f"the server is not idle: {values}")
        time.sleep(0.1)


def test_detokenizer_never_splits_a_character(tiny):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    text = "你好，世界 🙂 and café"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)  # the byte-level vocabulary splits these characters over several tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add([token]) for token in ids] + [detokenizer.finish()]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert sum(1 for piece in pieces if piece) < len(ids)  # some tokens sent nothing: half a character
    # A stop string: the text ends before it, even when the match straddles tokens.
    stopper = IncrementalDetokenizer(tokenizer, stop=["世界"])
    sent = "".join(stopper.add([token]) for token in ids) + stopper.finish()
    assert sent == "你好，" and stopper.stopped


def test_detokenizer_in_rust_gives_the_python_windows_pieces(tiny):
    """The fast tokenizer's DecodeStream is used, and sends exactly what the two-decode window in Python sends, on
    random ids (special ids and ids past the vocabulary included) in chunks of several tokens, with a stop string."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    rng = random.Random(0)
    for stop in ((), ("ab",)):
        ids = [rng.randrange(len(tokenizer) + 8) for _ in range(600)] + tokenizer.encode("你好，世界 🙂")
        cuts = sorted(rng.sample(range(1, len(ids)), len(ids) // 3))  # chunks of one to a few tokens
        chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
        in_rust, in_python = IncrementalDetokenizer(tokenizer, stop), IncrementalDetokenizer(tokenizer, stop)
        in_python.stream = None
        assert in_rust.stream is not None
        rust = [in_rust.add(chunk) for chunk in chunks] + [in_rust.finish()]
        python = [in_python.add(chunk) for chunk in chunks] + [in_python.finish()]
        assert rust == python and in_rust.stopped == in_python.stopped
        if not stop:
            assert "".join(rust) == tokenizer.decode(ids, skip_special_tokens=True)


def test_detokenizer_falls_back_to_the_python_window(tiny):
    """A DecodeStream that refuses a token midway (as it does when a decoder rewrites sent text): the Python window
    takes over where it stopped, and the text is still the full decode."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    ids = tokenizer.encode("Once upon a time, 你好，世界 🙂 and café")
    detokenizer = IncrementalDetokenizer(tokenizer)
    real, calls = detokenizer.stream, []

    class Refusing:
        def step(self, backend, token):
            calls.append(token)
            if len(calls) == 9:
                raise Exception("InvalidPrefix")
            return real.step(backend, token)

    detokenizer.stream = Refusing()
    pieces = [detokenizer.add([token]) for token in ids] + [detokenizer.finish()]
    assert len(calls) == 9 and detokenizer.stream is None
    assert "\ufffd" not in "".join(pieces) and "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_greedy_completion_matches_offline_token_for_token(client, offline):
    for prompt in PROMPTS:
        params = SamplingParams(temperature=0, max_tokens=24)
        expected = offline.generate([prompt], params, use_tqdm=False)[0]
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                          extra_body={"return_token_ids": True})
        choice = reply.choices[0]
        assert choice.text == expected["text"]
        assert choice.model_extra["token_ids"] == expected["token_ids"]
        assert reply.usage.completion_tokens == len(expected["token_ids"])
        assert reply.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"return_token_ids": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["text"]
        assert [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]] == \
            expected["token_ids"]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == [choice.finish_reason] and choice.finish_reason in ("stop", "length")
        assert chunks[-1].usage.completion_tokens == len(expected["token_ids"]) and not chunks[-1].choices


def test_chat_matches_offline(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}]
    ids = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    expected = offline.generate([ids], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert reply.choices[0].message.content == expected["text"]
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == len(expected["token_ids"])
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == \
        [reply.choices[0].finish_reason]


def test_n_samples_seed_and_prompt_lists(client, offline):
    reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, n=3, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True})
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert reply.usage.completion_tokens == 24
    again = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, n=3, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]  # a seed reproduces the samples
    stream = client.completions.create(model="tiny", prompt=["Hello", "Goodbye"], max_tokens=5, n=2,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    finished = [c.choices[0].index for c in stream if c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2, 3]  # prompt i, sample k -> choice i * n + k
    two = client.completions.create(model="tiny", prompt=["Hello", "Goodbye"], max_tokens=5, temperature=0)
    for choice, prompt in zip(two.choices, ["Hello", "Goodbye"], strict=True):
        alone = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
        assert choice.text == alone["text"]


def test_stop_cuts_the_text(client):
    full = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[10:13]
    assert len(full) > 16 and stop.strip()
    cut = full[: full.index(stop)]
    reply = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=40, temperature=0,
                                      stop=[stop, "never appears 12345"], extra_body={"ignore_eos": True})
    assert reply.choices[0].text == cut and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < 40
    stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=40, temperature=0,
                                       stop=stop, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_64_concurrent_streams_each_finish_once(server):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

    async def one(i: int) -> list[str]:
        stream = await client.completions.create(model="tiny", prompt=f"Request {i}:", max_tokens=4 + i % 5,
                                                 temperature=0.8, seed=i, stream=True)
        return [c.choices[0].finish_reason async for c in stream if c.choices[0].finish_reason]

    async def all_of_them() -> list[list[str]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(all_of_them())
    assert all(len(reasons) == 1 and reasons[0] in ("stop", "length") for reasons in results), results
    wait_idle(server)


def test_a_client_that_disconnects_frees_its_blocks(server):
    idle = wait_idle(server)
    body = {"model": "tiny", "prompt": "A long story:", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as reply:
        lines = reply.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in received)
        busy = metrics(server)
        assert busy["nanovllm:num_requests_running"] == 1 and busy["nanovllm:kv_cache_usage_perc"] > 0
    # The connection is closed mid-stream: the request is aborted and its blocks are free again.
    after = wait_idle(server, timeout=10)
    assert after["nanovllm:generation_tokens_total"] - idle["nanovllm:generation_tokens_total"] < 400


BAD_REQUESTS = [
    ({"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "Hi", "n": 1000}, 400, "n"),
    ({"prompt": "Hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "Hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "word " * 600, "max_tokens": 4}, 400, "prompt"),
    ({"prompt": [1, 2, 99999], "max_tokens": 4}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "Hi", "stop": [""]}, 400, "stop"),
    # fields this server does not implement, which would change what the client gets (issue 62: unknown fields pass)
    ({"prompt": "Hi", "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"prompt": "Hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"prompt": "Hi", "logprobs": 3}, 400, "logprobs"),
    ({"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    # strict types (issue 36, item 5): the engine's API refuses bools where numbers go, so does the server
    ({"prompt": [True, False]}, 400, "prompt"),
    ({"prompt": "Hi", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": "Hi", "ignore_eos": "yes"}, 400, "ignore_eos"),
    # stop strings bounded in number and length (issue 36, item 2)
    ({"prompt": "Hi", "stop": ["a"] * 17}, 400, "stop"),
    ({"prompt": "Hi", "stop": "s" * 1025}, 400, "stop"),
    # a request's choices (prompts x n) are bounded: each gets its state before any is computed
    ({"prompt": ["a"] * 2049, "n": 2}, 400, "prompt"),
]


@pytest.mark.parametrize(("fields", "status", "param"), BAD_REQUESTS)
def test_bad_input_gets_its_status_and_the_server_goes_on(server, fields, status, param):
    body = {"model": "tiny", **fields}
    for stream in (False, True):
        reply = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": stream}, timeout=30)
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert error["message"] and error["type"] and error["param"] == param
    good = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                      timeout=30)
    assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_stream_must_be_a_boolean(server):
    reply = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "stream": "yes"},
                       timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream"


def test_a_huge_n_is_refused_before_anything_is_built(server, client):
    """Issue 36, item 2: n=3,000,000 took 24.8 s and left 1.7 GB behind (a state per choice, built before the engine
    refused it). Now it is refused with the other checks that cost nothing, in both endpoints."""
    for create, fields in ((client.completions.create, {"prompt": "Hi"}),
                           (client.chat.completions.create, {"messages": [{"role": "user", "content": "Hi"}]})):
        began = time.monotonic()
        with pytest.raises(openai.BadRequestError) as refused:
            create(model="tiny", n=3_000_000, max_tokens=2, **fields)
        assert time.monotonic() - began < 5  # generous: the refusal itself is constant time
        assert refused.value.body["param"] == "n" and "max_num_seqs" in refused.value.body["message"]


def test_routes_and_metrics(server, client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/nope").json()["error"]["type"] == "not_found_error"
    before = metrics(server)
    prompt = "The quick brown fox jumps over the lazy dog. " * 3  # more than one block of 16 tokens
    for _ in range(2):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    after = metrics(server)
    assert after["nanovllm:prompt_tokens_total"] > before["nanovllm:prompt_tokens_total"]
    assert after["nanovllm:generation_tokens_total"] >= before["nanovllm:generation_tokens_total"] + 2
    # The second request found the first one's full blocks in the prefix cache.
    assert after["nanovllm:prefix_cache_hits_total"] >= before["nanovllm:prefix_cache_hits_total"] + 16
    assert 0 < after["nanovllm:prefix_cache_hit_rate"] <= 1


def test_metrics_speak_vllms_names_and_time_the_tokens(server, client):
    """Issue 62, item 4: gateways and dashboards read vLLM's names (vllm:num_requests_waiting,
    vllm:kv_cache_usage_perc, ...) and its TTFT, inter-token and time-per-token histograms; /metrics gives them
    beside ours, with the same figures."""
    before = metrics(server)
    for stream in (False, True):
        reply = client.completions.create(model="tiny", prompt="Count:", max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True}, stream=stream)
        if stream:
            assert len("".join(chunk.choices[0].text for chunk in reply if chunk.choices)) > 0
    after = metrics(server)
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total"):
        assert after[f"vllm:{name}"] == after[f"nanovllm:{name}"], name
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    count = {name: after[f"vllm:{name}_count"] - before.get(f"vllm:{name}_count", 0)
             for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                          "request_time_per_output_token_seconds")}
    # Two choices: two first tokens, two finished; up to 5 gaps each (tokens that came with the first share its time)
    assert count["time_to_first_token_seconds"] == count["request_time_per_output_token_seconds"] == 2
    assert 2 <= count["inter_token_latency_seconds"] <= 10, count
    assert after["vllm:time_to_first_token_seconds_sum"] > before.get("vllm:time_to_first_token_seconds_sum", 0)


def test_backpressure_and_ctrl_c(tiny):
    """A step of one token (``--max-num-batched-tokens 1``) makes long prompts wait; with two waiting requests
    allowed, the next one gets 503. Then SIGINT ends the server while streams are open: they end, and the process
    exits 0 within seconds."""
    args = ["--model", tiny, "--served-model-name", "tiny", *ARGS, "--max-num-batched-tokens", "1",
            "--max-waiting", "2"]
    with ServerProcess(args) as process:
        body = {"model": "tiny", "prompt": [10 + i % 400 for i in range(300)], "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{process.url}/v1/completions", json=body) as first, \
                    http.stream("POST", f"{process.url}/v1/completions", json=body) as second:
                assert first.status_code == second.status_code == 200
                third = http.post(f"{process.url}/v1/completions", json={**body, "stream": False})
                assert third.status_code == 503 and third.json()["error"]["type"] == "server_overloaded"
                assert third.headers["retry-after"] == "1"
                began = time.monotonic()
                process.process.send_signal(signal.SIGINT)
                for reply in (first, second):
                    rest = [line for line in reply.iter_lines() if line]
                    assert rest[-1] == "data: [DONE]"
                    assert json.loads(rest[-2][6:])["error"]["type"] == "service_unavailable"
            status = process.process.wait(15)
        assert status == 0 and time.monotonic() - began < 10, process.output()
        assert "Traceback" not in process.output()


def test_a_server_process_leaves_no_log_file_behind():
    """The child's output lives in a temporary file while it runs; once dead at start the text stays readable and the
    file is gone. (A server that is stopped: test_the_engine_runs_in_a_process_of_its_own_that_ends_with_the_server.)"""
    import sys

    from nanovllm.serve.process import free_port

    dead = ServerProcess(command=[sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
                         port=free_port())
    with pytest.raises(RuntimeError, match="status 3"):
        dead.start()
    assert "no model here" in dead.output() and not dead.log.exists()


def test_an_engine_failure_fails_its_requests_only(tiny):
    """In process: a step that raises fails the requests in the engine with a 500, and the next one is served."""
    from fastapi.testclient import TestClient

    from nanovllm.serve.app import create_app

    llm = LLM(tiny, **ENGINE)
    run = llm.model_runner.run
    failures = [RuntimeError("the device fell over")]

    def flaky(*args, **kwargs):
        if failures:
            raise failures.pop()
        return run(*args, **kwargs)

    llm.model_runner.run = flaky
    try:
        with TestClient(create_app(llm, model_name="tiny")) as http:
            body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3}
            broken = http.post("/v1/completions", json=body)
            assert broken.status_code == 500 and "the device fell over" in broken.json()["error"]["message"]
            assert broken.json()["error"]["type"] == "internal_server_error"
            assert http.post("/v1/completions", json=body).status_code == 200
            assert llm.is_finished() and not llm.scheduler.block_manager.used_block_ids
    finally:
        llm.exit()


def slow_step(llm: LLM, seconds: float, nth: int = 1) -> list[bool]:
    """Make the model runner's ``nth`` step from now take ``seconds`` longer, as a long prefill on a CPU does; the
    list says when that step has begun."""
    run, begun, calls = llm.model_runner.run, [], [0]

    def slow(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            begun.append(True)
            time.sleep(seconds)
        return run(*args, **kwargs)

    llm.model_runner.run = slow
    return begun


def test_a_step_longer_than_the_engine_timeout_is_not_taken_for_a_dead_engine(tiny):
    """Issue 60, item 1: the heartbeat went out only between steps, so a healthy 70 s prefill made /health answer 503
    and failed the requests with "the engine has not answered". Now a thread of the driver says "alive" every second,
    during a step too: a step more than twice as long as --engine-timeout gets 200s, and its request is served."""
    import threading

    from fastapi.testclient import TestClient

    from nanovllm.serve.app import create_app

    llm = LLM(tiny, **ENGINE)
    begun = slow_step(llm, 6.0)
    try:
        with TestClient(create_app(llm, model_name="tiny", engine_timeout=2.5)) as http:
            answers = {}
            body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3}
            request = threading.Thread(target=lambda: answers.update(reply=http.post("/v1/completions", json=body)))
            request.start()
            assert wait_until(lambda: bool(begun), 10)
            health, began = [], time.monotonic()
            while request.is_alive():
                health.append((time.monotonic() - began, http.get("/health").status_code))
                time.sleep(0.2)
            # Asked for about twice the timeout, all through the step: never a 503
            assert health[-1][0] > 4.5 and {status for _, status in health} == {200}, health
            assert answers["reply"].status_code == 200 and answers["reply"].json()["choices"][0]["text"]
    finally:
        llm.exit()


def test_a_stop_during_a_long_step_ends_the_open_streams_at_once(tiny):
    """Issue 60, item 2: a stop (Ctrl-C, SIGTERM) during a long step left the open requests waiting for the step, until
    uvicorn cut them with a plain-text 500. Now they end at once with the error event and [DONE]."""
    import threading

    from fastapi.testclient import TestClient

    from nanovllm.serve.app import create_app

    llm = LLM(tiny, **ENGINE)
    # The first decode step: the stream has begun (its first token came with the prefill)
    begun = slow_step(llm, 4.0, nth=2)
    try:
        with TestClient(create_app(llm, model_name="tiny")) as http:
            body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "stream": True}
            lines, ended = [], []

            def stream() -> None:
                with http.stream("POST", "/v1/completions", json=body) as reply:
                    lines.extend(line for line in reply.iter_lines() if line)
                ended.append(time.monotonic())

            reader = threading.Thread(target=stream)
            reader.start()
            assert wait_until(lambda: bool(begun), 10)
            asked = time.monotonic()
            http.app.state.shutdown()
            reader.join(10)
            assert ended and ended[0] - asked < 2.0, "the stream waited for the step"
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][6:])["error"]["type"] == "service_unavailable"
    finally:
        llm.exit()


# What the live page shows, read from the page: each frame's index, caption and used blocks.
FRAMES_JS = """[...document.querySelectorAll('#live .nvv-frame')].map(f => ({
    index: +f.getAttribute('data-frame'), caption: f.querySelector('.nvv-cap').textContent,
    used: f.querySelectorAll('.nvv-blk.nvv-used').length, blocks: f.querySelectorAll('.nvv-blk').length}))"""


def test_dashboard_page_fits_a_phone_and_asks_for_no_favicon(server):
    for lang in ("en", "zh"):
        page = httpx.get(f"{server.url}/dashboard?lang={lang}", timeout=10).text
        assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in page
        assert '<link rel="icon" href="data:,">' in page


def test_dashboard_browser_shows_blocks_taken_and_freed(server, client, tmp_path):
    from tests.core.test_viz_browser import CHROMIUM, ROOT, Browser

    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    wait_idle(server)
    browser = Browser(CHROMIUM)

    def frames_until(done, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            frames = browser.js(FRAMES_JS)
            if done(frames) or time.monotonic() > deadline:
                return frames
            time.sleep(0.1)

    try:
        browser.open(f"{server.url}/dashboard")
        start = frames_until(lambda f: len(f) >= 1)
        assert start and start[-1]["blocks"] == 64 and start[-1]["used"] == 0, start
        for i in range(3):
            client.completions.create(model="tiny", prompt=f"Request {i} " * 8, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
        frames = frames_until(lambda f: f and "finished" in f[-1]["caption"] and f[-1]["used"] == 0)
        assert any(f["used"] > 0 for f in frames), frames  # blocks were allocated ...
        assert frames[-1]["used"] == 0 and "finished" in frames[-1]["caption"]  # ... and freed
        assert any("prefill" in f["caption"] for f in frames) and any("decode" in f["caption"] for f in frames)
        # A client that goes away: the page shows its request aborted and its blocks freed. The tiny model can
        # finish all its tokens before a loaded machine notices the closed connection (then there is nothing to
        # abort and nothing to draw), so the test tries a few times; a page that never shows an abort fails.
        body = {"model": "tiny", "prompt": "A long story:", "max_tokens": 480, "stream": True, "ignore_eos": True}
        for _attempt in range(4):
            last = frames[-1]["index"]
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as reply:
                next(reply.iter_lines())
            frames = frames_until(lambda f, last=last: f and f[-1]["index"] > last and f[-1]["used"] == 0 and (
                "client gone" in f[-1]["caption"] or "finished" in f[-1]["caption"]))
            if "client gone" in frames[-1]["caption"]:
                break
        assert "client gone" in frames[-1]["caption"] and frames[-1]["used"] == 0, frames[-3:]
        assert browser.js("document.querySelector('#live').classList.contains('nvv-playing')")
        browser.screenshot(ROOT / "build" / "serve-dashboard.png")
        # The Chinese page speaks Chinese only.
        browser.open(f"{server.url}/dashboard?lang=zh")
        client.completions.create(model="tiny", prompt="你好", max_tokens=4, temperature=0)
        frames = frames_until(lambda f: f and "完成" in f[-1]["caption"])
        assert "完成" in frames[-1]["caption"] and "finished" not in frames[-1]["caption"]
        assert "块池" in browser.js("document.body.innerText") and "block pool" not in browser.js(
            "document.body.innerText")
    finally:
        browser.close()
    wait_idle(server)


def engine_processes(pid: int) -> list[int]:
    """The live processes that multiprocessing spawned for ``pid`` (its resource tracker aside), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"spawn_main" in command:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """Running, sleeping or stopped: not gone, and not a zombie that nobody reaped yet."""
    return process_state(pid) not in ("", "a zombie")


def wait_until(condition, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_engine_runs_in_a_process_of_its_own_that_ends_with_the_server(tiny):
    """`python -m nanovllm.serve` steps the engine in a child process (the HTTP side's Python never waits for it);
    Ctrl-C ends both, and a server killed outright (no clean-up code runs) takes its engine with it. The server's
    output lives in a temporary file while it runs; once stopped the text stays readable and the file is gone."""
    args = ["--model", tiny, "--served-model-name", "tiny", *ARGS]
    with ServerProcess(args) as process:
        assert process.log.exists()
        engines = engine_processes(process.process.pid)
        assert len(engines) == 1, engines
        reply = httpx.post(f"{process.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4})
        assert reply.status_code == 200
        assert process.stop() == 0 and wait_until(lambda: not alive(engines[0]))
        assert not process.log.exists() and "serving" in process.output()
    with ServerProcess(args) as process:
        engines = engine_processes(process.process.pid)
        process.process.send_signal(signal.SIGKILL)
        process.process.wait(10)
        assert wait_until(lambda: not alive(engines[0])), "the engine process outlived its killed server"


def test_a_stream_that_falls_behind_gets_several_steps_in_one_chunk(tiny):
    """`Generation.events` merges what waits in its queue: three steps' tokens of one choice make one piece of
    text, the same text the three would have made one by one."""
    from types import SimpleNamespace

    from nanovllm.engine.inputs import load_tokenizer
    from nanovllm.serve.app import Generation

    tokenizer = load_tokenizer(tiny)
    ids = tokenizer.encode("Hello there, general Kenobi")
    thirds = [ids[: len(ids) // 3], ids[len(ids) // 3 : 2 * len(ids) // 3], ids[2 * len(ids) // 3 :]]
    engine = SimpleNamespace(tokenizer=tokenizer, info=SimpleNamespace(eos_token_ids=()), abort=lambda *a: None)

    async def pieces(behind: bool) -> list[tuple[str, bool]]:
        generation = Generation(engine, [[1, 2, 3]], SamplingParams(max_tokens=len(ids), ignore_eos=True), [])
        stream = generation.streams[0]
        events = [(stream, "tokens", (0, part, k == 2)) for k, part in enumerate(thirds)]
        got = []
        if behind:  # all three steps came before the response read any
            for event in events:
                generation.queue.put_nowait(event)
            async for _choice, text, finished in generation.events():
                got.append((text, finished))
        else:
            iterator = generation.events()
            for event in events:
                generation.queue.put_nowait(event)
                _choice, text, finished = await iterator.__anext__()
                got.append((text, finished))
        return got

    one_by_one, merged = asyncio.run(pieces(False)), asyncio.run(pieces(True))
    assert len(one_by_one) == 3 and merged == [("".join(text for text, _ in one_by_one), True)]
    assert merged[0][0] == tokenizer.decode(ids)


def test_a_message_to_an_engine_that_does_not_read_never_blocks_the_server(tiny):
    """The server's messages leave through a writer thread: with the engine process stopped (SIGSTOP: it reads
    nothing) and 2 MB of messages posted, far beyond a pipe's buffer, posting returns at once; once the engine
    runs again, it receives them and stops when told to."""
    import threading

    from nanovllm.serve.client import EngineProcess

    engine = EngineProcess(tiny, dict(ENGINE), None)
    try:
        os.kill(engine.process.pid, signal.SIGSTOP)
        posted = threading.Event()

        def post() -> None:
            for key in range(20):  # unknown keys: the driver ignores these aborts, after reading them
                engine._post(("abort", key, list(range(25_000))))
            posted.set()

        threading.Thread(target=post, daemon=True).start()
        assert posted.wait(5), "posting blocked while the engine was not reading"
        os.kill(engine.process.pid, signal.SIGCONT)
    finally:
        os.kill(engine.process.pid, signal.SIGCONT)
        engine.shutdown_timeout = 30
        engine.close()
    assert engine.process.exitcode == 0 and not engine.writer.is_alive()


def test_a_process_started_while_sigint_is_ignored_inherits_it():
    """`sigint_ignored` (around the engine process's start): the child ignores Ctrl-C from its first instruction,
    before any of its own code runs; the parent's handler is back afterwards."""
    import subprocess
    import sys

    from nanovllm.serve.client import sigint_ignored

    before = signal.getsignal(signal.SIGINT)
    probe = [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"]
    with sigint_ignored():
        ignored = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()
    assert ignored == "True" and signal.getsignal(signal.SIGINT) is before
    assert subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_the_driver_returns_only_once_its_heartbeat_has_ended(tiny):
    """A daemon thread still running when the interpreter exits is killed where it stands: the heartbeat's aborted
    the engine process ("terminate called without an active exception", exit status -6) in about one exit in six.
    The driver's run now waits for it, so no heartbeat thread outlives run, stop after stop."""
    import threading

    from nanovllm.serve.driver import EngineDriver

    with LLM(tiny, **ENGINE) as llm:
        for _ in range(10):
            messages = [("stop",)]
            EngineDriver(llm, lambda message: None).run(lambda wait, queued=messages: queued.pop() if queued else None)
            assert not [thread for thread in threading.enumerate() if thread.name == "nanovllm-heartbeat"]


def test_the_live_page_gets_one_frame_for_a_burst_of_adds():
    """Frames that share an index (the recorder gives consecutive adds one) leave the driver as one, the last."""
    from types import SimpleNamespace

    from nanovllm.serve.driver import EngineDriver

    engine = SimpleNamespace(config=SimpleNamespace(kvcache_block_size=16), set_observer=lambda observer: None)
    driver = EngineDriver(engine, lambda message: None)
    for frame in ({"index": 3, "adds": 1}, {"index": 3, "adds": 2}, {"index": 4}, {"index": 4, "last": True}):
        driver._publish_frame(frame)
    assert driver.frames == [{"index": 3, "adds": 2}, {"index": 4, "last": True}]
