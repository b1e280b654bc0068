"""The server's structured output (chapter 29b): response_format and vLLM's structured_outputs extra body; tool
calls: the Hermes format, the grammars of tool_choice, the parser whole and streamed, and the server's tools,
tool_choice and parallel_tool_calls through the official openai client on the tiny model.

A call's arguments are checked by `jsonschema`, a reader independent of llguidance, against the tool's schema.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import pytest
from llguidance import LLMatcher
from llguidance.hf import from_tokenizer

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.engine.inputs import load_tokenizer
from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.serve.tool_calls import (
    ToolCallStream,
    ToolDefinition,
    ToolRequest,
    call_text,
    conversation,
    parse_tool_calls,
    template_tool_style,
    tool_call_grammar,
)

CITY = {"enum": ["Paris", "Rome", "Oslo"]}
WEATHER = {"type": "object", "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"city": CITY}, "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "The weather.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time.", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
# The tools' system block takes about 770 of the tiny tokenizer's tokens: the model gets room for 2,048.
SERVER_ARGS = ["--device", "cpu", "--num-kvcache-blocks", "160", "--kvcache-block-size", "16", "--max-model-len",
               "2048"]


@pytest.fixture(scope="module")
def long_tiny() -> Path:
    return build_tiny_model("qwen3", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def tokenizer(long_tiny: Path):
    return load_tokenizer(str(long_tiny))


def definitions() -> list[ToolDefinition]:
    return [ToolDefinition.model_validate(tool) for tool in TOOLS]


def valid_call(name: str, arguments: str) -> bool:
    return name in SCHEMAS and jsonschema.Draft202012Validator(SCHEMAS[name]).is_valid(json.loads(arguments))


# ---- the format, the grammar and the parser -----------------------------------------------------------------------
def test_both_templates_ignore_tools_so_the_server_writes_them(tokenizer):
    from nanovllm.book.smollm2 import smollm2_dir

    assert template_tool_style(tokenizer) == "server"
    assert template_tool_style(load_tokenizer(str(smollm2_dir()))) == "server"


def test_a_template_that_writes_hermes_calls_is_native_and_another_format_is_refused(tokenizer):
    hermes = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> use <tool_call>{% endif %}"
              "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    other = hermes.replace("<tool_call>", "[TOOL_CALLS]")
    tokenizer.chat_template = hermes
    try:
        assert template_tool_style(tokenizer) == "native"
        tokenizer.chat_template = other
        assert template_tool_style(tokenizer) is None
    finally:
        tokenizer.chat_template = load_tokenizer(str(build_tiny_model("qwen3"))).chat_template


def test_conversation_writes_calls_results_and_tools_as_qwen_does():
    messages = [{"role": "system", "content": "Be brief."}, *CHAT,
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": key, "type": "function", "function": {"name": "get_time", "arguments": arguments}}
                    for key, arguments in (("a", '{"city": "Oslo"}'), ("b", '{"city": "Rome"}'))]},
                {"role": "tool", "tool_call_id": "a", "content": "10:00"},
                {"role": "tool", "tool_call_id": "b", "content": "11:00"}]
    rendered = conversation(messages, TOOLS, native=False)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(TOOLS[0]) in rendered[0]["content"]
    assert rendered[2]["content"] == "\n".join([call_text("get_time", '{"city": "Oslo"}'),
                                                 call_text("get_time", '{"city": "Rome"}')])
    assert rendered[3]["content"] == ("<tool_response>\n10:00\n</tool_response>\n"
                                      "<tool_response>\n11:00\n</tool_response>")
    native = conversation(messages, TOOLS, native=True)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"} and native[0] == messages[0]


@pytest.mark.parametrize(("mode", "name", "parallel", "text", "accepted"), [
    ("required", None, True, call_text("get_time", '{"city": "Oslo"}'), True),
    ("required", None, True, "\n".join([call_text("get_time", '{"city": "Oslo"}')] * 2), True),
    ("required", None, False, "\n".join([call_text("get_time", '{"city": "Oslo"}')] * 2), False),
    ("required", None, True, "Sure. " + call_text("get_time", '{"city": "Oslo"}'), False),
    ("required", None, True, call_text("get_time", '{"city": "London"}'), False),
    ("required", None, True, call_text("get_time", '{"city":"Oslo"}'), False),
    ("named", "get_weather", True, call_text("get_time", '{"city": "Oslo"}'), False),
    ("named", "get_weather", True, call_text("get_weather", '{"city": "Oslo", "days": 2}'), True),
    ("auto", None, True, "Just text, <tool_ no call.", True),
    ("auto", None, True, "First: " + call_text("get_weather", '{"city": "Oslo", "days": 2}'), True),
    ("auto", None, True, "First: " + call_text("get_weather", '{"city": "Oslo", "days": 9}'), False),
    ("auto", None, True, "First: <tool_call>\nanything", False),
])
def test_the_grammar_of_each_tool_choice(tokenizer, mode, name, parallel, text, accepted):
    ask = ToolRequest(definitions(), mode, name, parallel)
    grammar = StructuredOutputsParams(grammar=tool_call_grammar([f for _, f in ask.offered()], mode, parallel))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    matcher = LLMatcher(from_tokenizer(tokenizer, n_vocab=512, eos_token=[eos]), grammar.llguidance_grammar,
                        log_level=0)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert (matcher.consume_tokens(tokens) and matcher.consume_token(eos)) is accepted


def test_parse_whole_and_streamed_agree_and_hold_no_tags(tokenizer):
    text = "Let me look. " + call_text("get_weather", '{"city": "Rome", "days": 3}') + "\n" + call_text(
        "get_time", '{"city": "Oslo"}')
    content, calls = parse_tool_calls(text)
    assert content == "Let me look. " and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Rome", "days": 3}'), ("get_time", '{"city": "Oslo"}')]
    assert calls[0].openai() == {"id": calls[0].id, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Rome", "days": 3}'}} and calls[0].id != calls[1].id
    for size in (1, 2, 5):
        stream = ToolCallStream()
        deltas = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)] + [stream.feed("", final=True)]
        streamed = "".join(d.get("content", "") for d in deltas)
        pieces = [p for d in deltas for p in d.get("tool_calls", [])]
        heads = [p for p in pieces if "id" in p]
        assert streamed == content and [p["index"] for p in heads] == [0, 1]
        assert [(h["function"]["name"], "".join(p["function"]["arguments"] for p in pieces if p["index"] == h["index"]))
                for h in heads] == [(c.name, c.arguments) for c in calls]
        assert not any("<" in p["function"]["arguments"] or "tool_call" in p["function"]["arguments"] for p in pieces)


def test_a_call_cut_short_is_no_call_and_plain_text_is_content():
    cut = call_text("get_weather", '{"city": "Rome", "days": 3}')[:-5]
    assert parse_tool_calls(cut) == (cut, []) and parse_tool_calls("No tools today.") == ("No tools today.", [])
    # a tag split across pieces is held back, then sent as content when no call follows
    stream = ToolCallStream()
    assert stream.feed("a <tool") == {"content": "a "} and stream.feed("box>", final=True) == {"content": "<toolbox>"}


@pytest.mark.parametrize("mode", ["required", "auto"])
def test_tool_calls_under_speculation_are_those_without(long_tiny: Path, tokenizer, mode):
    """A call's grammar constrains a speculating engine's drafts: prompt lookup, on a prompt that holds a call,
    proposes drafts the grammar takes and drafts it refuses, and the greedy output is the one without drafts."""
    from nanovllm.llm import LLM
    from nanovllm.sampling_params import SamplingParams

    ask = ToolRequest(definitions(), mode, None, False)
    grammar = StructuredOutputsParams(grammar=tool_call_grammar([f for _, f in ask.offered()], mode, False))
    example = tokenizer.encode(call_text("get_weather", '{"city": "Rome", "days": 3}'), add_special_tokens=False)
    prompts = [example + example[:6], example[:3] + example, example[:10]]
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=grammar)
    outputs, verified = [], []
    for speculative in ({}, {"speculative_method": "ngram", "num_speculative_tokens": 4}):
        with LLM(str(long_tiny), device="cpu", max_model_len=256, **speculative) as engine:
            engine.set_observer(lambda event, data: verified.append(sum(data["kept"])) if event == "verified" else None)
            outputs.append(engine.generate(prompts, params, use_tqdm=False))
            refused = engine.model_runner.grammars.refused_drafts
    assert outputs[0] == outputs[1]
    assert sum(verified) > 0 and refused > 0


# ---- the server ---------------------------------------------------------------------------------------------------
def served(model: Path, *args: str):
    """A server of ``model`` under the name "tiny", with ``args`` (a context manager: it stops the server)."""
    from nanovllm.serve.process import ServerProcess

    return ServerProcess(["--model", str(model), "--served-model-name", "tiny", *args])


def openai_client(server):
    """The official client of a running ``server``: no retries, a minute's patience."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def server(long_tiny: Path):
    with served(long_tiny, *SERVER_ARGS) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_give_calls_that_fit_the_schema(client, choice):
    reply = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=120, temperature=0)
    choice_ = reply.choices[0]
    assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
    calls = choice_.message.tool_calls
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
    assert valid_call(calls[0].function.name, calls[0].function.arguments)
    if isinstance(choice, dict):
        assert calls[0].function.name == "get_weather"


