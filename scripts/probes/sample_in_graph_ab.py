"""Does sampling inside the captured step (chapter 18's `SamplingGraphs`) take the host off the critical path?

    PYTHONPATH=$PWD python3 scripts/probes/sample_in_graph_ab.py [--batches 1 4 16 64] [--out FILE.json]

The latency benchmark's rows (`nanovllm.bench.latency.measure_setting`: Qwen3-0.6B's shapes, prompts of 512 tokens,
1,024 generated) with ``sample_in_graph`` off and on, in turns (off, on, off, on: run order cannot make a difference
out of nothing), each turn in an engine of its own; then per batch the means of each setting: ms per step, the
host's time per step (wall time less the wait for the GPU), the host's launch, kernels per step.
"""

from __future__ import annotations

import argparse
import json

from nanovllm.bench.latency import measure_setting
from nanovllm.bench.models import qwen3_06b_random
from nanovllm.bench.report import CopyRates


def mean(rows: list[dict], key: str) -> float:
    return sum(row[key] for row in rows) / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--turns", type=int, default=2, help="runs of each setting, in turns")
    parser.add_argument("--out", help="also write every row to this JSON file")
    args = parser.parse_args()
    rates = CopyRates.before_runs("cuda")
    print(f"copy rate before the runs: {rates.before / 1e12:.2f} TB/s", flush=True)
    model, rows = str(qwen3_06b_random()), []
    for turn in range(args.turns):
        for in_graph in (False, True):
            print(f"turn {turn}: sample_in_graph={in_graph}", flush=True)
            for row in measure_setting(model, args.batches, 512, 1024, rates.before, seed=0, device="cuda",
                                       max_model_len=4096, max_num_seqs=max(args.batches), sample_in_graph=in_graph):
                rows.append(row | {"sample_in_graph": in_graph, "turn": turn})
    rate = max(rates.before, rates.after_runs())
    print(f"copy rate after the runs: {rates.after / 1e12:.2f} TB/s; shares below at {rate / 1e12:.2f} TB/s")
    for batch in args.batches:
        off = [row for row in rows if row["batch"] == batch and not row["sample_in_graph"]]
        on = [row for row in rows if row["batch"] == batch and row["sample_in_graph"]]
        print(f"batch {batch:3d}: ms/step off {mean(off, 'ms_per_step'):.3f} on {mean(on, 'ms_per_step'):.3f} "
              f"({mean(off, 'ms_per_step') / mean(on, 'ms_per_step'):.3f}x); host off {mean(off, 'host_ms'):.3f} "
              f"on {mean(on, 'host_ms'):.3f}; launch off {mean(off, 'host_launch_ms'):.3f} on "
              f"{mean(on, 'host_launch_ms'):.3f}; kernels off {mean(off, 'kernels_per_step'):.0f} on "
              f"{mean(on, 'kernels_per_step'):.0f}; share on "
              f"{mean(on, 'bound_ms') * rates.before / rate / mean(on, 'ms_per_step'):.1%}")
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"rows": rows, "copy_rate_before": rates.before, "copy_rate_after": rates.after}, out, indent=1)


if __name__ == "__main__":
    main()
