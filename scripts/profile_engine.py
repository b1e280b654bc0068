"""Where the engine's time goes on nano-vllm's benchmark workload (a GPU diagnosis, not a benchmark).

    PYTHONPATH=$PWD python3 scripts/profile_engine.py --out build/profile

It runs the workload of `python -m nanovllm.bench --preset nano-vllm` on one engine:
1. cold (what the bench measures: the first run after the engine's own warm-up);
2. warm and synchronous (async scheduling off, so that each step's times are its own), with every
   step timed on the host and, through CUDA events, the GPU time of the decode forward, the LM head
   and the sampler;
3. warm, async scheduling on and then off, untimed: what overlapping the host with the GPU buys;
4. under torch.profiler, whose tables of CPU-side ops and GPU kernels it prints and saves.
A difference between runs 1 and 3 (async) is time spent compiling kernels inside the measured run.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch

from nanovllm.bench.engine import PRESETS, make_workload
from nanovllm.bench.models import qwen3_06b_random
from nanovllm.llm import LLM


class StepTimer:
    """Wraps the runner's and the scheduler's methods to time every step (host) and its GPU parts (events)."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[dict] = []
        self.current: dict = {}
        self.host_extra: dict[str, float] = {}
        self.pending: list[tuple[dict, str, torch.cuda.Event, torch.cuda.Event]] = []
        # (owner, attribute, what the instance held before: None if the class's method was in use)
        self.wrapped: list[tuple[object, str, object]] = []
        runner = llm.model_runner
        self._wrap_host(runner, "run", self._record_step)
        self._wrap_host(llm.scheduler, "schedule", self._add_host_time("schedule"))
        # The synchronous engine's postprocess is these two, back to back.
        self._wrap_host(llm.scheduler, "advance", self._add_host_time("postprocess"))
        self._wrap_host(llm.scheduler, "resolve", self._add_host_time("postprocess"))
        self._wrap_gpu(runner.model, "compute_logits", "lm_head")
        self._wrap_gpu(runner.sampler, "forward", "sampler")
        if runner.graphs is not None:
            self._wrap_gpu(runner.graphs, "replay", "forward")
        self._wrap_gpu(runner.model, "forward", "forward")

    def _replace(self, owner, name, wrapper) -> None:
        self.wrapped.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, wrapper)

    def restore(self) -> None:
        """Put every wrapped method back as it was (an instance attribute, such as a compiled op, included)."""
        for owner, name, before in reversed(self.wrapped):
            if before is None:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        self.wrapped.clear()

    def _add_host_time(self, label):
        def add(args, seconds):
            self.host_extra[label] = self.host_extra.get(label, 0.0) + seconds

        return add

    def _wrap_host(self, owner, name, on_call):
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            began = time.perf_counter()
            result = inner(*args, **kwargs)
            on_call(args, time.perf_counter() - began)
            return result

        self._replace(owner, name, timed)

    def _record_step(self, args, seconds):
        seqs, is_prefill = args
        self.current.update(
            kind="prefill" if is_prefill else "decode",
            batch=len(seqs),
            tokens=sum(s.num_scheduled_tokens for s in seqs),
            host_s=seconds,
        )
        self.steps.append(self.current)
        self.current = {}

    def _wrap_gpu(self, owner, name, label):
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = inner(*args, **kwargs)
            end.record()
            self.pending.append((self.current, label, start, end))
            return result

        self._replace(owner, name, timed)

    def resolve(self) -> None:
        torch.cuda.synchronize()
        for step, label, start, end in self.pending:
            step[label + "_gpu_ms"] = step.get(label + "_gpu_ms", 0.0) + start.elapsed_time(end)
        self.pending.clear()


def compiled_variants() -> dict[str, int]:
    """Compiled variants held by each attention and sampler kernel (Triton compiles one per new specialization)."""
    import nanovllm.layers.triton_attention as attention
    import nanovllm.layers.triton_sampler as sampler

    kernels = [attention.store_kvcache_kernel, attention.prefill_attention_kernel, attention.decode_attention_kernel,
               attention.decode_reduce_kernel, sampler.race_chunk_kernel, sampler.race_pick_kernel]  # fmt: skip
    return {kernel.fn.__name__: sum(len(c[0]) for c in kernel.device_caches.values()) for kernel in kernels}


