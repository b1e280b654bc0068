"""LLMEngine / LLM: bad input is refused clearly and the engine keeps serving; EOS ids; output order."""

from __future__ import annotations

import io
import json
import pickle
import shutil
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm.book.tiny_models import TINY_VOCAB_SIZE, build_tiny_model
from nanovllm.config import Config, UnknownConfigKeyError
from nanovllm.engine.llm_engine import EngineBusyError, NonFiniteLogitsError
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
        ([bytearray(b"bytes")], GREEDY, TypeError, "got bytearray: decode bytes to a str first"),
        ([memoryview(b"bytes")], GREEDY, TypeError, "got memoryview: decode bytes to a str first"),
        (["fine", "half a pair: \ud83d"], GREEDY, ValueError, r"prompt 1: .*lone surrogate, '\\ud83d' at index 13"),
        ([np.array([[1, 2], [3, 4]])], GREEDY, ValueError, r"prompt 0: a NumPy array prompt must be 1-D.*\(2, 2\)"),
        ([np.array(7)], GREEDY, ValueError, r"must be 1-D.*shape \(\)"),
        ([np.array([1.0, 2.0])], GREEDY, TypeError, "NumPy array prompt must hold integer token ids, got dtype float"),
        ([torch.tensor([[1, 2]])], GREEDY, ValueError, r"torch tensor prompt must be 1-D.*\(1, 2\)"),
        ([torch.tensor([1.0, 2.0])], GREEDY, TypeError, "torch tensor prompt must hold integer token ids"),
        ([torch.tensor([True, False])], GREEDY, TypeError, "got dtype torch.bool"),
        ([np.array([1, -2])], GREEDY, ValueError, "negative"),
        ([torch.tensor([1, TINY_VOCAB_SIZE])], GREEDY, ValueError, "outside the vocabulary"),
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
    from nanovllm.bench.engine import make_workload, run_engine

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


# ---- asynchronous scheduling (chapter 10) ----------------------------------------------------------

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
    # Chapter 16's ranks take pending tokens from their own copy of the previous step's samples.
    assert Config.from_kwargs(tiny, tensor_parallel_size=2, async_scheduling=True, device="cpu").async_scheduling
    assert not Config.from_kwargs(tiny, tensor_parallel_size=2, device="cpu").async_scheduling  # auto: CUDA only


# ---- the edges a new user found (issue 18) ---------------------------------------------------------

def test_token_id_arrays_are_prompts(llm: LLM) -> None:
    ids = [5, 6, 7, 8]
    arrays = [np.array(ids), np.array(ids, dtype=np.int32), np.array(ids, dtype=np.uint16), torch.tensor(ids),
              torch.tensor(ids, dtype=torch.int32), tuple(ids)]
    expected = llm.generate([ids], GREEDY, use_tqdm=False)[0]
    assert llm.generate(arrays, GREEDY, use_tqdm=False) == [expected] * len(arrays)


def test_a_model_directory_without_a_tokenizer_is_refused(tiny: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    model = Path(shutil.copytree(tiny, tmp_path / "no-tokenizer"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    with pytest.raises(ValueError, match=r"has no tokenizer \(none of tokenizer\.json, .*\); copy the tokenizer"):
        LLM(str(model))
    from nanovllm.__main__ import main

    assert main(["hello", "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model directory") and str(model) in err and "Traceback" not in err


def test_a_kv_pool_the_machine_cannot_hold_names_the_setting(tiny: Path) -> None:
    with pytest.raises(ValueError, match=r"KV cache of 1000000000 blocks needs .* GiB.*; lower num_kvcache_blocks"):
        LLM(str(tiny), device="cpu", num_kvcache_blocks=10**9)


@pytest.mark.parametrize("scheduling", [False, True], ids=["sync", "async"])
def test_concurrent_generate_calls_run_one_after_another(tiny: Path, scheduling: bool) -> None:
    llm = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=32, async_scheduling=scheduling)
    batches = [[[3 + t, 10 + i, 20 + t + i] for i in range(3)] for t in range(3)]
    expected = [llm.generate(batch, GREEDY, use_tqdm=False) for batch in batches]
    results: dict[int, list] = {t: [] for t in range(3)}
    errors: list[BaseException] = []

    def client(t: int) -> None:
        try:
            for _ in range(5):
                results[t].append(llm.generate(batches[t], GREEDY, use_tqdm=False))
        except BaseException as error:  # the assertion below shows it
            errors.append(error)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert results == {t: [expected[t]] * 5 for t in range(3)}
    assert llm.is_finished() and len(llm.scheduler.block_manager.free_block_ids) == 32


def test_a_call_from_inside_a_step_is_refused_and_the_engine_keeps_serving(tiny: Path) -> None:
    llm = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=32)
    refused = []

    def observer(event: str, data: dict) -> None:
        if event == "schedule" and not refused:
            with pytest.raises(EngineBusyError, match=r"generate\(\) was called from inside another call"):
                llm.generate([[1, 2]], GREEDY, use_tqdm=False)
            refused.append(event)

    llm.scheduler.observer = observer
    first = llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)
    llm.scheduler.observer = None
    assert refused and first == llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)


