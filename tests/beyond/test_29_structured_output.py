"""Structured output (chapter 29): StructuredOutputsParams and its checks, bitmasks, the Grammars object, and the
engine's constrained outputs on the tiny model and SmolLM2.

An output is checked by a fresh matcher of its constraint, which must accept every token (`max_tokens` may cut an
output short: then it is a prefix of a sentence of the grammar; one that ends with an end-of-sequence token is a
whole sentence), and, where it is whole, by an independent reader: `json` and `jsonschema` for JSON, `re` for a
regular expression.
"""

from __future__ import annotations

import copy
import json
import logging
import pickle
import re
import time
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from nanovllm.engine.grammars import (
    Grammars,
    allowed_tokens,
    apply_bitmask,
    bitmask_words,
    fill_bitmask,
    llguidance_tokenizer,
    pack_tokens,
)
from nanovllm.engine.sequence import Sequence
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

SHAPE = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "size": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["color", "size"], "additionalProperties": False}
COMPACT = StructuredOutputsParams(json=SHAPE, disable_any_whitespace=True)
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
PROMPTS = [[5 + i, 20, 30, 40] for i in range(6)]


def nested(depth: int) -> str:
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


@pytest.fixture(scope="module")
def llm(tiny: Path):
    with LLM(str(tiny), device="cpu", max_model_len=128) as engine:
        yield engine


def accepted(llm: LLM, constraint: StructuredOutputsParams, tokens: list[int]) -> bool:
    """Whether a fresh matcher of ``constraint`` takes every token, and is done if they end with end-of-sequence."""
    matcher = llm.model_runner.grammars.compile(constraint).deep_copy()
    whole = tokens[-1] in llm.config.eos_token_ids
    return all(matcher.consume_token(token) for token in tokens) and (not whole or matcher.is_stopped())


def constrained(constraint: StructuredOutputsParams, max_tokens: int = 24, **more) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint, **more)


# ---- StructuredOutputsParams -------------------------------------------------------------------------------------
def test_exactly_one_constraint_is_set():
    with pytest.raises(ValueError, match=r"exactly one constraint.*got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"exactly one constraint.*got none"):
        StructuredOutputsParams(json_object=False)
    with pytest.raises(ValueError, match="got json and regex"):
        StructuredOutputsParams(json=SHAPE, regex=DATE)
    with pytest.raises(ValueError, match="got regex and choice and grammar"):
        StructuredOutputsParams(regex=DATE, choice=["a"], grammar="start: /a/")
    for kind, value in (("json", SHAPE), ("json", json.dumps(SHAPE)), ("regex", DATE), ("choice", ["yes", "no"]),
                        ("grammar", 'start: "yes" | "no"'), ("json_object", True)):
        constraint = StructuredOutputsParams(**{kind: value})
        assert constraint.kind == kind and constraint.llguidance_grammar


def test_values_of_the_wrong_type_are_refused():
    for bad, match in (({"choice": "yes"}, "choice must be a list"), ({"choice": []}, "non-empty list of strings"),
                       ({"choice": ["a", 3]}, "non-empty list of strings"), ({"regex": 3}, "regex must be a str"),
                       ({"json": ["not", "a", "schema"]}, "a dict or its text"),
                       ({"json_object": "yes"}, "json_object must be a bool"),
                       ({"regex": DATE, "disable_any_whitespace": "no"}, "disable_any_whitespace must be a bool")):
        with pytest.raises((TypeError, ValueError), match=match):
            StructuredOutputsParams(**bad)


def test_a_bad_json_schema_is_refused_naming_the_problem():
    for schema, problem in (({"type": "bogus"}, "bogus"), ({"type": "array", "uniqueItems": True}, "uniqueItems"),
                            ({"type": "string", "format": "color"}, "Unknown format: color"),
                            ({"$ref": "#/$defs/missing"}, "missing"), ("{not json", "key must be a string")):
        with pytest.raises(ValueError, match=re.escape(problem)) as refused:
            StructuredOutputsParams(json=schema)
        assert "structured_outputs.json" in str(refused.value)


def test_a_bad_regex_or_grammar_is_refused_naming_the_problem():
    for regex, problem in (("a(b", "unclosed group"), ("[z-a]", "invalid character class range"),
                           ("a{3,2}", "invalid repetition"), ("(?=a)b", "look-around")):
        with pytest.raises(ValueError, match=re.escape(problem)) as refused:
            StructuredOutputsParams(regex=regex)
        assert "structured_outputs.regex" in str(refused.value)
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar.*unknown name"):
        StructuredOutputsParams(grammar="start: missing_rule")


def test_pathological_schemas_are_refused_within_a_second():
    def deep(depth: int) -> dict:
        schema = {"type": "string"}
        for _ in range(depth):
            schema = {"type": "object", "properties": {"a": schema}}
        return schema

    huge_enum = {"enum": [f"value {i}" for i in range(100_000)]}
    for schema in (nested(500), deep(500), deep(5000), nested(100_000), huge_enum):
        start = time.perf_counter()
        with pytest.raises(ValueError, match=r"structured_outputs\.json"):
            StructuredOutputsParams(json=schema)
        assert time.perf_counter() - start < 1.0


def test_the_cache_key_is_the_exact_text_in_its_order():
    ordered = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    swapped = StructuredOutputsParams(json={"properties": {"b": {}, "a": {}}, "type": "object"})
    assert ordered.key[1] == '{"type": "object", "properties": {"b": {}, "a": {}}}' and ordered.key != swapped.key
    text = '{"type":"object"}'
    assert StructuredOutputsParams(json=text).key == ("json", text, False)
    assert StructuredOutputsParams(json=text, disable_any_whitespace=True).key == ("json", text, True)


def test_sampling_params_take_the_field_and_refuse_ignore_eos():
    assert SamplingParams().structured_outputs is None
    params = SamplingParams(temperature=0, structured_outputs=COMPACT)
    assert params.structured_outputs is COMPACT and pickle.loads(pickle.dumps(params)) == params
    assert pickle.loads(pickle.dumps(COMPACT)).llguidance_grammar == COMPACT.llguidance_grammar
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SHAPE})
    with pytest.raises(ValueError, match="ignore_eos=True cannot be combined with structured_outputs"):
        SamplingParams(ignore_eos=True, structured_outputs=COMPACT)


