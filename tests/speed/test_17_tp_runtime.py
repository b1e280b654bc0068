"""Chapter 16, part two: tensor-parallel ranks as processes (gloo on CPU here, NCCL on GPUs when marked gpu).

The ranks are forked by multiprocessing's forkserver: the first engine's start imports the engine in it (about two
seconds on a CPU), later ones cost a fork per rank. The tests share engines where they can all the same.
"""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from contextlib import suppress
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from nanovllm.book.tiny_models import TINY_VOCAB_SIZE
from nanovllm.config import Config, check_tensor_parallel_size
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.tp_runtime import (
    FAULT_ENV,
    TPTimeoutError,
    TPWorkerError,
    process_gone,
    process_state,
    step_states,
)
from nanovllm.layers.linear import agree_min
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.interrupts import deferred_interrupt
from tests.core.test_10_engine import save_tiny_llama
from tests.scheduler_sim import RegimesSeen
from tests.speed.rank_targets import agree_rank

ROOT = Path(__file__).resolve().parents[2]
# Tiny pool and budget: chunked prefill and preemption in a short run.
SMALL = {"kvcache_block_size": 4, "num_kvcache_blocks": 12, "max_num_batched_tokens": 16}
PROMPTS = [
    "Question: Where do fish live? Answer:",
    "Small steps make",
    "Question: Where do fish live? Answer: Fish",  # shares a prefix with the first: prefix-cache hits
    "Write clear code",
]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SHM = Path("/dev/shm")
# Entries that Python's multiprocessing, torch or this engine would create there.
SHM_OURS = re.compile(r"nanovllm|torch|psm_|sem\.mp|wnsm_")

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def shm_entries() -> set[str]:
    return {name for name in os.listdir(SHM) if SHM_OURS.search(name)} if SHM.is_dir() else set()


def shm_mappings(pid: int) -> list[str]:
    """/dev/shm files a live process has mapped or open (Linux), except unlinked ones.

    An unlinked file (an anonymous multiprocessing semaphore, such as the lock tqdm makes in the
    driver) has no name left in /dev/shm and disappears with the process.
    """
    found = []
    maps, fds = Path(f"/proc/{pid}/maps"), Path(f"/proc/{pid}/fd")
    if maps.exists():
        found += [line for line in maps.read_text().splitlines() if "/dev/shm/" in line and "(deleted)" not in line]
    if fds.exists():
        for fd in fds.iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("/dev/shm/") and not target.endswith("(deleted)"):
                found.append(target)
    return found


def token_ids(outputs: list[dict]) -> list[list[int]]:
    return [output["token_ids"] for output in outputs]


@pytest.fixture(scope="module")
def shm_before() -> set[str]:
    return shm_entries()


@pytest.fixture(scope="module")
def engines(tiny: Path, shm_before: set[str]):
    """A TP=2 engine (two gloo ranks) and a TP=1 engine with the same small settings. At teardown, exit() stops the
    ranks, and only then does a call say that exit() was called (a rank's failure says so instead: the tests below)."""
    tp2 = LLM(str(tiny), tensor_parallel_size=2, **SMALL)
    tp1 = LLM(str(tiny), **SMALL)
    yield tp2, tp1
    pids = tp2.model_runner.pids
    tp2.exit()
    tp1.exit()
    assert all(process_gone(pid) for pid in pids)
    with pytest.raises(RuntimeError, match=r"ranks are stopped \(exit\(\) was called\)"):
        tp2.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