def test_streamed_deltas_reassemble_to_the_same_call(client):
    fields = {"model": "tiny", "messages": CHAT, "tools": TOOLS, "parallel_tool_calls": False, "max_tokens": 120,
              "temperature": 0, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    whole = client.chat.completions.create(**fields).choices[0].message.tool_calls[0]
    chunks = [chunk.choices[0] for chunk in client.chat.completions.create(**fields, stream=True) if chunk.choices]
    pieces = [call for c in chunks for call in c.delta.tool_calls or []]
    assert chunks[-1].finish_reason == "tool_calls" and not any(c.delta.content for c in chunks)
    assert pieces[0].id and pieces[0].type == "function" and {p.index for p in pieces} == {0}
    assert pieces[0].function.name == whole.function.name == "get_time"
    assert "".join(p.function.arguments or "" for p in pieces) == whole.function.arguments
    assert valid_call("get_time", whole.function.arguments)


def test_a_tool_calling_loop_completes(client):
    first = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120, temperature=0).choices[0]
    call = first.message.tool_calls[0]
    history = [*CHAT, first.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear", "high": 21})}]
    for choice in ("none", "auto"):
        final = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice=choice,
                                               max_tokens=12, temperature=0).choices[0]
        assert final.finish_reason in ("stop", "length", "tool_calls")
        assert final.message.content or final.message.tool_calls
        if choice == "none":
            assert final.message.tool_calls is None and final.finish_reason != "tool_calls"


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, "tools",
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "tools.0.function.name"),
    ({"tools": [{"type": "tool", "function": {"name": "f"}}]}, "tools", "tools.0.type"),
    ({"tools": "get_weather"}, "tools", "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "each once"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice",
     "'get_news'"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools", "both"),
    ({"functions": [{"name": "f"}]}, "functions", "functions"),
    ({"messages": [*CHAT, {"role": "tool", "content": "21"}]}, "messages", "tool_call_id"),
    ({"messages": [*CHAT, {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages", "not JSON"),
    ({"messages": [*CHAT, {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                                                "function": {"name": "f", "arguments": {}}}]}]},
     "messages", "arguments"),
])
def test_bad_tool_fields_get_400_naming_the_field(server, fields, param, words):
    body = {"model": "tiny", "max_tokens": 4, "messages": CHAT, **fields}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_completions_refuse_the_tool_fields_and_a_plain_chat_is_unchanged(server, client):
    for name, value in (("tools", TOOLS), ("tool_choice", "auto"), ("parallel_tool_calls", True)):
        reply = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", name: value},
                           timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == name
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0]
    assert plain.finish_reason == "length" and plain.message.tool_calls is None and plain.message.content
    assert "ignoring the request field 'tools'" not in server.output()


