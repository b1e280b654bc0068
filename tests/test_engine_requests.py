"""LLMEngine / LLM: bad input is refused clearly and the engine keeps serving; EOS ids; output order."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nanovllm.config import UnknownConfigKeyError
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
    result = run_engine(str(tiny), workload, kvcache_block_size=4, num_kvcache_blocks=64)
    assert result.output_tokens == workload.num_output_tokens and result.seconds > 0


def _flaky(llm: LLM, fail_on_call: int, error: type[BaseException]):
    """Make the model runner raise ``error`` on its n-th call (1-based), as an OOM or Ctrl-C would."""
    original, calls = llm.model_runner.run, {"n": 0}

    def run(seqs, is_prefill):
        calls["n"] += 1
        if calls["n"] == fail_on_call:
            raise error("simulated failure inside a step")
        return original(seqs, is_prefill)

    llm.model_runner.run = run
    return original


@pytest.mark.parametrize("fail_on_call", [1, 2, 3, 5])
def test_a_step_that_raises_leaves_the_engine_consistent(tiny: Path, fail_on_call: int) -> None:
    """A failed step is undone: calling step() again finishes the work with the same tokens."""
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15] * 7]
    expected = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=32).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=32, max_num_batched_tokens=8)
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


def test_an_interrupted_generate_drops_its_requests_and_the_engine_keeps_serving(tiny: Path) -> None:
    llm = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=32)
    original = _flaky(llm, 3, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[3, 4, 5, 6, 7], [8, 9]], GREEDY, use_tqdm=False)
    assert llm.is_finished() and len(llm.scheduler.block_manager.free_block_ids) == 32
    llm.model_runner.run = original
    fresh = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=32)
    assert llm.generate([[10, 11, 12]], GREEDY, use_tqdm=False) == fresh.generate([[10, 11, 12]], GREEDY,
                                                                                  use_tqdm=False)
