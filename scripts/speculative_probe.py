"""Speculative decoding at batch 1, measured: SmolLM2-135M's real weights continuing passages they quote.

    python scripts/speculative_probe.py [--max-tokens 256] [--repeats 3]

Runs the same greedy requests one at a time through three engines built in this one invocation: the default
engine (CUDA graphs, asynchronous scheduling on a GPU), the synchronous engine (the one speculation extends) and
the synchronous engine with ``speculative_method="ngram"``; prints tok/s, steps and the acceptance rate of each,
and the ratios against the first two. The verify step of this first version runs eagerly (no CUDA graph), so on a
GPU it pays the eager forward's launch cost: the ratio against the default engine says what that costs.
"""

from __future__ import annotations

import argparse
import json
import time

from nanovllm import LLM, SamplingParams
from nanovllm.book.smollm2 import smollm2_dir

PASSAGE = (
    "A decode step computes each sequence's last token. A verify step computes the last token and its k drafts, "
    "so the drafts must have slots in the KV cache before the step runs. The scheduler has already picked the "
    "decode batch and made room for one token per sequence, preempting if it had to. Each draft is one more token "
    "the step computes, a draft past the sequence's last allowed token could never be kept, and when the drafts "
    "would need a block that is not free, the sequence simply decodes without them."
)


def prompts() -> list[str]:
    """Prompts that quote the passage and ask for it again, cut at different places."""
    head = f"Here is a paragraph from a book about inference engines.\n\n{PASSAGE}\n\nThe same paragraph, copied:\n\n"
    return [head + PASSAGE[:cut] for cut in (30, 120, 260)]


def measure(settings: dict, max_tokens: int, repeats: int) -> dict:
    llm = LLM(str(smollm2_dir()), **settings)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts()[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    outputs, steps, seconds = [], 0, 0.0
    for _ in range(repeats):
        for prompt in prompts():
            llm.add_request(prompt, params)
            began = time.perf_counter()
            while not llm.is_finished():
                outputs += [output[1] for output in llm.step()[0]]
                steps += 1
            seconds += time.perf_counter() - began
    scheduler = llm.scheduler
    result = {"tok_s": len(outputs) * max_tokens / seconds, "steps": steps, "outputs": outputs,
              "acceptance": scheduler.accepted_tokens / scheduler.drafted_tokens if scheduler.drafted_tokens else None,
              "tokens_per_verify": 1 + scheduler.accepted_tokens / scheduler.verifications
              if scheduler.verifications else None}
    llm.exit()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    engines = {
        "default": {},
        "sync": {"async_scheduling": False},
        "sync + ngram": {"speculative_method": "ngram"},
        "sync + ngram, eager ops": {"speculative_method": "ngram", "compile_small_ops": False},
    }
    results = {name: measure(settings, args.max_tokens, args.repeats) for name, settings in engines.items()}
    base = results["default"]
    for name, result in results.items():
        rate = "" if result["acceptance"] is None else (
            f", acceptance {result['acceptance']:.0%}, {result['tokens_per_verify']:.2f} tokens per verify")
        print(f"{name:>24}: {result['tok_s']:8.1f} tok/s, {result['steps']:5d} steps, "
              f"{result['tok_s'] / base['tok_s']:.2f}x default, {result['tok_s'] / results['sync']['tok_s']:.2f}x sync"
              f", same tokens as default: {result['outputs'] == base['outputs']}{rate}")
        if result["outputs"] != base["outputs"]:
            # Where each differing output first parts from the default engine's (a near tie decided otherwise).
            parted = [next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
                      for ours, theirs in zip(result["outputs"], base["outputs"], strict=True) if ours != theirs]
            print(f"{'':>24}  {len(parted)} of {len(base['outputs'])} outputs differ, first at tokens {parted}")
    if args.out:
        with open(args.out, "w") as file:
            json.dump({name: {k: v for k, v in r.items() if k != "outputs"} for name, r in results.items()}, file,
                      indent=2)


if __name__ == "__main__":
    main()