# ---- bitmasks ----------------------------------------------------------------------------------------------------
def test_packed_tokens_unpack_to_the_same_tokens_bit_31_included():
    tokens = [0, 1, 31, 32, 63, 64, 500, 511, 512]
    row = pack_tokens(tokens, 600)
    assert row.dtype == torch.int32 and row.shape == (bitmask_words(600),) == (19,)
    assert allowed_tokens(row, 600).nonzero().flatten().tolist() == tokens
    assert allowed_tokens(pack_tokens([], 600), 600).sum() == 0
    # Token 600 would be bit 24 of word 18; a vocabulary of 600 ends before it.
    assert allowed_tokens(torch.full((19,), -1, dtype=torch.int32), 600).all()


def test_apply_bitmask_masks_only_the_given_rows_and_their_forbidden_tokens():
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    before = logits.clone()
    apply_bitmask(logits, torch.stack([pack_tokens([2, 33, 69], 70)]), [1])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    assert torch.equal(logits[1, [2, 33, 69]], before[1, [2, 33, 69]])
    assert torch.isinf(logits[1]).sum() == 67 and logits[1].max() > float("-inf")


def test_the_mask_by_hand_equals_llguidances_on_a_tiny_grammar(tiny: Path, llm: LLM):
    """The chapter's rule (a token is allowed if it keeps the text a prefix of a word; end-of-sequence once it is a
    word) gives llguidance's bitmask, bit for bit, along the tokenizer's spelling of red, blue and no. Of green and
    yes, llguidance allows a subset: not the tokens that would spell the rest of the word non-canonically."""
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    vocab, eos = llm.config.hf_config.vocab_size, list(llm.config.eos_token_ids)
    texts = [tokenizer.decode([t]) for t in range(vocab)]
    special = set(tokenizer.all_special_ids)
    words = ["red", "green", "blue", "yes", "no"]

    def by_hand(written: str) -> list[int]:
        keep = [t for t, text in enumerate(texts)
                if t not in special and text and any(w.startswith(written + text) for w in words)]
        return keep + (eos if written in words else [])

    constraint = StructuredOutputsParams(choice=words)
    for word in words:
        matcher, written = llm.model_runner.grammars.compile(constraint).deep_copy(), ""
        for token in [*tokenizer.encode(word), eos[0]]:
            row = torch.empty(1, bitmask_words(vocab), dtype=torch.int32)
            fill_bitmask(matcher, row, 0)
            if word in ("red", "blue", "no"):
                assert torch.equal(row[0], pack_tokens(by_hand(written), vocab)), (word, written)
            allowed = set(allowed_tokens(row[0], vocab).nonzero().flatten().tolist())
            assert token in allowed and allowed <= set(by_hand(written)), (word, written)
            assert matcher.consume_token(token)
            written += "" if token in eos else texts[token]
        assert matcher.is_stopped()


