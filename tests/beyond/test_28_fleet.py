"""Chapter 28: a fleet of servers behind SGLang's gateway (python -m nanovllm.serve.fleet), and its benchmark."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from nanovllm.bench.fleet import conversations, teach_words, workload_words
from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.serve.fleet import (
    POLICIES,
    Fleet,
    gateway_command,
    gpu_budgets,
    plan,
    prefix_cache_tokens,
    stop_groups,
    wait_healthy,
)
from nanovllm.serve.process import free_port

pytest.importorskip("sglang_router", reason="the fleet's gateway (sglang-router) is a pinned dependency")

ARGS = ["--device", "cpu", "--num-kvcache-blocks", "64", "--kvcache-block-size", "16", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(build_tiny_model("qwen3"))


def still_running(group: int) -> list[int]:
    """The processes of a process group that still run (not zombies), from /proc."""
    running = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, process_group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(process_group) == group and state != "Z":
            running.append(int(stat.parent.name))
    return running


@pytest.fixture(scope="module")
def fleet(tiny: str, tmp_path_factory: pytest.TempPathFactory):
    """Two replicas of the tiny model behind the gateway, round robin (so that both serve), for the module."""
    running = plan(["--model", tiny, *ARGS], 2, policy="round_robin", port=free_port("127.0.0.1"),
                   log_dir=tmp_path_factory.mktemp("fleet"))
    try:
        running.start()
        yield running
    finally:
        running.stop()


# ---- planning, without starting anything ---------------------------------------------------------------------------
def test_gpu_budgets_give_each_replica_a_gpu_or_a_growing_share_of_one() -> None:
    assert gpu_budgets(2, 0, 0.9) == [(None, None), (None, None)]
    assert gpu_budgets(2, 4, 0.9) == [(0, None), (1, None)]
    assert gpu_budgets(2, 1, 0.8) == [(0, 0.4), (0, 0.8)]
    # Three on two GPUs: GPU 0 holds replicas 0 and 2, GPU 1 replica 1 alone.
    assert gpu_budgets(3, 2, 0.9) == [(0, 0.45), (1, 0.9), (0, 0.9)]


def test_the_gateway_gets_every_worker_and_the_policy() -> None:
    command = gateway_command(["http://a:1", "http://b:2"], "round_robin", "127.0.0.1", 8000, 9000)
    at = command.index("--worker-urls")
    assert command[at + 1 : at + 3] == ["http://a:1", "http://b:2"]
    assert command[command.index("--policy") + 1] == "round_robin"
    assert command[command.index("--port") + 1] == "8000" and command[command.index("--prometheus-port") + 1] == "9000"


def test_plan_refuses_what_cannot_work(tiny: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--replicas must be at least 1"):
        plan(["--model", tiny, "--device", "cpu"], 0, log_dir=tmp_path)
    with pytest.raises(ValueError, match="policy must be one of"):
        plan(["--model", tiny, "--device", "cpu"], 1, policy="nearest", log_dir=tmp_path)
    # A server option that does not exist fails here, once, as the server's own parser says it.
    with pytest.raises(SystemExit):
        plan(["--model", tiny, "--device", "cpu", "--no-such-option"], 1, log_dir=tmp_path)
    joined = plan(["--model", tiny, "--device", "cpu"], 0, worker_urls=["http://10.0.0.2:8001"], log_dir=tmp_path)
    assert joined.replicas == [] and joined.remote == ["http://10.0.0.2:8001"]
    two = plan(["--model", tiny, "--device", "cpu"], None, log_dir=tmp_path)
    assert [r.gpu for r in two.replicas] == [None, None] and len({r.port for r in two.replicas}) == 2


def test_the_command_says_how_to_install_a_missing_gateway(monkeypatch, capsys) -> None:
    import importlib.util

    from nanovllm.serve import fleet as fleet_module

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang_router" else real(name))
    assert fleet_module.main(["--replicas", "1"]) == 2
    assert "pip install sglang-router==0.3.2" in capsys.readouterr().err
    assert set(POLICIES) >= {"cache_aware", "round_robin"}


def test_the_multi_turn_workload_is_the_same_for_every_policy() -> None:
    prompts = conversations(users=3, turns=4, context_words=50, seed=1)
    assert prompts == conversations(users=3, turns=4, context_words=50, seed=1)
    assert len(prompts) == 3 and all(len(turns) == 4 for turns in prompts)
    for turns in prompts:
        # Each turn's prompt starts with the whole conversation before it: what a prefix cache can reuse.
        assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(turns))
    assert len({turns[0].split(":")[0] for turns in prompts}) == 3


def test_the_gpu_models_tokenizer_knows_every_word_of_the_workload(tmp_path: Path) -> None:
    # The served benchmark model's word tokenizer names its ids t0, t1, ...: without the workload's words, every
    # document is <unk> tokens, the same for every user (a fleet run on the GPU found 82.3 % cached under both
    # policies that way).
    from tokenizers import Tokenizer

    from nanovllm.bench.serve import word_tokenizer

    word_tokenizer(tmp_path, 4096, {4095: "<|endoftext|>"})
    teach_words(tmp_path / "tokenizer.json", workload_words(users=31, turns=4))
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    unknown = tokenizer.token_to_id("<unk>")
    documents = [tokenizer.encode(turns[-1]).ids for turns in conversations(31, 4, 200, seed=3)]
    assert all(unknown not in ids for ids in documents)
    assert len({tuple(ids) for ids in documents}) == 31
    assert tokenizer.get_vocab_size() == 4096 and tokenizer.token_to_id("<|endoftext|>") == 4095


def test_the_benchmark_refuses_an_empty_workload(capsys) -> None:
    from nanovllm.bench.fleet import main

    assert main(["--users", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err


# ---- a running fleet -----------------------------------------------------------------------------------------------
def test_greedy_replies_through_the_gateway_equal_one_servers(fleet: Fleet, tiny: str) -> None:
    """Streamed or not, completion or chat, the gateway's greedy reply is the replica's own."""
    model = Path(tiny).name
    via_gateway = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0, timeout=60)
    direct = openai.OpenAI(base_url=f"{fleet.replicas[0].url}/v1", api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in via_gateway.models.list().data] == [model]
    for prompt in ("the river runs", "one two three four"):
        expected = direct.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
        for _ in range(2):  # round robin: both replicas answer
            got = via_gateway.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
            assert got.choices[0].text == expected
            stream = via_gateway.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                                    stream=True)
            assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected
    messages = [{"role": "user", "content": "say something"}]
    expected = direct.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    got = via_gateway.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert got.choices[0].message.content == expected.choices[0].message.content


def test_a_second_gateway_over_the_same_replicas(fleet: Fleet, tiny: str) -> None:
    """start_gateway alone: another policy and port over the running replicas, which both serve; stopping it leaves
    the fleet's own gateway and replicas as they were."""
    second = dataclasses.replace(fleet, policy="cache_aware", port=free_port("127.0.0.1"),
                                 metrics_port=free_port("127.0.0.1"), gateway=None, events=[])
    try:
        second.start_gateway()
        assert second.gateway is not fleet.gateway and second.gateway.poll() is None
        workers = httpx.get(f"{second.url}/workers", timeout=10).json()["workers"]
        assert sorted(worker["url"] for worker in workers) == sorted(replica.url for replica in fleet.replicas)
        body = {"model": Path(tiny).name, "prompt": "a second gateway", "max_tokens": 4, "temperature": 0.0}
        texts = [httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
                 for url in (second.url, fleet.url)]
        assert texts[0] == texts[1]
    finally:
        if second.gateway is not None:
            stop_groups([second.gateway], 5.0)
    assert second.gateway.poll() is not None and not still_running(second.gateway.pid)
    assert fleet.gateway.poll() is None and all(replica.alive() for replica in fleet.replicas)
    assert httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=60).status_code == 200


