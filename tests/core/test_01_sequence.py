"""Chapter 01: SamplingParams and Sequence."""

from __future__ import annotations

import ast
from pathlib import Path

import jupytext
import numpy as np
import pytest

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

CHAPTER_01 = Path(__file__).resolve().parents[2] / "notebooks" / "01_sequence.py"


# ---- SamplingParams ----------------------------------------------------------------------
def test_defaults_match_nano_vllm() -> None:
    params = SamplingParams()
    assert (params.temperature, params.max_tokens, params.ignore_eos) == (1.0, 64, False)
    assert (params.top_k, params.top_p, params.seed) == (None, 1.0, None)
    assert not params.greedy and SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"temperature": -0.1}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"temperature": "1"}, TypeError, "temperature"),
        ({"temperature": True}, TypeError, "temperature"),
        ({"max_tokens": 0}, ValueError, "max_tokens"),
        ({"max_tokens": -3}, ValueError, "max_tokens"),
        ({"max_tokens": 8.0}, TypeError, "max_tokens"),
        ({"max_tokens": True}, TypeError, "max_tokens"),
        ({"ignore_eos": 1}, TypeError, "ignore_eos"),
        ({"top_k": 0}, ValueError, "top_k"),
        ({"top_k": 2.5}, TypeError, "top_k"),
        ({"top_k": 2**63}, ValueError, r"top_k must be in \[1, 2\*\*63\)"),  # would overflow the GPU's int64
        ({"top_k": 10**30}, ValueError, "top_k"),
        ({"n": np.bool_(True)}, TypeError, "n must be an int, got bool"),
        ({"max_tokens": np.float64(8.0)}, TypeError, "max_tokens must be an int"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": "7"}, TypeError, "seed"),
    ],
)
def test_bad_sampling_params_are_refused_by_name(kwargs: dict, error: type, field: str) -> None:
    with pytest.raises(error, match=field):
        SamplingParams(**kwargs)


def test_numpy_scalars_count_as_the_numbers_they_hold() -> None:
    params = SamplingParams(temperature=np.float32(0.5), max_tokens=np.int64(4), ignore_eos=np.True_,
                            top_k=np.int32(3), top_p=np.float64(0.9), seed=np.uint8(7), n=np.int16(2))
    assert params == SamplingParams(temperature=0.5, max_tokens=4, ignore_eos=True, top_k=3, top_p=0.9, seed=7, n=2)
    # Stored as plain Python values: they pickle to the ranks and print as users expect.
    assert [type(getattr(params, name)) for name in ("temperature", "max_tokens", "ignore_eos", "top_k", "seed")] \
        == [float, int, bool, int, int]


def test_sampling_params_are_immutable() -> None:
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


