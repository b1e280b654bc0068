"""Where a tensor-parallel decode step's time goes (a diagnosis, not a benchmark).

    python3 scripts/profile_tp.py --out build/profile-tp                    # GPUs: NCCL, Qwen3-0.6B shapes
    python3 scripts/profile_tp.py --device cpu --out build/profile-tp-cpu   # CPU: gloo, the book's tiny Qwen3

A short run of nano-vllm's benchmark workload, scheduled synchronously (each step's times are its own), under
``tp1`` (one process), ``tp1-eager`` (no CUDA graphs), ``tp1-channel`` (one rank behind chapter 16's control
channel) and ``tpN`` (``--tp`` ranks). Per decode step: the driver's time to queue the call (pickling it) and to
wait for the tokens; in each process that computes (at tp1 the driver), the wait for the driver's message,
unpickling it, queueing the step (collectives included), the wait for the tokens and, on a GPU, the step's device
time. Medians go to ``profile_tp.txt``, every step to ``profile_tp.json`` (in ``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# The rank processes import this file again as their main module: the package must resolve there too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from nanovllm.engine import llm_engine, model_runner, tp_runtime

SETTING = re.compile(r"tp(?P<size>\d+)(?P<variant>-eager|-channel)?")  # tp1, tp1-eager, tp1-channel, tp2, ...
LABELS = {  # what a step's record holds (seconds, unless named _ms), in the table's order
    "message_wait_s": "wait for the driver's message", "unpickle_s": "unpickling", "launch_s": "queue the step",
    "pickle_s": "of which pickling", "coll_s": "of which collectives", "wait_s": "wait for the tokens",
    "gpu_ms": "device time of the step",
}


class Probe:
    """Records the steps that this process queues with `launcher.launch` (ModelRunner where the process computes,
    TPRunner in the driver), and the wait for their tokens. What happens before a step is queued (the wait for the
    driver's message, unpickling it) gathers in `pending` and joins the record of the next step."""

    def __init__(self, launcher: type) -> None:
        self.records: list[dict] = []
        self.pending: dict[str, float] = {}
        self.current: dict | None = None
        self.enabled = False
        self.computes = launcher is model_runner.ModelRunner
        patches = [(launcher, "launch", self.wrap_launch)]
        if self.computes:
            patches += [(dist, name, lambda fn: self.timed(fn, "coll_s")) for name in ("all_reduce", "gather")]
        self.undo = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
        for owner, name, wrap in patches:
            setattr(owner, name, wrap(getattr(owner, name)))

    def restore(self) -> None:
        for owner, name, original in self.undo:
            setattr(owner, name, original)

    def timed(self, fn: Any, key: str) -> Any:
        """`fn`, its time added under `key` to the step being queued (a rank's reply thread is not counted)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.enabled and threading.current_thread() is threading.main_thread():
                    target = self.pending if self.current is None else self.current
                    target[key] = target.get(key, 0.0) + time.perf_counter() - began

        return call

    def wrap_launch(self, inner: Any) -> Any:
        def launch(runner: Any, seqs: list, is_prefill: bool, previous: Any = None) -> Any:
            if not self.enabled:
                return inner(runner, seqs, is_prefill, previous)
            record = {"kind": "prefill" if is_prefill else "decode", "batch": len(seqs), **self.pending}
            gpu = self.computes and torch.cuda.is_initialized()  # CUDA events: the device time of the step
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if gpu else []
            self.pending, self.current, began = {}, record, time.perf_counter()
            if events:
                events[0].record()
            step = inner(runner, seqs, is_prefill, previous)
            if events:
                events[1].record()
            record["launch_s"], record["events"], self.current = time.perf_counter() - began, events, None
            self.records.append(record)
            tokens = step.token_ids

            def token_ids() -> list[int]:  # on a rank, its reply thread waits for the tokens
                began = time.perf_counter()
                try:
                    return tokens()
                finally:
                    record["wait_s"] = record.get("wait_s", 0.0) + time.perf_counter() - began

            step.token_ids = token_ids
            return step

        return launch

    def stats(self) -> list[dict]:
        """Every record since recording began, the device time in milliseconds (CUDA events do not pickle)."""
        records = []
        for record in self.records:
            record = dict(record)
            events = record.pop("events")
            if events:
                events[1].synchronize()
                record["gpu_ms"] = events[0].elapsed_time(events[1])
            records.append(record)
        return records


def timed_pickle(probe: Probe, name: str, key: str) -> SimpleNamespace:
    """Stands in for tp_runtime's pickle module: the same calls, the time of `name` added to the probe as `key`."""
    calls = {"dumps": pickle.dumps, "loads": pickle.loads, "HIGHEST_PROTOCOL": pickle.HIGHEST_PROTOCOL}
    return SimpleNamespace(**calls | {name: probe.timed(calls[name], key)})


def profiled_rank_main(rank: int, world_size: int, config: Any, store_port: int, conn: Any) -> None:
    """What each rank process runs: chapter 16's rank_main, its pipe, its pickling and its steps timed, and two
    more calls it answers: start recording, hand the records over."""
    probe = Probe(model_runner.ModelRunner)
    tp_runtime.pickle = timed_pickle(probe, "loads", "unpickle_s")
    conn.recv_bytes = probe.timed(conn.recv_bytes, "message_wait_s")
    tp_runtime.RankWorker.CALLS += ("probe_start", "probe_stats")
    tp_runtime.RankWorker.probe_start = lambda worker: setattr(probe, "enabled", True)
    tp_runtime.RankWorker.probe_stats = lambda worker: probe.stats()
    tp_runtime.rank_main(rank, world_size, config, store_port, conn)


def profile_setting(name: str, model: str, workload: Any, device: str) -> dict:
    """Run the workload under one setting: the engine's decode steps, the driver's records and every rank's."""
    from nanovllm.llm import LLM
    from nanovllm.sampling_params import SamplingParams

    match = SETTING.fullmatch(name)
    tp, eager = int(match["size"]), match["variant"] == "-eager"
    channel = tp > 1 or match["variant"] == "-channel"
    saved = llm_engine.ModelRunner, tp_runtime.rank_main, tp_runtime.pickle, tp_runtime.RankWorker.CALLS
    if channel:  # a TPRunner even for one rank; it spawns profiled_rank_main, found by name in the rank
        llm_engine.ModelRunner, tp_runtime.rank_main = tp_runtime.TPRunner, profiled_rank_main
        tp_runtime.RankWorker.CALLS += ("probe_start", "probe_stats")  # the driver checks the names too
    probe = Probe(tp_runtime.TPRunner if channel else model_runner.ModelRunner)
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    llm, engine_steps = None, []
    try:
        llm = LLM(model, device=device, tensor_parallel_size=tp, enforce_eager=eager, async_scheduling=False,
                  max_model_len=max(4096, longest))
        tp_runtime.pickle = timed_pickle(probe, "dumps", "pickle_s") if channel else pickle
        inner = llm._step  # what generate() calls

        def step() -> tuple:
            began = time.perf_counter()
            finished, num_tokens, is_prefill = inner()
            if not is_prefill:
                engine_steps.append(time.perf_counter() - began)
            return finished, num_tokens, is_prefill

        # Warm-up: the first steps of a fresh engine compile kernels.
        llm.generate([p[:64] for p in workload.prompts[:4]], SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        if channel:
            llm.model_runner.call("probe_start")
        probe.enabled, llm._step, began = True, step, time.perf_counter()
        llm.generate(workload.prompts, workload.sampling_params(), use_tqdm=False)
        seconds, probe.enabled = time.perf_counter() - began, False
        ranks = llm.model_runner.call("probe_stats") if channel else [probe.stats()]
    finally:
        if llm is not None:
            llm.exit()
        probe.restore()
        llm_engine.ModelRunner, tp_runtime.rank_main, tp_runtime.pickle, tp_runtime.RankWorker.CALLS = saved
    del llm
    gc.collect()  # the next setting needs this one's GPU memory, graph pools included
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"engine_step_s": engine_steps, "driver": probe.stats() if channel else [], "ranks": ranks,
            "tokens_per_s": workload.num_output_tokens / seconds}


def summarize(result: dict) -> dict[str, float]:
    """Medians per decode step, in milliseconds."""
    row = {"engine step (schedule + run + postprocess)": statistics.median(result["engine_step_s"]) * 1e3}
    for who, steps in [("driver", result["driver"])] + [(f"rank {r}", s) for r, s in enumerate(result["ranks"])]:
        for key, label in LABELS.items():
            values = [step[key] for step in steps if step["kind"] == "decode" and key in step]
            if values:
                row[f"{who}: {label}"] = statistics.median(values) * (1 if key.endswith("_ms") else 1e3)
    row["tokens/s (whole run, synchronous)"] = result["tokens_per_s"]
    return row


def table(summaries: dict[str, dict[str, float]]) -> str:
    widest = sorted(summaries.values(), key=len, reverse=True)  # the setting with the most ranks sets the order
    keys = list(dict.fromkeys(key for summary in widest for key in summary))
    width = max(map(len, keys)) + 2
    lines = [" " * width + "".join(f"{name:>14}" for name in summaries)] + [
        key.ljust(width) + "".join(f"{s[key]:14.3f}" if key in s else f"{'-':>14}" for s in summaries.values())
        for key in keys]
    return "median per decode step, ms (rank 0 of tp1 is the driver process itself)\n" + "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for profile_tp.txt and profile_tp.json")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--tp", type=int, default=2, help="the tensor-parallel size under study")
    parser.add_argument("--settings", help="comma-separated: tp1, tp1-eager, tp1-channel, tpN, tpN-eager "
                                           "(default: those that apply to the device and its GPUs)")
    parser.add_argument("--model", help="model directory (default: Qwen3-0.6B shapes on CUDA, a tiny Qwen3 on CPU)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64, help="decode steps per sequence")
    args = parser.parse_args()
    names = args.settings.split(",") if args.settings else None
    if names and not all(SETTING.fullmatch(name) for name in names):
        parser.error(f"--settings {args.settings}: each one is tpN, tpN-eager or tp1-channel")

    from nanovllm.bench.engine import make_workload
    from nanovllm.bench.models import qwen3_06b_random
    from nanovllm.book.tiny_models import build_tiny_model
    from nanovllm.config import Config

    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    names = names or ["tp1"] + ["tp1-eager"] * (gpus > 0) + ["tp1-channel"] + [f"tp{args.tp}"] * (gpus != 1)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared machines
    model = args.model or str(qwen3_06b_random() if gpus else build_tiny_model("qwen3", max_position_embeddings=4096))
    vocab_size = Config.from_kwargs(model, device=device).hf_config.vocab_size
    workload = make_workload(args.num_seqs, (100, 1024), (args.output_len,) * 2, vocab_size=vocab_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs, summaries = {}, {}
    for name in names:
        print(f"==> {name} ...", flush=True)
        runs[name] = profile_setting(name, model, workload, device)
        summaries[name] = summarize(runs[name])
    where = f"{gpus} x {torch.cuda.get_device_name()}" if gpus else "CPU"
    text = f"{model} on {where}, torch {torch.__version__}: {workload.describe()}\n\n{table(summaries)}\n"
    (out / "profile_tp.txt").write_text(text)
    (out / "profile_tp.json").write_text(json.dumps({"summary": summaries, "runs": runs}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":  # the spawned ranks import this file too: only the driver runs main
    raise SystemExit(main())
