"""Does the engine's thread slow down because the grammar workers share its physical core?

    PYTHONPATH=$PWD python3 scripts/probes/worker_affinity_probe.py [--batch 256] [--workers 4] [--rounds 3]

GPU only (a diagnosis for issue 63, not a benchmark). With 4 workers filling a 256-sequence step, the engine thread's
own phases took about 1.7 times as long as in a free run on an H100 (settle_order_probe.py: `schedule` 0.30 -> 0.52
ms). If the machine's CPUs are hyperthreads, a worker may run on the other half of the engine's core. This probe
takes turns, in one engine, between the CPUs as the system gives them and "pinned": each worker alone on a
physical core of its own (its sibling threads left idle), the engine on the remaining cores. It prints the medians
of the free and constrained runs of each, and the ratios.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from pathlib import Path

import torch

from scripts.probes.constrained_gap_probe import add_options, engine_and_requests


def physical_cores() -> list[list[int]]:
    """The CPUs this process may use, grouped by physical core (hyperthread siblings together)."""
    cores: dict[str, list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        cores.setdefault(siblings, []).append(cpu)
    return list(cores.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(parser, max_tokens=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cores = physical_cores()
    print(f"{sum(map(len, cores))} CPUs on {len(cores)} physical cores: {cores}")
    if len(cores) < args.workers + 2:
        raise SystemExit("not enough physical cores to give each worker one and keep two for the engine")
    everything = {cpu for core in cores for cpu in core}
    llm, runs, prompts = engine_and_requests(args.batch, args.workers, args.max_tokens)
    walls: dict[str, list[float]] = collections.defaultdict(list)
    try:
        for params in runs.values():  # warm-up; the first constrained run starts the workers
            llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        workers = [process.pid for process in llm.model_runner.grammars.workers.processes]
        worker_cores, engine_cores = cores[-args.workers:], cores[:-args.workers]
        placements = {
            "shared": (everything, [everything] * args.workers),
            "pinned": ({cpu for core in engine_cores for cpu in core}, [{core[0]} for core in worker_cores]),
        }
        for _ in range(args.rounds):
            for placement, (engine_cpus, worker_cpus) in placements.items():
                os.sched_setaffinity(0, engine_cpus)
                for pid, cpus in zip(workers, worker_cpus, strict=True):
                    os.sched_setaffinity(pid, cpus)
                for name, params in runs.items():
                    torch.cuda.synchronize()
                    began = time.perf_counter()
                    llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
                    torch.cuda.synchronize()
                    walls[f"{placement}, {name}"].append(time.perf_counter() - began)
    finally:
        llm.exit()
    medians = {name: statistics.median(times) for name, times in walls.items()}
    print(f"{torch.cuda.get_device_name()}, {args.batch} sequences, {args.workers} workers, {args.max_tokens} tokens, "
          f"medians of {args.rounds} rounds")
    for placement in ("shared", "pinned"):
        free, constrained = medians[f"{placement}, free"], medians[f"{placement}, constrained"]
        print(f"  {placement}: free {1e3 * free:7.1f} ms, constrained {1e3 * constrained:7.1f} ms, "
              f"constrained/free speed {free / constrained:.3f}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump({"device": torch.cuda.get_device_name(), "cores": cores, "medians_s": medians,
                       "batch": args.batch, "workers": args.workers, "max_tokens": args.max_tokens}, file, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