# ---- the engine on the tiny model --------------------------------------------------------------------------------
def test_a_byte_level_vocabulary_keeps_its_newline_under_a_byte_fallback_decoder(tiny: Path):
    """transformers 5.17 converts SmolLM2's GGUF with a decoder that tries byte fallback before ByteLevel; llguidance's
    own reading of it takes the token for a newline, `Ċ`, as the bytes of `Ċ` (found on the GPU machine, 2026-12-07).
    `llguidance_tokenizer` gives a byte-level vocabulary its plain ByteLevel decoder."""
    from llguidance.hf import from_tokenizer
    from tokenizers import decoders

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    tokenizer.backend_tokenizer.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("\u2581", " "), decoders.ByteLevel()])
    newline = tokenizer.encode("\n")
    assert tokenizer.decode(newline) == "\n"  # Hugging Face still decodes it
    assert from_tokenizer(tokenizer, n_vocab=len(tokenizer)).decode_bytes(newline) == "Ċ".encode()  # the fault
    assert llguidance_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).decode_bytes(newline) == b"\n"


def test_outputs_fit_json_regex_choice_and_grammar(llm: LLM):
    constraints = [COMPACT, StructuredOutputsParams(regex=DATE), StructuredOutputsParams(choice=["yes", "no"]),
                   StructuredOutputsParams(grammar='start: "(" NUMBER ("+" NUMBER)* ")"\nNUMBER: /[0-9]/'),
                   StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
                   StructuredOutputsParams(json=SHAPE)]
    outputs = llm.generate([[5, 20, 30, 40]] * len(constraints), [constrained(c) for c in constraints],
                           use_tqdm=False)
    eos = llm.config.eos_token_ids
    for constraint, output in zip(constraints, outputs, strict=True):
        assert accepted(llm, constraint, output["token_ids"]), (constraint.kind, output)
    shape, date, choice = (output["token_ids"][-1] in eos for output in outputs[:3])
    assert shape and date and choice
    jsonschema.validate(json.loads(outputs[0]["text"]), SHAPE)
    assert re.fullmatch(DATE, outputs[1]["text"]) and outputs[2]["text"] in ("yes", "no")


def test_unconstrained_greedy_is_unchanged_beside_constrained_requests(llm: LLM):
    plain = [[10, 20, 30], [40, 50], [60, 70, 80, 90]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [output["token_ids"] for output in llm.generate(plain, greedy, use_tqdm=False)]
    mixed = llm.generate([plain[0], [5, 20], plain[1], [6, 20], plain[2]],
                         [greedy, constrained(COMPACT), greedy, constrained(StructuredOutputsParams(regex=DATE)),
                          greedy], use_tqdm=False)
    assert [mixed[i]["token_ids"] for i in (0, 2, 4)] == alone
    assert accepted(llm, COMPACT, mixed[1]["token_ids"]) and re.fullmatch(DATE, mixed[3]["text"])


def test_n_samples_each_fit_forked_or_not(tiny: Path, llm: LLM):
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=24, structured_outputs=COMPACT)
    forked = llm.generate([[7, 20, 30]], params, use_tqdm=False)[0]["outputs"]
    assert len({tuple(o["token_ids"]) for o in forked}) > 1
    for output in forked:
        assert accepted(llm, COMPACT, output["token_ids"])
        jsonschema.validate(json.loads(output["text"]), SHAPE)
    with LLM(str(tiny), device="cpu", max_model_len=128, fork_samples=False) as separate:
        apart = separate.generate([[7, 20, 30]], params, use_tqdm=False)[0]["outputs"]
    assert [o["token_ids"] for o in apart] == [o["token_ids"] for o in forked]


def test_each_sequence_has_its_own_matcher_which_goes_with_it(llm: LLM):
    params = constrained(COMPACT)
    grammars = llm.model_runner.grammars
    seqs = [llm.make_sequence([5 + i, 20], params) for i in range(3)]
    for seq in seqs:
        llm.scheduler.add(seq)
    while not llm.is_finished():
        llm.step()
    states = [grammars.matchers[seq] for seq in seqs]
    assert len({id(state.matcher) for state in states}) == 3
    # A matcher reads a token before the next mask: the last one, which ends the sequence, it never reads.
    assert all(state.consumed == seq.num_completion_tokens - 1 for state, seq in zip(states, seqs, strict=True))
    assert len({id(m) for m in grammars.compiled.values()}) == len(grammars.compiled)
    del seqs, states, seq
    assert len(grammars.matchers) == 0


def test_preemption_keeps_the_matchers(tiny: Path, llm: LLM):
    params = constrained(COMPACT)
    roomy = llm.generate(PROMPTS, params, use_tqdm=False)
    preempted = []
    with LLM(str(tiny), device="cpu", kvcache_block_size=4, num_kvcache_blocks=10, max_model_len=64) as cramped:
        cramped.set_observer(lambda event, data: preempted.extend(data["preempted"]) if event == "schedule" else None)
        squeezed = cramped.generate(PROMPTS, params, use_tqdm=False)
    assert preempted
    assert [o["token_ids"] for o in squeezed] == [o["token_ids"] for o in roomy]