# ---- configuration ---------------------------------------------------------------------------------
def test_tensor_parallel_size_must_divide_heads_kv_heads_mlp_and_vocab(tiny: Path) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide num_attention_heads=4"):
        Config.from_kwargs(tiny, tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide num_key_value_heads=2"):
        Config.from_kwargs(tiny, tensor_parallel_size=4)
    shape = {"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 512}
    check_tensor_parallel_size(SimpleNamespace(**shape), 4)
    for name, odd in (("intermediate_size", 130), ("vocab_size", 510)):
        with pytest.raises(ValueError, match=f"does not divide {name}={odd}"):
            check_tensor_parallel_size(SimpleNamespace(**{**shape, name: odd}), 4)
    # Without num_key_value_heads (older configs), the KV heads are the attention heads.
    check_tensor_parallel_size(SimpleNamespace(num_attention_heads=8, intermediate_size=8, vocab_size=8), 4)
    # The engine refuses before any process starts.
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(str(tiny), tensor_parallel_size=3)
    assert mp.active_children() == []


def test_a_malformed_fault_hook_is_refused_before_spawning(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("one:2", "2:1", "1:-1"):
        monkeypatch.setenv(FAULT_ENV, value)
        with pytest.raises(ValueError, match=FAULT_ENV):
            LLM(str(tiny), tensor_parallel_size=2, **SMALL)
    assert mp.active_children() == []


# ---- parity ----------------------------------------------------------------------------------------
def test_tp2_gives_the_tokens_of_tp1_under_chunked_prefill_preemption_and_prefix_hits(engines) -> None:
    tp2, tp1 = engines
    seen = RegimesSeen()
    tp2.scheduler.observer = seen
    try:
        for _ in range(2):  # the second round also finds the first round's blocks in the prefix cache
            expected = token_ids(tp1.generate(PROMPTS, GREEDY, use_tqdm=False))
            assert token_ids(tp2.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    finally:
        tp2.scheduler.observer = None
    assert seen.partial and seen.preempted and seen.cached, seen


def test_logits_of_tp2_are_within_tolerance_of_tp1(engines) -> None:
    tp2, tp1 = engines

    def prefill(runner):
        seqs = [Sequence([5, 80, 3, 400, 9, 12, 7], block_size=4), Sequence([44, 2, 19], block_size=4)]
        seqs[0].block_table, seqs[1].block_table = [0, 1], [2]
        for seq in seqs:
            seq.num_scheduled_tokens = len(seq)
        return runner.compute_logits(seqs, True)

    one, two = prefill(tp1.model_runner), prefill(tp2.model_runner)
    assert one.shape == two.shape == (2, 512)
    assert (one - two).abs().max().item() < 1e-4
    assert not torch.equal(one, torch.zeros_like(one))


# ---- what each rank holds --------------------------------------------------------------------------
def test_each_rank_holds_its_slice_of_every_sharded_weight(engines, tiny: Path) -> None:
    ranks = engines[0].model_runner
    worlds = ranks.call("world")
    assert [(w["rank"], w["size"], w["backend"], w["device"]) for w in worlds] == [
        (0, 2, "gloo", "cpu"), (1, 2, "gloo", "cpu")]
    assert [w["pid"] for w in worlds] == ranks.pids and os.getpid() not in ranks.pids
    with safe_open(str(tiny / "model.safetensors"), "pt") as checkpoint:
        full = {name: checkpoint.get_tensor(name) for name in checkpoint.keys()}
    layer = "model.layers.1"

    def rows(name: str, rank: int) -> torch.Tensor:
        tensor = full[name]
        size = tensor.shape[0] // 2
        return tensor[rank * size : (rank + 1) * size]

    def cols(name: str, rank: int) -> torch.Tensor:
        tensor = full[name]
        size = tensor.shape[1] // 2
        return tensor[:, rank * size : (rank + 1) * size]

    expected = {
        f"{layer}.self_attn.qkv_proj.weight": lambda r: torch.cat(
            [rows(f"{layer}.self_attn.{p}_proj.weight", r) for p in "qkv"]),
        f"{layer}.mlp.gate_up_proj.weight": lambda r: torch.cat(
            [rows(f"{layer}.mlp.{p}_proj.weight", r) for p in ("gate", "up")]),
        f"{layer}.self_attn.o_proj.weight": lambda r: cols(f"{layer}.self_attn.o_proj.weight", r),
        f"{layer}.mlp.down_proj.weight": lambda r: cols(f"{layer}.mlp.down_proj.weight", r),
        "model.embed_tokens.weight": lambda r: rows("model.embed_tokens.weight", r),
        "lm_head.weight": lambda r: rows("lm_head.weight", r),
        f"{layer}.input_layernorm.weight": lambda r: full[f"{layer}.input_layernorm.weight"],  # replicated
    }
    for name, slice_of in expected.items():
        shards = ranks.call("shard", name)
        for rank, shard in enumerate(shards):
            assert torch.equal(shard, slice_of(rank)), (name, rank)
    halves = ranks.call("shard", "lm_head.weight")
    assert not torch.equal(halves[0], halves[1])


def test_every_rank_has_the_pool_the_scheduler_uses(engines) -> None:
    tp2, _ = engines
    shapes = tp2.model_runner.call("kv_cache_shape")
    # [2, layers, blocks, block_size, kv_heads per rank, head_dim]
    assert shapes[0] == shapes[1] == (2, 2, 12, 4, 1, 16)
    assert tp2.scheduler.block_manager.num_blocks == tp2.config.num_kvcache_blocks == 12


def test_ranks_with_different_budgets_agree_on_the_smallest_block_count() -> None:
    assert agree_min(7) == 7  # one process: nothing to agree with
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    pipes, procs = [], []
    for rank, blocks in enumerate((900, 640)):
        ours, theirs = context.Pipe()
        procs.append(context.Process(target=agree_rank, args=(rank, store.port, blocks, theirs)))
        procs[-1].start()
        theirs.close()
        pipes.append(ours)
    try:
        assert [pipe.recv() for pipe in pipes] == [640, 640]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert [proc.exitcode for proc in procs] == [0, 0]


def test_a_step_message_rebuilds_the_slim_sequences_and_sends_params_once() -> None:
    from nanovllm.engine.sequence import SequenceStatus
    from nanovllm.engine.tp_runtime import TPRunner, step_sequences

    seqs = [Sequence(list(range(10 + i)), SamplingParams(temperature=0.5 + i), block_size=4) for i in range(3)]
    for seq in seqs:
        seq.block_table = [7, 3, 9, 1][: seq.num_blocks]
        seq.num_cached_tokens, seq.num_scheduled_tokens = len(seq) - 1, 1
    rebuilt = step_sequences(pickle.loads(pickle.dumps(step_states(seqs))))
    for seq, copy in zip(seqs, rebuilt, strict=True):  # noqa: F402 (the module is test_copies_are_whole's)
        assert vars(copy) == vars(pickle.loads(pickle.dumps(seq)))  # what chapter 01's slim pickling gives
        assert copy.token_ids == [seq.last_token] and copy.sampling_params is None
    driver = SimpleNamespace(_params_sent={})  # the part of a TPRunner this method uses
    new, gone = TPRunner._params_update(driver, seqs)
    assert new == {seq.seq_id: seq.sampling_params for seq in seqs} and gone == []
    assert TPRunner._params_update(driver, seqs[:2]) == ({}, [])  # known sequences: nothing to send
    seqs[0].status = SequenceStatus.FINISHED
    assert TPRunner._params_update(driver, seqs[1:]) == ({}, [seqs[0].seq_id])  # rank 0 may forget it


def test_block_size_travels_with_the_sequence() -> None:
    seq = Sequence(list(range(30)), block_size=4)
    seq.block_table, seq.num_cached_tokens, seq.num_scheduled_tokens = list(range(8)), 29, 1
    slim = pickle.loads(pickle.dumps(seq))
    assert slim.block_size == 4 and slim.token_ids == [29] and slim.sampling_params is None


def test_large_messages_cross_the_control_channel_intact(engines) -> None:
    import zlib

    payload = os.urandom(8 * 2**20)  # 8x upstream's fixed 1 MiB buffer
    assert engines[0].model_runner.call("echo", payload) == [(len(payload), zlib.crc32(payload))] * 2


def test_an_unknown_call_is_refused_in_the_driver_and_the_ranks_keep_serving(engines) -> None:
    tp2, tp1 = engines
    with pytest.raises(ValueError, match="unknown call 'format_disk'"):
        tp2.model_runner.call("format_disk")
    assert tp2.model_runner.alive
    assert token_ids(tp2.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == token_ids(
        tp1.generate(PROMPTS[:1], GREEDY, use_tqdm=False))


def test_a_one_process_engine_refuses_to_step_after_exit(tiny: Path) -> None:
    with LLM(str(tiny), **SMALL) as llm:
        assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]["token_ids"]) == GREEDY.max_tokens
    with pytest.raises(RuntimeError, match=r"stopped \(exit\(\) was called\)"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


def test_ranks_use_no_shared_memory_files(engines) -> None:
    for pid in [os.getpid(), *engines[0].model_runner.pids]:
        assert shm_mappings(pid) == [], pid


# ---- failures and shutdown -------------------------------------------------------------------------
def test_a_failing_rank_stops_every_rank_and_the_driver_says_which(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, shm_before: set[str]
) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:3")
    llm = LLM(str(tiny), tensor_parallel_size=2, **SMALL)
    pids = llm.model_runner.pids
    with pytest.raises(TPWorkerError) as caught:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    message = str(caught.value)
    assert message.startswith("tensor-parallel rank 1 failed during run (call 3): RuntimeError: injected fault")
    assert "all 2 rank processes have been stopped" in message and "Traceback" in message
    assert all(process_gone(pid) for pid in pids) and not llm.model_runner.alive
    with pytest.raises(RuntimeError, match="stopped after an error: rank 1 failed"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.exit()  # idempotent
    assert shm_entries() <= shm_before


def test_a_rank_failing_at_start_up_fails_the_constructor(
    engines, tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook is set after the shared engines started the forkserver: a rank still reads it, from the environment
    that the driver hands it (the server's own is the one it started with)."""
    before = {proc.pid for proc in mp.active_children()}  # the shared engines' ranks
    monkeypatch.setenv(FAULT_ENV, "1:0")
    with pytest.raises(TPWorkerError, match="rank 1 failed during start-up: RuntimeError: injected fault"):
        LLM(str(tiny), tensor_parallel_size=2, **SMALL)
    assert {proc.pid for proc in mp.active_children()} == before == set(engines[0].model_runner.pids)


def test_two_engines_at_once_then_context_managers_stop_them(tiny: Path) -> None:
    settings = {"kvcache_block_size": 16, "kvcache_memory_gb": 1 / 256}
    expected = token_ids(LLM(str(tiny), **settings).generate(PROMPTS, GREEDY, use_tqdm=False))
    with LLM(str(tiny), tensor_parallel_size=2, **settings) as a, LLM(str(tiny), tensor_parallel_size=2,
                                                                     **settings) as b:
        pids = a.model_runner.pids + b.model_runner.pids
        assert len(set(pids)) == 4
        # Interleave the two engines' steps: their ranks must never mix.
        ids = {"a": [a.add_request(p, GREEDY) for p in PROMPTS], "b": [b.add_request(p, GREEDY) for p in PROMPTS]}
        done: dict[str, dict[int, list[int]]] = {"a": {}, "b": {}}
        while not (a.is_finished() and b.is_finished()):
            for key, engine in (("a", a), ("b", b)):
                if not engine.is_finished():
                    done[key].update(engine.step()[0])
        for key in ("a", "b"):
            assert [done[key][i] for i in ids[key]] == expected
    assert all(process_gone(pid) for pid in pids)
    with pytest.raises(RuntimeError, match=r"ranks are stopped \(exit\(\) was called\)"):
        a.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


DRIVER = textwrap.dedent(
    """
    import sys, time
    from nanovllm.llm import LLM
    from nanovllm.sampling_params import SamplingParams

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], tensor_parallel_size=2, kvcache_block_size=16, kvcache_memory_gb=1 / 256)
        llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        print(*llm.model_runner.pids, flush=True)
        if sys.argv[2] == "hang":
            time.sleep(600)
        # "leave": no exit() call; the runner's finalizer must stop the ranks at interpreter exit
    """
)


def test_no_orphans_when_the_driver_leaves_without_exit_or_is_killed(tiny: Path, tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(FAULT_ENV, None)
    command = [sys.executable, str(script), str(tiny)]
    leave = subprocess.Popen([*command, "leave"], stdout=subprocess.PIPE, text=True, env=env)
    hang = subprocess.Popen([*command, "hang"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        hang_pids = [int(pid) for pid in hang.stdout.readline().split()]
        assert len(hang_pids) == 2 and not any(process_gone(pid) for pid in hang_pids)
        hang.send_signal(signal.SIGKILL)  # no clean-up code runs in the driver
        hang.wait(10)
        deadline = time.monotonic() + 15
        while not all(process_gone(pid) for pid in hang_pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(process_gone(pid) for pid in hang_pids), "ranks outlived a killed driver"
        out, _ = leave.communicate(timeout=60)
        leave_pids = [int(pid) for pid in out.split()]
        assert leave.returncode == 0 and len(leave_pids) == 2
        assert all(process_gone(pid) for pid in leave_pids), "ranks outlived a driver that exited without exit()"
    finally:
        for proc in (leave, hang):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_nothing_is_left_behind(engines, shm_before: set[str]) -> None:
    """Runs last in this module: apart from the shared engines (stopped at teardown), no process, no /dev/shm."""
    assert {p.pid for p in mp.active_children()} <= set(engines[0].model_runner.pids)
    assert shm_entries() <= shm_before


# ---- asynchronous scheduling --------------------------------------------------------------------------
ASYNC_REGIMES = {
    "preemption": {"kvcache_block_size": 4, "num_kvcache_blocks": 12},
    "chunks": {"kvcache_block_size": 4, "num_kvcache_blocks": 128, "max_num_batched_tokens": 7},
    "everything": {"kvcache_block_size": 2, "num_kvcache_blocks": 24, "max_num_batched_tokens": 9, "max_num_seqs": 3},
}


@pytest.mark.parametrize("regime", list(ASYNC_REGIMES))
def test_async_tp2_gives_the_tokens_of_sync_tp2_and_of_tp1(tiny: Path, regime: str) -> None:
    """Greedy and seeded requests, sequences ending on EOS mid-batch (the next step already queued on the
    ranks, whose pending tokens come from each rank's copy of rank 0's samples), max_tokens of 1."""
    settings = ASYNC_REGIMES[regime]
    prompts = [[3 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate([10, 9, 11, 6, 12, 1, 23, 5])]
    params = [SamplingParams(temperature=0, max_tokens=25), SamplingParams(temperature=1.0, seed=3, max_tokens=25),
              SamplingParams(temperature=0, max_tokens=1), SamplingParams(temperature=0.7, seed=8, max_tokens=9,
                                                                         ignore_eos=True)] * 2
    greedy = [SamplingParams(temperature=0, max_tokens=25, ignore_eos=p.ignore_eos) for p in params]
    tp1 = LLM(str(tiny), async_scheduling=False, **settings)
    warm = tp1.generate(prompts, SamplingParams(temperature=0, max_tokens=25, ignore_eos=True), use_tqdm=False)
    eos = frozenset(t for t, _ in Counter(t for o in warm for t in o["token_ids"][2:]).most_common(5))
    tp1.scheduler.eos_token_ids = eos
    expected_greedy = token_ids(tp1.generate(prompts, greedy, use_tqdm=False))
    with LLM(str(tiny), tensor_parallel_size=2, async_scheduling=False, **settings) as tp2:
        tp2.scheduler.eos_token_ids = eos
        outputs = {}
        for scheduling in (False, True):
            tp2.config.async_scheduling = scheduling  # the engine reads it at every step
            outputs[scheduling] = token_ids(tp2.generate(prompts, params, use_tqdm=False))
            assert tp2.is_finished() and tp2.in_flight is None
            pool = tp2.scheduler.block_manager
            assert len(pool.free_block_ids) == pool.num_blocks
        assert token_ids(tp2.generate(prompts, greedy, use_tqdm=False)) == expected_greedy  # async, greedy
    assert outputs[True] == outputs[False]
    stops = sum(o[-1] in eos and len(o) < p.max_tokens for o, p in zip(outputs[True], params, strict=True))
    assert stops >= 2, "the test needs sequences that stop on EOS before max_tokens"


def test_parallel_samples_fork_and_copy_on_write_on_every_rank(tiny: Path) -> None:
    """n > 1 (chapter 05): each rank copies its own KV shard before a step writes into a shared block, and
    with async scheduling each rank feeds the forked siblings' pending first tokens from its copy of the
    samples. Seeded sampling: the same samples synchronously and asynchronously; greedy: TP=1's tokens."""
    settings = {"kvcache_block_size": 4, "num_kvcache_blocks": 40, "max_num_batched_tokens": 16}
    prompts = ["Question: Where do fish live? Answer:", "Small steps make"]
    seeded = SamplingParams(temperature=0.9, seed=7, n=3, max_tokens=9, ignore_eos=True)
    greedy = SamplingParams(temperature=0, n=2, max_tokens=9, ignore_eos=True)

    def samples(outputs: list[dict]) -> list[list[list[int]]]:
        return [[o["token_ids"] for o in output["outputs"]] for output in outputs]

    expected = samples(LLM(str(tiny), **settings).generate(prompts, greedy, use_tqdm=False))
    copies = []
    with LLM(str(tiny), tensor_parallel_size=2, async_scheduling=False, **settings) as tp2:
        tp2.scheduler.observer = lambda event, data: copies.extend(
            pair for seq in data["seqs"] for pair in seq.blocks_to_copy) if event == "schedule" else None
        runs = {}
        for scheduling in (False, True):
            tp2.config.async_scheduling = scheduling
            runs[scheduling] = samples(tp2.generate(prompts, seeded, use_tqdm=False))
            assert samples(tp2.generate(prompts, greedy, use_tqdm=False)) == expected
    assert runs[True] == runs[False] and len({tuple(s) for s in runs[True][0]}) > 1  # the samples differ
    assert copies, "the test needs copy-on-write copies"


def test_async_tp_step_queues_the_next_step_before_collecting(engines) -> None:
    """The shared TP=2 engine, scheduling asynchronously for this test (the engine reads the setting at every step;
    a prompt shorter than a block never hits the prefix cache, whatever earlier tests left there)."""
    llm, tp1 = engines
    assert llm.is_finished() and llm.in_flight is None
    scheduling, llm.config.async_scheduling = llm.config.async_scheduling, True
    try:
        seq_id = llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert llm.step() == ([], 0, True)  # the prefill is queued on both ranks, nothing collected yet
        assert llm.step()[1:] == (3, True)  # queues decode 1, collects the prefill
        assert llm.step()[1:] == (1, False)  # queues decode 2 (its input: decode 1's pending token)
        finished, num_tokens, is_prefill = llm.step()  # nothing left to queue: collects decode 2
        assert [seq_id] == [i for i, _ in finished] and (num_tokens, is_prefill) == (1, False)
        assert llm.is_finished() and llm.in_flight is None
    finally:
        llm.config.async_scheduling = scheduling
    reference = tp1.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert finished[0][1] == reference[0]["token_ids"]


# ---- Ctrl-C and stalled ranks -------------------------------------------------------------------------
def test_deferred_interrupt_delivers_ctrl_c_after_the_block() -> None:
    before = signal.getsignal(signal.SIGINT)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupt():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the signal has arrived by now; without the deferral it would raise here
            done.append("the block finished")
    assert done == ["the block finished"] and signal.getsignal(signal.SIGINT) is before


def test_process_state_reads_the_kernel() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while process_state(child.pid) != "stopped" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(child.pid) == "stopped"
        os.kill(child.pid, signal.SIGCONT)
    finally:
        child.kill()
        child.wait()
    assert process_state(os.getpid()) == "running" and process_state(child.pid) == ""


CTRL_C = """
import json, os, signal, sys, threading, time
from nanovllm.engine.tp_runtime import process_state
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

if __name__ == "__main__":
    model, device = sys.argv[1], sys.argv[2]
    settings = {"device": device, "kvcache_block_size": 4, "max_num_batched_tokens": 64, "async_scheduling": True}
    if device == "cuda":
        settings.update(dtype="float32", max_num_seqs=32)  # graphs: few sizes to capture
    prompts = ["Question: Where do fish live? Answer:", "Small steps make", "Write clear code"]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [o["token_ids"] for o in LLM(model, **settings).generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(model, tensor_parallel_size=2, **settings)
    pids = llm.model_runner.pids
    report = {}
    # Ctrl-C as a terminal sends it: to every process of the foreground group, the ranks included.
    threading.Timer(float(sys.argv[3]), os.killpg, (os.getpgrp(), signal.SIGINT)).start()
    started = time.monotonic()
    try:
        long = [[3 + (5 * i + j) % 300 for j in range(20)] for i in range(24)]
        for _ in range(100):  # until Ctrl-C arrives (a GPU runs one of these in about a second)
            llm.generate(long, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), use_tqdm=False)
        report["error"] = "generate finished before Ctrl-C"
    except KeyboardInterrupt:
        report["interrupted_after_s"] = round(time.monotonic() - started, 2)
    report["engine_idle"] = llm.is_finished()
    # the forkserver, their parent, reaps them: a rank that died would be gone, not a zombie
    report["ranks_alive"] = [process_state(pid) not in ("", "a zombie") for pid in pids]
    report["same_tokens"] = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected
    report["runner_alive"] = llm.model_runner.alive
    llm.exit()
    print(json.dumps(report))
"""


def run_ctrl_c(tiny: Path, tmp_path: Path, device: str, after_s: float) -> dict:
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(FAULT_ENV, None)
    # Its own session: the Ctrl-C it sends to its process group does not reach pytest.
    done = subprocess.run([sys.executable, str(script), str(tiny), device, str(after_s)], capture_output=True,
                          text=True, env=env, timeout=300, start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_ctrl_c_during_generate_leaves_the_tp_engine_serving(tiny: Path, tmp_path: Path) -> None:
    # A second in, a CPU is about 100 steps into the first generate, past its prefills (8 steps of 64 tokens) and
    # decoding with the next step queued: the Ctrl-C lands mid-decode as at 4 s (about 400 steps), for 3 CPU-s less.
    report = run_ctrl_c(tiny, tmp_path, "cpu", after_s=1.0)
    assert "interrupted_after_s" in report, report
    assert report["engine_idle"] and report["ranks_alive"] == [True, True], report
    assert report["same_tokens"] and report["runner_alive"], report


@pytest.mark.parametrize("stalled", [1, 0])
def test_a_stalled_rank_is_named_and_nothing_is_left_behind(tiny: Path, shm_before: set[str], stalled: int) -> None:
    llm = LLM(str(tiny), tensor_parallel_size=2, rank_timeout_s=2.0, **SMALL)
    pids = llm.model_runner.pids
    assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]["token_ids"]) == GREEDY.max_tokens
    os.kill(pids[stalled], signal.SIGSTOP)  # what a debugger, or a stuck host, looks like from outside
    started = time.monotonic()
    try:
        with pytest.raises(TPTimeoutError) as caught:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        with suppress(ProcessLookupError):
            os.kill(pids[stalled], signal.SIGCONT)
    waited = time.monotonic() - started
    message = str(caught.value)
    assert isinstance(caught.value, TimeoutError)
    assert message.startswith(f"tensor-parallel rank {stalled} (pid {pids[stalled]}, stopped) did not answer"), message
    assert "rank_timeout_s=2 s" in message and "all 2 rank processes have been stopped" in message
    assert waited < 2.0 + 8.0, waited  # the timeout, then stopping the ranks
    assert all(process_gone(pid) for pid in pids) and not llm.model_runner.alive
    with pytest.raises(RuntimeError, match=f"stopped after an error: rank {stalled} .* did not answer"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert shm_entries() <= shm_before


# ---- slim pickling: what a step ships of each sequence ---------------------------------------------------------------
def decoding(length: int, block_size: int) -> Sequence:
    seq = Sequence(list(range(length)), SamplingParams(temperature=0.5, seed=3), block_size=block_size)
    seq.status = SequenceStatus.RUNNING
    seq.block_table = list(range(seq.num_blocks))
    seq.num_cached_tokens = length - 1
    seq.num_scheduled_tokens = 1
    return seq


def test_decode_pickle_ships_only_the_last_token_whatever_the_length() -> None:
    short, long = decoding(10, 16), decoding(10_000, 16)
    size_short = len(pickle.dumps(short))
    size_long = len(pickle.dumps(long))
    shipped = pickle.loads(pickle.dumps(long))
    assert shipped.token_ids == [9_999] and shipped.scheduled_token_ids == [9_999]
    assert shipped.last_token == long.last_token
    # Only the block table grows with the length: 625 block ids, not 10,000 tokens.
    assert size_long - size_short < 4 * (long.num_blocks - short.num_blocks) + 64
    assert (shipped.num_tokens, shipped.num_prompt_tokens, shipped.num_cached_tokens) == (10_000, 10_000, 9_999)
    assert shipped.status is SequenceStatus.RUNNING and shipped.seq_id == long.seq_id
    assert shipped.sampling_params is None  # only rank 0 samples


def test_prefill_pickle_ships_uncached_tokens_and_survives_a_second_trip() -> None:
    seq = Sequence(list(range(20)), block_size=8)
    seq.num_cached_tokens = 8  # a prefix-cache hit on the first block
    seq.num_scheduled_tokens = 12
    shipped = pickle.loads(pickle.dumps(seq))
    assert shipped.token_ids == list(range(8, 20)) and shipped.scheduled_token_ids == list(range(8, 20))
    again = pickle.loads(pickle.dumps(shipped))
    assert again.token_ids == list(range(8, 20)) and again.first_token_index == 8


def test_block_size_travels_explicitly_to_another_process() -> None:
    """A fresh interpreter (as a tensor-parallel worker) gets the block size from the pickle."""
    seq = decoding(100, 32)
    program = (
        "import pickle, sys\n"
        "seq = pickle.loads(sys.stdin.buffer.read())\n"
        "print(seq.block_size, seq.num_blocks, seq.last_block_num_tokens, seq.scheduled_token_ids)\n"
    )
    result = subprocess.run([sys.executable, "-c", program], input=pickle.dumps(seq), capture_output=True)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().strip().split(maxsplit=3) == ["32", "4", "4", "[99]"]


def test_copies_are_whole() -> None:
    seq = decoding(50, 16)
    for clone in (copy.copy(seq), copy.deepcopy(seq)):
        assert clone.token_ids == seq.token_ids and clone.token_ids is not seq.token_ids
        assert clone.block_table == seq.block_table and clone.block_table is not seq.block_table
        assert clone.sampling_params == seq.sampling_params and clone.first_token_index == 0
        clone.append_token(1)
        assert len(seq) == 50


# ---- n > 1: each rank copies its own KV shard ------------------------------------------------------------------------
def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


def test_tensor_parallel_ranks_copy_their_own_shards(tiny_arch: Path) -> None:
    """Two ranks (gloo on the CPU): each applies the step's copies to its own KV heads; the samples equal
    the one-process engine's."""
    batch = prompts_of([6, 9], seed=7)
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=3, seed=5)
    expected = LLM(str(tiny_arch), kvcache_block_size=4, num_kvcache_blocks=32).generate(batch, params, use_tqdm=False)
    with LLM(str(tiny_arch), kvcache_block_size=4, num_kvcache_blocks=32, tensor_parallel_size=2) as llm:
        assert llm.generate(batch, params, use_tqdm=False) == expected


# ---- settings: load_format and rank_timeout_s ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny_llama")


def test_load_format_and_rank_timeout_are_checked(tiny_llama: Path) -> None:
    for key, value, error in (("load_format", "pt", ValueError), ("load_format", 1, TypeError),
                              ("rank_timeout_s", 0, ValueError), ("rank_timeout_s", "5", TypeError)):
        with pytest.raises(error, match=key):
            Config.from_kwargs(tiny_llama, **{key: value})
    assert Config.from_kwargs(tiny_llama, rank_timeout_s=2.5).rank_timeout_s == 2.5


# ---- GPUs: NCCL --------------------------------------------------------------------------------------
@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nccl_tp2_gives_the_tokens_of_one_gpu(tiny: Path, backend: str) -> None:
    settings = {**SMALL, "device": "cuda", "dtype": "float32", "attention_backend": backend}
    with LLM(str(tiny), **settings) as tp1:
        expected = token_ids(tp1.generate(PROMPTS, GREEDY, use_tqdm=False))
    with LLM(str(tiny), tensor_parallel_size=2, **settings) as tp2:
        ranks = tp2.model_runner
        worlds = ranks.call("world")
        assert [(w["backend"], w["device"]) for w in worlds] == [("nccl", "cuda:0"), ("nccl", "cuda:1")]
        for _ in range(2):
            assert token_ids(tp2.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        shapes = ranks.call("kv_cache_shape")
        assert shapes[0] == shapes[1] and shapes[0][2] == tp2.scheduler.block_manager.num_blocks
        shards = ranks.call("shard", "lm_head.weight")
        with safe_open(str(tiny / "model.safetensors"), "pt") as checkpoint:
            assert torch.equal(torch.cat(shards), checkpoint.get_tensor("lm_head.weight"))
        pids = ranks.pids
    assert all(process_gone(pid) for pid in pids)


@pytest.mark.gpu
@two_gpus
def test_nccl_pool_sized_from_free_memory_is_agreed(tiny: Path) -> None:
    with LLM(str(tiny), tensor_parallel_size=2, device="cuda", kvcache_block_size=16,
             gpu_memory_utilization=0.5) as tp2:
        shapes = tp2.model_runner.call("kv_cache_shape")
        assert shapes[0] == shapes[1] and shapes[0][2] == tp2.config.num_kvcache_blocks > 0


@pytest.mark.gpu
@two_gpus
def test_nccl_failing_rank_is_reported_and_stopped(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 0 waits inside an NCCL collective for rank 1, which is gone; the driver must not hang.
    monkeypatch.setenv(FAULT_ENV, "1:3")
    llm = LLM(str(tiny), tensor_parallel_size=2, **SMALL, device="cuda", dtype="float32")
    pids = llm.model_runner.pids
    with pytest.raises(TPWorkerError, match="rank 1 failed during run"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(process_gone(pid) for pid in pids)


@pytest.mark.gpu
@two_gpus
def test_nccl_graphs_on_every_rank_and_async_scheduling_give_the_tokens_of_one_gpu(tiny: Path) -> None:
    """Decode graphs captured on both ranks (all-reduces inside), asynchronous scheduling (the default on CUDA):
    greedy tokens equal one GPU's, under chunked prefill, preemption and prefix hits, and seeded samples with
    forks (n = 3) are the same synchronously and asynchronously."""
    settings = {**SMALL, "device": "cuda", "dtype": "float32", "attention_backend": "triton", "max_num_seqs": 8}
    with LLM(str(tiny), **settings) as tp1:
        assert tp1.model_runner.graphs is not None
        expected = token_ids(tp1.generate(PROMPTS, GREEDY, use_tqdm=False))
    seeded = SamplingParams(temperature=0.9, seed=7, n=3, max_tokens=9, ignore_eos=True)
    with LLM(str(tiny), tensor_parallel_size=2, **settings) as tp2:
        assert tp2.config.async_scheduling is True
        assert [w["graphs"] for w in tp2.model_runner.call("world")] == [True, True]
        for _ in range(2):  # the second round also hits the prefix cache
            assert token_ids(tp2.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        runs = {}
        for scheduling in (True, False):
            tp2.config.async_scheduling = scheduling
            runs[scheduling] = [[o["token_ids"] for o in out["outputs"]]
                                for out in tp2.generate(PROMPTS[:2], seeded, use_tqdm=False)]
        assert runs[True] == runs[False]


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("stalled", [1, 0])
def test_nccl_a_stalled_rank_is_named_and_nothing_is_left_behind(tiny: Path, stalled: int) -> None:
    shm = set(os.listdir(SHM)) if SHM.is_dir() else set()
    settings = {**SMALL, "device": "cuda", "dtype": "float32", "max_num_seqs": 8, "rank_timeout_s": 5.0}
    llm = LLM(str(tiny), tensor_parallel_size=2, **settings)
    pids = llm.model_runner.pids
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    os.kill(pids[stalled], signal.SIGSTOP)
    try:
        with pytest.raises(TPTimeoutError) as caught:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        with suppress(ProcessLookupError):
            os.kill(pids[stalled], signal.SIGCONT)
    assert str(caught.value).startswith(f"tensor-parallel rank {stalled} (pid {pids[stalled]}, stopped)")
    assert all(process_gone(pid) for pid in pids)
    left = (set(os.listdir(SHM)) if SHM.is_dir() else set()) - shm
    assert not left, f"left in /dev/shm: {sorted(left)}"


@pytest.mark.gpu
@two_gpus
def test_nccl_ctrl_c_during_generate_leaves_the_tp_engine_serving(tiny: Path, tmp_path: Path) -> None:
    report = run_ctrl_c(tiny, tmp_path, "cuda", after_s=1.0)
    assert "interrupted_after_s" in report, report
    assert report["engine_idle"] and report["ranks_alive"] == [True, True], report
    assert report["same_tokens"] and report["runner_alive"], report
