"""Where a tensor-parallel decode step's time goes (a diagnosis, not a benchmark).

    python3 scripts/profile_tp.py --out build/profile-tp                       # GPUs: NCCL, Qwen3-0.6B shapes
    python3 scripts/profile_tp.py --device cpu --out build/profile-tp-cpu      # CPU: gloo, a tiny Qwen3

It runs a short version of nano-vllm's benchmark workload (synchronous scheduling, so that every
step's times are its own) under several settings, one engine each:

- ``tp1``: one process (CUDA graphs when the device allows them);
- ``tp1-eager``: one process, no CUDA graphs (GPU only): what the graphs are worth;
- ``tp1-channel``: one rank process behind chapter 10's control channel, no collectives: what the
  channel alone costs per step;
- ``tpN``: N ranks (``--tp``), the setting under study.

Every ``run`` call of a step is timed on both sides of the channel with one monotonic clock (the
same on every process of a Linux host): in the driver, pickling, writing to the pipes, waiting,
reading and unpickling the replies; in each rank, the arrival of the message, unpickling, the
step's host time split into the forward's launch, the time spent inside collectives (host, and on
a GPU also CUDA-event time), the wait for the sampled tokens, and the reply. On a GPU, CUDA events
also give each rank's device time for the step. With ``--trace-steps K`` every process also runs K
decode steps under torch.profiler (a table of ops and kernels and a gzipped Chrome trace per rank).

Results: ``profile_tp.json`` (summary and every step) and ``profile_tp.txt`` (the tables) in
``--out``. Keep ``NCCL_NVLS_ENABLE=0`` on shared machines (the ranks set it unless it is set).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import pickle
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The rank processes re-import this file as their main module: the package must resolve there too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from nanovllm.engine import llm_engine, model_runner, tp_runtime

TRACE_ENV = "NANOVLLM_PROFILE_TRACE"  # "<dir>|<label>|<first decode step>|<count>" for the torch.profiler window


def now() -> float:
    """Seconds on CLOCK_MONOTONIC: one clock for every process of the host, so timestamps compare across them."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _event() -> torch.cuda.Event | None:
    """A recorded timing event on the current stream, or None (no CUDA, or inside a graph capture)."""
    if not _cuda() or torch.cuda.is_current_stream_capturing():
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed_ms(start: torch.cuda.Event | None, end: torch.cuda.Event | None) -> float | None:
    return None if start is None or end is None else start.elapsed_time(end)


# ---- probes inside a process that computes steps (a rank, or the driver at TP=1) ------------------


