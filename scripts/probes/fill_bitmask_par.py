"""Is llguidance's parallel fill (``fill_next_token_bitmask_par``) faster than filling the rows one by one?

    PYTHONPATH=$PWD python3 scripts/probes/fill_bitmask_par.py [--rows 2 16 256] [--steps 40] [--out FILE.json]

Chapter 29's roster schema (``nanovllm.bench.structured.ROSTER_SCHEMA``), one matcher per row, each a few random
tokens into its own roster. Two identical sets of matchers walk the same tokens step by step: at each step one set
fills its rows one after another (what ``Grammars.fill_row`` does, a matcher's ``unsafe_compute_mask_ptr`` each) and
the other in one call over an ``LLExecutor``'s threads; the bitmasks must be equal. The next token of each row is
drawn among those its mask allows (never end-of-sequence), and both sets read it. Two tokenizers: the tiny model's
byte-level one with Qwen3's 151,936 ids (what ``python -m nanovllm.bench --structured`` runs on a GPU) and SmolLM2's
49,152-token BPE. Per row count: the median microseconds of a step's fill, serial and parallel, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch


def walkers(grammars, rows: int, rng: random.Random):
    """Two lists of ``rows`` matchers of the roster schema, pairwise equal, each a random 0-40 tokens in."""
    from nanovllm.bench.structured import ROSTER_SCHEMA
    from nanovllm.engine.grammars import bitmask_words, fill_bitmask
    from nanovllm.sampling_params import StructuredOutputsParams

    compiled = grammars.compile(StructuredOutputsParams(json=ROSTER_SCHEMA))
    first, second = [], []
    words = torch.empty(1, bitmask_words(grammars.vocab_size), dtype=torch.int32)
    for _ in range(rows):
        matcher = compiled.deep_copy()
        for _ in range(rng.randrange(41)):
            fill_bitmask(matcher, words, 0)
            assert matcher.consume_token(draw(words[0], grammars, rng))
        first.append(matcher)
        second.append(matcher.deep_copy())
    return first, second


def draw(row: torch.Tensor, grammars, rng: random.Random) -> int:
    """A random token that the bitmask ``row`` allows, never an end-of-sequence one."""
    from nanovllm.engine.grammars import allowed_tokens

    allowed = allowed_tokens(row, grammars.vocab_size).nonzero().flatten().tolist()
    choices = [t for t in allowed if t not in grammars.eos_token_ids]
    return rng.choice(choices)


def measure(grammars, rows: int, steps: int, executor, seed: int = 0) -> dict:
    from llguidance.torch import fill_next_token_bitmask_par

    from nanovllm.engine.grammars import bitmask_words, fill_bitmask

    rng = random.Random(seed)
    serial_set, par_set = walkers(grammars, rows, rng)
    words = bitmask_words(grammars.vocab_size)
    serial_mask = torch.full((rows, words), -1, dtype=torch.int32)
    par_mask = torch.full((rows, words), -1, dtype=torch.int32)
    serial_us, par_us = [], []
    pairs = list(zip(par_set, range(rows), strict=True))
    for _ in range(steps):
        start = time.perf_counter()
        for row, matcher in enumerate(serial_set):
            fill_bitmask(matcher, serial_mask, row)
            matcher.is_error()
        serial_us.append(1e6 * (time.perf_counter() - start))
        start = time.perf_counter()
        fill_next_token_bitmask_par(executor, pairs, par_mask)
        for matcher in par_set:
            matcher.is_error()
        par_us.append(1e6 * (time.perf_counter() - start))
        assert torch.equal(serial_mask, par_mask)
        for row in range(rows):
            token = draw(serial_mask[row], grammars, rng)
            assert serial_set[row].consume_token(token) and par_set[row].consume_token(token)
    serial, par = statistics.median(serial_us), statistics.median(par_us)
    return {"rows": rows, "serial_us": serial, "par_us": par, "par_over_serial": par / serial,
            "serial_us_per_row": serial / rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 16, 256])
    parser.add_argument("--steps", type=int, default=40, help="steps timed at each row count (medians reported)")
    parser.add_argument("--threads", type=int, default=None, help="the executor's threads (default: llguidance's)")
    parser.add_argument("--out", help="also write every row to this JSON file")
    args = parser.parse_args()
    from llguidance import LLExecutor

    from nanovllm.book.smollm2 import smollm2_dir
    from nanovllm.book.tiny_models import build_tiny_model
    from nanovllm.config import Config
    from nanovllm.engine.grammars import Grammars

    executor = LLExecutor(args.threads) if args.threads else LLExecutor()
    print(f"{os.cpu_count()} cores, executor threads: {args.threads or 'default'}", flush=True)
    results = []
    models = {"tiny byte-level, 151,936 ids": build_tiny_model("qwen3", vocab_size=151936)}
    try:
        models["SmolLM2, 49,152 ids"] = smollm2_dir()
    # no GGUF on this machine (a GPU machine without network)
    except ImportError as error:
        print(f"SmolLM2 skipped: {error}", flush=True)
    for name, model in models.items():
        grammars = Grammars(Config(str(model), device="cpu"))
        for rows in args.rows:
            row = measure(grammars, rows, args.steps, executor) | {"tokenizer": name, "cores": os.cpu_count()}
            results.append(row)
            print(f"{name}: {rows:4d} rows: serial {row['serial_us']:9.1f} us ({row['serial_us_per_row']:.1f} a row), "
                  f"parallel {row['par_us']:9.1f} us: {row['par_over_serial']:.2f}x", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