def test_a_dead_replica_leaves_the_rotation_and_the_supervisor_restarts_it(fleet: Fleet, tiny: str) -> None:
    model = Path(tiny).name
    body = {"model": model, "prompt": "a dead replica", "max_tokens": 4, "temperature": 0.0}
    expected = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    victim = fleet.replicas[1]
    os.kill(victim.process.pid, signal.SIGKILL)
    victim.process.wait()
    for _ in range(6):
        reply = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected
    fleet.check()
    assert victim.alive() and victim.restarts == 1 and "exited with code -9; restarted" in fleet.events[-1]
    wait_healthy(victim.url, victim.process, 120, "the restarted replica")
    # Back in the rotation: round robin reaches it again (its counters started from zero with it).
    deadline = time.monotonic() + 30
    while _requests_served(victim.url) == 0 and time.monotonic() < deadline:
        assert httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=60).status_code == 200
        time.sleep(0.5)
    assert _requests_served(victim.url) > 0


def _requests_served(url: str) -> float:
    """Prompt tokens a server has looked up in its prefix cache: more than 0 once it has served a request."""
    return prefix_cache_tokens([url])["queries"]


def test_a_server_started_elsewhere_joins_by_url(fleet: Fleet, tiny: str, tmp_path: Path) -> None:
    """--worker-url: the gateway routes to a server the fleet did not start (round robin: to both), here a replica of
    the module's fleet, which this fleet's stop leaves running."""
    outside = fleet.replicas[0]
    served_before = _requests_served(outside.url)
    joined = plan(["--model", tiny, *ARGS], 1, policy="round_robin", port=free_port("127.0.0.1"),
                  worker_urls=[outside.url], log_dir=tmp_path)
    try:
        joined.start()
        body = {"model": Path(tiny).name, "prompt": "joined by url", "max_tokens": 3, "temperature": 0.0}
        for _ in range(4):
            assert httpx.post(f"{joined.url}/v1/completions", json=body, timeout=60).status_code == 200
        assert _requests_served(outside.url) > served_before and _requests_served(joined.replicas[0].url) > 0
    finally:
        joined.stop()
    assert outside.alive() and httpx.get(f"{outside.url}/health", timeout=10).status_code == 200


