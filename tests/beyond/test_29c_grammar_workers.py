"""Grammar workers (chapter 29c): the worker processes' masks against chapter 29's in-process ones, step after step;
the scratch path, failures, forgotten sequences, a dead worker, stopping; the fill in two halves and the sampling
queued later (LaterTokens, begin_step); the setting; the engine's outputs with and without workers (on a CPU, the
eager path; on a GPU, the captured one, whose buffers are shared segments and whose sampling is queued later)."""

from __future__ import annotations

import gc
import glob
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from nanovllm.config import Config
from nanovllm.engine.grammar_workers import WorkerGrammars
from nanovllm.engine.grammars import Grammars, allowed_tokens, bitmask_words
from nanovllm.engine.model_runner import LaterTokens, SampledTokens
from nanovllm.engine.sequence import Sequence
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams
from tests.speed.test_17b_tp_across_machines import parent_of

SHAPE = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "size": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["color", "size"], "additionalProperties": False}
ROSTER = {"type": "array", "minItems": 4,
          "items": {"type": "object", "required": ["name", "age"], "additionalProperties": False,
                    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}}}}
WORD = StructuredOutputsParams(regex=r"[a-z]{3,8}( [0-9]{1,3})?")


def decoding(count: int, schema: dict = ROSTER) -> list[Sequence]:
    params = SamplingParams(temperature=1.0, max_tokens=500, structured_outputs=StructuredOutputsParams(json=schema))
    seqs = [Sequence([1, 2, 3], params, block_size=16) for _ in range(count)]
    for seq in seqs:
        seq.num_cached_tokens = len(seq)
    return seqs


def plain_sequence() -> Sequence:
    """An unconstrained sequence beside those of `decoding`, its prompt cached: its row allows every token."""
    seq = Sequence([1, 2, 3], SamplingParams(temperature=1.0, max_tokens=50), block_size=16)
    seq.num_cached_tokens = len(seq)
    return seq


def append(seqs: list[Sequence], tokens: list[int]) -> None:
    for seq, token in zip(seqs, tokens, strict=True):
        seq.append_token(token)
        seq.num_cached_tokens = len(seq)


def draws(grammars: Grammars, bitmask: torch.Tensor, rng: random.Random) -> list[int]:
    """A random allowed token per row, never an end of sequence."""
    allowed = allowed_tokens(bitmask, grammars.vocab_size)
    return [rng.choice([t for t in row.nonzero().flatten().tolist() if t not in grammars.eos_token_ids])
            for row in allowed]


def test_workers_write_chapter_29s_masks_step_after_step(tiny: Path):
    """Two workers and chapter 29's Grammars, the same 12 sequences walking the same random tokens (one of them
    plain, whose row allows everything): equal bitmasks at every step, into a shared segment and into a bitmask that
    lies in none (the scratch segment's path)."""
    config = Config(str(tiny), device="cpu", grammar_workers=2)
    here, there = Grammars(config), WorkerGrammars(config)
    try:
        ours, theirs = decoding(12), decoding(12)
        ours[5], theirs[5] = plain_sequence(), plain_sequence()
        shared = there.host_bitmasks(12, copies=1, pinned=False)[0]
        elsewhere = torch.zeros(12, bitmask_words(here.vocab_size), dtype=torch.int32)
        mask = torch.empty_like(elsewhere)
        rng = random.Random(0)
        for step in range(10):
            here.fill(ours, mask)
            there.fill(theirs, shared if step % 2 else elsewhere)
            assert torch.equal(mask, shared if step % 2 else elsewhere), step
            assert torch.equal(mask[5], torch.full_like(mask[5], -1))
            tokens = draws(here, mask, rng)
            append(ours, tokens)
            append(theirs, tokens)
        assert there.workers.locate(shared) == (0, 0) and there.workers.locate(elsewhere) is None
        assert there.workers.locate(shared[3:]) == (0, 3)
    finally:
        there.workers.close()


