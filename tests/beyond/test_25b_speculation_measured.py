"""Speculative decoding, measured (chapter 25b): the benchmark `python -m nanovllm.bench --speculative` and the
`spec_decode` counters that a speculating server adds to `/metrics`.

The benchmark runs on tiny models on the CPU: the same requests without and with drafts (prompt lookup, a draft
model, several numbers of drafts against one plain run), the outputs compared only where they must match. The
server test streams a speculating server's completion and reads its counters back from `/metrics`.
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.engine.speculative import NgramProposer, Speculator, StepCosts
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams
from tests.beyond.test_25_speculative_decoding import PROMPTS


@pytest.fixture(scope="module")
def tiny():
    # The benchmark's logic is the same whatever the model: chapter 25's tests run every tiny architecture.
    return str(build_tiny_model("qwen3"))


@pytest.fixture(scope="module")
def self_draft(tiny, tmp_path_factory):
    from nanovllm.engine.speculative import write_self_draft

    return str(write_self_draft(tiny, 1, tmp_path_factory.mktemp("draft")))


# ---- the benchmark ----------------------------------------------------------------------------------------------
def test_the_benchmark_compares_a_draft_model_with_plain_decoding(self_draft, tiny, tmp_path, capsys):
    """`python -m nanovllm.bench --speculative --draft-model DIR`: the same requests without and with the draft
    model's drafts, the outputs identical, the acceptance reported."""
    from nanovllm.bench.speculative import main

    out = tmp_path / "speculative.json"
    assert main(["--model", tiny, "--draft-model", self_draft, "--batches", "1", "2", "--max-tokens", "16",
                 "--repeats", "1", "--device", "cpu", "--out", str(out)]) == 0
    assert "with the draft model" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 2]
    assert all(row["proposer"] == "the draft model" and row["identical"] == row["batch"] and row["drafted"] > 0
               for row in rows)


def test_the_benchmark_runs_several_numbers_of_drafts_against_one_plain_run(tiny, tmp_path, capsys):
    """`--num-speculative-tokens 1 3`: one speculating engine per number, each against the same plain run."""
    from nanovllm.bench.speculative import main

    out = tmp_path / "speculative.json"
    assert main(["--model", tiny, "--batches", "1", "--max-tokens", "12", "--num-speculative-tokens", "1", "3",
                 "--repeats", "1", "--device", "cpu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["num_speculative_tokens"] for row in rows] == [1, 3]
    assert rows[0]["plain_tok_s"] == rows[1]["plain_tok_s"] and rows[0]["plain_steps"] == rows[1]["plain_steps"]
    assert all(row["identical"] == 1 for row in rows)
    printed = capsys.readouterr().out
    assert "1 draft:" in printed and "3 drafts:" in printed


def test_the_benchmark_compares_outputs_only_where_they_must_match(tiny, capsys):
    """Greedy or seeded requests must come out the same with and without drafts; unseeded sampled ones differ from
    run to run anyway, so the benchmark does not count them as identical or not."""
    from nanovllm.bench.speculative import compare, print_row

    prompts = [PROMPTS[0]] * 2
    settings = {"device": "cpu", "kvcache_block_size": 4, "num_kvcache_blocks": 64}
    for params, identical in ((SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True), None),
                              (SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, seed=3), 2),
                              (SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), 2)):
        [row] = compare(tiny, prompts, [params] * 2, 2, **settings)
        assert row["identical"] == identical
        print_row(row)
    printed = capsys.readouterr().out
    assert "sampled without a seed, not compared" in printed and printed.count("identical outputs 2/2") == 2


