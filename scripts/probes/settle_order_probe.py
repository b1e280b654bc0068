"""Does a constrained step gain if the next step is staged before the step in flight's sampling is queued?

    PYTHONPATH=$PWD python3 scripts/probes/settle_order_probe.py [--batch 256] [--workers 4] [--rounds 3]

GPU only (a diagnosis for issue 63, not a benchmark). Chapter 29c's runner settles the step in flight (`LaterTokens`:
the fill's end, the rows' copy, the masked sampling) in `begin_step`, before it stages the next step's inputs. This
probe tries the other order in the same engine: `begin_step` leaves the tokens unsettled, and the replay settles them
after the staging (`replay_staged`), so the host stages while the workers may still fill, and the sampling and the
next forward reach the device back to back. The order is switched by patching the runner's class, here only.

For each round it runs the benchmark's free requests, then the constrained ones in the shipped order, then in the
other one, and prints each run's median wall time, the constrained/free ratios, whether both orders gave the same
tokens, and the host's time in each phase of a step (wrapped functions, their own calls; nested phases overlap).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch

from nanovllm.engine.cuda_graphs import DecodeStaging
from nanovllm.engine.grammar_workers import WorkerGrammars
from nanovllm.engine.grammars import Grammars
from nanovllm.engine.model_runner import LaterTokens, ModelRunner, SampledTokens
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PENDING_TOKEN
from scripts.probes.constrained_gap_probe import add_options, engine_and_requests

PHASES: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
STAGED_FIRST = {"on": False}


def timed(cls: type, name: str) -> None:
    """Record the wall time of every call of ``cls.name`` in PHASES."""
    original = cls.__dict__[name]

    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            PHASES[f"{cls.__name__}.{name}"].append(time.perf_counter() - began)

    setattr(cls, name, wrapper)


shipped_begin_step = ModelRunner.begin_step
shipped_replay_staged = ModelRunner.replay_staged


def begin_step(self: ModelRunner, seqs, previous):
    if not STAGED_FIRST["on"]:
        return shipped_begin_step(self, seqs, previous)
    # Chapter 18's begin_step: the step in flight stays unsettled; replay_staged (below) or any reader settles it.
    if self.stopped:
        raise RuntimeError("this model runner was stopped (exit() was called)")
    self.in_flight = previous if isinstance(previous, LaterTokens) else None
    pending = any(seq.last_token == PENDING_TOKEN for seq in seqs)
    self.copy_blocks(seqs)
    return pending


def replay_staged(self: ModelRunner, seqs, previous: SampledTokens | None) -> torch.Tensor:
    in_flight = getattr(self, "in_flight", None)
    if not STAGED_FIRST["on"] or in_flight is None:
        return shipped_replay_staged(self, seqs, previous)
    if self.staging is None:
        self.staging = DecodeStaging(self.graphs.buffers, self.block_size)
    self.staging.stage(seqs, self.graphs.bucket(len(seqs)))
    self.in_flight = None
    in_flight.settle()
    if previous is not None:
        previous.write_pending(seqs, self.graphs.buffers.input_ids[: len(seqs)])
    return self.graphs.replay_loaded(len(seqs))


def eager_guard(original):
    """A step that will not replay a graph settles the step in flight first, as the shipped begin_step does."""
    def wrapper(self: ModelRunner, seqs, is_prefill, previous=None):
        if isinstance(previous, LaterTokens) and (
                is_prefill or self.graphs is None or not self.graphs.covers(len(seqs))):
            previous.settle()
        return original(self, seqs, is_prefill, previous)
    return wrapper


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(parser, max_tokens=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ModelRunner.begin_step, ModelRunner.replay_staged = begin_step, replay_staged
    ModelRunner.launch = eager_guard(ModelRunner.launch)
    for cls, name in [(Grammars, "start_fill"), (WorkerGrammars, "start_fill"), (WorkerGrammars, "finish_fill"),
                      (LaterTokens, "settle"), (DecodeStaging, "stage"), (Scheduler, "schedule"),
                      (Scheduler, "resolve"), (SampledTokens, "token_ids"), (ModelRunner, "launch")]:
        if name in cls.__dict__:
            timed(cls, name)
    llm, params, prompts = engine_and_requests(args.batch, args.workers, args.max_tokens)
    free, constrained = params["free"], params["constrained"]
    walls: dict[str, list[float]] = collections.defaultdict(list)
    phases: dict[str, dict[str, float]] = {}
    same_tokens = True
    runs = [("free", free, False), ("constrained, shipped order", constrained, False),
            ("constrained, staged first", constrained, True)]
    try:
        for _, params, staged_first in runs:  # warm-up
            STAGED_FIRST["on"] = staged_first
            llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        for _ in range(args.rounds):
            outputs = {}
            for name, params, staged_first in runs:
                STAGED_FIRST["on"] = staged_first
                PHASES.clear()
                synchronize()
                began = time.perf_counter()
                outputs[name] = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
                synchronize()
                walls[name].append(time.perf_counter() - began)
                phases[name] = {phase: 1e3 * sum(times) for phase, times in PHASES.items()}
                phases[name]["steps"] = len(PHASES.get("ModelRunner.launch", []))
            shipped, staged = outputs["constrained, shipped order"], outputs["constrained, staged first"]
            same_tokens &= [o["token_ids"] for o in shipped] == [o["token_ids"] for o in staged]
    finally:
        llm.exit()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report = {"device": device, "batch": args.batch, "workers": args.workers,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "same_tokens": same_tokens,
              "median_wall_s": {name: statistics.median(times) for name, times in walls.items()},
              "last_round_phases_ms": phases}
    free_s = report["median_wall_s"]["free"]
    print(f"{report['device']}, {args.batch} sequences, {args.workers} workers, {args.max_tokens} tokens, "
          f"medians of {args.rounds} rounds; same tokens in both orders: {same_tokens}")
    for name, seconds in report["median_wall_s"].items():
        print(f"  {name:28s} {1e3 * seconds:8.1f} ms  free/this {free_s / seconds:.3f}")
    for name, by_phase in phases.items():
        steps = max(1, by_phase.pop("steps"))
        print(f"  host per step, {name} ({steps} launches): " + ", ".join(
            f"{phase} {ms / steps:.3f}" for phase, ms in sorted(by_phase.items())))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
