"""Where a verify step's time goes (chapter 25; a GPU diagnosis, not a benchmark).

    PYTHONPATH=$PWD python3 scripts/profile_verify.py --out build/verify

One request (Qwen3-0.6B shapes, random weights, a 512-token prompt) decodes with speculation on and a proposer
that always offers k drafts, so that every decode step is a verify step of k + 1 query tokens; the same request
then runs on the synchronous engine without speculation. For each: the wall time of every decode step (does it
fall after the first steps, as it would if kernels were compiling?), then, over a window of steady steps,
cProfile's top functions and torch.profiler's top CUDA kernels and CPU operators per step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
from pathlib import Path

import torch

# A synchronous step returns once its tokens are on the host: profile_host_step's timer serves as it is
# (run as a script, this file's folder is on sys.path).
from profile_host_step import decode_until

from nanovllm.bench.models import qwen3_06b_random
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams


class Fixed:
    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        return [1] * min(self.k, self.k if limit is None else limit)


def run(name: str, settings: dict, k: int, out: Path) -> dict:
    llm = LLM(str(qwen3_06b_random()), async_scheduling=False, **settings)
    if settings.get("speculative_method"):
        llm.speculator.proposer = Fixed(k)
        # The random model rejects the fixed drafts: keep verifying anyway (no back-off pause).
        llm.speculator.min_tokens_per_verify = 0
    llm.add_request(list(range(1000, 1512)), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    first = decode_until(llm, 40)
    steady = decode_until(llm, 40)
    profiler = cProfile.Profile()
    profiler.enable()
    decode_until(llm, 20)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        decode_until(llm, 20)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
    cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    (out / f"{name}.txt").write_text(f"{text.getvalue()}\n\n{table}\n\n{cpu_table}")
    result = {"first_steps_ms": [round(s * 1e3, 2) for s in first[:10]],
              "median_first_40_ms": statistics.median(first) * 1e3, "median_steady_ms": statistics.median(steady) * 1e3,
              "drafted": llm.speculator.counts.drafted, "accepted": llm.speculator.counts.accepted,
              "verifications": llm.speculator.counts.verifications}
    llm.exit()
    print(f"{name:>22}: first steps {result['first_steps_ms']} ms; median {result['median_first_40_ms']:.2f} ms over "
          f"the first 40, {result['median_steady_ms']:.2f} ms over the next 40")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/verify")
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "decode, sync": run("decode-sync", {}, args.k, out),
        "verify, k drafts": run("verify", {"speculative_method": "ngram"}, args.k, out),
        "verify, eager ops": run("verify-eager-ops", {"speculative_method": "ngram", "compile_small_ops": False,
                                                      "fused_decode": False}, args.k, out),
    }
    (out / "verify.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