# A tool-aware template in the shape of Qwen's: the tools in a system block, earlier calls as <tool_call> blocks.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call a function within <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_native_template_gets_the_tools_and_the_loop_through_the_server(long_tiny: Path, tmp_path: Path):
    import shutil

    model = tmp_path / "hermes-tiny"
    shutil.copytree(long_tiny, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    assert template_tool_style(load_tokenizer(str(model))) == "native"
    with served(model, *SERVER_ARGS) as process:
        client = openai_client(process)
        reply = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=120, temperature=0)
        plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, temperature=0)
        # the template wrote the tools (about 100 tokens each in the tiny tokenizer)
        assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 100
        call = reply.choices[0].message.tool_calls[0]
        assert reply.choices[0].finish_reason == "tool_calls"
        assert valid_call(call.function.name, call.function.arguments)
        history = [*CHAT, reply.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "21"}]
        final = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                               max_tokens=4, temperature=0)
        assert final.choices[0].message.content and final.choices[0].message.tool_calls is None
        # the earlier call, rendered by the template: its arguments as the template's tojson writes them
        assert final.usage.prompt_tokens > reply.usage.prompt_tokens + 20


def test_tool_call_events_rewrite_chapter_22s_chunks_per_choice():
    import asyncio

    from nanovllm.serve.app import sse, tool_call_events
    from nanovllm.serve.protocol import chat_chunk

    text = "Let me see. " + call_text("get_time", '{"city": "Oslo"}')

    def chunks(index: int, finish: str) -> list[str]:
        pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
        return [sse(chat_chunk("id", "tiny", 0, index, {"content": piece} if piece else {},
                               finish if i == len(pieces) - 1 else None)) for i, piece in enumerate(pieces)]

    async def upstream():
        yield sse(chat_chunk("id", "tiny", 0, 0, {"role": "assistant", "content": ""}, None))
        # two choices interleaved (n=2): one ends by the grammar (stop), one cut short (length)
        for first, second in zip(chunks(0, "stop"), chunks(1, "length"), strict=True):
            yield first
            yield second
        yield sse({"id": "id", "object": "chat.completion.chunk", "choices": [], "usage": {"total_tokens": 9}})
        yield sse("[DONE]")

    async def collect() -> list[str]:
        return [event async for event in tool_call_events(upstream())]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n" and '"usage"' in events[-2] and '"role"' in events[0]
    parsed = [json.loads(e.removeprefix("data: ")) for e in events[1:-2]]
    for index, reason in ((0, "tool_calls"), (1, "length")):
        mine = [c["choices"][0] for c in parsed if c["choices"][0]["index"] == index]
        assert "".join(c["delta"].get("content", "") for c in mine) == "Let me see. "
        pieces = [p for c in mine for p in c["delta"].get("tool_calls", [])]
        assert pieces[0]["function"]["name"] == "get_time" and pieces[0]["id"].startswith("call_")
        assert "".join(p["function"]["arguments"] for p in pieces) == '{"city": "Oslo"}'
        assert mine[-1]["finish_reason"] == reason and all(c["finish_reason"] is None for c in mine[:-1])
    assert not any("<tool" in json.dumps(c) for c in parsed)