class StepProbe:
    """Patches the runner's classes in this process to time every step; `stats()` returns the records."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.current: dict | None = None
        self.enabled = False
        self.undo: list[tuple[object, str, object]] = []
        self.trace = _TraceWindow.from_env()

    def patch(self, owner: object, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        self.undo.append((owner, name, original))
        setattr(owner, name, make(original))

    def restore(self) -> None:
        for owner, name, original in reversed(self.undo):
            setattr(owner, name, original)
        self.undo.clear()

    def install(self) -> None:
        self.patch(model_runner.ModelRunner, "launch", self._wrap_launch)
        self.patch(model_runner.ModelRunner, "compute_logits", self._wrap_host("forward_s"))
        self.patch(model_runner.SampledTokens, "token_ids", self._wrap_tokens)
        for name in ("all_reduce", "gather", "broadcast", "all_gather"):
            self.patch(dist, name, self._wrap_collective)

    def _wrap_launch(self, inner: Callable) -> Callable:
        probe = self

        def launch(runner: Any, seqs: list, is_prefill: bool, previous: Any = None) -> Any:
            if not probe.enabled:
                return inner(runner, seqs, is_prefill, previous)
            record = {"kind": "prefill" if is_prefill else "decode", "batch": len(seqs),
                      "tokens": sum(s.num_scheduled_tokens for s in seqs), "coll_host_s": 0.0, "coll_calls": 0,
                      "coll_events": [], "forward_s": 0.0, "wait_tokens_s": 0.0}
            probe.current = record
            probe.trace.before_step(record["kind"])
            record["t_run_start"] = now()
            start = _event()
            try:
                step = inner(runner, seqs, is_prefill, previous)
            finally:
                record["t_launched"] = record["t_run_end"] = now()
                record["launch_s"] = record["t_launched"] - record["t_run_start"]
                record["gpu_events"] = (start, _event())
                probe.trace.after_step()
                probe.current = None
            probe.records.append(record)
            step._probe_record = record  # the wait for its tokens (token_ids) is added to this record
            return step

        return launch

    def _wrap_tokens(self, inner: Callable) -> Callable:
        def token_ids(step: Any) -> Any:
            began = now()
            try:
                return inner(step)
            finally:
                record = getattr(step, "_probe_record", None)
                if record is not None:
                    record["t_run_end"] = now()
                    record["wait_tokens_s"] += record["t_run_end"] - began

        return token_ids

    def _wrap_host(self, key: str) -> Callable[[Callable], Callable]:
        probe = self

        def make(inner: Callable) -> Callable:
            def timed(*args: Any, **kwargs: Any) -> Any:
                began = now()
                try:
                    return inner(*args, **kwargs)
                finally:
                    if probe.current is not None:
                        probe.current[key] += now() - began

            return timed

        return make

    def _wrap_collective(self, inner: Callable) -> Callable:
        probe = self

        def collective(*args: Any, **kwargs: Any) -> Any:
            record = probe.current
            if record is None:
                return inner(*args, **kwargs)
            start, began = _event(), now()
            try:
                return inner(*args, **kwargs)
            finally:
                record["coll_host_s"] += now() - began
                record["coll_calls"] += 1
                record["coll_events"].append((start, _event()))

        return collective

    def reset(self) -> None:
        self.records.clear()
        self.enabled = True

    def stats(self) -> list[dict]:
        """Every step since `reset`, device times resolved (milliseconds), events dropped."""
        if _cuda():
            torch.cuda.synchronize()
        out = []
        for record in self.records:
            record = dict(record)
            start, end = record.pop("gpu_events")
            record["gpu_step_ms"] = _elapsed_ms(start, end)
            pairs = record.pop("coll_events")
            times = [_elapsed_ms(a, b) for a, b in pairs]
            record["gpu_coll_ms"] = sum(times) if times and None not in times else None
            out.append(record)
        return out


class _TraceWindow:
    """torch.profiler around decode steps [first, first + count) of this process, if TRACE_ENV asks for it."""

    def __init__(self, directory: str | None, label: str = "", first: int = 0, count: int = 0) -> None:
        self.directory, self.label, self.first, self.count = directory, label, first, count
        self.decode_steps = 0
        self.profiler: Any = None

    @classmethod
    def from_env(cls) -> _TraceWindow:
        value = os.environ.get(TRACE_ENV)
        if not value:
            return cls(None)
        directory, label, first, count = value.split("|")
        return cls(directory, label, int(first), int(count))

    def before_step(self, kind: str) -> None:
        if self.directory is None or kind != "decode":
            return
        if self.decode_steps == self.first and self.count > 0:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _cuda() else [])
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()
        self.decode_steps += 1

    def after_step(self) -> None:
        if self.profiler is None or self.decode_steps < self.first + self.count:
            return
        if _cuda():
            torch.cuda.synchronize()
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        rank = dist.get_rank() if dist.is_initialized() else 0
        stem = Path(self.directory) / f"trace-{self.label}-rank{rank}"
        sort = "self_cuda_time_total" if _cuda() else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=60)
        stem.with_suffix(".txt").write_text(f"{self.count} decode steps, {self.label}, rank {rank}\n{table}\n")
        raw = stem.with_suffix(".json")
        profiler.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class TimedConn:
    """A pipe end that stamps what crosses it: the time each message finished arriving or leaving, and its size."""

    def __init__(self, conn: Any, log: list[dict], peer: int = 0) -> None:
        self._conn, self.log, self.peer = conn, log, peer

    def send_bytes(self, data: bytes) -> None:
        began = now()
        self._conn.send_bytes(data)
        ended = now()
        self.log.append({"dir": "send", "t0": began, "t": ended, "s": ended - began, "bytes": len(data),
                         "peer": self.peer, "main": _main_thread()})

    def recv_bytes(self) -> bytes:
        data = self._conn.recv_bytes()
        self.log.append({"dir": "recv", "t": now(), "bytes": len(data), "peer": self.peer, "main": _main_thread()})
        return data

    def __getattr__(self, name: str) -> Any:  # poll, fileno, close, ...
        return getattr(self._conn, name)


class TimedPickle:
    """Stands in for the `pickle` module inside tp_runtime: the same calls, each one's duration logged."""

    def __init__(self, log: list[dict]) -> None:
        self.log = log
        self.HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL

    def dumps(self, obj: Any, protocol: int | None = None) -> bytes:
        began = now()
        data = pickle.dumps(obj, protocol=protocol)
        self.log.append({"op": "dumps", "t": now(), "s": now() - began, "main": _main_thread()})
        return data

    def loads(self, data: bytes) -> Any:
        began = now()
        obj = pickle.loads(data)
        self.log.append({"op": "loads", "t": now(), "s": now() - began, "main": _main_thread()})
        return obj