def test_the_host_works_while_the_workers_fill_and_one_fill_goes_at_a_time(tiny: Path):
    """start_fill returns before the rows are written, the host sleeps (its rest of a step), finish_fill collects
    them: chapter 29's masks, step after step. While a fill is out, no other message goes; in process, start_fill is
    the whole fill."""
    config = Config(str(tiny), device="cpu", grammar_workers=2)
    here, there = Grammars(config), WorkerGrammars(config)
    try:
        ours, theirs = decoding(8), decoding(8)
        shared = there.host_bitmasks(8, copies=1, pinned=False)[0]
        mask = torch.empty(8, bitmask_words(here.vocab_size), dtype=torch.int32)
        rng = random.Random(1)
        for step in range(6):
            mask.fill_(0)
            here.start_fill(ours, mask)
            assert not torch.equal(mask, torch.zeros_like(mask))
            here.finish_fill()
            there.start_fill(theirs, shared)
            with pytest.raises(RuntimeError, match="still in progress"):
                there.workers.held()
            with pytest.raises(RuntimeError, match="still in progress"):
                there.start_fill(theirs, shared)
            time.sleep(0.002)
            there.finish_fill()
            assert torch.equal(mask, shared), step
            tokens = draws(here, mask, rng)
            append(ours, tokens)
            append(theirs, tokens)
        with pytest.raises(RuntimeError, match="no fill to finish"):
            there.finish_fill()
        with pytest.raises(RuntimeError, match="no fill to finish"):
            there.workers.finish_fill()
        assert there.workers.held() == [4, 4]
    finally:
        there.workers.close()


def test_the_usual_decode_step_reads_the_step_in_flights_samples_by_row(tiny: Path):
    """Under asynchronous scheduling (each new token pending, the step in flight's samples at hand): while a step
    holds the sequences of the last fill in the same order (one of them plain), start_fill takes each row's sample
    without looking the sequences up; a sequence gone, the order changed, drafts checked, a grammar failed, or a step
    in flight other than the one filled last each take chapter 29's road once. The masks equal chapter 29's in process
    at every step."""
    config = Config(str(tiny), device="cpu", grammar_workers=2)
    here, there = Grammars(config), WorkerGrammars(config)
    looked_up = []
    jobs = there.jobs
    there.jobs = lambda *args: looked_up.append(len(looked_up)) or jobs(*args)

    def postprocess(seqs: list[Sequence], previous: SampledTokens, pending: dict[int, int]) -> None:
        """The engine's postprocess of the step in flight: each of ``seqs``' pending tokens set to its sample."""
        for seq in seqs:
            seq.set_token(pending[seq.seq_id], previous.token_ids()[previous.seqs.index(seq)])

    try:
        ours, theirs = decoding(8), decoding(8)
        ours[5], theirs[5] = plain_sequence(), plain_sequence()
        shared = there.host_bitmasks(8, copies=1, pinned=False)[0]
        mask = torch.empty(8, bitmask_words(here.vocab_size), dtype=torch.int32)
        rng, previous, pending = random.Random(2), None, []
        roads = []
        for step in range(12):
            if step == 3:  # a sequence finished
                ours, theirs = ours[1:], theirs[1:]
            if step == 5:  # the same sequences in another order
                ours, theirs = ours[::-1], theirs[::-1]
            if step == 7:  # a speculator's drafts checked (none cut: empty drafts but one)
                here.fill(ours, mask[: len(ours)])
                first = draws(here, mask[:1], rng)[0]
                drafts = [[first]] + [[] for _ in ours[1:]]
                # the checks read every token, as at a verify step's proposal: none pending
                postprocess(theirs, previous, pending)
                pending, previous = {}, None
                assert there.cut_drafts(theirs, drafts) == here.cut_drafts(ours, drafts)
                assert there.repeatable is None
            before = len(looked_up)
            here.fill(ours, mask[: len(ours)])
            step_seqs = list(theirs)
            there.fill(step_seqs, shared[: len(theirs)], previous)
            roads.append("looked up" if len(looked_up) > before else "by row")
            assert torch.equal(mask[: len(ours)], shared[: len(theirs)]), step
            if previous is not None:  # after the next step's fill, as the engine does
                postprocess(theirs, previous, pending)
            # a failed grammar allows only the end of its sequence, which draws never picks
            tokens = ([here.eos_token_ids[0]] if step > 8 else []) + draws(here, mask[int(step > 8) : len(ours)], rng)
            if step == 8:  # a token the first sequence's grammar refuses: it fails in its worker
                tokens[0] = int((~allowed_tokens(mask[0], here.vocab_size)).nonzero()[0])
            append(ours, tokens)
            pending = {seq.seq_id: seq.append_pending_token() for seq in theirs}
            sampled = torch.tensor(tokens)
            previous = SampledTokens(step_seqs, list(range(len(theirs))), sampled, sampled,
                                     [(seq.request_id, seq.sample_index) for seq in theirs])
        assert roads == ["looked up", "by row", "by row", "looked up", "by row", "looked up", "by row",
                         "looked up", "by row", "by row", "looked up", "by row"]
        assert there.matchers[theirs[0]].error is not None and torch.equal(shared[0], there.end_of_sequence)
        plain_row = theirs.index(next(seq for seq in theirs if seq.sampling_params.structured_outputs is None))
        assert torch.equal(shared[plain_row], torch.full_like(shared[plain_row], -1))
        # a step in flight that is not the one filled last (here: a copy of it) is looked up too
        postprocess(theirs, previous, pending)
        assert there.usual_step_tokens(list(theirs), SampledTokens(list(previous.seqs), previous.rows,
                                                                   previous.on_device, previous.on_host,
                                                                   previous.samples)) is None
    finally:
        there.workers.close()


