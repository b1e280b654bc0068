"""Chapter 01: SamplingParams and Sequence."""

from __future__ import annotations

import ast
import copy
import pickle
import subprocess
import sys
from pathlib import Path

import jupytext
import numpy as np
import pytest

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

CHAPTER_01 = Path(__file__).resolve().parent.parent / "notebooks" / "01_sequence.py"


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


# ---- slim pickling ----------------------------------------------------------------------------
def decoding(length: int, block_size: int) -> Sequence:
    seq = Sequence(list(range(length)), SamplingParams(temperature=0.5, seed=3), block_size=block_size)
    seq.status = SequenceStatus.RUNNING
    seq.block_table = list(range(seq.num_blocks))
    seq.num_cached_tokens = length - 1
    seq.num_scheduled_tokens = 1
    return seq


def test_decode_pickle_ships_only_the_last_token_whatever_the_length() -> None:
    short, long = decoding(10, 16), decoding(10_000, 16)
    size_short = len(pickle.dumps(short))
    size_long = len(pickle.dumps(long))
    shipped = pickle.loads(pickle.dumps(long))
    assert shipped.token_ids == [9_999] and shipped.scheduled_token_ids == [9_999]
    assert shipped.last_token == long.last_token
    # Only the block table grows with the length: 625 block ids, not 10,000 tokens.
    assert size_long - size_short < 4 * (long.num_blocks - short.num_blocks) + 64
    assert (shipped.num_tokens, shipped.num_prompt_tokens, shipped.num_cached_tokens) == (10_000, 10_000, 9_999)
    assert shipped.status is SequenceStatus.RUNNING and shipped.seq_id == long.seq_id
    assert shipped.sampling_params is None  # only rank 0 samples


def test_prefill_pickle_ships_uncached_tokens_and_survives_a_second_trip() -> None:
    seq = Sequence(list(range(20)), block_size=8)
    seq.num_cached_tokens = 8  # a prefix-cache hit on the first block
    seq.num_scheduled_tokens = 12
    shipped = pickle.loads(pickle.dumps(seq))
    assert shipped.token_ids == list(range(8, 20)) and shipped.scheduled_token_ids == list(range(8, 20))
    again = pickle.loads(pickle.dumps(shipped))
    assert again.token_ids == list(range(8, 20)) and again.first_token_index == 8


def test_block_size_travels_explicitly_to_another_process() -> None:
    """A fresh interpreter (as a tensor-parallel worker) gets the block size from the pickle."""
    seq = decoding(100, 32)
    program = (
        "import pickle, sys\n"
        "seq = pickle.loads(sys.stdin.buffer.read())\n"
        "print(seq.block_size, seq.num_blocks, seq.last_block_num_tokens, seq.scheduled_token_ids)\n"
    )
    result = subprocess.run([sys.executable, "-c", program], input=pickle.dumps(seq), capture_output=True)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().strip().split(maxsplit=3) == ["32", "4", "4", "[99]"]


def test_copies_are_whole() -> None:
    seq = decoding(50, 16)
    for clone in (copy.copy(seq), copy.deepcopy(seq)):
        assert clone.token_ids == seq.token_ids and clone.token_ids is not seq.token_ids
        assert clone.block_table == seq.block_table and clone.block_table is not seq.block_table
        assert clone.sampling_params == seq.sampling_params and clone.first_token_index == 0
        clone.append_token(1)
        assert len(seq) == 50


# ---- pending tokens (asynchronous scheduling, chapter 10) -------------------------------------
def test_a_pending_token_is_counted_then_filled_in() -> None:
    seq = Sequence([1, 2, 3], block_size=2)
    index = seq.append_pending_token()
    assert index == 3 and len(seq) == 4 and seq.last_token == PENDING_TOKEN and seq.num_blocks == 2
    seq.set_token(3, 9)
    assert seq.completion_token_ids == [9]
    with pytest.raises(AssertionError, match="not pending"):
        seq.set_token(3, 10)  # already filled in


def test_truncate_drops_tokens_past_a_finish_but_never_the_prompt() -> None:
    seq = Sequence([1, 2, 3], block_size=2)
    seq.append_token(7)
    seq.append_pending_token()
    seq.num_cached_tokens = 4
    seq.truncate(4)
    assert seq.token_ids == [1, 2, 3, 7] and seq.num_cached_tokens == 4
    seq.truncate(3)
    assert seq.token_ids == [1, 2, 3] and seq.num_cached_tokens == 3
    for bad in (2, 5):
        with pytest.raises(AssertionError):
            seq.truncate(bad)


def test_a_preempted_sequence_may_finish_while_waiting() -> None:
    seq = Sequence([1], block_size=4)
    seq.status = SequenceStatus.RUNNING
    seq.status = SequenceStatus.WAITING  # preempted while its newest token was being computed
    seq.status = SequenceStatus.FINISHED  # ... which turned out to end it
    assert seq.is_finished


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