# ---- the server's response_format (issue 63, items 1 and 5), on the tiny model's server ------------------------------
# The schema of the demo's Shape (chapter 29's tests use the same one).
SHAPE_SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                 "size": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["color", "size"], "additionalProperties": False}
SHAPE_SERVER_ARGS = ["--device", "cpu", "--num-kvcache-blocks", "64", "--kvcache-block-size", "16", "--max-model-len",
                     "512"]
# JSON without blanks: the tiny model, free to write blanks, would write nothing else until max_tokens.
COMPACT_BODY = {"structured_outputs": {"disable_any_whitespace": True}}
SHAPE_CHAT = [{"role": "user", "content": "Describe a shape."}]


@pytest.fixture(scope="module")
def tiny_server(tiny: Path):
    with served(tiny, *SHAPE_SERVER_ARGS) as process:
        yield process


@pytest.fixture(scope="module")
def tiny_api(tiny_server):
    return openai_client(tiny_server)


def test_parse_with_a_pydantic_model_returns_the_parsed_object(tiny_api):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Shape(BaseModel):
        color: Literal["red", "green", "blue"]
        size: int = Field(ge=1, le=9)

    reply = tiny_api.chat.completions.parse(model="tiny", messages=SHAPE_CHAT, response_format=Shape, max_tokens=40,
                                            temperature=0, extra_body=COMPACT_BODY)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Shape)
    assert Shape.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_streamed_joins_into_json(tiny_api):
    for seed in range(3):
        stream = tiny_api.chat.completions.create(model="tiny", messages=SHAPE_CHAT,
                                                  response_format={"type": "json_object"}, max_tokens=60,
                                                  temperature=0.8, seed=seed, stream=True, extra_body=COMPACT_BODY)
        chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
        assert chunks[-1].finish_reason == "stop"
        assert isinstance(json.loads("".join(c.delta.content or "" for c in chunks)), dict)