# ---- a rank process: the normal rank_main, with probes --------------------------------------------

PROBE_CALLS = ("profile_reset", "profile_stats")


def _add_probe_calls(probe: StepProbe | None) -> None:
    """Two more calls a rank answers: start recording, and hand over what was recorded."""
    if "profile_stats" not in tp_runtime.RankWorker.CALLS:
        tp_runtime.RankWorker.CALLS = (*tp_runtime.RankWorker.CALLS, *PROBE_CALLS)
    if probe is not None:
        def reset(worker: Any) -> None:
            probe.channel.clear()  # what this call's reply adds next is skipped by rank_calls
            probe.reset()

        tp_runtime.RankWorker.profile_reset = reset
        tp_runtime.RankWorker.profile_stats = lambda worker: {"steps": probe.stats(), "channel": probe.channel}


def profiled_rank_main(rank: int, world_size: int, config: Any, store_port: int, conn: Any) -> None:
    """The target of each rank process: chapter 10's rank_main, with its pipe, pickling and runner timed."""
    probe = StepProbe()
    probe.install()
    probe.channel = []  # pipe and pickle events, in order; matched to calls afterwards
    tp_runtime.pickle = TimedPickle(probe.channel)
    _add_probe_calls(probe)
    tp_runtime.rank_main(rank, world_size, config, store_port, TimedConn(conn, probe.channel))


def rank_calls(channel: list[dict]) -> list[dict]:
    """A rank's channel log cut into calls: header and args arrive, args unpickled, reply pickled and sent.

    The main thread receives and unpickles; the reply thread pickles and sends, possibly later than the next
    call arrives. A call is a header and its args (two receives); its reply is the first reply written after
    the call's args were unpickled."""
    calls: list[dict] = []
    for event in (e for e in channel if e["main"]):
        if event.get("dir") == "recv":
            if calls and "t_args" not in calls[-1]:
                calls[-1]["t_args"] = event["t"]
                calls[-1]["bytes_in"] += event["bytes"]
            else:
                calls.append({"t_header": event["t"], "bytes_in": event["bytes"], "unpickle_s": 0.0})
        elif event.get("op") == "loads" and calls:
            calls[-1]["unpickle_s"] += event["s"]
            calls[-1]["t_loaded"] = event["t"]
    replies = [e for e in channel if not e["main"]]
    sends = [(i, e) for i, e in enumerate(replies) if e.get("dir") == "send"]
    position = 0
    for call in calls:
        while position < len(sends) and sends[position][1]["t0"] < call.get("t_loaded", call["t_header"]):
            position += 1
        if position == len(sends):
            break
        index, send = sends[position]
        dumps = [e for e in replies[:index] if e.get("op") == "dumps"]
        call.update(t_reply_sent=send["t0"], reply_send_s=send["s"], bytes_out=send["bytes"],
                    reply_pickle_s=dumps[-1]["s"] if dumps else 0.0)
        position += 1
    return calls


