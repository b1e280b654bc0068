"""Tensor parallelism across machines (chapter 17b): two "nodes" on this machine, over gloo. Node 0 is the engine
(`LLM(..., nnodes=2, master_port=...)`), node 1 the agent a user starts on the other machine (`python -m
nanovllm.engine.tp_node`); together they must give the tokens of one process, check their settings before anything
starts, time out a node that never joins, and leave nothing running when a rank dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

import pytest

from nanovllm.config import Config
from nanovllm.engine.tp_node import main, run_node
from nanovllm.engine.tp_runtime import TPTimeoutError, TPWorkerError, process_gone
from nanovllm.llm import LLM
from nanovllm.serve.process import free_port
from tests.speed.test_17_tp_runtime import GREEDY, PROMPTS, ROOT, SMALL, token_ids


# ---- across machines: two "nodes" on this machine, over gloo ---------------------------------------------------------
def start_node(port: int, node_rank: int = 1) -> subprocess.Popen:
    """Node `node_rank`'s agent, as a user would start it on another machine."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "nanovllm.engine.tp_node", "--master-addr", "127.0.0.1", "--master-port",
               str(port), "--node-rank", str(node_rank), "--join-timeout-s", "60"]
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)


def children_of(pid: int) -> set[int]:
    """The live child processes of `pid` (Linux /proc), but for multiprocessing's forkserver and its resource tracker,
    which fork the ranks and live as long as `pid` does, once its first engine has started them."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes()
            if int(fields[1]) == pid and fields[0] != "Z" and b"multiprocessing.forkserver" not in command \
                    and b"multiprocessing.resource_tracker" not in command:
                found.add(int(stat.parent.name))
    return found


def parent_of(pid: int) -> int:
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def all_gone(pids: list[int], seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while not all(process_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return all(process_gone(pid) for pid in pids)


def test_two_nodes_on_one_machine_give_the_tokens_of_tp1(tiny: Path) -> None:
    # A fresh TP=1 engine: the shared ones' pools were written behind their prefix caches' back (the logits test).
    with LLM(str(tiny), **SMALL) as tp1:
        expected = token_ids(tp1.generate(PROMPTS, GREEDY, use_tqdm=False))
    port = free_port()
    agent = start_node(port)
    try:
        with LLM(str(tiny), tensor_parallel_size=2, nnodes=2, master_port=port, **SMALL) as llm:
            worlds = llm.model_runner.call("world")
            # rank 0 is forked for this driver (by its forkserver), rank 1 is the agent's child: two "nodes", one
            # gloo group
            assert [(w["rank"], w["size"], w["backend"]) for w in worlds] == [(0, 2, "gloo"), (1, 2, "gloo")]
            assert parent_of(worlds[0]["parent"]) == os.getpid() and worlds[1]["parent"] == agent.pid
            assert llm.model_runner.pids == [w["pid"] for w in worlds]
            assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
            llm.config.async_scheduling = True
            assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
            pids = llm.model_runner.pids
        assert agent.wait(30) == 0, agent.stderr.read()
        assert f"node 1: ranks [1] (pids [{pids[1]}]) joined 127.0.0.1:{port}" in agent.stderr.read()
        assert all_gone(pids)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def test_node_settings_are_checked_before_anything_starts(tiny: Path, capsys: pytest.CaptureFixture) -> None:
    bad = [
        ({"nnodes": 0}, ValueError, r"nnodes must be >= 1, got 0"),
        ({"tensor_parallel_size": 2, "nnodes": 3, "master_port": 29500},
         ValueError, r"tensor_parallel_size=2 is not divisible by nnodes=3: every node runs the same number"),
        ({"tensor_parallel_size": 2, "nnodes": 2}, ValueError, r"nnodes=2 needs master_port \(e.g. 29500\)"),
        ({"master_port": 70000}, ValueError, r"master_port must be in \[0, 65535\], got 70000"),
        ({"master_port": "29500"}, TypeError, r"master_port must be an int"),
        ({"master_addr": " "}, ValueError, r"master_addr must be a host name or an IP address"),
        ({"join_timeout_s": 0}, ValueError, r"join_timeout_s must be > 0"),
    ]
    for settings, error, message in bad:
        with pytest.raises(error, match=message):
            Config.from_kwargs(tiny, **settings)
    # a port that another program holds
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"cannot open the rendezvous store on port {port} \(master_port\)"):
            LLM(str(tiny), tensor_parallel_size=2, nnodes=2, master_port=port, **SMALL)
    # the agent's command line
    with pytest.raises(SystemExit):
        main(["--master-addr", "127.0.0.1", "--master-port", "70000", "--node-rank", "1"])
    assert "--master-port 70000 is not a port" in capsys.readouterr().err
    assert main(["--master-addr", "127.0.0.1", "--master-port", "29500", "--node-rank", "0"]) == 2
    assert "node 0 is the engine's own machine" in capsys.readouterr().err


def test_a_node_that_never_joins_is_a_timeout_and_nothing_is_left_running(tiny: Path) -> None:
    port, before = free_port(), children_of(os.getpid())
    # node 2 of an engine that has nodes 0 and 1 (an agent in a thread: it is refused before it starts any rank),
    # while node 1 never comes
    refused: list[BaseException] = []

    def stray() -> None:
        try:
            run_node("127.0.0.1", port, 2, timeout_s=30.0)
        except ValueError as error:
            refused.append(error)

    agent = threading.Thread(target=stray)
    agent.start()
    started = time.monotonic()
    with pytest.raises(TPTimeoutError) as caught:
        LLM(str(tiny), tensor_parallel_size=2, nnodes=2, master_port=port, join_timeout_s=3.0, **SMALL)
    waited = time.monotonic() - started
    agent.join(30)
    assert str(caught.value).startswith("tensor-parallel node 1 did not join within join_timeout_s=3 s; on node K, "
                                        "run `python -m nanovllm.engine.tp_node --master-addr 127.0.0.1 "
                                        f"--master-port {port} --node-rank K`"), caught.value
    assert 3.0 <= waited < 3.0 + 5.0, waited
    assert [str(error) for error in refused] == ["node 0 refused this node: node_rank 2 is out of range: this engine "
                                                 "runs nnodes=2, so the other nodes are 1 to 1"]
    assert children_of(os.getpid()) == before
    with socket.create_server(("", port)):  # the store let its port go
        pass


def test_a_remote_rank_killed_mid_run_stops_every_process(tiny: Path) -> None:
    port, before = free_port(), children_of(os.getpid())
    agent = start_node(port)
    try:
        llm = LLM(str(tiny), tensor_parallel_size=2, nnodes=2, master_port=port, **SMALL)
        pids = llm.model_runner.pids
        assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]["token_ids"]) == GREEDY.max_tokens
        os.kill(pids[1], signal.SIGKILL)  # rank 1 lives on "node 1"
        with pytest.raises(TPWorkerError) as caught:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        # the rank that vanished is named, not rank 0, whose collective failed for want of it
        assert str(caught.value).splitlines()[0] == ("tensor-parallel rank 1 failed during run: the process exited "
                                                     "(code unknown to node 0) without a reply; all 2 rank processes "
                                                     "have been stopped")
        assert agent.wait(15) == 1  # its rank did not end well
        assert all_gone(pids) and not llm.model_runner.alive
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert children_of(os.getpid()) == before