def test_later_tokens_queue_their_sampling_once_when_first_needed(tiny: Path):
    """Nothing is drawn until the tokens are read; write_pending, token_ids and the runner's begin_step settle them,
    once; a draw that raises leaves them unsettled, and the next read tries again."""
    seqs = decoding(3)
    calls = []

    def draw() -> torch.Tensor:
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("grammar worker 1 is gone")
        return torch.tensor([7, 8, 9])

    later = LaterTokens.later(seqs, [0, 1, 2], draw)
    assert calls == []
    with pytest.raises(RuntimeError, match="gone"):
        later.token_ids()
    ids = torch.tensor([4, 5, 6])
    later.write_pending(seqs, ids)
    assert calls == [0, 1] and ids.tolist() == [4, 5, 6]  # no token was pending: the ids stay
    assert later.token_ids() == [7, 8, 9] and later.samples == [(s.request_id, s.sample_index) for s in seqs]
    assert calls == [0, 1]
    with LLM(str(tiny), device="cpu", max_model_len=64) as llm:
        waiting = LaterTokens.later(seqs, [0, 1, 2], lambda: torch.tensor([1, 2, 3]))
        assert llm.model_runner.begin_step([], waiting) is False
        assert waiting.draw is None and waiting.token_ids() == [1, 2, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bitmask_kernel_clears_what_chapter_29s_forbid_clears(dtype: torch.dtype):
    """triton_forbid (compiled on a GPU, interpreted on a CPU) against chapter 29's table, on vocabularies that end
    inside a word or at one, rows of a larger buffer, a row allowing everything and one allowing nothing; forbid
    itself takes the kernel on a GPU. Bad shapes, dtypes and layouts are refused."""
    from nanovllm.engine.grammars import _forbidden_bits, forbid
    from nanovllm.layers.triton_bitmask import triton_forbid

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 33, 70, 1000, 5000):
        buffer = torch.randint(-(2**31), 2**31 - 1, (7, bitmask_words(vocab)), dtype=torch.int32, generator=generator)
        buffer[0], buffer[1] = -1, 0
        logits = torch.randn(5, vocab, generator=generator).to(dtype)
        expected = logits.clone()
        forbidden = _forbidden_bits(torch.device("cpu"))[buffer[:5].view(torch.uint8).int()]
        expected.masked_fill_(forbidden.flatten(1)[:, :vocab], float("-inf"))
        by_kernel, by_forbid = logits.to(device), logits.to(device)
        triton_forbid(by_kernel, buffer.to(device)[:5])
        forbid(by_forbid, buffer.to(device)[:5])
        assert torch.equal(by_kernel.cpu(), expected) and torch.equal(by_forbid.cpu(), expected), vocab
    logits, bitmask = torch.zeros(2, 64, device=device), torch.zeros(2, 2, dtype=torch.int32, device=device)
    for bad_logits, bad_bitmask, message in [(logits, bitmask[:, :1], "at least 64 bits"),
                                             (logits, bitmask.float(), "must be int32"),
                                             (logits, bitmask[:1], r"\[n, words\] expected"),
                                             (logits[:, ::2], bitmask, "adjacent columns")]:
        with pytest.raises(ValueError, match=message):
            triton_forbid(bad_logits, bad_bitmask)
    triton_forbid(logits[:0], bitmask[:0])  # no rows: nothing to launch