def test_asynchronous_steps_give_the_same_constrained_outputs(tiny: Path, llm: LLM):
    params = [constrained(COMPACT), constrained(StructuredOutputsParams(regex=DATE)),
              SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=24, structured_outputs=COMPACT)]
    prompts = [[5, 20, 30], [6, 20, 30], [7, 20, 30]]
    sync = llm.generate(prompts, params, use_tqdm=False)
    with LLM(str(tiny), device="cpu", max_model_len=128, async_scheduling=True) as overlapped:
        assert overlapped.config.async_scheduling
        asynchronous = overlapped.generate(prompts, params, use_tqdm=False)
    assert asynchronous == sync


# ---- when a grammar cannot go on -------------------------------------------------------------------------------
def test_a_token_the_grammar_refuses_ends_the_request_with_the_reason_logged(llm: LLM, caplog):
    """Only end-of-sequence tokens remain for a sequence whose matcher was handed a token it refuses."""
    grammars, vocab = llm.model_runner.grammars, llm.config.hf_config.vocab_size
    yes_no = StructuredOutputsParams(choice=["yes", "no"])
    seq = Sequence([5, 20], SamplingParams(temperature=0, structured_outputs=yes_no), block_size=16)
    seq.append_token(llm.tokenizer.convert_tokens_to_ids("x"))
    seq.num_cached_tokens, seq.num_scheduled_tokens = 2, 1
    logits = torch.zeros(1, vocab)
    with caplog.at_level(logging.WARNING, logger="nanovllm.grammars"):
        grammars.mask([seq], logits)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == sorted(llm.config.eos_token_ids)
    assert grammars.matchers[seq].error and "structured output failed after 1 tokens" in caplog.text


def test_two_ranks_write_the_constrained_outputs_of_one(tiny: Path, llm: LLM):
    """Under tensor parallelism rank 0 samples, keeping each constrained sequence's object, and so its matcher, from
    step to step (`RankWorker._sequences`): two ranks write the outputs of one, greedy and seeded (n = 2, forked),
    beside a plain request, with preemption in a cramped cache."""
    prompts = PROMPTS[:4]
    params = [constrained(COMPACT), SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=24,
                                                   structured_outputs=StructuredOutputsParams(regex=DATE)),
              SamplingParams(temperature=0, max_tokens=12), constrained(StructuredOutputsParams(choice=["yes", "no"]))]
    one = [output["token_ids"] for output in llm.generate(prompts, params, use_tqdm=False)]
    preempted = []
    with LLM(str(tiny), device="cpu", tensor_parallel_size=2, kvcache_block_size=4, num_kvcache_blocks=10,
             max_model_len=64) as two_ranks:
        two_ranks.set_observer(lambda event, data: preempted.extend(data["preempted"]) if event == "schedule" else None)
        two = [output["token_ids"] for output in two_ranks.generate(prompts, params, use_tqdm=False)]
        two_ranks.generate([[9, 9]], SamplingParams(max_tokens=2), use_tqdm=False)  # tells rank 0 who finished
        held = two_ranks.model_runner.call("world")[0]["params_held"]
    assert preempted and two == one
    assert accepted(llm, COMPACT, two[0]) and held == 1  # only the last request's params, held until its next step


# ---- with speculative decoding ---------------------------------------------------------------------------------
# Prompt lookup proposes what followed the last tokens earlier: on these prompts, mostly drafts the grammars refuse
# (prompt tokens that are no JSON, date or choice), and some they take.
SPECULATED = [[10, 20, 30, 10, 20, 30], [5, 20, 30, 5, 20], [7, 7, 7, 7], [1, 2, 1, 2, 1], [3, 4, 3, 4]]
SPECULATED_PARAMS = [constrained(COMPACT, 32), constrained(StructuredOutputsParams(json=SHAPE), 32),
                     constrained(StructuredOutputsParams(regex=DATE), 32),
                     constrained(StructuredOutputsParams(choice=["yes", "no"]), 32),
                     SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=24, structured_outputs=COMPACT)]


def speculate(tiny: Path, **settings) -> tuple[list[dict], dict[str, int], list[Sequence], Grammars]:
    """The outputs of SPECULATED under prompt-lookup speculation, the drafts it verified and kept, the sequences of
    its verify steps (held, so that their matchers stay in the weak dictionary), and the engine's grammars."""
    counts, seqs = {"verified": 0, "kept": 0}, []

    def observe(event: str, data: dict) -> None:
        if event == "verified":
            counts["verified"] += sum(data["drafted"])
            counts["kept"] += sum(data["kept"])
            seqs.extend(data["seqs"])

    with LLM(str(tiny), device="cpu", max_model_len=128, speculative_method="ngram", num_speculative_tokens=4,
             **settings) as speculating:
        speculating.set_observer(observe)
        outputs = speculating.generate(SPECULATED, SPECULATED_PARAMS, use_tqdm=False)
        return outputs, counts, seqs, speculating.model_runner.grammars