# ---- the server's counters -------------------------------------------------------------------------------------
def test_the_server_streams_speculative_decoding_token_for_token():
    """`python -m nanovllm.serve --speculative-method ngram --num-speculative-tokens 4`: a streamed greedy
    completion (a chunk may carry several tokens) equals the offline engine's without speculation."""
    openai = pytest.importorskip("openai")
    from nanovllm.serve.process import ServerProcess

    tiny = str(build_tiny_model("qwen3"))
    engine = {"device": "cpu", "num_kvcache_blocks": 64, "kvcache_block_size": 16, "max_model_len": 512}
    args = ["--device", "cpu", "--num-kvcache-blocks", "64", "--kvcache-block-size", "16", "--max-model-len", "512",
            "--speculative-method", "ngram", "--num-speculative-tokens", "4"]
    prompt = "one two three four one two three four one two three"
    offline = LLM(tiny, **engine)
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    offline.exit()
    with ServerProcess(["--model", tiny, "--served-model-name", "tiny", *args]) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0, stream=True,
                                           extra_body={"return_token_ids": True})
        chunks = [chunk for chunk in stream if chunk.choices]
        assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == expected["token_ids"]
        assert "".join(c.choices[0].text for c in chunks) == expected["text"]
        # /metrics counts what the stream's verify steps drafted and kept, by position too.
        with urllib.request.urlopen(f"{server.url}/metrics") as response:
            text = response.read().decode()
        values = {m[1]: float(m[2]) for m in re.finditer(r"^(nanovllm:spec_decode\S+) (\S+)$", text, re.MULTILINE)}
        label = '{model_name="tiny"}'
        drafted = values[f"nanovllm:spec_decode_num_draft_tokens_total{label}"]
        accepted = values[f"nanovllm:spec_decode_num_accepted_tokens_total{label}"]
        by_position = [v for k, v in values.items() if "_per_pos_total" in k]
        # (The tiny random model rarely agrees with prompt lookup: chapter 25b checks the counts with replayed drafts.)
        assert 0 <= accepted <= drafted and values[f"nanovllm:spec_decode_num_drafts_total{label}"] > 0
        assert sum(by_position) == accepted and by_position == sorted(by_position, reverse=True)


# ---- the draft budget from measured costs -----------------------------------------------------------------------
def flat_costs(verify_s: float = 1e-3, decode_s: float = 1e-3) -> StepCosts:
    """A GPU's costs at small batches, roughly: every size up to 64 rows costs about the same."""
    sizes = (1, 2, 4, 8, 16, 32, 64)
    return StepCosts(sizes, tuple(decode_s for _ in sizes), tuple(verify_s for _ in sizes))


def test_step_costs_interpolate_between_measured_sizes() -> None:
    costs = StepCosts((1, 4, 8), (1.0, 2.0, 4.0), (1.5, 3.0, 6.0))
    assert costs.decode(4) == 2.0 and costs.verify(1) == 1.5
    assert costs.decode(6) == pytest.approx(3.0) and costs.verify(2) == pytest.approx(2.0)
    assert costs.covers(8) and not costs.covers(9) and not costs.covers(0)
    with pytest.raises(AssertionError, match="no cost measured for 9 rows"):
        costs.verify(9)


def test_without_costs_the_fixed_rule_of_chapter_25_stays() -> None:
    speculator = Speculator(NgramProposer(num_speculative_tokens=7))
    assert speculator.costs is None
    assert [speculator.drafts_per_sequence(b) for b in (1, 4, 5, 6)] == [15, 3, 2, 0]


def test_a_fresh_budget_drafts_where_rows_are_cheap_and_stops_when_nothing_is_kept() -> None:
    speculator = Speculator(NgramProposer(num_speculative_tokens=7))
    speculator.costs = flat_costs(verify_s=1.5e-3)
    # Rows cost nothing up to 64: the budget takes as many drafts as the table covers, at 1 and at 8 sequences
    # (7 drafts: 8 rows; at 8 sequences 64 rows cover 7 drafts too), none at 64 (no bigger graph measured).
    assert speculator.drafts_per_sequence(1) == 7 and speculator.drafts_per_sequence(8) == 7
    assert speculator.drafts_per_sequence(64) == 0
    assert speculator.expected_tokens(2) == pytest.approx(2.0)
    # Asked 40 times at every position, nothing kept: the estimate falls below what a verify step costs.
    speculator.count_asked([7] * 40)
    assert speculator.expected_tokens(7) == pytest.approx(1 + 7 * 1 / 42)
    assert speculator.drafts_per_sequence(1) == 0 and not speculator.wants_drafts([object()])


