"""Where the host's time goes in a small decode step on a GPU (a diagnosis, not a benchmark).

    PYTHONPATH=$PWD python3 scripts/host_profile.py [--batch 1] [--steps 512] [--out build/host-profile.txt]

At batch 1 the GPU finishes a fused decode step before the host has launched the next one (chapter 15's
timeline): the Python step is the wall. This runs one engine on Qwen3-0.6B's shapes (random weights, the
engine's GPU defaults: CUDA graphs, asynchronous scheduling, fused decode), warms it up, then decodes ``steps``
tokens for ``batch`` prompts of 512 tokens twice: once plain (wall time per step) and once under cProfile,
whose tables (own time, then cumulative) it prints and saves. cProfile slows every Python call, so read its
shares, not its microseconds (tqdm's set_postfix on a disabled bar shows 27 us a call there, 2 us without it).

First run, one H100 (2026-12-05), batch 1: 0.840 ms a step (1.061 under cProfile). Of the host's step under
cProfile: the sampler 0.31 ms (its two Triton launches through Triton's Python launcher 0.22), the graph replay
0.23 (staging the inputs 0.14 of it), the LM head's matmul call 0.07-0.09, `SampledTokens.start` 0.10 (CUDA event
records, each looking up the current stream). The two Triton launches a step are the first candidates: inside the
decode graph, or one launch instead of two.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from nanovllm.bench.models import qwen3_06b_random
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams


def decode(llm: LLM, batch: int, steps: int, first_token: int) -> float:
    """Seconds per step of one generate call: ``batch`` prompts of 512 tokens, ``steps`` tokens each."""
    prompts = [[first_token + i] * 512 for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--out", default="build/host-profile.txt")
    args = parser.parse_args()
    llm = LLM(str(qwen3_06b_random()), device="cuda")
    decode(llm, args.batch, 64, first_token=100)
    plain = decode(llm, args.batch, args.steps, first_token=200)
    profiler = cProfile.Profile()
    profiler.enable()
    profiled = decode(llm, args.batch, args.steps, first_token=300)
    profiler.disable()
    text = io.StringIO()
    text.write(
        f"batch {args.batch}: {plain * 1e3:.3f} ms per step (the prefill included), "
        f"{profiled * 1e3:.3f} ms under cProfile\n"
    )
    for key in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(40)
    print(text.getvalue())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text.getvalue())
    llm.exit()


if __name__ == "__main__":
    main()