def matchers_follow_their_tokens(grammars: Grammars, seqs: list[Sequence]) -> bool:
    """Whether each held sequence's matcher is where a fresh one is after the tokens it has read: the drafts each
    verify step fed it were rolled back, and it read only the tokens the engine kept."""
    words = bitmask_words(grammars.vocab_size)
    for seq in set(seqs):
        state = grammars.matchers[seq]
        fresh = grammars.compile(seq.sampling_params.structured_outputs).deep_copy()
        read = seq.completion_token_ids[: state.consumed]
        if state.error is not None or not fresh.consume_tokens(read):
            return False
        masks = torch.empty(2, words, dtype=torch.int32)
        fill_bitmask(state.matcher, masks, 0)
        fill_bitmask(fresh, masks, 1)
        if not torch.equal(masks[0], masks[1]):
            return False
    return True


@pytest.mark.parametrize("settings", [{}, {"async_scheduling": True}], ids=["sync", "async"])
def test_speculation_gives_the_same_constrained_outputs_token_for_token(tiny: Path, llm: LLM, settings: dict):
    """Greedy and seeded (n = 2) constrained requests, with prompt lookup's drafts: the grammars cut the drafts they
    refuse before verification, the verify steps mask the rest, and the outputs are those without speculation."""
    expected = llm.generate(SPECULATED, SPECULATED_PARAMS, use_tqdm=False)
    outputs, counts, seqs, grammars = speculate(tiny, **settings)
    assert outputs == expected
    assert grammars.refused_drafts > 0 and counts["kept"] > 0 and counts["verified"] > counts["kept"]
    assert matchers_follow_their_tokens(grammars, seqs)
    for output, params in zip(outputs[:4], SPECULATED_PARAMS, strict=False):
        assert accepted(llm, params.structured_outputs, output["token_ids"])


def test_verify_masks_drafts_the_grammar_refuses_when_they_are_not_cut(tiny: Path, llm: LLM, monkeypatch):
    """Without `cut_drafts`, refused drafts reach the verify step: its masks alone keep the outputs the same."""
    monkeypatch.setattr(Grammars, "cut_drafts", lambda self, seqs, drafts: drafts)
    expected = llm.generate(SPECULATED, SPECULATED_PARAMS, use_tqdm=False)
    outputs, counts, seqs, grammars = speculate(tiny)
    assert outputs == expected
    assert grammars.refused_drafts > 0 and counts["kept"] > 0
    assert matchers_follow_their_tokens(grammars, seqs)


def test_a_verify_steps_rows_are_masked_after_each_draft_and_the_matcher_rolls_back(llm: LLM):
    """Row i under the grammar after i drafts; rows after a refused draft unmasked; the matcher back where it was."""
    grammars, vocab = llm.model_runner.grammars, llm.config.hf_config.vocab_size
    yes_no = StructuredOutputsParams(choice=["yes", "no"])
    y, e, x = (llm.tokenizer.convert_tokens_to_ids(t) for t in ("y", "e", "x"))
    seq = Sequence([5, 20], SamplingParams(temperature=0, structured_outputs=yes_no), block_size=16)
    drafts = [y, e, x, y]
    for token in drafts:
        seq.append_token(token)
    seq.num_cached_tokens, seq.num_scheduled_tokens, seq.num_draft_tokens = 1, 5, 4
    logits = torch.zeros(5, vocab)
    refused = grammars.refused_drafts
    grammars.mask_drafts([seq], logits)
    fresh = grammars.compile(yes_no).deep_copy()
    expected = torch.full((5, bitmask_words(vocab)), -1, dtype=torch.int32)
    for row, token in enumerate([y, e]):
        fill_bitmask(fresh, expected, row)
        assert fresh.consume_token(token)
    fill_bitmask(fresh, expected, 2)
    # rows 0 to 2: the grammar after 0, 1 and 2 drafts; rows 3 and 4 follow "x", which it refuses
    assert torch.equal(torch.isfinite(logits), allowed_tokens(expected, vocab))
    assert torch.isfinite(logits[3:]).all() and grammars.refused_drafts == refused + 2
    state = grammars.matchers[seq]
    assert state.consumed == 0 and state.error is None and state.matcher.validate_tokens([y, e, y]) == 2
    # cut before verification: the same two drafts, and the matcher does not move
    assert grammars.cut_drafts([seq], [drafts]) == [[y, e]] and state.matcher.validate_tokens([y, e]) == 2