def test_a_call_that_lands_between_taking_the_lock_and_beginning_runs_whole(tiny: Path, monkeypatch) -> None:
    """Issue 36, item 7: a signal handler that called generate() right after the outer call took the engine's lock,
    before it marked itself begun, waited for its own thread's lock forever. Here the handler is injected at that
    moment (the Ctrl-C deferral that follows it); the whole exchange runs in a thread that must come back."""
    import nanovllm.engine.llm_engine as llm_engine

    llm = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=32)
    expected = {tuple(prompt): llm.generate([prompt], GREEDY, use_tqdm=False) for prompt in ([3, 4, 5], [1, 2])}
    real_deferral, landed, inner = llm_engine.deferred_interrupt, [], []

    def landing_handler():
        if not landed:  # once: the handler's own call passes here too
            landed.append(True)
            inner.append(llm.generate([[1, 2]], GREEDY, use_tqdm=False))
        return real_deferral()

    monkeypatch.setattr(llm_engine, "deferred_interrupt", landing_handler)
    outer = []
    call = threading.Thread(target=lambda: outer.append(llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)),
                            daemon=True)
    call.start()
    call.join(timeout=60)
    assert not call.is_alive(), "the call and the one that landed inside it deadlocked"
    assert inner == [expected[(1, 2)]] and outer == [expected[(3, 4, 5)]]


def test_a_real_timer_signal_calling_generate_gets_an_answer_or_busy_never_a_hang(tmp_path: Path, tiny: Path) -> None:
    """Issue 36, item 7, with a real SIGALRM: one-shot timers at sub-millisecond offsets whose handler calls
    generate() while the main thread is in generate(); every handler call returns tokens or raises EngineBusyError,
    and the process ends (a deadlock would not)."""
    script = tmp_path / "alarm.py"
    script.write_text(f"""
import random, signal
from nanovllm.engine.llm_engine import EngineBusyError
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams
greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
llm = LLM({str(tiny)!r}, kvcache_block_size=4, num_kvcache_blocks=32)
outcomes = {{"tokens": 0, "busy": 0}}
def handler(signum, frame):
    try:
        llm.generate([[1, 2]], greedy, use_tqdm=False)
        outcomes["tokens"] += 1
    except EngineBusyError:
        outcomes["busy"] += 1
signal.signal(signal.SIGALRM, handler)
random.seed(0)
for _ in range(60):
    signal.setitimer(signal.ITIMER_REAL, random.uniform(0.0001, 0.004))
    llm.generate([[3, 4, 5]], greedy, use_tqdm=False)
    signal.setitimer(signal.ITIMER_REAL, 0)
print(outcomes["tokens"], outcomes["busy"])
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    tokens, busy = map(int, done.stdout.split()[-2:])
    assert tokens + busy > 0  # the handler did run, and each call ended one way or the other


@pytest.mark.parametrize("scheduling", [False, True], ids=["sync", "async"])
def test_generate_shares_its_steps_with_earlier_requests_and_loses_none(tiny: Path, scheduling: bool) -> None:
    """generate() returns its own outputs; what add_request queued before is computed alongside, and step()
    reports it (finished meanwhile or not), n > 1 samples included, with the tokens of a fresh engine."""
    settings = {"kvcache_block_size": 4, "num_kvcache_blocks": 48, "async_scheduling": scheduling}
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    pair = SamplingParams(temperature=1.0, seed=5, max_tokens=4, ignore_eos=True, n=2)
    earlier = [([9, 9, 9], short), ([8, 8], long), ([7, 7, 7, 7], pair)]
    alone = LLM(str(tiny), **settings).generate([p for p, _ in earlier], [s for _, s in earlier], use_tqdm=False)

    llm = LLM(str(tiny), **settings)
    ids = [llm.add_request(prompt, params) for prompt, params in earlier]
    mine = llm.generate([[5, 6]], GREEDY, use_tqdm=False)
    assert mine == LLM(str(tiny), **settings).generate([[5, 6]], GREEDY, use_tqdm=False)
    assert not llm.is_finished()  # the long request still runs, holding its blocks
    reported: dict[int, list[int]] = {}
    while not llm.is_finished():
        reported.update(dict(llm.step()[0]))
    assert reported[ids[0]] == alone[0]["token_ids"] and reported[ids[1]] == alone[1]["token_ids"]
    samples = sorted(tokens for seq_id, tokens in reported.items() if seq_id not in ids[:2])
    assert samples == sorted(o["token_ids"] for o in alone[2]["outputs"])
    assert len(llm.scheduler.block_manager.free_block_ids) == 48


def _poison(llm: LLM, token: int) -> None:
    """Make the embedding of ``token`` NaN: a sequence holding it gets NaN logits, the others do not."""
    with torch.no_grad():
        llm.model_runner.model.model.embed_tokens.weight[token] = float("nan")


@pytest.mark.parametrize("scheduling", [False, True], ids=["sync", "async"])
def test_nan_weights_are_named_instead_of_generating_token_0(tiny: Path, tmp_path: Path, scheduling: bool) -> None:
    model = Path(shutil.copytree(tiny, tmp_path / "nan-weights"))
    weights = load_file(model / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(weights, str(model / "model.safetensors"))
    llm = LLM(str(model), kvcache_block_size=4, num_kvcache_blocks=32, async_scheduling=scheduling)
    with pytest.raises(NonFiniteLogitsError, match=r"prompt 0, 1: the model's logits are NaN or infinite \(the "
                       r"weights hold NaN or inf \(model\.layers\.1\.mlp\.down_proj\.weight\)"):
        llm.generate(["Hello", [1, 2, 3]], GREEDY, use_tqdm=False)
    assert llm.is_finished() and len(llm.scheduler.block_manager.free_block_ids) == 32


@pytest.mark.parametrize("scheduling", [False, True], ids=["sync", "async"])
def test_non_finite_logits_drop_their_request_and_the_engine_keeps_serving(tiny: Path, scheduling: bool) -> None:
    settings = {"kvcache_block_size": 4, "num_kvcache_blocks": 32, "async_scheduling": scheduling}
    clean = LLM(str(tiny), **settings).generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False)
    llm = LLM(str(tiny), **settings)
    _poison(llm, 400)
    with pytest.raises(NonFiniteLogitsError, match=r"^prompt 1: .*\(model\.embed_tokens\.weight\)") as caught:
        llm.generate([[5, 6, 7], [1, 400, 2]], GREEDY, use_tqdm=False)
    assert caught.value.request_ids and llm.is_finished()
    assert llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False) == clean
    # Through add_request and step: the poisoned request is reported once, the others carry on.
    good = llm.add_request([5, 6, 7], GREEDY)
    bad = llm.add_request([400], GREEDY)
    other = llm.add_request([8, 9], GREEDY)
    reported, raised = {}, []
    while not llm.is_finished():
        try:
            reported.update(dict(llm.step()[0]))
        except NonFiniteLogitsError as error:
            raised.append(error.request_ids)
    assert raised == [[bad]]
    assert reported == {good: clean[0]["token_ids"], other: clean[1]["token_ids"]}
    assert len(llm.scheduler.block_manager.free_block_ids) == 32


# ---- issue 22: the progress bar, step() outputs of forked samples ------------------------------------------
class BrokenStderr(io.TextIOBase):
    """A stderr whose reader is gone, as in `python run.py 2>&1 | head`."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_progress_bar_that_cannot_write_does_not_take_the_engine_down(llm: LLM,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    expected = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    monkeypatch.setattr(sys, "stderr", BrokenStderr())
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=True) == expected  # the bar goes silent, the call goes on
    monkeypatch.undo()
    assert llm.is_finished()
    # tqdm's lock is free, and the engine's: a call from another thread, with a bar, returns.
    answers = []
    thread = threading.Thread(target=lambda: answers.append(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=True)))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive() and answers == [expected]


