"""Chapter 23: the serving benchmark, ``python -m nanovllm.bench.serve``: the GPU measurement's model with a word
tokenizer, the client processes' share of the concurrency, and a whole run against a real server and the offline
engine (TTFT, TPOT, ITL next to the server's decode steps)."""

from __future__ import annotations

import json

import pytest

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams
from tests.beyond.test_21_serving import ARGS, ENGINE


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(build_tiny_model("qwen3"))


def test_word_tokenizer_knows_every_id_of_the_model(tiny, tmp_path):
    """The GPU measurement's model (bench.serve.qwen3_06b_served) on tiny shapes: a vocabulary of 1,000 ids, the
    tokenizer written from code. Random ids (specials included) survive decode then encode, and every generated id
    comes out of the engine as a word of its own, so each one makes a chunk of a stream."""
    import random

    from transformers import AutoTokenizer

    from nanovllm.bench.serve import with_word_tokenizer

    model = with_word_tokenizer(build_tiny_model("qwen3", vocab_size=1000), tmp_path / "served")
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert len(tokenizer) == 1000 and tokenizer.eos_token_id == AutoTokenizer.from_pretrained(tiny).eos_token_id
    ids = [random.Random(0).randrange(1000) for _ in range(300)] + [0, 1, 2]
    assert tokenizer.encode(tokenizer.decode(ids)) == ids
    llm = LLM(str(model), **ENGINE)
    try:
        out = llm.generate(["t5 t6 t7"], SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=1),
                           use_tqdm=False)[0]
    finally:
        llm.exit()
    words = [i for i in out["token_ids"] if i not in tokenizer.all_special_ids]
    assert out["text"].split() == [f"t{i}" if i != tokenizer.unk_token_id else "<unk>" for i in words]
    assert max(out["token_ids"]) >= 512  # ids that the tiny model's own tokenizer (512 tokens) cannot decode


def test_bench_serve_offline_and_decode_step_and_a_peer_that_fails(tiny, tmp_path, monkeypatch, capsys):
    """`python -m nanovllm.bench.serve --offline --max-concurrency 2 --client-processes 2`: the two client processes
    sent every prompt, the offline engine got the prompts the server got and made the same tokens, and the server's
    decode steps of that run sit next to the streams' ITL.

    Issue 61, item 5, in the same run (one server started for both): with --launch both, a `transformers serve` peer
    that did not run made the command exit 1 with no message, losing our server's figures. Now the peer's error is
    printed and kept in the report, and ours is reported."""
    import sys

    from nanovllm.bench import serve

    monkeypatch.setattr(serve, "transformers_command",
                        lambda *args: [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"])
    out = tmp_path / "serve.json"
    assert serve.main(["--model", tiny, "--num-prompts", "4", "--input-len", "8", "16", "--output-len", "6", "12",
                       "--max-concurrency", "2", "--client-processes", "2", "--offline", "--launch", "both",
                       "--out", str(out), "--", *ARGS[2:]]) == 0
    report = json.loads(out.read_text())
    assert [server["name"] for server in report["servers"]] == ["nano-vllm"]
    assert "exited with status 3" in report["peer_error"] and "no such model" in report["peer_error"]
    assert "(the peer) failed" in capsys.readouterr().err
    served, offline = report["servers"][0], report["offline"]
    assert served["completed"] == 4 and served["failed"] == 0
    assert served["input_tokens"] == offline["input_tokens"] and served["output_tokens"] == offline["output_tokens"]
    assert offline["max_num_seqs"] == 2 and offline["breakdown"]["decode_steps"] > 0
    decode = served["engine_steps"]["decode"]
    assert decode["steps"] >= max(6, served["output_tokens"] / 2 - 4) and decode["mean_ms"] > 0
    assert set(report["ratios"]) == {"served_over_offline", "itl_p50_over_decode_step",
                                     "itl_p50_over_offline_decode_step"}


def test_client_processes_share_the_concurrency_exactly():
    from nanovllm.bench.serve import split_concurrency

    assert split_concurrency(5, 4) == [2, 1, 1, 1] and split_concurrency(16, 4) == [4] * 4
    assert split_concurrency(None, 3) == [None] * 3
    with pytest.raises(ValueError, match="3 client processes for at most 2 requests"):
        split_concurrency(2, 3)