def test_a_refused_token_fails_its_sequence_with_llguidances_reason(tiny: Path):
    """A token the grammar refuses: the sequence fails with llguidance's words, its row allows only its end, its
    worker forgets it, and the next step writes that row in this process without asking a worker."""
    config = Config(str(tiny), device="cpu", grammar_workers=2)
    grammars = WorkerGrammars(config)
    try:
        seqs = decoding(3)
        rows = grammars.host_bitmasks(3, copies=1, pinned=False)[0]
        grammars.fill(seqs, rows)
        refused = int((~allowed_tokens(rows[1], grammars.vocab_size)).nonzero()[0])
        first, last = draws(grammars, rows[:1], random.Random(0))[0], draws(grammars, rows[2:], random.Random(1))[0]
        append(seqs, [first, refused, last])
        grammars.fill(seqs, rows)
        state = grammars.matchers[seqs[1]]
        assert state.error is not None and "doesn't satisfy the grammar" in state.error
        assert torch.equal(rows[1], grammars.end_of_sequence)
        assert grammars.matchers[seqs[0]].error is None and grammars.matchers[seqs[2]].error is None
        assert seqs[1].seq_id not in grammars.placed and sorted(grammars.workers.held()) in ([1, 1], [0, 2])
        first, last = draws(grammars, rows[:1], random.Random(2))[0], draws(grammars, rows[2:], random.Random(3))[0]
        append(seqs, [first, 5, last])
        grammars.fill(seqs, rows)
        assert torch.equal(rows[1], grammars.end_of_sequence) and sum(grammars.workers.held()) == 2
    finally:
        grammars.workers.close()


def test_sequences_let_go_are_forgotten_by_their_workers(tiny: Path):
    """Matchers live as long as their sequences: once the engine lets a sequence go, its worker drops its matcher
    with its next message."""
    config = Config(str(tiny), device="cpu", grammar_workers=3)
    grammars = WorkerGrammars(config)
    try:
        seqs = decoding(9)
        grammars.fill(seqs, grammars.host_bitmasks(9, copies=1, pinned=False)[0])
        assert grammars.workers.held() == [3, 3, 3]
        del seqs[:4]
        gc.collect()
        assert sum(grammars.workers.held()) == 5 and len(grammars.placed) == 5
    finally:
        grammars.workers.close()


