"""LLMEngine / LLM: output order, EOS ids, seeded sampling across batches, the CLI, errors that surface through
`LLM`, and engines built and driven on several threads at once. Bad input, failed and interrupted steps, one call
at a time and non-finite logits are chapter 20's (tests/beyond/test_20_robustness.py)."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from nanovllm.book.tiny_models import TINY_VOCAB_SIZE, build_tiny_model
from nanovllm.config import UnknownConfigKeyError
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


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


# ---- the edges a new user found (issue 18) ---------------------------------------------------------

def test_a_kv_pool_the_machine_cannot_hold_names_the_setting(tiny: Path) -> None:
    with pytest.raises(ValueError, match=r"KV cache of 1000000000 blocks needs .* GiB.*; lower num_kvcache_blocks"):
        LLM(str(tiny), device="cpu", num_kvcache_blocks=10**9)


# ---- issue 22: two engines in one process ------------------------------------------------------------------
def test_two_engines_on_two_threads_each_compute_their_own_tokens(tiny: Path) -> None:
    """The attention context belongs to the thread computing the step: two engines driven at once from two
    threads each give the tokens they give alone (a process-wide context gave wrong tokens or crashed)."""
    engines = [LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=64),
               LLM(str(build_tiny_model("llama")), kvcache_block_size=8, num_kvcache_blocks=32)]
    prompts = [[[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14] * 9]]
    expected = [llm.generate(p, GREEDY, use_tqdm=False) for llm, p in zip(engines, prompts, strict=True)]
    results: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []

    def drive(i: int) -> None:
        try:
            for _ in range(15):
                results[i].append(engines[i].generate(prompts[i], GREEDY, use_tqdm=False))
        except BaseException as error:  # reported below, with the thread's traceback
            errors.append(error)

    threads = [threading.Thread(target=drive, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for i in (0, 1):
        assert results[i] == [expected[i]] * 15


def test_building_engines_concurrently_keeps_each_dtype_and_the_process_default(tiny: Path) -> None:
    dtypes = ["float32", "bfloat16", "float16", "bfloat16"] * 2
    built: dict[int, set] = {}
    barrier = threading.Barrier(len(dtypes))

    def build(i: int) -> None:
        barrier.wait()
        llm = LLM(str(tiny), dtype=dtypes[i], kvcache_block_size=4, num_kvcache_blocks=8, enforce_eager=True)
        built[i] = {param.dtype for param in llm.model_runner.model.parameters()}

    threads = [threading.Thread(target=build, args=(i,)) for i in range(len(dtypes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert built == {i: {getattr(torch, dtype)} for i, dtype in enumerate(dtypes)}
    assert torch.get_default_dtype() == torch.float32  # the process default was never touched