def test_a_replica_whose_port_was_taken_meanwhile_starts_again_on_a_fresh_one(tiny: str, tmp_path: Path) -> None:
    """The port a replica was given is taken before its server binds it (here by a listening socket): it starts again
    on a fresh port, says so, and serves; a replica that fails otherwise is not started again."""
    import socket

    fleet = plan(["--model", tiny, *ARGS], 1, policy="round_robin", port=free_port("127.0.0.1"), log_dir=tmp_path)
    replica = fleet.replicas[0]
    taken = replica.port
    try:
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", taken))
            squatter.listen()
            fleet.start_replica(replica)
        assert replica.port != taken and httpx.get(f"{replica.url}/health", timeout=10).status_code == 200
        assert fleet.events == [f"replica 0: port {taken} was taken meanwhile; started again on port {replica.port}"]
    finally:
        fleet.stop()
    broken = plan(["--model", str(tmp_path / "no-model"), *ARGS], 1, policy="round_robin",
                  port=free_port("127.0.0.1"), log_dir=tmp_path / "broken")
    try:
        with pytest.raises(RuntimeError, match="exited with code"):
            broken.start_replica(broken.replicas[0])
        assert broken.events == []
    finally:
        broken.stop()


def test_sigterm_ends_the_whole_tree_within_seconds(tiny: str, tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "nanovllm.serve.fleet", "--replicas", "1", "--port", str(port),
               "--log-dir", str(tmp_path), "--model", tiny, *ARGS]
    fleet_process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = fleet_process.stdout.readline()
        assert f"behind http://127.0.0.1:{port}" in line, line + fleet_process.stdout.read()
        children = subprocess.run(["pgrep", "-P", str(fleet_process.pid)], capture_output=True, text=True)
        groups = [int(pid) for pid in children.stdout.split()]
        assert len(groups) == 2  # the server and the gateway, each leading a group of its own
        began = time.monotonic()
        fleet_process.send_signal(signal.SIGTERM)
        assert fleet_process.wait(timeout=15) == 0
        while [pid for group in groups for pid in still_running(group)] and time.monotonic() < began + 10:
            time.sleep(0.1)
        assert time.monotonic() - began < 10, [pid for group in groups for pid in still_running(group)]
    finally:
        if fleet_process.poll() is None:
            fleet_process.kill()


def test_sigkill_to_the_fleet_still_ends_its_children(tiny: str, tmp_path: Path) -> None:
    """A kill the fleet cannot catch: each child (the server and the gateway) gets SIGTERM from Linux as its parent
    dies (die_with_parent), and stops with what it started, within seconds."""
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "nanovllm.serve.fleet", "--replicas", "1", "--port", str(port),
               "--log-dir", str(tmp_path), "--model", tiny, *ARGS]
    fleet_process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    groups: list[int] = []
    try:
        line = fleet_process.stdout.readline()
        assert f"behind http://127.0.0.1:{port}" in line, line + fleet_process.stdout.read()
        children = subprocess.run(["pgrep", "-P", str(fleet_process.pid)], capture_output=True, text=True)
        groups = [int(pid) for pid in children.stdout.split()]
        # The server (with its engine process) and the gateway, each leading a group of its own
        assert len(groups) == 2 and all(still_running(group) for group in groups)
        assert sum(len(still_running(group)) for group in groups) >= 3
        began = time.monotonic()
        fleet_process.kill()
        assert fleet_process.wait(timeout=5) == -signal.SIGKILL
        while [pid for group in groups for pid in still_running(group)] and time.monotonic() < began + 10:
            time.sleep(0.1)
        assert not [pid for group in groups for pid in still_running(group)], "orphans outlived the fleet"
    finally:
        if fleet_process.poll() is None:
            fleet_process.kill()
        # Whatever is left (a failed check above), so that no orphan outlives the test
        for group in groups:
            for pid in still_running(group):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