def test_a_dead_worker_raises_in_the_engine_and_stopping_leaves_nothing_behind(tiny: Path):
    """A worker killed mid-run: the next fill raises a RuntimeError naming it. Closing stops the others, and no
    shared segment's file remains (each is unlinked as soon as every worker mapped it)."""
    before = set(glob.glob("/dev/shm/nanovllm-bitmask-*"))
    config = Config(str(tiny), device="cpu", grammar_workers=2)
    grammars = WorkerGrammars(config)
    workers = grammars.workers
    rows = grammars.host_bitmasks(4, copies=1, pinned=False)[0]
    assert set(glob.glob("/dev/shm/nanovllm-bitmask-*")) == before
    # a session of its own: a terminal's Ctrl-C, sent to the engine's process group, never reaches a worker
    assert all(os.getpgid(process.pid) != os.getpgid(0) for process in workers.processes)
    workers.processes[1].send_signal(signal.SIGKILL)
    workers.processes[1].wait()
    seqs = decoding(4)
    with pytest.raises(RuntimeError, match="grammar worker 1 is gone"):
        grammars.fill(seqs, rows)
    workers.close()
    assert [process.poll() for process in workers.processes] == [0, -signal.SIGKILL]


def test_a_worker_answers_an_unknown_request_with_an_error(tiny: Path):
    """A request outside REQUESTS is refused in the worker's words, and the worker goes on answering."""
    grammars = WorkerGrammars(Config(str(tiny), device="cpu", grammar_workers=1))
    workers = grammars.workers
    try:
        workers.connections[0].send(("exec", "print('no')"))
        with pytest.raises(RuntimeError, match="grammar worker 0: ValueError: unknown request 'exec'"):
            workers._replies([0])
        assert workers.held() == [0]
    finally:
        workers.close()


def verify_step(seq_drafts: list[tuple[Sequence, list[int]]]) -> list[Sequence]:
    """The sequences of a verify step, each with its drafts appended and scheduled after its last token."""
    for seq, drafts in seq_drafts:
        for token in drafts:
            seq.append_token(token)
        seq.num_cached_tokens = len(seq) - len(drafts) - 1
        seq.num_scheduled_tokens, seq.num_draft_tokens = len(drafts) + 1, len(drafts)
    return [seq for seq, _ in seq_drafts]


def test_the_workers_cut_and_mask_a_verify_steps_drafts_as_chapter_29_does(tiny: Path):
    """Six constrained sequences and a plain one, a few steps in: drafts the grammar takes, then one it refuses, then
    an end of sequence for one of them. The workers' cut drafts, masked logits and refused-draft counts equal chapter
    29's in-process ones; the matchers do not keep the drafts (the next fill's masks still agree)."""
    config = Config(str(tiny), device="cpu", grammar_workers=2)
    here, there = Grammars(config), WorkerGrammars(config)
    try:
        ours, theirs = decoding(6), decoding(6)
        ours.append(plain_sequence())
        theirs.append(plain_sequence())
        mask = torch.empty(7, bitmask_words(here.vocab_size), dtype=torch.int32)
        rng = random.Random(3)
        for _ in range(3):
            here.fill(ours, mask)
            tokens = draws(here, mask, rng)
            append(ours, tokens)
            append(theirs, tokens)
        here.fill(ours, mask)
        allowed = draws(here, mask, rng)
        # the plain row allows every token: its "refused" draft is just another token
        refused = [int((~allowed_tokens(mask[row], here.vocab_size)).nonzero()[0]) for row in range(6)] + [allowed[6]]
        drafts = [[allowed[row], refused[row], allowed[row]] for row in range(7)]
        drafts[2] = [allowed[2], here.eos_token_ids[0]]
        assert there.cut_drafts(theirs, drafts) == here.cut_drafts(ours, drafts)
        assert there.refused_drafts == here.refused_drafts > 0
        logits = {name: torch.randn(sum(len(d) + 1 for d in drafts), here.vocab_size, generator=torch.Generator()
                                    .manual_seed(0)) for name in ("here", "there")}
        here.mask_drafts(verify_step(list(zip(ours, drafts, strict=True))), logits["here"])
        there.mask_drafts(verify_step(list(zip(theirs, drafts, strict=True))), logits["there"])
        assert torch.equal(logits["here"], logits["there"]) and not torch.isfinite(logits["here"]).all()
        assert there.refused_drafts == here.refused_drafts
        for seq in [*ours, *theirs]:
            del seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens :]
            seq.num_tokens -= seq.num_draft_tokens
            seq.num_draft_tokens, seq.num_cached_tokens, seq.num_scheduled_tokens = 0, len(seq), 0
        shared = there.host_bitmasks(7, copies=1, pinned=False)[0]
        here.fill(ours, mask)
        there.fill(theirs, shared)
        assert torch.equal(mask, shared)
    finally:
        there.workers.close()