# ---- the driver ---------------------------------------------------------------------------------


class DriverProbe:
    """Times each step call in the driver: encoding and pickling, writing the pipes, waiting, reading replies."""

    def __init__(self, runner: tp_runtime.TPRunner) -> None:
        self.runner = runner
        self.channel: list[dict] = []
        self.calls: dict[int, dict] = {}
        self.enabled = False
        self._saved_pickle = tp_runtime.pickle
        tp_runtime.pickle = TimedPickle(self.channel)
        runner._conns[:] = [TimedConn(conn, self.channel, rank) for rank, conn in enumerate(runner._conns)]
        launch, collect = runner.launch, runner.collect

        def timed_launch(seqs: list, is_prefill: bool, previous: Any = None) -> Any:
            if not self.enabled:
                return launch(seqs, is_prefill, previous)
            mark, began = len(self.channel), now()
            step = launch(seqs, is_prefill, previous)
            events = self.channel[mark:]
            sends = [e for e in events if e.get("dir") == "send"]
            self.calls[step.call] = {
                "kind": "prefill" if is_prefill else "decode", "batch": len(seqs), "t_start": began,
                "launch_s": now() - began, "pickle_s": sum(e["s"] for e in events if e.get("op") == "dumps"),
                "send_s": sum(e["s"] for e in sends), "bytes_per_rank": sum(e["bytes"] for e in sends) / len(
                    runner._conns), "t_args_sent": [max((e["t0"] for e in sends if e["peer"] == r), default=None)
                                                    for r in range(len(runner._conns))]}
            return step

        def timed_collect(call: int, *args: Any, **kwargs: Any) -> Any:
            record = self.calls.get(call) if self.enabled else None
            if record is None:
                return collect(call, *args, **kwargs)
            mark, began = len(self.channel), now()
            result = collect(call, *args, **kwargs)
            events = self.channel[mark:]
            record["wait_s"] = now() - began
            record["unpickle_s"] = sum(e["s"] for e in events if e.get("op") == "loads")
            record["t_end"] = now()
            record["total_s"] = record["t_end"] - record["t_start"]
            # Replies are read in call order per rank: the last one read from each rank is this call's.
            replies = {e["peer"]: e["t"] for e in events if e.get("dir") == "recv"}
            record["t_replies"] = [replies.get(r) for r in range(len(runner._conns))]
            return result

        runner.launch, runner.collect = timed_launch, timed_collect

    def restore(self) -> None:
        tp_runtime.pickle = self._saved_pickle


def _settings(names: list[str], tp: int) -> list[dict]:
    table = {
        "tp1": {"tp": 1, "channel": False, "eager": False},
        "tp1-eager": {"tp": 1, "channel": False, "eager": True},
        "tp1-channel": {"tp": 1, "channel": True, "eager": False},
        f"tp{tp}": {"tp": tp, "channel": True, "eager": False},
        f"tp{tp}-eager": {"tp": tp, "channel": True, "eager": True},
    }
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown setting(s) {unknown}; choose from {sorted(table)}")
    return [{"name": name, **table[name]} for name in names]


@contextlib.contextmanager
def _runner_class(channel: bool):
    """Make LLMEngine build a TPRunner even at tensor_parallel_size=1 (one rank behind the channel)."""
    saved = llm_engine.ModelRunner
    if channel:
        llm_engine.ModelRunner = tp_runtime.TPRunner
    try:
        yield
    finally:
        llm_engine.ModelRunner = saved