def test_a_model_without_an_end_of_sequence_token_cannot_be_constrained(llm: LLM):
    config = copy.copy(llm.config)
    config.eos_token_ids = ()
    seq = Sequence([5, 20], constrained(COMPACT), block_size=16)
    seq.num_scheduled_tokens = 2
    with pytest.raises(ValueError, match="declares none"):
        Grammars(config).mask([seq], torch.zeros(1, config.hf_config.vocab_size))


# ---- a real model ------------------------------------------------------------------------------------------------
def test_smollm2_writes_json_that_validates_where_unconstrained_it_does_not():
    from nanovllm.book.smollm2 import smollm2_dir

    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    with LLM(str(smollm2_dir()), device="cpu", max_model_len=256) as smol:
        request = [{"role": "user", "content": "Describe a software engineer named Ada as JSON with name and age."}]
        question = smol.tokenizer.apply_chat_template(request, tokenize=False, add_generation_prompt=True)
        free, shaped = smol.generate(
            [question] * 2, [SamplingParams(temperature=0, max_tokens=30),
                             constrained(StructuredOutputsParams(json=person), max_tokens=60)], use_tqdm=False)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free["text"])
    jsonschema.validate(json.loads(shaped["text"]), person)
    assert shaped["token_ids"][-1] in smol.config.eos_token_ids