@pytest.mark.parametrize("cut", [True, False], ids=["drafts cut", "drafts masked"])
def test_speculation_with_grammar_workers_writes_the_outputs_in_process(tiny: Path, monkeypatch, cut: bool):
    """Prompt lookup's drafts on constrained requests (greedy, and seeded with n = 2): the workers cut the drafts their
    grammars refuse, or, with cutting off, mask the verify rows after them; the outputs equal those of chapter 29's
    matchers in process, speculating too."""
    from tests.beyond.test_29_structured_output import speculate

    if not cut:
        monkeypatch.setattr(WorkerGrammars, "cut_drafts", lambda self, seqs, drafts: drafts)
    expected, *_ = speculate(tiny)
    outputs, counts, _, grammars = speculate(tiny, grammar_workers=2)
    try:
        assert isinstance(grammars, WorkerGrammars) and outputs == expected
        assert grammars.refused_drafts > 0 and counts["verified"] > counts["kept"] > 0
    finally:
        grammars.workers.close()


def test_the_setting(tiny: Path, monkeypatch):
    """Left out: 4 on a GPU whose process may use 8 cores or more, else 0 (on a CPU always); a number is kept, beside a
    speculative method too; negative numbers and non-numbers are refused with the setting's name; the command line
    offers it as --grammar-workers, left out by default."""
    from nanovllm import config as config_module
    from nanovllm.serve.cli import build_parser, engine_settings

    assert Config(str(tiny), device="cpu").grammar_workers == 0
    assert Config(str(tiny), device="cpu", grammar_workers=None).grammar_workers == 0
    for cores, workers in ((16, 4), (8, 4), (7, 0), (2, 0)):
        monkeypatch.setattr(config_module.os, "sched_getaffinity", lambda pid, cores=cores: set(range(cores)))
        assert config_module.default_grammar_workers("cuda") == workers, cores
        assert config_module.default_grammar_workers("cpu") == 0
    assert Config(str(tiny), device="cpu", grammar_workers=3).grammar_workers == 3
    with pytest.raises(ValueError, match="grammar_workers"):
        Config(str(tiny), device="cpu", grammar_workers=-1)
    with pytest.raises((ValueError, TypeError), match="grammar_workers"):
        Config(str(tiny), device="cpu", grammar_workers="four")
    assert Config(str(tiny), device="cpu", grammar_workers=2, speculative_method="ngram").grammar_workers == 2
    assert engine_settings(build_parser().parse_args(["--grammar-workers", "4"]))["grammar_workers"] == 4
    assert engine_settings(build_parser().parse_args([]))["grammar_workers"] is None