def profile_setting(setting: dict, model: str, workload: Any, args: argparse.Namespace, out: Path) -> dict:
    """Run the workload under one setting; return per-step records of the driver and of every rank."""
    from nanovllm.llm import LLM
    from nanovllm.sampling_params import SamplingParams

    label = setting["name"]
    if args.trace_steps:
        os.environ[TRACE_ENV] = f"{out}|{label}|{args.trace_first}|{args.trace_steps}"
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    config = {"device": args.device, "dtype": args.dtype, "tensor_parallel_size": setting["tp"],
              "enforce_eager": setting["eager"], "async_scheduling": False,
              "max_model_len": max(args.max_model_len, longest)}
    if args.kvcache_memory_gb:
        config["kvcache_memory_gb"] = args.kvcache_memory_gb
    local = None
    if not setting["channel"]:
        local = StepProbe()  # patches this process's classes: installed before the engine exists
        local.install()
    _add_probe_calls(None)
    saved_target = tp_runtime.rank_main
    tp_runtime.rank_main = profiled_rank_main  # TPRunner spawns this (by name) instead
    began = time.perf_counter()
    try:
        with _runner_class(setting["channel"]):
            llm = LLM(model, **config)
    finally:
        tp_runtime.rank_main = saved_target
        os.environ.pop(TRACE_ENV, None)
    startup_s = time.perf_counter() - began
    driver = DriverProbe(llm.model_runner) if setting["channel"] else None
    steps: list[dict] = []
    step_name = "_step" if hasattr(llm, "_step") else "step"  # generate() calls _step where it exists
    inner_step = getattr(llm, step_name)

    def step() -> tuple:
        began = now()
        finished, num_tokens, is_prefill = inner_step()
        steps.append({"kind": "prefill" if is_prefill else "decode", "s": now() - began})
        return finished, num_tokens, is_prefill

    try:
        # Warm-up: the first steps of a fresh engine compile kernels; measure what follows.
        llm.generate([p[:64] for p in workload.prompts[:4]], SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        first_call = None
        if driver is not None:
            first_call = llm.model_runner.post("profile_reset")
            llm.model_runner.collect(first_call)
            first_call += 1
            driver.enabled = True
        else:
            local.reset()
        setattr(llm, step_name, step)
        began = time.perf_counter()
        llm.generate(workload.prompts, workload.sampling_params(), use_tqdm=False)
        seconds = time.perf_counter() - began
        if driver is not None:
            driver.enabled = False
            ranks = llm.model_runner.call("profile_stats")
        else:
            ranks = [{"steps": local.stats(), "channel": []}]
            local.enabled = False
        delattr(llm, step_name)
        # The same workload with asynchronous scheduling (what the benchmark runs), untimed per step.
        llm.config.async_scheduling = True
        began = time.perf_counter()
        llm.generate(workload.prompts, workload.sampling_params(), use_tqdm=False)
        async_seconds = time.perf_counter() - began
    finally:
        if driver is not None:
            driver.restore()
        if local is not None:
            local.restore()
        llm.exit()
        # The next setting needs this one's GPU memory (graph pools included) back.
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"setting": setting, "startup_s": startup_s, "seconds": seconds,
            "tokens_per_s": workload.num_output_tokens / seconds, "engine_steps": steps,
            "async_tokens_per_s": workload.num_output_tokens / async_seconds,
            "driver_calls": driver.calls if driver else None, "first_call": first_call,
            "ranks": [{"steps": r["steps"], "calls": rank_calls(r["channel"])} for r in ranks]}


# ---- summary ------------------------------------------------------------------------------------