def test_a_progress_bar_that_fails_to_start_takes_only_its_own_requests(llm: LLM,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import nanovllm.engine.llm_engine as llm_engine

    queued = llm.add_request([3, 4, 5], GREEDY)

    def no_bar(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no terminal")

    monkeypatch.setattr(llm_engine, "tqdm", no_bar)
    with pytest.raises(RuntimeError, match="no terminal"):
        llm.generate([[5, 6, 7], [8, 9]], GREEDY)
    monkeypatch.undo()
    assert [seq.request_id for seq in llm.scheduler.waiting] == [queued]  # the failed call's requests are gone
    finished = dict(llm.step()[0])
    while not llm.is_finished():
        finished.update(dict(llm.step()[0]))
    assert list(finished) == [queued]


@pytest.mark.parametrize("scheduling", [False, True], ids=["sync", "async"])
def test_step_outputs_name_the_request_and_sample_of_forked_samples(tiny: Path, scheduling: bool) -> None:
    llm = LLM(str(tiny), kvcache_block_size=4, num_kvcache_blocks=32, async_scheduling=scheduling)
    sampled = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, n=2, seed=1)
    requests = [llm.add_request([5, 6, 7], sampled), llm.add_request([8, 9], sampled)]
    outputs = []
    while not llm.is_finished():
        outputs += llm.step()[0]
    assert sorted((o.request_id, o.sample_index) for o in outputs) == [(r, i) for r in requests for i in (0, 1)]
    for output in outputs:
        seq_id, token_ids = output  # still nano-vllm's pair
        assert len(token_ids) == 4 and (seq_id == output.request_id) == (output.sample_index == 0)
    assert pickle.loads(pickle.dumps(outputs[0])) == outputs[0]
    assert pickle.loads(pickle.dumps(outputs[0])).request_id == outputs[0].request_id
    assert "request_id=" in repr(outputs[0])


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