def test_json_schema_on_completions_and_structured_outputs_extra_body(tiny_api):
    schema = {"name": "shape", "schema": SHAPE_SCHEMA, "strict": True}
    reply = tiny_api.completions.create(model="tiny", prompt="A shape:", max_tokens=40, temperature=0,
                                        extra_body={"response_format": {"type": "json_schema", "json_schema": schema},
                                                    **COMPACT_BODY})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), SHAPE_SCHEMA)
    # vLLM's extra-body field, alone; and "text", which constrains nothing
    choice = tiny_api.completions.create(model="tiny", prompt="Yes?", max_tokens=8, temperature=0,
                                         extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0]
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
    plain = tiny_api.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0,
                                        extra_body={"ignore_eos": True})
    text = tiny_api.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0,
                                       extra_body={"response_format": {"type": "text"}, "ignore_eos": True})
    assert text.choices[0].text == plain.choices[0].text


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"json_schema": {}}}, "structured_outputs", "json_schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format", "both"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    # chapter 29b serves tools on chat completions: a bad parameters schema is refused there, any tools on completions
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, "tools", "tools"),
    ({"tool_choice": "auto"}, "tool_choice", "tool_choice"),
])
def test_bad_constraints_and_tools_get_400_naming_the_field(tiny_server, fields, param, words):
    import httpx

    for route, body in (("chat/completions", {"messages": SHAPE_CHAT}), ("completions", {"prompt": "Hi"})):
        reply = httpx.post(f"{tiny_server.url}/v1/{route}", json={"model": "tiny", "max_tokens": 4, **body, **fields},
                           timeout=30)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"
    assert "ignoring the request field 'response_format'" not in tiny_server.output()


def test_a_speculating_server_serves_response_format(tiny: Path, tiny_api):
    """A server that speculates constrains as one that does not: the same replies, token for token."""
    asks = [dict(messages=SHAPE_CHAT, max_tokens=40, response_format={"type": "json_object"}, extra_body=COMPACT_BODY),
            dict(messages=[{"role": "user", "content": "yes yes yes yes?"}], max_tokens=8,
                 extra_body={"structured_outputs": {"choice": ["yes", "no"]}})]
    expected = [tiny_api.chat.completions.create(model="tiny", temperature=0, **ask).choices[0] for ask in asks]
    with served(tiny, *SHAPE_SERVER_ARGS, "--speculative-method", "ngram") as process:
        speculating = openai_client(process)
        replies = [speculating.chat.completions.create(model="tiny", temperature=0, **ask).choices[0]
                   for ask in asks]
    assert [(r.message.content, r.finish_reason) for r in replies] == \
        [(e.message.content, e.finish_reason) for e in expected]
    assert isinstance(json.loads(replies[0].message.content), dict) and replies[1].message.content in ("yes", "no")