def _ms(values: list[float]) -> float | None:
    middle = _median(values)
    return None if middle is None else middle * 1e3


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(result: dict) -> dict[str, float | None]:
    """Median milliseconds per decode step of every component (None where a component does not apply)."""
    ms = 1e3
    engine = [s["s"] for s in result["engine_steps"] if s["kind"] == "decode"]
    middle = _median(engine)
    row: dict[str, float | None] = {"engine step (schedule + run + postprocess)": None if middle is None else
                                    middle * ms, "decode steps": len(engine)}
    ranks = result["ranks"]
    rank_steps = [[s for s in r["steps"] if s["kind"] == "decode"] for r in ranks]
    driver = result["driver_calls"]
    if driver is not None:
        first = result["first_call"]  # rank call k (after the reset cleared its log) is call first + k
        calls = {n: c for n, c in driver.items() if c["kind"] == "decode" and "total_s" in c}
        values = list(calls.values())
        row["driver: step call (launch to tokens)"] = _median([c["total_s"] for c in values]) * ms
        row["driver: encode + pickle + write"] = _median([c["launch_s"] for c in values]) * ms
        row["driver: pickle"] = _median([c["pickle_s"] for c in values]) * ms
        row["driver: write pipes"] = _median([c["send_s"] for c in values]) * ms
        row["driver: wait for replies"] = _median([c["wait_s"] for c in values]) * ms
        row["driver: unpickle replies"] = _median([c["unpickle_s"] for c in values]) * ms
        row["message bytes per rank"] = _median([c["bytes_per_rank"] for c in values])
        for r, rank in enumerate(ranks):
            by_call = {first + k: call for k, call in enumerate(rank["calls"])}
            pairs = [(calls[n], by_call[n]) for n in calls if n in by_call]
            row[f"rank {r}: pipe driver->rank"] = _ms([rc.get("t_args", rc["t_header"]) - dc["t_args_sent"][r]
                                                      for dc, rc in pairs if dc["t_args_sent"][r] is not None])
            row[f"rank {r}: unpickle"] = _ms([rc["unpickle_s"] for _, rc in pairs])
            row[f"rank {r}: reply pickle + write"] = _ms([rc.get("reply_pickle_s", 0) + rc.get("reply_send_s", 0)
                                                         for _, rc in pairs])
            row[f"rank {r}: pipe rank->driver"] = _ms([dc["t_replies"][r] - rc["t_reply_sent"] for dc, rc in pairs
                                                      if dc["t_replies"][r] is not None and "t_reply_sent" in rc])
            row[f"rank {r}: idle between calls"] = _ms([by_call[n]["t_header"] - by_call[n - 1]["t_reply_sent"]
                                                       for n in calls if n - 1 in by_call and n in by_call
                                                       and "t_reply_sent" in by_call[n - 1]])
    for key in [k for k in row if k.startswith("rank ")]:
        row[key] = row.pop(key)  # rank rows after the driver's, per rank
    for r, steps in enumerate(rank_steps):
        prefix = f"rank {r}"  # at tp1 without the channel, "rank 0" is the driver process itself
        row[f"{prefix}: step host time"] = _median([s["t_run_end"] - s["t_run_start"] for s in steps]) * ms
        row[f"{prefix}: launch (whole step queued)"] = _median([s["launch_s"] for s in steps]) * ms
        row[f"{prefix}: of which inputs + forward + head"] = _median([s["forward_s"] for s in steps]) * ms
        row[f"{prefix}: in collectives (host)"] = _median([s["coll_host_s"] for s in steps]) * ms
        row[f"{prefix}: collective calls"] = _median([s["coll_calls"] for s in steps])
        row[f"{prefix}: wait for sampled tokens"] = _median([s["wait_tokens_s"] for s in steps]) * ms
        row[f"{prefix}: device time of the step"] = _median([s["gpu_step_ms"] for s in steps])
        row[f"{prefix}: device time in collectives"] = _median([s["gpu_coll_ms"] for s in steps])
    row["tokens/s (whole run, synchronous)"] = result["tokens_per_s"]
    row["tokens/s (whole run, asynchronous)"] = result["async_tokens_per_s"]
    return row