def test_the_budget_stops_at_the_position_where_drafts_stop_paying() -> None:
    speculator = Speculator(NgramProposer(num_speculative_tokens=7))
    # A verify step costs a decode step plus a tenth of one per row past the first.
    sizes = (1, 2, 4, 8, 16)
    speculator.costs = StepCosts(sizes, (1.0,) * 5, tuple(1.0 + 0.1 * (s - 1) for s in sizes))
    # The first two positions kept 9 times in 10, the later ones never.
    speculator.count_asked([7] * 1000)
    speculator.counts.accepted_by_position = (900, 900, 0, 0, 0, 0, 0)
    assert speculator.drafts_per_sequence(1) == 2
    # Rows linear in cost (a large batch): no number of drafts gives more tokens a second than a decode step.
    speculator.costs = StepCosts(sizes, tuple(float(s) for s in sizes), tuple(float(s) for s in sizes))
    assert speculator.drafts_per_sequence(2) == 0


def test_a_draft_models_steps_count_against_its_drafts() -> None:
    speculator = Speculator(NgramProposer(num_speculative_tokens=4))
    speculator.costs = flat_costs(verify_s=1.2e-3)
    assert speculator.drafts_per_sequence(1) == 4
    speculator.draft_costs = flat_costs(decode_s=1e-3)
    assert speculator.drafts_per_sequence(1) == 0


def test_propose_counts_the_rooms_it_asks_to_fill() -> None:
    from nanovllm.engine.sequence import Sequence

    speculator = Speculator(NgramProposer(num_speculative_tokens=3))
    seqs = [Sequence([5, 6, 7, 5, 6], SamplingParams(max_tokens=10), block_size=4),
            Sequence([1, 2, 3], SamplingParams(max_tokens=10), block_size=4)]
    speculator.costs = flat_costs()
    drafts = speculator.propose(seqs, budget=16)
    assert drafts[0] == [7, 5, 6] and drafts[1] == []
    assert speculator.counts.asked_by_position == (2, 2, 2)


def test_a_cpu_engine_measures_no_costs() -> None:
    llm = LLM(str(build_tiny_model("qwen3")), device="cpu", speculative_method="ngram")
    try:
        assert llm.speculator.costs is None and llm.model_runner.step_costs() is None
    finally:
        llm.exit()


@pytest.mark.gpu
def test_a_gpu_engine_measures_its_steps_and_stays_lossless(tiny) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(tiny, device="cuda", max_num_seqs=16)
    try:
        expected = [out["token_ids"] for out in plain.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        plain.exit()
    llm = LLM(tiny, device="cuda", max_num_seqs=16, speculative_method="ngram")
    try:
        costs = llm.speculator.costs
        assert costs is not None and costs.sizes[0] == 1 and costs.sizes[-1] == 16
        assert all(s > 0 for s in costs.decode_seconds + costs.verify_seconds)
        assert [out["token_ids"] for out in llm.generate(PROMPTS, params, use_tqdm=False)] == expected
    finally:
        llm.exit()


def test_step_costs_time_the_runners_own_decode_and_verify_steps() -> None:
    """The measurement's body on the CPU: a runner whose graph sizes are stood in for (the steps then run eagerly)
    times a decode and a verify step at the powers of two and the largest size, and writes nothing that a later
    request could read (no block is published)."""
    from types import SimpleNamespace

    llm = LLM(str(build_tiny_model("qwen3")), device="cpu", kvcache_block_size=16, num_kvcache_blocks=64)
    try:
        runner = llm.model_runner
        runner.graphs = SimpleNamespace(sizes=[1, 2, 4, 8, 16, 24], covers=lambda rows: False)
        costs = runner.step_costs(context_len=100, repeats=2)
        assert costs.sizes == (1, 2, 4, 8, 16, 24)
        assert all(s > 0 for s in costs.decode_seconds + costs.verify_seconds)
        runner.graphs = None
        # The engine still serves, and its tokens are those of an engine that measured nothing.
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        fresh = LLM(str(build_tiny_model("qwen3")), device="cpu", kvcache_block_size=16, num_kvcache_blocks=64)
        try:
            expected = fresh.generate(PROMPTS, greedy, use_tqdm=False)
        finally:
            fresh.exit()
        assert llm.generate(PROMPTS, greedy, use_tqdm=False) == expected
    finally:
        llm.exit()