def summarize(steps: list[dict]) -> dict:
    """Totals per kind, and decode steps grouped by batch size."""
    out: dict = {}
    for kind in ("prefill", "decode"):
        mine = [s for s in steps if s["kind"] == kind]
        out[kind] = {
            "steps": len(mine),
            "host_s": sum(s["host_s"] for s in mine),
            **{
                key: sum(s.get(key, 0.0) for s in mine) / 1e3
                for key in ("forward_gpu_ms", "lm_head_gpu_ms", "sampler_gpu_ms")
            },
        }
    buckets: dict[int, list[dict]] = collections.defaultdict(list)
    for s in steps:
        if s["kind"] == "decode":
            buckets[1 << (s["batch"] - 1).bit_length()].append(s)
    out["decode_by_batch"] = {
        f"<={b}": {
            "steps": len(group),
            "host_ms_per_step": 1e3 * sum(s["host_s"] for s in group) / len(group),
            **{
                key.replace("_gpu_ms", "_ms_per_step"): sum(s.get(key, 0.0) for s in group) / len(group)
                for key in ("forward_gpu_ms", "lm_head_gpu_ms", "sampler_gpu_ms")
            },
        }
        for b, group in sorted(buckets.items())
    }
    out["prefill_steps"] = [
        {k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()} for s in steps if s["kind"] == "prefill"
    ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/profile")
    parser.add_argument("--no-profiler", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(qwen3_06b_random())
    llm = LLM(model)
    config = llm.model_runner.config
    workload = make_workload(**PRESETS["nano-vllm"], vocab_size=config.hf_config.vocab_size)
    params = workload.sampling_params()
    print(f"workload: {workload.describe()}; blocks {config.num_kvcache_blocks} x {config.kvcache_block_size}")
    llm.generate([workload.prompts[0][:8]], params[0].__class__(max_tokens=2), use_tqdm=False)
    report: dict = {}

    def shifted(by: int) -> list[list[int]]:
        # Other token ids of the same lengths: a run of the same prompts again would hit the prefix cache.
        return [[(t + by) % 10_001 for t in prompt] for prompt in workload.prompts]

    overlap = config.async_scheduling
    runs = (("cold", workload.prompts, overlap), ("warm_sync_timed", shifted(1), False),
            ("warm_async", shifted(3), True), ("warm_sync", shifted(4), False))
    for name, prompts, async_scheduling in runs:
        llm.config.async_scheduling = async_scheduling  # the engine reads it at every step
        timer = StepTimer(llm) if name == "warm_sync_timed" else None
        variants = compiled_variants()
        torch.cuda.synchronize()
        began = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        report[name] = {"seconds": seconds, "tokens_per_s": workload.num_output_tokens / seconds,
                        "async_scheduling": async_scheduling}
        print(f"{name}: {seconds:.2f} s, {workload.num_output_tokens / seconds:,.0f} tok/s "
              f"(async_scheduling={async_scheduling})")
        report[name]["triton_variants_compiled_during_run"] = {
            kernel: count - variants.get(kernel, 0) for kernel, count in compiled_variants().items()
        }
        print(f"  Triton variants compiled during the run: {report[name]['triton_variants_compiled_during_run']}")
        if timer is not None:
            timer.resolve()
            report[name].update(summarize(timer.steps), host_extra=timer.host_extra)
            timer.restore()  # the profiler run below sees the plain engine
            print(json.dumps({k: v for k, v in report[name].items() if k != "prefill_steps"}, indent=1))
            for s in report[name]["prefill_steps"]:
                print("  prefill step", s)

    llm.config.async_scheduling = overlap
    if not args.no_profiler:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(shifted(2), params, use_tqdm=False)
            torch.cuda.synchronize()
        averages = prof.key_averages()
        for sort in ("self_cuda_time_total", "self_cpu_time_total"):
            table = averages.table(sort_by=sort, row_limit=45, max_name_column_width=70)
            (out / f"profile_{sort}.txt").write_text(table)
            print(table)
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    llm.exit()


if __name__ == "__main__":
    main()