def table(summaries: dict[str, dict[str, float | None]]) -> str:
    names = list(summaries)
    keys: list[str] = []
    for summary in sorted(summaries.values(), key=len, reverse=True):  # the widest setting sets the order
        keys += [k for k in summary if k not in keys]
    width = max(len(k) for k in keys) + 2
    lines = ["median per decode step, milliseconds (unless named otherwise)",
             "".ljust(width) + "".join(n.rjust(14) for n in names)]
    for key in keys:
        cells = []
        for name in names:
            value = summaries[name].get(key)
            cells.append("-".rjust(14) if value is None else f"{value:14.3f}" if isinstance(value, float)
                         else f"{value:14}")
        lines.append(key.ljust(width) + "".join(cells))
    return "\n".join(lines)


def build_model(args: argparse.Namespace) -> str:
    from nanovllm.bench.engine import qwen3_06b_random
    from nanovllm.book.tiny_models import build_tiny_model

    if args.model:
        return args.model
    if args.shape == "qwen3-0.6b":
        return str(qwen3_06b_random())
    # The tiny Qwen3 of the book with a context long enough for the workload's lengths; vocabulary and
    # head counts as chapter 10's (every TP size up to 2 divides them).
    return str(build_tiny_model("qwen3", max_position_embeddings=4096))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for profile_tp.json, profile_tp.txt and traces")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tp", type=int, default=2, help="the tensor-parallel size under study")
    parser.add_argument("--settings", help="comma-separated: tp1, tp1-eager, tp1-channel, tpN, tpN-eager "
                                           "(default: all of them that apply to the device)")
    parser.add_argument("--model", help="model directory (default: --shape)")
    parser.add_argument("--shape", choices=["tiny", "qwen3-0.6b"], help="random model (default: qwen3-0.6b on "
                                                                        "CUDA, tiny on CPU)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=(100, 1024), metavar=("LOW", "HIGH"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(64, 64), metavar=("LOW", "HIGH"),
                        help="decode steps per sequence (short run: 64)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kvcache-memory-gb", type=float, help="CPU KV pool size (default: the engine's)")
    parser.add_argument("--trace-steps", type=int, default=0, help="decode steps to run under torch.profiler")
    parser.add_argument("--trace-first", type=int, default=8, help="first traced decode step")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    from nanovllm.bench.engine import make_workload
    from nanovllm.config import Config

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.shape = args.shape or ("qwen3-0.6b" if args.device == "cuda" else "tiny")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(args)
    hf = Config.from_kwargs(model, device=args.device, dtype=args.dtype)
    workload = make_workload(args.num_seqs, tuple(args.input_len), tuple(args.output_len),
                             vocab_size=hf.hf_config.vocab_size)
    default = ["tp1", "tp1-eager", "tp1-channel", f"tp{args.tp}"] if args.device == "cuda" else \
        ["tp1", "tp1-channel", f"tp{args.tp}"]
    settings = _settings(args.settings.split(",") if args.settings else default, args.tp)
    header = {"model": model, "device": args.device, "dtype": hf.dtype, "workload": workload.describe(),
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "gpus": torch.cuda.device_count() if args.device == "cuda" else 0, "cpus": os.cpu_count(),
              "scheduling": "synchronous (each step's times are its own)",
              "note": "rank 0 of tp1 is the driver process itself; clocks: CLOCK_MONOTONIC, shared by all processes"}
    print(json.dumps(header))
    results, summaries = {}, {}
    for setting in settings:
        print(f"==> {setting['name']} ...", flush=True)
        result = profile_setting(setting, model, workload, args, out)
        results[setting["name"]] = result
        summaries[setting["name"]] = summarize(result)
        print(f"    {result['tokens_per_s']:,.0f} tok/s (start-up {result['startup_s']:.1f} s)", flush=True)
        # Written after every setting: a run cut short keeps what it measured.
        text = "\n".join([json.dumps(header, indent=1), "", table(summaries), ""])
        (out / "profile_tp.txt").write_text(text)
        (out / "profile_tp.json").write_text(json.dumps({"header": header, "summary": summaries, "runs": results},
                                                        indent=1, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