# ---- Sequence: construction and bad input -------------------------------------------------
@pytest.mark.parametrize(
    ("token_ids", "error", "fragment"),
    [
        ([], ValueError, "empty"),
        ("hello", TypeError, "list of ints"),
        (b"\x01", TypeError, "list of ints"),
        (bytearray(b"\x01"), TypeError, "list of ints"),
        (memoryview(b"\x01"), TypeError, "list of ints"),
        (None, TypeError, "list of ints"),
        ([1, 2.0], TypeError, "position 1"),
        ([1, "2"], TypeError, "position 1"),
        ([True], TypeError, "position 0"),
        ([3, -1], ValueError, "negative"),
    ],
)
def test_bad_prompts_are_refused(token_ids: object, error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        Sequence(token_ids, block_size=4)  # type: ignore[arg-type]


def test_block_size_must_be_explicit() -> None:
    # Its value is checked where it enters, as Config.kvcache_block_size (chapter 10).
    with pytest.raises(TypeError, match="block_size"):
        Sequence([1])  # type: ignore[call-arg]


def test_numpy_token_ids_become_python_ints() -> None:
    seq = Sequence(np.arange(5, dtype=np.int64), block_size=4)
    assert seq.token_ids == [0, 1, 2, 3, 4] and all(type(t) is int for t in seq.token_ids)
    seq.append_token(np.int32(9))
    assert seq.last_token == 9 and type(seq.last_token) is int


def test_ids_are_unique_and_increasing() -> None:
    a, b = Sequence([1], block_size=4), Sequence([1], block_size=4)
    assert b.seq_id > a.seq_id


# ---- counters and block arithmetic -----------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 4, 16, 256])
@pytest.mark.parametrize("length", [1, 3, 4, 5, 16, 17, 300])
def test_block_arithmetic(block_size: int, length: int) -> None:
    seq = Sequence(list(range(length)), block_size=block_size)
    expected_blocks = -(-length // block_size)
    assert seq.num_blocks == expected_blocks
    assert seq.last_block_num_tokens == length - (expected_blocks - 1) * block_size
    assert 1 <= seq.last_block_num_tokens <= block_size
    assert [t for i in range(seq.num_blocks) for t in seq.block(i)] == seq.token_ids
    with pytest.raises(AssertionError):
        seq.block(seq.num_blocks)
    with pytest.raises(AssertionError):
        seq.block(-1)


def test_append_and_completion_bookkeeping() -> None:
    seq = Sequence([5, 6, 7], block_size=2)
    for token in (8, 9):
        seq.append_token(token)
    assert (len(seq), seq.num_tokens, seq.num_prompt_tokens, seq.num_completion_tokens) == (5, 5, 3, 2)
    assert seq.prompt_token_ids == [5, 6, 7] and seq.completion_token_ids == [8, 9]
    assert seq.num_blocks == 3 and seq.last_block_num_tokens == 1
    seq.num_cached_tokens = 4
    assert seq.num_cached_blocks == 2
    seq.num_scheduled_tokens = 1
    assert seq.scheduled_token_ids == [9]
    with pytest.raises(TypeError):
        seq.append_token("10")  # type: ignore[arg-type]


# ---- status -----------------------------------------------------------------------------------
def test_status_follows_the_state_machine() -> None:
    seq = Sequence([1], block_size=4)
    assert seq.status is SequenceStatus.WAITING and not seq.is_finished
    seq.status = SequenceStatus.RUNNING
    seq.status = SequenceStatus.WAITING  # preemption
    seq.status = SequenceStatus.RUNNING
    seq.status = SequenceStatus.FINISHED
    assert seq.is_finished
    for status in (SequenceStatus.WAITING, SequenceStatus.RUNNING):
        with pytest.raises(RuntimeError, match="illegal"):
            seq.status = status


# ---- chapter 01's worked trace against chapter 04's scheduler ----------------------------------
def chapter_01_expected_trace() -> list[tuple]:
    """The table that chapter 01's "Check it" cell asserts its hand-played trace against."""
    for cell in jupytext.read(CHAPTER_01, fmt="py:percent").cells:
        if cell.cell_type != "code" or "expected = [" not in cell.source:
            continue
        for node in ast.parse(cell.source).body:
            if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["expected"]:
                return ast.literal_eval(node.value)
    raise AssertionError("chapter 01 has no `expected = [...]` table any more: update this test")


def counters(seq: Sequence) -> tuple:
    """A row of chapter 01's trace without its label."""
    return (seq.status.name, seq.num_tokens, seq.num_cached_tokens, seq.num_scheduled_tokens,
            seq.num_blocks, seq.last_block_num_tokens)


def test_chapter_01_trace_is_what_the_scheduler_does() -> None:
    # Chapter 01 plays the scheduler by hand: a 10-token prompt, blocks of 4, a budget of 6
    # tokens, sampled tokens 999 (ignored after the partial chunk), 7, 8, 9, 10. Chapter 04's
    # scheduler on the same example must produce every row, the status column included.
    expected = chapter_01_expected_trace()
    sched = Scheduler(num_kvcache_blocks=8, kvcache_block_size=4, max_num_seqs=1, max_num_batched_tokens=6)
    seq = Sequence(list(range(100, 110)), SamplingParams(temperature=0, max_tokens=8), block_size=4)
    rows = [counters(seq)]
    sched.add(seq)
    for sampled in (999, 7, 8, 9, 10):
        seqs, is_prefill = sched.schedule()
        rows.append(counters(seq))
        sched.postprocess(seqs, [sampled], is_prefill)
        rows.append(counters(seq))
    assert rows == [row[1:] for row in expected]
    # The point of contention: a partly prefilled sequence is still WAITING.
    assert [row[1] for row in expected[1:4]] == ["WAITING", "WAITING", "RUNNING"]