# ---- its cost (issue 63, item 4) --------------------------------------------------------------------------------
def test_the_benchmark_runs_both_ways_on_the_same_tokens_in_one_invocation(tiny: Path, tmp_path: Path):
    from nanovllm.bench.engine import main as bench

    out = tmp_path / "structured.json"
    assert bench(["--structured", "--model", str(tiny), "--batches", "1", "3", "--max-tokens", "12", "--repeats", "1",
                  "--device", "cpu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 3]
    for row in rows:
        # the roster is longer than any run: the constrained requests never end before max_tokens
        assert row["tokens"] == {"free": 12 * row["batch"], "constrained": 12 * row["batch"]}
        assert 0 < row["mask_ms_per_step"] < row["step_ms"]["constrained"] and row["ratio"] > 0
    with pytest.raises(SystemExit):
        bench(["--structured", "--batches", "0", "--device", "cpu"])


def test_mask_time_counts_nested_and_overlapping_calls_once():
    from nanovllm.bench.structured import covered_seconds

    assert covered_seconds([]) == 0
    assert covered_seconds([(0.0, 5.0), (1.0, 2.0)]) == 5.0  # a watched call inside another
    assert covered_seconds([(4.0, 6.0), (0.0, 2.0), (1.0, 3.0)]) == 5.0
    assert covered_seconds([(0.0, 1.0), (1.0, 1.5)]) == 1.5


# ---- the mask inside the captured step (issue 63, item 4) ----------------------------------------------------------
class _LinearHead(torch.nn.Module):
    """A stand-in model for the sampling graphs: compute_logits is one matmul over the graph's output rows."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states @ self.weight.T


def _masked_graphs(vocab: int, sizes: list[int], device: str = "cpu", hidden: int = 16):
    """MaskedSamplingGraphs over stand-in decode graphs (what it reads of a CudaGraphRunner), with chapter 12's race
    kernels (the Triton interpreter on a CPU); nothing captured."""
    from types import SimpleNamespace

    from nanovllm.engine.cuda_graphs import SamplingGraphs, graph_batch_size
    from nanovllm.engine.grammars import MaskedSamplingGraphs
    from nanovllm.layers.triton_sampler import triton_temperature_sample

    graphs = SimpleNamespace(sizes=sizes, device=torch.device(device), pool=None,
                             outputs=torch.randn(sizes[-1], hidden, device=device),
                             bucket=lambda n: graph_batch_size(n, sizes))  # fmt: skip
    head = _LinearHead(torch.randn(vocab, hidden, device=device))
    plain = SamplingGraphs(head, graphs, triton_temperature_sample)
    hosts = [torch.full((sizes[-1], bitmask_words(vocab)), -1, dtype=torch.int32, pin_memory=device == "cuda")
             for _ in range(2)]
    return MaskedSamplingGraphs(plain, hosts), plain, graphs, head


def _decoding(llm: LLM, params: SamplingParams, walk: int, seed: int, refused: int | None = None) -> Sequence:
    """A sequence ready to decode, ``walk`` completion tokens in: random tokens its grammar allows (never an end of
    sequence; plain tokens for an unconstrained one), then ``refused`` if given."""
    import random

    rng, vocab = random.Random(seed), llm.config.hf_config.vocab_size
    seq = Sequence([5 + seed, 20, 30], params, block_size=16)
    matcher = None
    if params.structured_outputs is not None:
        matcher = llm.model_runner.grammars.compile(params.structured_outputs).deep_copy()
    for _ in range(walk):
        token = rng.randrange(40, 200)
        if matcher is not None:
            row = torch.empty(1, bitmask_words(vocab), dtype=torch.int32)
            fill_bitmask(matcher, row, 0)
            allowed = allowed_tokens(row[0], vocab).nonzero().flatten().tolist()
            token = rng.choice([t for t in allowed if t not in llm.config.eos_token_ids])
            assert matcher.consume_token(token)
        seq.append_token(token)
    if refused is not None:
        seq.append_token(refused)
    seq.num_cached_tokens, seq.num_scheduled_tokens = len(seq) - 1, 1
    return seq


def _mixed_step(llm: LLM, seed: int) -> tuple[list[Sequence], list[float]]:
    """Five sequences of one decode step, and their temperatures: a JSON schema, a plain one, a regex, a grammar that
    failed (its last token refused: only an end of sequence is left), a plain one at temperature 1."""
    yes_no = StructuredOutputsParams(choice=["yes", "no"])
    temperatures = [0.0, 0.0, 0.8, 0.0, 1.0]
    kinds = [COMPACT, None, StructuredOutputsParams(regex=DATE), yes_no, None]
    seqs = []
    for i, (kind, temperature) in enumerate(zip(kinds, temperatures, strict=True)):
        params = SamplingParams(temperature=temperature, max_tokens=64, structured_outputs=kind)
        refused = llm.tokenizer.convert_tokens_to_ids("x") if kind is yes_no else None
        seqs.append(_decoding(llm, params, walk=(0 if kind is yes_no else 3 + i), seed=seed + i, refused=refused))
    return seqs, temperatures


def test_forbid_equals_apply_bitmask_on_every_row():
    from nanovllm.engine.grammars import forbid

    torch.manual_seed(0)
    for vocab in (1, 31, 32, 33, 70, 1000):
        words = bitmask_words(vocab)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), dtype=torch.int32)
        bitmask[0] = -1
        bitmask[1] = 0
        # rows of a larger buffer, as the graphs read them
        buffer = torch.zeros(8, words, dtype=torch.int32)
        buffer[:5] = bitmask
        logits = torch.randn(5, vocab)
        expected = logits.clone()
        apply_bitmask(expected, bitmask, list(range(5)))
        forbid(logits, buffer[:5])
        assert torch.equal(logits, expected), vocab


@pytest.mark.parametrize("seed", [0, 1])
def test_the_masked_draw_equals_the_eager_path_greedy_and_seeded(llm: LLM, seed: int, caplog):
    """What a replay of the masked graphs does (`MaskedSamplingGraphs.draw`, called eagerly) gives the tokens of the
    eager path (`Grammars.mask`, then the same race with the same Philox key), on a step that mixes constrained
    rows, plain rows and a failed grammar, greedy rows and rows at a temperature; with padding rows up to the
    bucket."""
    grammars, vocab = llm.model_runner.grammars, llm.config.hf_config.vocab_size
    masked, plain, graphs, head = _masked_graphs(vocab, [1, 2, 4, 8])
    eager_seqs, temperatures = _mixed_step(llm, seed)
    graph_seqs, _ = _mixed_step(llm, seed)
    n, key = len(eager_seqs), plain.seed.clone()
    with caplog.at_level(logging.WARNING, logger="nanovllm.grammars"):
        logits = head.compute_logits(graphs.outputs[:n])
        grammars.mask(eager_seqs, logits)
        eager = plain.sample_plain(logits, torch.tensor(temperatures), seed=key.clone())

        grammars.fill(graph_seqs, masked.host_rows(n))
        masked.send(n)
        masked.temperatures[:n] = torch.tensor(temperatures)
        masked.draw(graphs.bucket(n))
    assert masked.seed is plain.seed and int(plain.seed) == int(key) + 1
    assert torch.equal(masked.tokens[:n], eager)
    # the mask held: each constrained row's token is one its grammar allows; the failed one may only end
    allowed = allowed_tokens(masked.bitmask[:n], vocab)
    assert all(allowed[i, token] for i, token in enumerate(eager.tolist()))
    assert allowed[1].all() and allowed[4].all() and not allowed[0].all() and not allowed[2].all()
    assert allowed[3].nonzero().flatten().tolist() == sorted(llm.config.eos_token_ids)
    assert eager[3].item() in llm.config.eos_token_ids


def test_fill_rewrites_every_row_of_a_reused_buffer(llm: LLM):
    """`Grammars.fill` writes every row of the host buffer it is given (the masked graphs reuse two in turn): a
    constrained row its grammar's tokens, a failed grammar's row only end of sequence, a plain row all ones."""
    grammars, vocab = llm.model_runner.grammars, llm.config.hf_config.vocab_size
    for seed in range(3):
        filled, _ = _mixed_step(llm, 10 * seed)
        expected_seqs, _ = _mixed_step(llm, 10 * seed)
        rows = torch.zeros(len(filled), bitmask_words(vocab), dtype=torch.int32)  # what an earlier step left
        grammars.fill(filled, rows)
        expected = torch.full_like(rows, -1)
        for i, seq in enumerate(expected_seqs):
            if seq.sampling_params.structured_outputs is not None:
                grammars.fill_row(seq, grammars.follow(seq, {}), expected, i)
        assert torch.equal(rows, expected)
        assert grammars.matchers[filled[3]].error and torch.equal(rows[3], grammars.end_of_sequence)
        assert rows[1].eq(-1).all() and not rows[0].eq(-1).all()


class _Transfer:
    """Stands for a CUDA event recorded after a copy: in flight from record() until synchronize()."""

    def __init__(self) -> None:
        self.in_flight = False

    def record(self) -> None:
        self.in_flight = True

    def synchronize(self) -> None:
        self.in_flight = False


def test_the_host_never_writes_a_bitmask_buffer_whose_copy_may_be_in_flight():
    """`host_rows` hands out the host buffers in turn, each once its last copy is done: the step the host fills never
    shares a buffer with the step before, whose copy may still be queued behind the forward."""
    masked, *_ = _masked_graphs(70, [1, 2, 4])
    masked.sent = [_Transfer() for _ in masked.sent]
    before = None
    for step in range(6):
        rows = masked.host_rows(3)
        assert not masked.sent[masked.turn].in_flight
        assert rows.data_ptr() != before
        rows.fill_(step)
        # what send() does on a GPU: the copy is queued, and stays in flight until someone waits for it
        masked.sent[masked.turn].record()
        before = rows.data_ptr()


@pytest.mark.gpu
def test_gpu_masked_sampling_graphs_sample_under_each_steps_mask_without_waiting():
    """Captured masked graphs, replayed step after step with no wait but `host_rows`' own: each step allows one token
    a row (a different one each step), and every greedy row samples it. A bitmask copied too early or too late, or a
    host buffer overwritten in flight, would show as another step's token."""
    vocab, sizes = 4000, [1, 2, 4, 8, 16]
    masked, plain, *_ = _masked_graphs(vocab, sizes, device="cuda", hidden=32)
    plain.capture()
    masked.capture()
    drawn, wanted = [], []
    for step in range(40):
        n = max(1, sizes[step % len(sizes)] - step % 2)
        tokens = [(97 * step + 31 * row) % vocab for row in range(n)]
        rows = masked.host_rows(n)
        rows.zero_()
        for row, token in enumerate(tokens):
            rows[row, token // 32] = (1 << (token % 32)) - (1 << 32 if token % 32 == 31 else 0)
        masked.send(n)
        drawn.append(masked.sample([0.0] * n).clone())
        # a plain replay between two masked ones shares the key and leaves the bitmask alone
        plain.sample([0.0] * n)
        wanted.append(tokens)
    assert [d.tolist() for d in drawn] == wanted


@pytest.mark.gpu
def test_gpu_constrained_steps_sample_in_the_masked_graphs_with_the_eager_tokens(tiny: Path):
    """The engine with and without the captured sampler: the same constrained greedy tokens (JSON, regex, a plain
    request beside them), synchronous and asynchronous; with it, constrained decode steps replay the masked graphs."""
    from nanovllm.engine.grammars import MaskedSamplingGraphs

    params = [constrained(COMPACT, 40), constrained(StructuredOutputsParams(regex=DATE), 40),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), constrained(COMPACT, 40)]
    prompts = [[5, 20, 30], [6, 20], [7, 20, 30, 40], [8, 20]]
    replays = []
    real_sample = MaskedSamplingGraphs.sample
    tokens = {}
    for in_graph in (False, True):
        for asynchronous in (False, True):
            with LLM(str(tiny), dtype="float32", sample_in_graph=in_graph, async_scheduling=asynchronous,
                     kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256, max_num_seqs=8) as llm:
                MaskedSamplingGraphs.sample = lambda self, t: replays.append(len(t)) or real_sample(self, t)
                try:
                    outputs = llm.generate(prompts, params, use_tqdm=False)
                finally:
                    MaskedSamplingGraphs.sample = real_sample
                assert (llm.model_runner.masked_sampling is not None) == in_graph
                assert all(accepted(llm, COMPACT, outputs[i]["token_ids"]) for i in (0, 3))
                assert accepted(llm, StructuredOutputsParams(regex=DATE), outputs[1]["token_ids"])
            tokens[in_graph, asynchronous] = [o["token_ids"] for o in outputs]
    assert tokens[True, False] == tokens[True, True] == tokens[False, False] == tokens[False, True]
    assert replays and max(replays) == 4
