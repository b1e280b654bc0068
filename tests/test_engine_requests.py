"""LLMEngine / LLM: bad input is refused clearly and the engine keeps serving; EOS ids; output order."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from nanovllm.config import Config, UnknownConfigKeyError
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.tiny_models import TINY_VOCAB_SIZE, build_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny() -> Path:
    return build_tiny_model("qwen3")


@pytest.fixture(scope="module")
def llm(tiny: Path) -> LLM:
    return LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=32, max_model_len=64)


def test_outputs_come_back_in_prompt_order(llm: LLM) -> None:
    prompts = [[5, 6, 7], "Hello there", [9] * 20]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 2, 5)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [9, 2, 5]
    for output in outputs:
        assert output["text"] == llm.tokenizer.decode(output["token_ids"], skip_special_tokens=True)
    assert llm.generate([], GREEDY) == []


@pytest.mark.parametrize(
    ("prompts", "params", "error", "message"),
    [
        (["ok", ""], GREEDY, ValueError, "prompt 1: prompt is an empty string"),
        ([[1, 2], []], GREEDY, ValueError, "prompt 1: .*empty"),
        ([[1, TINY_VOCAB_SIZE]], GREEDY, ValueError, f"outside the vocabulary \\(size {TINY_VOCAB_SIZE}\\)"),
        ([[1, -3]], GREEDY, ValueError, "negative"),
        ([[1, 2.5]], GREEDY, TypeError, "must be an int"),
        ([[1] * 60], GREEDY, ValueError, "exceeds max_model_len=64"),
        ([[1] * 10], SamplingParams(max_tokens=55), ValueError, "exceeds max_model_len=64"),
        ([[1] * 2], "greedy", TypeError, "SamplingParams"),
        ([[1], [2]], [GREEDY], ValueError, "1 sampling params for 2 prompts"),
        ("a single string", GREEDY, TypeError, "list of prompts"),
        ([b"bytes"], GREEDY, TypeError, "str or a list of token ids"),
    ],
)
def test_bad_requests_are_refused_and_the_engine_keeps_serving(llm: LLM, prompts, params, error, message) -> None:
    pending = llm.add_request([3, 4, 5], GREEDY)  # a request already queued must survive the failure
    with pytest.raises(error, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    assert len(llm.scheduler.waiting) == 1  # nothing of the failed call was queued
    finished = {}
    while not llm.is_finished():
        finished.update(dict(llm.step()[0]))
    assert len(finished[pending]) == GREEDY.max_tokens
    assert len(llm.generate([[7, 8]], GREEDY, use_tqdm=False)[0]["token_ids"]) == GREEDY.max_tokens


def test_a_request_that_can_never_fit_the_pool(tiny: Path) -> None:
    small = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=3)
    with pytest.raises(ValueError, match="can never fit the KV cache"):
        small.generate([[1] * 10], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(small.generate([[1] * 8], SamplingParams(max_tokens=4), use_tqdm=False)[0]["token_ids"]) >= 1


def test_config_errors_surface_through_llm(tiny: Path) -> None:
    with pytest.raises(UnknownConfigKeyError, match="did you mean 'max_num_seqs'"):
        LLM(str(tiny), max_num_seq=4)
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tiny / "missing"))


def test_stops_on_every_declared_eos_id(tiny: Path, tmp_path: Path) -> None:
    prompt = [11, 12, 13, 14]
    free_run = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=16)
    tokens = free_run.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                               use_tqdm=False)[0]["token_ids"]
    stop_at = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    model = tmp_path / "two-eos"
    shutil.copytree(tiny, model)
    generation = json.loads((model / "generation_config.json").read_text()) \
        if (model / "generation_config.json").exists() else {}
    unused = next(t for t in range(TINY_VOCAB_SIZE) if t not in tokens)
    generation["eos_token_id"] = [unused, tokens[stop_at]]  # the second id is the one that shows up
    (model / "generation_config.json").write_text(json.dumps(generation))
    engine = LLM(str(model), kvcache_block_size=4, num_kvcache_blocks=16)
    assert engine.config.eos_token_ids == (unused, tokens[stop_at])
    stopped = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert stopped["token_ids"] == tokens[: stop_at + 1]  # the EOS itself is kept, as in nano-vllm
    ignored = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert ignored[0]["token_ids"] == tokens


def test_seeded_sampling_is_reproducible_across_batches(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, max_tokens=8, seed=1234, ignore_eos=True)
    alone = llm.generate([[21, 22, 23]], seeded, use_tqdm=False)[0]["token_ids"]
    crowd = llm.generate([[5] * 9, [21, 22, 23], [40, 41]], [GREEDY, seeded, GREEDY], use_tqdm=False)
    assert crowd[1]["token_ids"] == alone


def test_cli_generates_with_a_given_model(tiny: Path, capsys: pytest.CaptureFixture) -> None:
    from nanovllm.__main__ import main

    assert main(["generate", "Hello", "Where do fish live?", "--model", str(tiny), "--max-tokens", "3"]) == 0
    printed = capsys.readouterr().out
    assert ">>> Hello" in printed and ">>> Where do fish live?" in printed
    assert main(["hi", "--model", str(tiny / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_engine_side_of_the_benchmark(tiny: Path) -> None:
    from nanovllm.bench import make_workload, run_engine

    workload = make_workload(4, (3, 9), (1, 6), vocab_size=TINY_VOCAB_SIZE, seed=0)
    for scheduling in (False, True):
        breakdown: dict = {}
        result = run_engine(str(tiny), workload, kvcache_block_size=4, num_kvcache_blocks=64,
                            async_scheduling=scheduling, breakdown=breakdown)
        assert result.output_tokens == workload.num_output_tokens and result.seconds > 0
        # One prefill step for the four prompts, then one decode step per token after the first.
        assert breakdown["prefill_steps"] == 1 and breakdown["decode_steps"] == max(workload.output_lens) - 1
        assert 0 < breakdown["prefill"] + breakdown["decode"] <= result.seconds


def _flaky(llm: LLM, fail_on_call: int, error: type[BaseException]) -> None:
    """Make the model runner raise ``error`` on its n-th step (1-based), as an OOM or Ctrl-C would.

    The engine calls ``run`` (synchronous) or ``launch`` (async scheduling): both are wrapped.
    """
    calls = {"n": 0}

    def failing(method):
        def wrapper(*args):
            calls["n"] += 1
            if calls["n"] == fail_on_call:
                raise error("simulated failure inside a step")
            return method(*args)

        return wrapper

    runner = llm.model_runner
    runner.run, runner.launch = failing(runner.run), failing(runner.launch)


@pytest.mark.parametrize("scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fail_on_call", [1, 2, 3, 5])
def test_a_step_that_raises_leaves_the_engine_consistent(tiny: Path, fail_on_call: int, scheduling: bool) -> None:
    """A failed step is undone: calling step() again finishes the work with the same tokens."""
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15] * 7]
    expected = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=32).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=32, max_num_batched_tokens=8,
              async_scheduling=scheduling)
    _flaky(llm, fail_on_call, RuntimeError)
    ids = [llm.add_request(p, GREEDY) for p in prompts]
    done, failures = {}, 0
    while not llm.is_finished():
        try:
            finished, _, _ = llm.step()
        except RuntimeError:
            failures += 1
            continue
        done.update(finished)
    assert failures == 1
    assert [done[i] for i in ids] == [o["token_ids"] for o in expected]
    assert len(llm.scheduler.block_manager.free_block_ids) == 32


@pytest.mark.parametrize("scheduling", [False, True], ids=["sync", "async"])
def test_an_interrupted_generate_drops_its_requests_and_the_engine_keeps_serving(tiny: Path, scheduling: bool) -> None:
    llm = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=32, async_scheduling=scheduling)
    _flaky(llm, 3, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[3, 4, 5, 6, 7], [8, 9]], GREEDY, use_tqdm=False)
    assert llm.is_finished() and len(llm.scheduler.block_manager.free_block_ids) == 32
    fresh = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=32)
    assert llm.generate([[10, 11, 12]], GREEDY, use_tqdm=False) == fresh.generate([[10, 11, 12]], GREEDY,
                                                                                  use_tqdm=False)


# ---- asynchronous scheduling (chapter 11) ----------------------------------------------------------

def _frequent_tokens(tiny: Path, prompts: list[list[int]], regime: dict) -> frozenset[int]:
    """Five tokens the model often generates for these prompts: made EOS ids, they end sequences early."""
    llm = LLM(str(tiny), async_scheduling=False, **regime)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=25, ignore_eos=True), use_tqdm=False)
    return frozenset(t for t, _ in Counter(t for o in outputs for t in o["token_ids"][2:]).most_common(5))


@pytest.mark.parametrize(
    "regime",
    [
        {"kvcache_block_size": 4, "num_kvcache_blocks": 128},
        {"kvcache_block_size": 4, "num_kvcache_blocks": 12},  # preemption
        {"kvcache_block_size": 4, "num_kvcache_blocks": 128, "max_num_batched_tokens": 7},  # chunked prefill
        {"kvcache_block_size": 2, "num_kvcache_blocks": 24, "max_num_batched_tokens": 9, "max_num_seqs": 3,
         "enable_prefix_caching": False},
        {"kvcache_block_size": 8, "num_kvcache_blocks": 32, "max_num_seqs": 1},
    ],
    ids=["plain", "preemption", "chunks", "everything", "one-at-a-time"],
)
def test_async_scheduling_gives_the_same_tokens_and_frees_everything(tiny: Path, regime: dict) -> None:
    """Greedy and seeded requests, sequences ending on EOS mid-batch (after the next step was already
    scheduled), max_tokens of 1: the tokens equal the synchronous engine's, and no block is leaked."""
    prompts = [[3 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate([10, 9, 11, 6, 12, 1, 23, 5])]
    params = [SamplingParams(temperature=0, max_tokens=25), SamplingParams(temperature=1.0, seed=3, max_tokens=25),
              SamplingParams(temperature=0, max_tokens=1), SamplingParams(temperature=0.7, seed=8, max_tokens=9,
                                                                         ignore_eos=True)] * 2
    eos = _frequent_tokens(tiny, prompts, regime)
    outputs, stops = {}, {}
    for scheduling in (False, True):
        llm = LLM(str(tiny), async_scheduling=scheduling, **regime)
        llm.scheduler.eos_token_ids = eos
        outputs[scheduling] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        pool = llm.scheduler.block_manager
        assert llm.is_finished() and llm.in_flight is None
        assert len(pool.free_block_ids) == pool.num_blocks
        ends = zip(outputs[scheduling], params, strict=True)
        stops[scheduling] = sum(o[-1] in eos and len(o) < p.max_tokens for o, p in ends)
    assert outputs[True] == outputs[False]
    assert stops[True] >= 2, "the test needs sequences that stop on EOS before max_tokens"


def test_async_step_reports_the_step_before(tiny: Path) -> None:
    llm = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=32, async_scheduling=True)
    seq_id = llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert llm.step() == ([], 0, True)  # the prefill is queued, nothing is collected yet
    assert llm.in_flight is not None and not llm.is_finished()
    finished, num_tokens, is_prefill = llm.step()  # queues the decode step, collects the prefill
    assert (finished, num_tokens, is_prefill) == ([], 3, True)
    finished, num_tokens, is_prefill = llm.step()  # nothing left to schedule: collects the decode step
    assert [seq_id] == [i for i, _ in finished] and (num_tokens, is_prefill) == (1, False)
    assert llm.is_finished() and len(finished[0][1]) == 2


def test_async_scheduling_is_allowed_with_tensor_parallelism(tiny: Path) -> None:
    # Chapter 10's ranks take pending tokens from their own copy of the previous step's samples.
    assert Config.from_kwargs(tiny, tensor_parallel_size=2, async_scheduling=True, device="cpu").async_scheduling
    assert not Config.from_kwargs(tiny, tensor_parallel_size=2, device="cpu").async_scheduling  # auto: CUDA only