def test_the_engine_writes_the_same_with_grammar_workers(tiny: Path):
    """Greedy JSON for three prompts, a plain request beside them, and a seeded regex with n = 2: token for token
    the outputs of chapter 29's in-process matchers; the runner's grammars are WorkerGrammars only with workers, whose
    processes the engine's exit stops."""
    prompts = [[5, 20, 30], [6, 20], [7, 20, 30, 40], [8, 20]]
    shape = SamplingParams(temperature=0, max_tokens=32, structured_outputs=StructuredOutputsParams(json=SHAPE))
    params = [shape] * 3 + [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)]
    seeded = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=12, structured_outputs=WORD)
    outputs = {}
    for count in (0, 2):
        with LLM(str(tiny), device="cpu", grammar_workers=count, max_model_len=256) as llm:
            assert isinstance(llm.model_runner.grammars, WorkerGrammars) == bool(count)
            outputs[count] = (llm.generate(prompts, params, use_tqdm=False),
                              llm.generate([[9, 20]], seeded, use_tqdm=False))
        if count:
            processes = llm.model_runner.grammars.workers.processes
            assert len(processes) == 2 and all(process.poll() is not None for process in processes)
    assert outputs[0] == outputs[2]


@pytest.mark.gpu
def test_gpu_captured_steps_sample_under_the_workers_rows(tiny: Path, monkeypatch):
    """On a GPU the captured sampler's host buffers are the workers' shared segments, pinned; the constrained greedy
    tokens equal those of the matchers in process, with asynchronous scheduling; the captured steps' sampling is
    queued later (LaterTokens), both ways."""
    prompts = [[5, 20, 30], [6, 20], [7, 20, 30, 40], [8, 20]]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SHAPE)),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs=WORD),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SHAPE))]
    tokens, settled = {}, []
    settle = LaterTokens.settle
    monkeypatch.setattr(LaterTokens, "settle", lambda self: (settled.append(self.draw is not None), settle(self)))
    for count in (0, 2):
        with LLM(str(tiny), dtype="float32", grammar_workers=count, kvcache_block_size=16, num_kvcache_blocks=64,
                 max_model_len=256, max_num_seqs=8) as llm:
            tokens[count] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
            masked = llm.model_runner.masked_sampling
            assert masked is not None
            if count:
                workers = llm.model_runner.grammars.workers
                assert all(workers.locate(host) is not None and host.is_pinned() for host in masked.hosts)
                workers.close()
    assert tokens[0] == tokens[2]
    # the captured constrained steps were sampled later, about 40 of them a run, in both runs
    assert settled.count(True) >= 60


def test_two_ranks_with_grammar_workers_write_the_outputs_of_one(tiny: Path):
    """Under tensor parallelism rank 0 (a daemon process, which multiprocessing would refuse children) starts the
    workers; with preemption in a cramped cache, two ranks with two workers write what one engine without them does."""
    prompts = [[5, 20, 30], [6, 20], [7, 20, 30, 40]]
    params = [SamplingParams(temperature=0, max_tokens=32, structured_outputs=StructuredOutputsParams(json=ROSTER)),
              SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=16, structured_outputs=WORD),
              SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)]
    with LLM(str(tiny), device="cpu", max_model_len=64) as one_rank:
        one = [output["token_ids"] for output in one_rank.generate(prompts, params, use_tqdm=False)]
    preempted = []
    with LLM(str(tiny), device="cpu", tensor_parallel_size=2, grammar_workers=2, kvcache_block_size=4,
             num_kvcache_blocks=10, max_model_len=64) as two_ranks:
        two_ranks.set_observer(lambda event, data: preempted.extend(data["preempted"]) if event == "schedule" else None)
        two = [output["token_ids"] for output in two_ranks.generate(prompts, params, use_tqdm=False)]
        # rank 0 started them (the ranks themselves are forked by multiprocessing's forkserver)
        workers = [pid for pid in grammar_processes() if parent_of(pid) in two_ranks.model_runner.pids]
    assert preempted and two == one and len(workers) == 2


def grammar_processes() -> list[int]:
    """The ids of the running processes whose command line is a grammar worker's."""
    found = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as file:
                if b"nanovllm.engine.grammar_process" in file.read():
                    found.append(int(cmdline.split("/")[2]))
        except OSError:
            continue
    return found
