# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown] tags=["en"]
# # 29b · Tool calls: constrained text in the template's format
#
# **Goal.** An agent sends the server a list of **tools** (functions, each with a JSON schema of
# its parameters) and lets the model decide to call one: the reply then holds `tool_calls`, the
# client runs the function, sends its result back as a `tool` message, and the model answers. For
# the model, a tool call is just text in the format its chat template taught it, here Hermes'
# `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, which Qwen2.5 and Qwen3 write.
# For the server, it is chapter 29's structured output with one more grammar: the call's frame,
# then each function's parameter schema. By the end you can say what the tiny Qwen3's and
# SmolLM2's chat templates do with `tools` (nothing) and what the server does about it, build the
# llguidance grammar for `tool_choice` `"required"`, a named function and `"auto"` (lazy: free text
# until the model opens a call), parse the text into OpenAI's `tool_calls`, stream them as
# OpenAI's deltas, and run the whole loop (call, tool result, answer) with the official `openai`
# client. First, the server learns chapter 29's constraints in the shape OpenAI's clients send
# them, `response_format`, which `chat.completions.parse` turns into a Pydantic object.

# %% [markdown] tags=["zh"]
# # 29b · 工具调用：按模板格式写出的受约束文本
#
# **目标：** 智能体（agent）把一组**工具**（tools，即函数，每个带一个描述参数的 JSON schema）发给服务器，让模型决定
# 调不调用：调用时，回复里带着 `tool_calls`，客户端运行这个函数，把结果作为一条 `tool` 消息发回来，模型再作答。对
# 模型来说，工具调用只是按它的对话模板教过的格式写出的文本，这里是 Hermes 的格式
# `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`，Qwen2.5 和 Qwen3 就这样写。对服务器来说，它就是
# 第 29 章的结构化输出，多了一个语法：调用的外框，加上每个函数的参数 schema。读完本章，你能说出小 Qwen3 和 SmolLM2 的
# 对话模板拿 `tools` 做了什么（什么也没做）以及服务器怎么应对；能为 `tool_choice` 取 `"required"`、指名一个函数和
# `"auto"`（惰性的：模型打开一个调用之前都是自由文本）构建 llguidance 的语法；能把文本解析成 OpenAI 的 `tool_calls`，
# 以 OpenAI 的增量（delta）形式流式发出；还能用官方 `openai` 客户端走完整个循环（调用、工具结果、回答）。在这之前，
# 服务器先以 OpenAI 客户端发送的形式接受第 29 章的约束，即 `response_format`，`chat.completions.parse` 把回复变成一个
# Pydantic 对象。

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "{model}: the template renders tools: {renders}": "{model}：模板会写出工具：{renders}",
    "{mode:<9} wrote {text}": "{mode:<9} 写出 {text}",
    "  fits the schema: {valid}; parsed: {calls}": "  符合 schema：{valid}；解析结果：{calls}",
    "after {written!r}: {count} tokens allowed, e.g. {shown}":
        "在 {written!r} 之后：允许 {count} 个 token，例如 {shown}",
    "deltas: {count}; reassembled: {calls}": "增量：{count} 个；拼回来：{calls}",
    "the same calls as parsed whole: {same}": "与整段解析的调用相同：{same}",
    "{choice:<9} finish_reason {reason}, {calls}": "{choice:<9} finish_reason 为 {reason}，{calls}",
    "streamed: {chunks} chunks, reassembled {calls}, finish_reason {reason}":
        "流式：{chunks} 个片段，拼回来是 {calls}，finish_reason 为 {reason}",
    "the loop's final answer ({reason}): {text}": "循环的最终回答（{reason}）：{text}",
    "refused: {error}": "被拒绝：{error}",
    "server started, asked and stopped in {seconds:.1f} s": "服务器启动、应答、停止共用 {seconds:.1f} 秒",
    "parsed: {shape!r}, finish_reason {reason}": "解析结果：{shape!r}，finish_reason 为 {reason}",
    "streamed in JSON mode: {text!r}": "JSON 模式的流式输出：{text!r}",
    "all exercise answers check out": "练习答案全部验证通过",
})

# %% [markdown] tags=["en"]
# ## The idea: a tool call is text the grammar shapes
#
# A chat template turns messages into the prompt's text; a template written for tool use also
# turns the tools into text (a system block that lists each function's schema and says how to call
# one) and the model's earlier calls and their results into turns. The model then writes a call as
# ordinary tokens:
#
# ```
#   <tool_call>                                   the frame: fixed text, every character forced
#   {"name": "get_weather", "arguments": {...}}   the name: one of the tools; the arguments: its schema
#   </tool_call>                                  then the end of the turn (or another call)
# ```
#
# Nothing in the engine is new. Chapter 29 masks each token by a grammar; here the grammar is the
# frame around one JSON schema per function, written in llguidance's Lark, where `%json {...}`
# inlines a schema. What `tool_choice` asks decides where the grammar starts:
#
# - `"required"`: a call from the first token (one or more, unless `parallel_tool_calls` is
#   false); a named function (`{"type": "function", "function": {"name": ...}}`): exactly one call
#   of that function;
# - `"auto"`: free text, or text and then calls. llguidance has **lazy** lexemes for this
#   (`head[lazy]: TEXT "<tool_call>"` matches as few bytes as it can): the text is free until the
#   model writes `<tool_call>`, and from there the call is constrained like a required one;
# - `"none"`: no grammar; the tools are still in the prompt, and nothing is parsed.
#
# The server's side is parsing: the text of the reply becomes `message.tool_calls`, the text
# before the first call stays `content`, and `finish_reason` becomes `"tool_calls"`. When
# streaming, the frame never reaches the client: it gets OpenAI's tool-call deltas.

# %% [markdown] tags=["zh"]
# ## 思路：工具调用就是由语法塑形的文本
#
# 对话模板把消息变成提示词的文本；为工具使用写的模板还把工具变成文本（一个 system 块，列出每个函数的 schema，并说明
# 怎么调用），把模型先前的调用及其结果变成对话轮次。于是模型用普通的 token 写出一个调用：
#
# ```
#   <tool_call>                                   外框：固定的文本，每个字符都是强制的
#   {"name": "get_weather", "arguments": {...}}   名字：工具之一；参数：它的 schema
#   </tool_call>                                  然后是这一轮的结束（或者下一个调用）
# ```
#
# 引擎里没有任何新东西。第 29 章用语法给每个 token 加掩码；这里的语法是每个函数一个 JSON schema，外面套上外框，用
# llguidance 的 Lark 写成，其中 `%json {...}` 可以内嵌一个 schema。`tool_choice` 要求什么，决定语法从哪里开始：
#
# - `"required"`：从第一个 token 起就是调用（一个或多个，除非 `parallel_tool_calls` 为 false）；指名一个函数
#   （`{"type": "function", "function": {"name": ...}}`）：恰好调用这个函数一次；
# - `"auto"`：自由文本，或者先是文本然后是调用。llguidance 为此提供了**惰性**（lazy）词素
#   （`head[lazy]: TEXT "<tool_call>"` 尽可能少地匹配字节）：模型写出 `<tool_call>` 之前文本是自由的，从那里起调用
#   就像 required 一样受约束；
# - `"none"`：不加语法；工具仍在提示词里，也不做解析。
#
# 服务器这边要做的是解析：回复的文本变成 `message.tool_calls`，第一个调用之前的文本留作 `content`，`finish_reason`
# 变成 `"tool_calls"`。流式输出时，外框从不发给客户端：客户端收到的是 OpenAI 的工具调用增量。

# %% [markdown] tags=["en"]
# ## What the templates do with tools
#
# `apply_chat_template(messages, tools=...)` hands the tools to the template; what happens next is
# the template's business. Our tiny Qwen3 (chapter 06) has a four-line template of its own, and
# SmolLM2-135M-Instruct's, read from its GGUF file, is the plain ChatML one. Rendered with a tool
# and without, each gives the same text: **neither template knows tools**. SmolLM2's even
# concatenates `message['content']`, so an assistant message whose content is `None` (a pure tool
# call, as OpenAI's clients send it back) fails in its template.
#
# The real Qwen3 template does know them: it writes a `# Tools` system block with each function's
# JSON in `<tools></tools>`, asks for `<tool_call>` blocks, writes the assistant's earlier calls in
# that format, and wraps each tool result in `<tool_response></tool_response>` inside a user turn.
# So the server takes three roads, decided once, by rendering a probe tool
# (`template_tool_style`):
#
# - the template renders tools and its text holds `<tool_call>`: **native**, the tools go to the
#   template;
# - the template ignores tools: **the server writes them**, as Qwen3's template would (the
#   `# Tools` block in the system message, earlier calls as `<tool_call>` text, results as
#   `<tool_response>` in a user turn), so the model at least sees them, and the grammar has the
#   same format;
# - the template renders tools in some other format (Llama 3.1's, Mistral's): refused with 400,
#   since forcing Hermes' frame on a model trained for another would be wrong.
#
# That SmolLM2-135M or a random tiny model ever *chooses* to call a tool is not to be expected:
# neither was trained for it. With `"required"` or a named function the grammar makes the call
# well-formed anyway, which is what a test needs; with `"auto"` they mostly write text.

# %% [markdown] tags=["zh"]
# ## 模板拿工具做了什么
#
# `apply_chat_template(messages, tools=...)` 把工具交给模板；接下来怎么处理是模板的事。我们的小 Qwen3（第 06 章）有
# 一个四行的自有模板，SmolLM2-135M-Instruct 的模板从它的 GGUF 文件读出，是朴素的 ChatML 模板。带一个工具和不带工具
# 各渲染一次，两者得到的文本都一样：**两个模板都不认识工具**。SmolLM2 的模板还直接拼接 `message['content']`，所以
# content 为 `None` 的 assistant 消息（纯粹的工具调用，OpenAI 的客户端就这样发回来）会在它的模板里出错。
#
# 真正的 Qwen3 模板是认识工具的：它写出一个 `# Tools` system 块，把每个函数的 JSON 放进 `<tools></tools>`，要求以
# `<tool_call>` 块调用，用这个格式写出 assistant 先前的调用，并把每个工具结果包在 user 轮次里的
# `<tool_response></tool_response>` 中。所以服务器有三条路，用一个探测工具渲染一次就定下来（`template_tool_style`）：
#
# - 模板会写出工具，而且文本里有 `<tool_call>`：**原生**（native），工具交给模板；
# - 模板忽略工具：**由服务器写出工具**，像 Qwen3 的模板那样（system 消息里的 `# Tools` 块，先前的调用写成
#   `<tool_call>` 文本，结果写成 user 轮次里的 `<tool_response>`），这样模型至少能看到它们，语法也是同一个格式；
# - 模板用别的格式（Llama 3.1 的、Mistral 的）写出工具：以 400 拒绝，因为把 Hermes 的外框强加给按另一种格式训练的
#   模型是错的。
#
# 不要指望 SmolLM2-135M 或随机权重的小模型会*主动*调用工具：它们都没有为此训练过。用 `"required"` 或指名一个函数时，
# 语法照样让调用格式正确，测试要的正是这一点；用 `"auto"` 时它们大多写文本。

# %%
import json

import jsonschema

from nanovllm.book.smollm2 import smollm2_dir
from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.engine.inputs import load_tokenizer

# en: The tools' system block is long in the tiny model's 512 tokens of BPE (about 770 tokens): room for 2,048.
# zh: 在小模型只有 512 个 token 的 BPE 里，工具的 system 块很长（约 770 个 token）：给它留出 2,048 的位置。
tiny = build_tiny_model("qwen3", max_position_embeddings=2048)
tokenizer = load_tokenizer(str(tiny))
tokenizer.model_max_length = 2048
smol_tokenizer = load_tokenizer(str(smollm2_dir()))
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"enum": ["Paris", "Rome", "Oslo"]}},
                                               "required": ["city"], "additionalProperties": False}}}]
question = [{"role": "user", "content": "What is the weather in Paris?"}]
for name, model_tokenizer in (("tiny Qwen3", tokenizer), ("SmolLM2", smol_tokenizer)):
    plain = model_tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    with_tools = model_tokenizer.apply_chat_template(question, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    print(say("{model}: the template renders tools: {renders}", model=name, renders=plain != with_tools))
    assert plain == with_tools

# %% [markdown] tags=["en"]
# ## Build it: the format
#
# The new module, `nanovllm.serve.tool_calls`, starts with OpenAI's shapes (pydantic, strict as
# chapter 22's are: a tool's `type` must be `"function"`, a name must follow OpenAI's rule of 64
# letters, digits, `_` and `-`, which also keeps it safe inside a grammar's literal) and the text of
# Hermes' format.

# %% [markdown] tags=["zh"]
# ## 动手实现：格式
#
# 新模块 `nanovllm.serve.tool_calls` 先定义 OpenAI 的数据形状（用 pydantic，和第 22 章一样严格：工具的 `type` 必须是
# `"function"`，名字必须符合 OpenAI 的规则，至多 64 个字母、数字、`_` 和 `-`，这也保证它放进语法的字面量里是安全
# 的），以及 Hermes 格式的文本。

# %% default module
#| default_exp serve.tool_calls

# %% tool shapes
#| export
"""Tool calls: OpenAI's tools as text in Hermes' format (Qwen's), the grammar that constrains a call, and the parser
that turns the text back into ``tool_calls`` (chapter 29b)."""
# zh: 工具调用：把 OpenAI 的工具写成 Hermes 格式（Qwen 的格式）的文本、约束调用的语法，以及把文本变回
# zh: ``tool_calls`` 的解析器（第 29b 章）。
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# en: OpenAI's rule for a function's name; a name that follows it is safe inside the grammar's literals.
# zh: OpenAI 对函数名的规则；符合它的名字放进语法的字面量里是安全的。
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
# en: The tags around a call in Hermes' format, which Qwen2.5 and Qwen3 write.
# zh: Hermes 格式里包住一个调用的标签，Qwen2.5 和 Qwen3 就这样写。
OPEN, CLOSE = "<tool_call>", "</tool_call>"


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    # en: A JSON schema of the arguments (an object); none: the function takes no arguments.
    # zh: 参数的 JSON schema（一个对象）；没有时，函数不带参数。
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    """One of a request's ``tools``: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""
    # zh: 请求的 ``tools`` 之一：``{"type": "function", "function": {"name", "description", "parameters"}}``。

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name": ...}}``."""
    # zh: 指名一个函数的 ``tool_choice``：``{"type": "function", "function": {"name": ...}}``。

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    # en: JSON text, as OpenAI sends it.
    # zh: JSON 文本，OpenAI 就这样发送。
    arguments: str


class ToolCallMessage(BaseModel):
    """A call that an assistant's message made, as a client sends the conversation back."""
    # zh: assistant 消息中的一个调用，客户端把对话发回来时就是这个形状。

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"]
    function: FunctionCall


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and what it asks of them: ``mode`` is "none", "auto", "required" or "named" (the
    function ``name``); ``parallel``: more than one call may come (``parallel_tool_calls``)."""
    # zh: 一个对话请求的工具和它对工具的要求：``mode`` 是 "none"、"auto"、"required" 或 "named"（即函数
    # zh: ``name``）；``parallel``：可以有不止一个调用（``parallel_tool_calls``）。

    tools: list[ToolDefinition]
    mode: Literal["none", "auto", "required", "named"] = "auto"
    name: str | None = None
    parallel: bool = True

    def offered(self) -> list[tuple[int, FunctionDefinition]]:
        """The functions a call may name, with their index in ``tools``: the named one, or all of them."""
        # zh: 调用可以指名的函数及其在 ``tools`` 中的下标：指名的那一个，或者全部。
        return [(i, tool.function) for i, tool in enumerate(self.tools)
                if self.mode != "named" or tool.function.name == self.name]

    def schemas(self) -> list[dict[str, Any]]:
        """The tools as plain JSON, as a chat template reads them."""
        # zh: 工具的纯 JSON 形式，对话模板就这样读取它们。
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


# %% [markdown] tags=["en"]
# The text of a call is the one Qwen3's template writes for an earlier call: the name, then the
# arguments as JSON with `json.dumps`' separators (`", "` and `": "`). `tools_prompt` is the system
# block a tool-aware Qwen template writes; the server writes it itself for a template that ignores
# tools. `template_tool_style` renders a probe tool once to tell the three roads apart.

# %% [markdown] tags=["zh"]
# 调用的文本就是 Qwen3 模板为先前的调用写出的那种：先是名字，然后是参数，参数是用 `json.dumps` 的分隔符（`", "` 和
# `": "`）写成的 JSON。`tools_prompt` 是认识工具的 Qwen 模板写出的 system 块；遇到忽略工具的模板，服务器自己写出它。
# `template_tool_style` 用一个探测工具渲染一次，分辨三条路。

# %% tool format
#| export
# en: What a call's arguments look like: JSON with json.dumps' separators, as the templates write earlier calls.
# zh: 调用参数的样子：用 json.dumps 的分隔符写成的 JSON，和模板写出先前调用时一样。
ARGUMENT_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# en: A tool that only probes what a chat template does with tools.
# zh: 只用来探测对话模板怎样处理工具的工具。
PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "A probe.",
                                               "parameters": {"type": "object", "properties": {}}}}


def call_head(name: str) -> str:
    """A call's JSON up to its arguments: ``{"name": "get_weather", "arguments": ``."""
    # zh: 一个调用的 JSON 直到参数之前的部分：``{"name": "get_weather", "arguments": ``。
    return f'{{"name": {json.dumps(name)}, "arguments": '


def call_text(name: str, arguments: str) -> str:
    """One call in Hermes' format: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``."""
    # zh: Hermes 格式的一个调用：``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``。
    return f"{OPEN}\n{call_head(name)}{arguments}}}\n{CLOSE}"


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The system block that lists the tools and asks for calls in Hermes' format, as Qwen's templates write it."""
    # zh: 列出工具、要求以 Hermes 格式调用的 system 块，和 Qwen 的模板写的一样。
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function "
            "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def template_tool_style(tokenizer: Any) -> Literal["native", "server"] | None:
    """How the chat template of ``tokenizer`` takes tools: "native" when it writes them and Hermes' ``<tool_call>``
    itself, "server" when it ignores them (the server then writes them: `conversation`), None when it writes them
    in another format, or cannot render a conversation at all."""
    # zh: ``tokenizer`` 的对话模板怎样接收工具："native" 表示它自己写出工具和 Hermes 的 ``<tool_call>``；"server"
    # zh: 表示它忽略工具（于是由服务器写出：见 `conversation`）；None 表示它用别的格式写出工具，或者根本渲染不了
    # zh: 对话。
    probe = [{"role": "user", "content": "Hi"}]
    try:
        plain = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        with_tools = tokenizer.apply_chat_template(probe, tools=[PROBE_TOOL], tokenize=False,
                                                   add_generation_prompt=True)
    # en: jinja raises what it likes; a template that cannot render this cannot serve tools.
    # zh: jinja 想抛什么就抛什么；连这个都渲染不了的模板，服务不了工具。
    except Exception:
        return None
    if plain == with_tools:
        return "server"
    return "native" if OPEN in with_tools else None


def conversation(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 native: bool) -> list[dict[str, Any]]:
    """The messages as the chat template should get them. ``messages``: dicts with "role", "content" (text), and
    "tool_calls" (OpenAI's, arguments as JSON text) or "tool_call_id" where given. ``native``: the template writes
    tools itself, and gets each call's arguments as a dict. Otherwise the server writes Qwen's format: the tools
    in the system message, earlier calls as text, and each run of tool results as one user turn."""
    # zh: 对话模板应当收到的消息。``messages``：字典，带 "role"、"content"（文本），以及给出时的 "tool_calls"
    # zh: （OpenAI 的形状，参数是 JSON 文本）或 "tool_call_id"。``native``：模板自己写出工具，每个调用的参数以
    # zh: 字典交给它。否则由服务器写出 Qwen 的格式：工具写进 system 消息，先前的调用写成文本，每一串工具结果合成
    # zh: 一个 user 轮次。
    if native:
        return [{**message, "tool_calls": [{**call, "function": {**call["function"], "arguments": json.loads(
            call["function"]["arguments"])}} for call in message["tool_calls"]]} if message.get("tool_calls")
            else message for message in messages]
    rendered: list[dict[str, Any]] = []
    results: list[str] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            results.append(f"<tool_response>\n{content}\n</tool_response>")
            continue
        if results:
            rendered.append({"role": "user", "content": "\n".join(results)})
            results = []
        calls = [call_text(call["function"]["name"], call["function"]["arguments"])
                 for call in message.get("tool_calls") or []]
        rendered.append({"role": role, "content": "\n".join([content, *calls] if content else calls)})
    if results:
        rendered.append({"role": "user", "content": "\n".join(results)})
    if tools:
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{tools_prompt(tools)}"}
        else:
            rendered.insert(0, {"role": "system", "content": tools_prompt(tools)})
    return rendered


# %% [markdown] tags=["en"]
# Both models' templates ignore tools, so the server writes them. The conversation of a whole loop
# (the question, the assistant's call with `content` None, the tool's result) renders in SmolLM2's
# template, which would have failed on the `None`:

# %% [markdown] tags=["zh"]
# 两个模型的模板都忽略工具，所以由服务器写出。一个完整循环的对话（问题、`content` 为 None 的 assistant 调用、工具的
# 结果）在 SmolLM2 的模板里也能渲染，否则它会在那个 `None` 上出错：

# %%
from jinja2 import TemplateError

from nanovllm.serve.tool_calls import call_text, conversation, template_tool_style

assert template_tool_style(tokenizer) == template_tool_style(smol_tokenizer) == "server"
loop = [*question, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear", "high": 21}'}]
try:
    smol_tokenizer.apply_chat_template(loop, tokenize=False)
    raise AssertionError("SmolLM2's template rendered a message without content")
# en: transformers 5.24 raises a TemplateError there; 5.17, on the GPU machine, lets jinja's TypeError through.
# zh: transformers 5.24 在这里抛出 TemplateError；GPU 机器上的 5.17 则让 jinja 的 TypeError 直接抛出来。
except (TemplateError, TypeError) as error:
    print(say("refused: {error}", error=f"SmolLM2's own template: {error}"))
rendered = smol_tokenizer.apply_chat_template(conversation(loop, TOOLS, native=False), tokenize=False,
                                              add_generation_prompt=True)
print(rendered.replace(json.dumps(TOOLS[1]), "{...get_time...}"))
assert call_text("get_weather", '{"city": "Paris", "days": 1}') in rendered and "<tool_response>" in rendered

# %% [markdown] tags=["en"]
# ## Build it: the grammar
#
# One rule per offered function: its frame text up to the arguments, then `%json` with the
# function's schema, laid out as the templates write arguments (`ARGUMENT_LAYOUT` goes into the
# schema as llguidance's `x-guidance` options: no free blanks, which also keeps a small model from
# writing blanks forever). A function without `parameters` takes `{}` only. Then the start rule by
# `tool_choice`:
#
# ```
#   required:  start: "<tool_call>" body ("\n<tool_call>" body)*      one or more calls
#   named:     start: "<tool_call>" body                              one call, one function offered
#   auto:      start: TEXT | head body ("\n<tool_call>" body)*        free text, or text then calls
#              head[lazy]: TEXT "<tool_call>"
#   body:      "\n" (call_0 | call_1 | ...) "\n</tool_call>"
# ```
#
# `parallel_tool_calls: false` drops the repetition. After the last call the grammar is complete,
# so the next token can only be the end of the turn.

# %% [markdown] tags=["zh"]
# ## 动手实现：语法
#
# 每个提供的函数一条规则：先是直到参数为止的外框文本，然后是 `%json` 加上这个函数的 schema，排版和模板写参数时一样
# （`ARGUMENT_LAYOUT` 作为 llguidance 的 `x-guidance` 选项放进 schema：不允许随意的空白，这也让小模型不会一直写空白）。
# 没有 `parameters` 的函数只接受 `{}`。然后按 `tool_choice` 定下起始规则：
#
# ```
#   required:  start: "<tool_call>" body ("\n<tool_call>" body)*      一个或多个调用
#   named:     start: "<tool_call>" body                              一个调用，只提供一个函数
#   auto:      start: TEXT | head body ("\n<tool_call>" body)*        自由文本，或者先文本后调用
#              head[lazy]: TEXT "<tool_call>"
#   body:      "\n" (call_0 | call_1 | ...) "\n</tool_call>"
# ```
#
# `parallel_tool_calls: false` 去掉重复。最后一个调用之后语法就完整了，所以下一个 token 只能是这一轮的结束。

# %% tool grammar
#| export
def arguments_schema(function: FunctionDefinition) -> dict[str, Any]:
    """The JSON schema a call's arguments must fit, laid out as the templates write them (`ARGUMENT_LAYOUT`)."""
    # zh: 调用参数必须符合的 JSON schema，排版和模板写出的一样（`ARGUMENT_LAYOUT`）。
    schema = function.parameters
    if schema is None:
        schema = {"type": "object", "properties": {}, "additionalProperties": False}
    return {**schema, "x-guidance": ARGUMENT_LAYOUT}


def tool_call_grammar(functions: list[FunctionDefinition], mode: str, parallel: bool = True) -> str:
    """llguidance's Lark grammar of the calls ``mode`` asks for ("auto", "required" or "named"), each naming one of
    ``functions`` with arguments that fit its schema; "auto" also takes free text, lazily: constrained once the text
    opens a call."""
    # zh: ``mode``（"auto"、"required" 或 "named"）所要求的调用的 llguidance Lark 语法，每个调用指名 ``functions``
    # zh: 之一，参数符合它的 schema；"auto" 还接受自由文本，惰性地：文本一旦打开调用，就受约束。
    # en: json.dumps writes each literal as a Lark string: quotes and newlines escaped.
    # zh: json.dumps 把每个字面量写成 Lark 字符串：引号和换行都已转义。
    rules = [f'call_{i}: {json.dumps(call_head(f.name))} %json {json.dumps(arguments_schema(f))} "}}"'
             for i, f in enumerate(functions)]
    calls = " | ".join(f"call_{i}" for i in range(len(functions)))
    body = f"body: {json.dumps(chr(10))} ({calls}) {json.dumps(chr(10) + CLOSE)}"
    more = f" ({json.dumps(chr(10) + OPEN)} body)*" if parallel and mode != "named" else ""
    if mode == "auto":
        start = [f"start: TEXT | head body{more}", f'head[lazy]: TEXT {json.dumps(OPEN)}', r"TEXT: /(.|\n)*/"]
    else:
        start = [f"start: {json.dumps(OPEN)} body{more}"]
    return "\n".join([*start, body, *rules]) + "\n"


# %% [markdown] tags=["en"]
# The grammars on the tiny model, offline, through chapter 29's
# `StructuredOutputsParams(grammar=...)`: `"required"` with both tools, the named `get_time`, and
# `"auto"`. The first two come out as calls whose arguments validate against their schemas
# (`jsonschema`, a reader independent of llguidance); the random model under `"auto"` writes text.

# %% [markdown] tags=["zh"]
# 在小模型上离线试这些语法，走第 29 章的 `StructuredOutputsParams(grammar=...)`：带两个工具的 `"required"`、指名的
# `get_time`，以及 `"auto"`。前两个得到的是调用，参数能通过各自 schema 的校验（用 `jsonschema`，一个独立于
# llguidance 的读者）；随机权重的模型在 `"auto"` 下写的是文本。

# %%
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm.serve.tool_calls import ToolDefinition, ToolRequest, tool_call_grammar

definitions = [ToolDefinition.model_validate(tool) for tool in TOOLS]
asks = {"required": ToolRequest(definitions, "required", parallel=False),
        "named": ToolRequest(definitions, "named", "get_time"), "auto": ToolRequest(definitions, "auto")}
grammars = {mode: tool_call_grammar([function for _, function in ask.offered()], ask.mode, ask.parallel)
            for mode, ask in asks.items()}
print(grammars["auto"].replace(json.dumps(WEATHER), "{...weather schema...}"))
llm = LLM(str(tiny), device="cpu", max_model_len=2048)
prompt = tokenizer.apply_chat_template(conversation(question, [t.model_dump() for t in definitions], native=False),
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
outputs = {mode: llm.generate([prompt], SamplingParams(temperature=0, max_tokens=80, structured_outputs=(
    StructuredOutputsParams(grammar=grammar))), use_tqdm=False)[0]["text"] for mode, grammar in grammars.items()}
# en: ascii(): the random model's text holds any character, Chinese ones too, which the English page would not print.
# zh: ascii()：随机模型的文本什么字符都有，也有中文字符，而英文页面不该打印中文。
for mode, text in outputs.items():
    print(say("{mode:<9} wrote {text}", mode=mode, text=ascii(text[:90])))

# %% [markdown] tags=["en"]
# Where `"auto"` turns strict: a fresh matcher of its grammar follows some text, then the opening
# tag. Before the tag nearly every token is allowed; right after it, only the tokens that spell
# the frame's next characters, `\n{"name": "`.

# %% [markdown] tags=["zh"]
# `"auto"` 在哪里变严格：让它语法的一个新匹配器读入一些文本，再读入开标签。标签之前几乎每个 token 都允许；紧接着
# 标签之后，只允许拼出外框下几个字符 `\n{"name": "` 的 token。

# %%
import torch
from llguidance import LLMatcher

from nanovllm.engine.grammars import allowed_tokens, bitmask_words, fill_bitmask

grammars_of_llm = llm.model_runner.grammars
matcher = LLMatcher(grammars_of_llm.tokenizer, StructuredOutputsParams(grammar=grammars["auto"]).llguidance_grammar)
allowed_counts = []
for written in ("Let me check. ", "<tool_call>"):
    assert matcher.consume_tokens(tokenizer.encode(written, add_special_tokens=False))
    bitmask = torch.zeros(1, bitmask_words(grammars_of_llm.vocab_size), dtype=torch.int32)
    fill_bitmask(matcher, bitmask, 0)
    allowed = allowed_tokens(bitmask[0], grammars_of_llm.vocab_size).nonzero().flatten().tolist()
    allowed_counts.append(len(allowed))
    print(say("after {written!r}: {count} tokens allowed, e.g. {shown}", written=written, count=len(allowed),
              shown=[tokenizer.decode([t]) for t in allowed[:6]]))
# en: Before the tag: every token of text (not those that hold half a UTF-8 character) and the ends of the turn;
# en: after it: only the frame.
# zh: 标签之前：每个文本 token（只装了半个 UTF-8 字符的除外）和这一轮的结束 token 都允许；标签之后：只有外框。
assert allowed_counts[0] > 400
assert allowed and all('\n{"name": "'.startswith(tokenizer.decode([t])) for t in allowed)

# %% [markdown] tags=["en"]
# ## Build it: parsing, whole and streamed
#
# The server parses what the model wrote back into OpenAI's shape. One parser serves both ways of
# answering, so that they cannot disagree: `ToolCallStream` takes the text as it comes and returns
# OpenAI's delta for each piece. Text before the first call is `content`, except its last few
# characters while they could be the start of `<tool_call>` (held back, as chapter 22 holds back a
# possible stop string). Inside a call, the name is sent once the frame up to `"arguments": ` has
# arrived, with the call's new `id`; then the arguments go out as they grow, holding back what
# could be the closing `}\n</tool_call>` (a raw newline cannot occur inside compact JSON, so that
# text cannot be part of the arguments). `parse_tool_calls` feeds the whole text at once. A call
# cut short (`max_tokens`) is no call: the non-streamed reply keeps the text as `content`, as vLLM
# does; a stream has sent its first pieces already, and ends with `finish_reason` `"length"`.

# %% [markdown] tags=["zh"]
# ## 动手实现：解析，整段的和流式的
#
# 服务器把模型写出的文本解析回 OpenAI 的形状。两种作答方式共用一个解析器，这样它们不会不一致：`ToolCallStream`
# 随文本到来逐段接收，为每一段返回 OpenAI 的增量。第一个调用之前的文本是 `content`，只是最后几个字符在它们可能是
# `<tool_call>` 的开头时先扣住（就像第 22 章扣住可能的停止字符串）。在调用里面，等到直到 `"arguments": ` 的外框到齐，
# 就连同调用的新 `id` 发出名字；然后参数随着增长发出，扣住可能是结尾 `}\n</tool_call>` 的部分（紧凑的 JSON 里不会
# 出现未转义的换行，所以那段文本不可能属于参数）。`parse_tool_calls` 把整段文本一次喂进去。被截断（`max_tokens`）的
# 调用不算调用：不流式的回复把文本留作 `content`，和 vLLM 一样；流式输出已经发出了前面几段，以 `finish_reason`
# `"length"` 结束。

# %% tool parser
#| export
# en: The frame from the opening tag to the arguments, and from the arguments to the closing tag.
# zh: 从开标签到参数的外框，以及从参数到闭标签的外框。
CALL_HEAD = re.compile(r'\n\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')
CALL_END = "}\n" + CLOSE


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``: they wait for the next piece."""
    # zh: ``text`` 末尾有几个字符可能是 ``tag`` 的开头：它们等下一段到来。
    return next((size for size in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:size])), 0)


@dataclass
class ToolCall:
    name: str
    arguments: str = ""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        """The call as OpenAI's ``message.tool_calls`` holds it."""
        # zh: OpenAI 的 ``message.tool_calls`` 中这个调用的形状。
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallStream:
    """One choice's text, as it comes, turned into OpenAI's deltas: ``content`` before the first call, then
    ``tool_calls`` pieces (the first of each call with its id, type and name, then its arguments as they grow). The
    tags never reach the client."""
    # zh: 一个 choice 的文本随到随转成 OpenAI 的增量：第一个调用之前是 ``content``，之后是 ``tool_calls`` 的片段（每个
    # zh: 调用的第一段带 id、type 和名字，然后是随着增长的参数）。标签从不发给客户端。

    def __init__(self) -> None:
        self.pending = ""
        self.calls: list[ToolCall] = []
        # en: Inside a call: after its opening tag, before its closing one.
        # zh: 在调用里面：开标签之后，闭标签之前。
        self.in_call = False
        self.named = False

    def feed(self, text: str, final: bool = False) -> dict[str, Any]:
        """The delta for ``text``, the choice's next piece (``final``: the last one; nothing is held back)."""
        # zh: ``text``（这个 choice 的下一段）对应的增量（``final``：最后一段，什么也不扣住）。
        self.pending += text
        content, pieces = "", []
        while True:
            if not self.in_call:
                at = self.pending.find(OPEN)
                end = at if at >= 0 else len(self.pending) - (0 if final else held_back(self.pending, OPEN))
                # en: Text between calls is the separator the grammar allows; only text before them is content.
                # zh: 调用之间的文本是语法允许的分隔符；只有调用之前的文本才是 content。
                if not self.calls:
                    content += self.pending[:end]
                self.pending = self.pending[end:]
                if at < 0:
                    break
                self.pending, self.in_call, self.named = self.pending[len(OPEN):], True, False
            elif not self.named:
                head = CALL_HEAD.match(self.pending)
                if head is None:
                    break
                call = ToolCall(head[1])
                self.calls.append(call)
                self.pending, self.named = self.pending[head.end():], True
                pieces.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            else:
                at = self.pending.find(CALL_END)
                end = at if at >= 0 else len(self.pending) - held_back(self.pending, CALL_END)
                if end:
                    self.calls[-1].arguments += self.pending[:end]
                    pieces.append({"index": len(self.calls) - 1, "function": {"arguments": self.pending[:end]}})
                self.pending = self.pending[end:]
                if at < 0:
                    break
                self.pending, self.in_call = self.pending[len(CALL_END):], False
        return {**({"content": content} if content else {}), **({"tool_calls": pieces} if pieces else {})}


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """``text`` as a reply: the content before the first call (None if blank) and the calls; a call cut short makes
    no call, and the whole text stays the content."""
    # zh: 把 ``text`` 当作回复：第一个调用之前的内容（空白时为 None）和各个调用；被截断的调用不算调用，整段文本仍是
    # zh: 内容。
    stream = ToolCallStream()
    content = stream.feed(text, final=True).get("content")
    if stream.in_call or not stream.calls:
        return text, []
    return (content if content and content.strip() else None), stream.calls


# %% [markdown] tags=["en"]
# The required and named outputs above, parsed whole, and the named one streamed token by token
# as the detokenizer would pass it: the deltas join into the same call, and no piece holds a tag.

# %% [markdown] tags=["zh"]
# 把上面 required 和指名函数的输出整段解析；再把指名函数的输出像去分词器那样逐 token 流式喂入：增量拼起来是同一个
# 调用，而且没有哪一段含有标签。

# %%
from nanovllm.serve.tool_calls import ToolCallStream, parse_tool_calls

schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
for mode in ("required", "named"):
    content, calls = parse_tool_calls(outputs[mode])
    valid = bool(calls) and all(jsonschema.Draft202012Validator(schemas[c.name]).is_valid(json.loads(c.arguments))
                                for c in calls)
    print(say("  fits the schema: {valid}; parsed: {calls}", valid=valid,
              calls=[(c.name, c.arguments) for c in calls]))
    assert valid and content is None
assert [c.name for c in parse_tool_calls(outputs["named"])[1]] == ["get_time"]
assert parse_tool_calls(outputs["auto"]) == (outputs["auto"], [])

stream = ToolCallStream()
token_ids = tokenizer.encode(outputs["named"], add_special_tokens=False)
deltas = [stream.feed(tokenizer.decode(token_ids[i : i + 1])) for i in range(len(token_ids))]
deltas.append(stream.feed("", final=True))
pieces = [piece for delta in deltas for piece in delta.get("tool_calls", [])]
joined = {"name": pieces[0]["function"]["name"], "arguments": "".join(p["function"]["arguments"] for p in pieces)}
print(say("deltas: {count}; reassembled: {calls}", count=len(pieces), calls=joined))
whole = parse_tool_calls(outputs["named"])[1][0]
print(say("the same calls as parsed whole: {same}", same=(joined["name"], joined["arguments"]) == (
    whole.name, whole.arguments)))
assert (joined["name"], joined["arguments"]) == (whole.name, whole.arguments)
assert not any("content" in delta for delta in deltas) and "<" not in joined["arguments"]
llm.exit()

# %% [markdown] tags=["en"]
# ## A real model's choice: SmolLM2
#
# The random tiny model shows that the grammar holds; SmolLM2-135M-Instruct shows what it leaves to
# the model. Asked the time in Tokyo, with the tools in the server's system block, under `"auto"`
# it answers in text (an invented time: it was never trained to call tools, so it does not); under
# `"required"` the grammar forces the frame, and the model fills in what the frame leaves open: it
# picks `get_time` out of the two functions, and `Tokyo` as the city, from the question.

# %% [markdown] tags=["zh"]
# ## 真实模型的选择：SmolLM2
#
# 随机权重的小模型说明语法守得住；SmolLM2-135M-Instruct 则说明语法把什么留给了模型。问它东京现在几点，工具放在
# 服务器写的 system 块里：在 `"auto"` 下它用文本回答（编造了一个时间：它从没被训练过调用工具，所以不会调用）；在
# `"required"` 下语法强制了外框，模型填写外框留出的部分：它从两个函数里挑出 `get_time`，又从问题里取出 `Tokyo`
# 作为城市。

# %%
CITY_NAME = {"type": "string", "maxLength": 20}
SMOL_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast in a city.",
                                      "parameters": {**WEATHER, "properties": {**WEATHER["properties"],
                                                                               "city": CITY_NAME}}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a city.", "parameters": {
        "type": "object", "properties": {"city": CITY_NAME}, "required": ["city"], "additionalProperties": False}}}]
smol = LLM(str(smollm2_dir()), device="cpu", max_model_len=1024)
smol_ask = conversation([{"role": "user", "content": "What time is it in Tokyo?"}], SMOL_TOOLS, native=False)
smol_prompt = smol_tokenizer.apply_chat_template(smol_ask, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
smol_definitions = [ToolDefinition.model_validate(tool) for tool in SMOL_TOOLS]
smol_params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(
    grammar=tool_call_grammar([function for _, function in ToolRequest(smol_definitions, mode).offered()], mode,
                              parallel=False))) for mode in ("auto", "required")]
smol_auto, smol_required = (output["text"] for output in smol.generate([smol_prompt] * 2, smol_params,
                                                                        use_tqdm=False))
smol.exit()
for mode, text in (("auto", smol_auto), ("required", smol_required)):
    print(say("{mode:<9} wrote {text}", mode=mode, text=ascii(text)))
smol_calls = parse_tool_calls(smol_required)[1]
assert parse_tool_calls(smol_auto) == (smol_auto, [])
assert [(c.name, json.loads(c.arguments)) for c in smol_calls] == [("get_time", {"city": "Tokyo"})]

# %% [markdown] tags=["en"]
# ## Serving it: response_format
#
# Chapter 22's server refused `response_format` by name. OpenAI's clients send it in two shapes:
# `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}`, which
# becomes `StructuredOutputsParams(json=schema)`, and `{"type": "json_object"}`, which becomes
# `json_object=True`; `{"type": "text"}` asks for nothing. vLLM's own extra-body field
# `structured_outputs` (`{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`) takes the
# same road, and, as in vLLM, it may also just add `disable_any_whitespace` to a `response_format`.
# `tools` and `tool_choice` are the next section's.
#
# Two things are new on the server's side. **Where it compiles**: a schema becomes llguidance's
# grammar when its `StructuredOutputsParams` is made, in about a millisecond, bounded by
# llguidance's own limits (`grammar_limits()`, an `LLParserLimits`: a hostile schema is refused, not
# compiled for seconds). Still, the event loop serves every other stream, so the request's sampling
# parameters are now built on the thread that tokenizes (`Api.off_loop`), and `Api.constrained` adds
# the constraint there. That moves one line of chapter 22's `Api.generate`, which is written again
# below (no member of chapter 22 runs off the loop after tokenizing). **What a bad constraint gets**:
# 400 in OpenAI's shape, with `param` naming the field (`response_format` or `structured_outputs`)
# and the message llguidance's reason.
#
# Chapter 22's `NOT_IMPLEMENTED` loses the two names with `-=`, a line that runs after the set is
# made, so the set is not written again; and the two fields are marked as logged already, so that the
# server never logs them as fields it does not know.

# %% [markdown] tags=["zh"]
# ## 用于服务：response_format
#
# 第 22 章的服务器按名字拒绝 `response_format`。OpenAI 的客户端以两种形式发送它：
# `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}` 变成
# `StructuredOutputsParams(json=schema)`，`{"type": "json_object"}` 变成 `json_object=True`；`{"type": "text"}` 什么也
# 不要求。vLLM 自己的额外请求体字段 `structured_outputs`（`{"json" | "regex" | "choice" | "grammar" | "json_object":
# ...}`）走同一条路；和 vLLM 一样，它也可以只给 `response_format` 加上 `disable_any_whitespace`。`tools` 和
# `tool_choice` 留给下一节。
#
# 服务器一侧有两件新事。**在哪里编译**：创建 `StructuredOutputsParams` 时，schema 就编译成 llguidance 的语法，大约一
# 毫秒，并受 llguidance 自己的限额约束（`grammar_limits()`，一个 `LLParserLimits`：恶意的 schema 会被拒绝，而不是被
# 编译好几秒）。即便如此，事件循环还要服务其他所有的流，所以请求的采样参数现在在负责分词的线程上构建（`Api.off_loop`），
# 由 `Api.constrained` 在那里加上约束。这把第 22 章 `Api.generate` 里的一行挪了位置，下面重写了这个方法（第 22 章没有
# 哪个成员在分词之后还在事件循环之外运行）。**错误的约束得到什么**：OpenAI 形式的 400，`param` 指明字段
# （`response_format` 或 `structured_outputs`），消息是 llguidance 给出的原因。
#
# 第 22 章的 `NOT_IMPLEMENTED` 用 `-=` 去掉这两个名字：这一行在集合建好之后运行，集合本身不用重写；这两个字段还被标记为
# 已经记录过，服务器不会把它们当作不认识的字段写进日志。

# %% response format
#| export serve.protocol
from typing import Any

from nanovllm.book.literate import add_to_class
from nanovllm.sampling_params import CONSTRAINTS
from nanovllm.serve.protocol import NOT_IMPLEMENTED, SamplingRequest, ServerError

# en: Implemented from chapter 29 on: out of chapter 22's refused names (`-=` runs after the set is made; the set is
# en: not written again).
# zh: 从第 29 章起已经实现：移出第 22 章拒绝的名字（`-=` 在集合建好之后运行，集合本身不用重写）。
NOT_IMPLEMENTED -= {"response_format", "structured_outputs"}
# en: What the extra-body field ``structured_outputs`` may hold besides a constraint.
# zh: 额外请求体字段 ``structured_outputs`` 除了约束之外还可以带的选项。
CONSTRAINT_OPTIONS = ("disable_any_whitespace",)


def response_format_fields(value: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as `StructuredOutputsParams` fields: ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}`` gives ``json``, ``{"type": "json_object"}`` gives ``json_object``, and
    ``{"type": "text"}`` no constraint (None)."""
    # zh: OpenAI 的 ``response_format`` 换成 `StructuredOutputsParams` 的字段：``json_schema`` 给出 ``json``，
    # zh: ``json_object`` 给出 ``json_object``，``text`` 不加约束（None）。
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ServerError(400, "response_format.json_schema.schema must be a JSON schema (an object)",
                              param="response_format")
        return {"json": schema}
    raise ServerError(400, f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                      param="response_format")


@add_to_class(SamplingRequest)
def constraint_fields(self) -> tuple[str, dict[str, Any]] | None:
    """What the request's output must match, not yet compiled: the field that asks (``response_format``, or vLLM's
    ``structured_outputs``) and `StructuredOutputsParams`' fields; None for no constraint."""
    # zh: 请求的输出必须匹配什么（尚未编译）：提出要求的字段（``response_format`` 或 vLLM 的 ``structured_outputs``）和
    # zh: `StructuredOutputsParams` 的字段；不加约束时为 None。
    extra = self.model_extra or {}
    options = extra.get("structured_outputs")
    if options is not None and not isinstance(options, dict):
        raise ServerError(400, "structured_outputs must be an object", param="structured_outputs")
    options = dict(options or {})
    unknown = [name for name in options if name not in (*CONSTRAINTS, *CONSTRAINT_OPTIONS)]
    if unknown:
        raise ServerError(400, f"structured_outputs takes {', '.join((*CONSTRAINTS, *CONSTRAINT_OPTIONS))}; got "
                          f"{', '.join(map(repr, unknown))}", param="structured_outputs")
    asked = response_format_fields(extra["response_format"]) if extra.get("response_format") is not None else None
    if asked is None:
        return ("structured_outputs", options) if options else None
    given = [name for name in CONSTRAINTS if options.get(name) not in (None, False)]
    if given:
        raise ServerError(400, f"response_format and structured_outputs.{given[0]} both constrain the output: give "
                          "one of them", param="response_format")
    return "response_format", {**options, **asked}


# %% serve constraints
#| export serve.app
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm.serve.app import Api, Generation
from nanovllm.serve.protocol import SamplingRequest, ServerError, now, request_id


@add_to_init(Api)
def _init_constraints(self) -> None:
    # en: Fields this server knows: marked as logged already, they are never logged as unknown ones.
    # zh: 服务器认识的字段：先标记为已记录，它们就不会被当作不认识的字段写进日志。
    self.ignored |= {"response_format", "structured_outputs"}


@add_to_class(Api)
def constrained(self, body: SamplingRequest, params: SamplingParams) -> SamplingParams:
    """``params`` with the constraint that ``body`` asks for, compiled and checked (on the tokenizer's thread: see
    `generate`); a refusal, with its reason, names the field that asked."""
    # zh: 给 ``params`` 加上 ``body`` 要求的约束，编译并检查过（在分词线程上：见 `generate`）；拒绝时说明原因，并指明
    # zh: 提出要求的字段。
    asked = body.constraint_fields()
    if asked is None:
        return params
    param, fields = asked
    try:
        constraint = StructuredOutputsParams(**fields)
    except (TypeError, ValueError) as error:
        message = str(error)
        if param == "response_format":
            message = message.replace("structured_outputs.json_object", "response_format").replace(
                "structured_outputs.json", "response_format.json_schema.schema")
        raise ServerError(400, message, param=param) from None
    try:
        return replace(params, structured_outputs=constraint)
    except ValueError as error:
        raise ServerError(400, str(error), param="ignore_eos") from None


@add_to_class(Api)
async def generate(self, body: SamplingRequest, prompts: list[list[int]], chat: bool,
                   request: Request) -> Response:
    """Run the request's prompts: a stream of server-sent events, or one response once every choice ended. The
    sampling parameters are built on the tokenizer's thread, where a constraint compiles (`constrained`)."""
    # zh: 运行请求的提示词：一串服务器发送事件，或在每个 choice 都结束后的一个回复。采样参数在分词线程上构建，约束在
    # zh: 那里编译（`constrained`）。
    stops, max_tokens = body.stop_strings(), self.default_max_tokens(prompts, chat)
    params = await self.off_loop(lambda: self.constrained(body, body.sampling_params(max_tokens)))
    generation = Generation(self.client, prompts, params, stops, self.latency)
    await generation.start()
    rid, created = request_id("chatcmpl" if chat else "cmpl"), now()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream:
        return StreamingResponse(self.stream_events(generation, rid, created, chat, include_usage,
                                                    body.return_token_ids),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await self.collect(generation, rid, created, chat, request, body.return_token_ids)


# %% [markdown] tags=["en"]
# A server of the tiny model, and the official `openai` client. `chat.completions.parse` turns a
# Pydantic model into a strict `json_schema` response format and the reply back into the model; the
# extra-body `structured_outputs` asks for JSON without blanks, so that the tiny model, which would
# otherwise write blanks, ends its object quickly. Then a streamed request in JSON mode, whose
# chunks join into JSON; a bad schema, which gets 400; and `functions`, refused by name (the
# deprecated field; chapter 29b serves `tools`).

# %% [markdown] tags=["zh"]
# 一个小模型的服务器，加上官方的 `openai` 客户端。`chat.completions.parse` 把 Pydantic 模型变成严格的 `json_schema`
# 响应格式，再把回复变回这个模型；额外请求体字段 `structured_outputs` 要求不带空白的 JSON，这样原本会写空白的小模型能
# 很快写完它的对象。然后是一个 JSON 模式的流式请求，它的各个片段拼起来就是 JSON；一个错误的 schema，得到 400；以及
# `functions`，按名字拒绝（这是已经废弃的字段；`tools` 由第 29b 章实现）。

# %%
import time
from typing import Literal

import openai
from pydantic import BaseModel, Field

from nanovllm.serve.process import ServerProcess


class Shape(BaseModel):
    color: Literal["red", "green", "blue"]
    size: int = Field(ge=1, le=9)


began = time.perf_counter()
server = ServerProcess(["--model", str(tiny), "--served-model-name", "tiny", "--device", "cpu", "--max-model-len",
                        "512", "--num-kvcache-blocks", "64", "--kvcache-block-size", "16"]).start()
client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
compact = {"structured_outputs": {"disable_any_whitespace": True}}
chat = [{"role": "user", "content": "Describe a shape."}]
parsed = client.chat.completions.parse(model="tiny", messages=chat, response_format=Shape, max_tokens=40,
                                       temperature=0, extra_body=compact)
shape = parsed.choices[0].message.parsed
print(say("parsed: {shape!r}, finish_reason {reason}", shape=shape, reason=parsed.choices[0].finish_reason))
assert isinstance(shape, Shape) and parsed.choices[0].finish_reason == "stop"
stream = client.chat.completions.create(model="tiny", messages=chat, response_format={"type": "json_object"},
                                        max_tokens=60, temperature=0, stream=True, extra_body=compact)
streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
print(say("streamed in JSON mode: {text!r}", text=streamed))
assert isinstance(json.loads(streamed), dict)
for fields in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
               {"functions": [{"name": "f"}]}):
    try:
        client.chat.completions.create(model="tiny", messages=chat, max_tokens=4, **fields)
    except openai.BadRequestError as error:
        print(say("refused: {error}", error=f"{error.body['param']}: {error.body['message'][:90]}"))
        assert error.body["param"] == next(iter(fields))
server.stop()
print(say("server started, asked and stopped in {seconds:.1f} s", seconds=time.perf_counter() - began))

# %% [markdown] tags=["en"]
# ## Serving it: tools and tool_choice
#
# Chapter 22 refused `tools`, `tool_choice` and `parallel_tool_calls` by name; chapter 29's
# `NOT_IMPLEMENTED -= ...` line now lets them through, while `functions` and `function_call`, the
# deprecated names, stay refused. `/v1/completions` still refuses the three (they mean nothing
# without messages). The request side, in `nanovllm.serve.protocol`:
#
# - `ChatMessage` gets two fields: an assistant's `tool_calls` and a tool message's `tool_call_id`
#   (a later chapter's field of a pydantic model is an attribute the tangler writes into the class;
#   in this notebook, where pydantic built the model already, a hidden cell rebuilds it).
# - `ChatCompletionRequest.tool_request` checks the three fields strictly, on the event loop (it is
#   cheap): a wrong type gets 400 naming the field, as does a `tool_choice` naming a function that
#   `tools` lacks, two tools of one name, or a `tool_choice` without tools.
# - `ChatCompletionRequest.constraint_fields` extends chapter 29's: with tools and a `tool_choice`
#   other than `"none"`, the constraint is the grammar of the calls. Each offered function's schema
#   is compiled first, so that a bad one gets 400 naming `tools[i].function.parameters`; this runs
#   where chapter 29 compiles, on the tokenizer's thread, off the event loop. A request that asks
#   for tool calls and a `response_format` both is refused: the two grammars would fight.

# %% [markdown] tags=["zh"]
# ## 用于服务：tools 与 tool_choice
#
# 第 22 章按名字拒绝 `tools`、`tool_choice` 和 `parallel_tool_calls`；现在用第 29 章那样的 `NOT_IMPLEMENTED -= ...`
# 放行它们，而已经废弃的 `functions` 和 `function_call` 仍被拒绝。`/v1/completions` 仍然拒绝这三个字段（没有消息，
# 它们没有意义）。请求这一侧，在 `nanovllm.serve.protocol` 里：
#
# - `ChatMessage` 多了两个字段：assistant 的 `tool_calls` 和 tool 消息的 `tool_call_id`（后面章节给 pydantic 模型加的
#   字段，是一个由 tangler 写进类里的属性；在本 notebook 里 pydantic 已经建好了模型，由一个隐藏的单元格重建它）。
# - `ChatCompletionRequest.tool_request` 在事件循环上严格检查这三个字段（开销很小）：类型错误得到指明字段的 400；
#   `tool_choice` 指名了 `tools` 里没有的函数、两个工具同名、没有工具却给了 `tool_choice`，也都如此。
# - `ChatCompletionRequest.constraint_fields` 扩展第 29 章的同名方法：有工具且 `tool_choice` 不是 `"none"` 时，约束就是
#   调用的语法。先编译每个提供的函数的 schema，这样错误的 schema 得到指明 `tools[i].function.parameters` 的 400；这一步
#   在第 29 章编译的地方运行，即分词线程上，不在事件循环里。同时要求工具调用和 `response_format` 的请求被拒绝：两个
#   语法会互相打架。

# %% tool fields
#| export serve.protocol
from typing import Any

from pydantic import TypeAdapter, ValidationError

from nanovllm.book.literate import add_to_class
from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.serve.protocol import (
    NOT_IMPLEMENTED,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
    ServerError,
)
from nanovllm.serve.tool_calls import (
    NamedToolChoice,
    ToolCallMessage,
    ToolDefinition,
    ToolRequest,
    arguments_schema,
    tool_call_grammar,
)

# en: Implemented from chapter 29b on, on chat completions; functions and function_call, deprecated, stay refused.
# zh: 从第 29b 章起在对话补全上实现；已经废弃的 functions 和 function_call 仍被拒绝。
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
NOT_IMPLEMENTED -= set(TOOL_FIELDS)
# en: An assistant's message may hold the calls it made; a tool's message answers one of them, by its id.
# zh: assistant 的消息可以带上它做过的调用；tool 的消息按 id 回答其中一个。
ChatMessage.tool_calls: list[ToolCallMessage] | None = None
ChatMessage.tool_call_id: str | None = None
_TOOLS = TypeAdapter(list[ToolDefinition])
_NAMED = TypeAdapter(NamedToolChoice)


def first_error(field: str, error: ValidationError) -> str:
    """pydantic's first complaint, naming where in ``field`` it is: ``tools.0.function.name: ...``."""
    # zh: pydantic 的第一条错误，指明它在 ``field`` 的哪里：``tools.0.function.name: ...``。
    first = error.errors()[0]
    return f"{'.'.join([field, *map(str, first['loc'])])}: {first['msg']}"


@add_to_class(ChatCompletionRequest)
def tool_request(self) -> ToolRequest | None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked (None: no tools); a refusal
    names the field."""
    # zh: 请求的 ``tools``、``tool_choice`` 和 ``parallel_tool_calls``，检查过（None：没有工具）；拒绝时指明字段。
    extra = self.model_extra or {}
    tools, choice, parallel = (extra.get(name) for name in TOOL_FIELDS)
    if parallel is not None and not isinstance(parallel, bool):
        raise ServerError(400, f"parallel_tool_calls must be a boolean, got {parallel!r}",
                          param="parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise ServerError(400, "tool_choice needs tools", param="tool_choice")
        return None
    try:
        definitions = _TOOLS.validate_python(tools)
    except ValidationError as error:
        raise ServerError(400, first_error("tools", error), param="tools") from None
    names = [tool.function.name for tool in definitions]
    if not names or len(set(names)) < len(names):
        raise ServerError(400, "tools must name at least one function, each once", param="tools")
    mode, name = ("auto" if choice is None else choice), None
    if not isinstance(mode, str):
        try:
            name = _NAMED.validate_python(choice).function.name
        except ValidationError as error:
            raise ServerError(400, first_error("tool_choice", error), param="tool_choice") from None
        if name not in names:
            raise ServerError(400, f"tool_choice names the function {name!r}, which tools do not define",
                              param="tool_choice")
        mode = "named"
    elif mode not in ("none", "auto", "required"):
        raise ServerError(400, f"tool_choice must be 'none', 'auto', 'required' or a named function, got {mode!r}",
                          param="tool_choice")
    return ToolRequest(definitions, mode, name, parallel is not False)


@add_to_class(ChatCompletionRequest)
def constraint_fields(self) -> tuple[str, dict[str, Any]] | None:
    """Chapter 29's constraint, or, when tools are to be called, the grammar of the calls; each offered function's
    schema is compiled first (so a bad one is refused naming it), on the thread that calls this."""
    # zh: 第 29 章的约束；或者，要调用工具时，调用的语法；先编译每个提供的函数的 schema（错误的 schema 被拒绝时指明
    # zh: 它），在调用本方法的线程上。
    asked = SamplingRequest.constraint_fields(self)
    tools = self.tool_request()
    if tools is None or tools.mode == "none":
        return asked
    if asked is not None:
        raise ServerError(400, f"tools (tool_choice {tools.mode!r}) and {asked[0]} both constrain the output: give "
                          "one of them", param="tools")
    for index, function in tools.offered():
        try:
            StructuredOutputsParams(json=arguments_schema(function))
        except (TypeError, ValueError) as error:
            where = f"tools[{index}].function.parameters"
            raise ServerError(400, str(error).replace("structured_outputs.json", where), param="tools") from None
    offered = [function for _, function in tools.offered()]
    return "tools", {"grammar": tool_call_grammar(offered, tools.mode, tools.parallel)}


@add_to_class(CompletionRequest)
def ignored_fields(self) -> list[str]:
    """Chapter 22's unknown fields, and the tool fields refused by name: they belong to chat completions."""
    # zh: 第 22 章的未知字段；工具字段按名字拒绝：它们属于对话补全。
    extra = self.model_extra or {}
    for name in TOOL_FIELDS:
        if extra.get(name) is not None:
            raise ServerError(400, f"{name} is taken by /v1/chat/completions, not /v1/completions", param=name)
    return SamplingRequest.ignored_fields(self)


# %%
#| hide
# en: The package writes the two fields into ChatMessage's class; here pydantic built it already: rebuild it, and the
# en: request that holds a list of them.
# zh: 包里这两个字段写在 ChatMessage 的类里；这里 pydantic 已经建好了它：重建它，以及装着它们的列表的请求。
from pydantic.fields import FieldInfo

ChatMessage.__pydantic_fields__["tool_calls"] = FieldInfo.from_annotated_attribute(list[ToolCallMessage] | None, None)
ChatMessage.__pydantic_fields__["tool_call_id"] = FieldInfo.from_annotated_attribute(str | None, None)
for model in (ChatMessage, ChatCompletionRequest):
    model.model_rebuild(force=True)
assert ChatMessage(role="tool", content="21", tool_call_id="call_1").tool_call_id == "call_1"

# %% [markdown] tags=["en"]
# The server's side, in `nanovllm.serve.app`. At start the `Api` renders the probe once
# (`template_tool_style`). The chat route is written again (it is chapter 22's, with the tools):
# it checks the messages (a `tool_calls` only on an assistant, arguments that are JSON, a
# `tool_call_id` on each tool message), renders the conversation natively or in the server's
# Qwen format, and hands the prompt to chapter 29's `Api.generate`, which compiles the grammar off
# the loop. What comes back is chapter 22's response, and the tool calls are a view over it
# (`Api.tool_calls_of`): a whole reply is parsed once (`parse_tool_calls`); a stream passes through
# `tool_call_events`, which gives each choice a `ToolCallStream` and rewrites each chunk's
# `content` into its delta. Only requests that may call tools take that road, so every other
# request is served exactly as before. The cost is one more JSON read and write of each chunk of
# those streams, small beside a step.

# %% [markdown] tags=["zh"]
# 服务器这一侧，在 `nanovllm.serve.app` 里。启动时 `Api` 把探测工具渲染一次（`template_tool_style`）。对话路由重写了
# 一遍（就是第 22 章的那个，加上工具）：它检查消息（`tool_calls` 只能出现在 assistant 消息上，参数必须是 JSON，每条
# tool 消息都要有 `tool_call_id`），以原生方式或服务器的 Qwen 格式渲染对话，再把提示词交给第 29 章的 `Api.generate`，
# 后者在事件循环之外编译语法。返回的是第 22 章的响应，工具调用是它之上的一层视图（`Api.tool_calls_of`）：整段的回复
# 解析一次（`parse_tool_calls`）；流式输出经过 `tool_call_events`，它给每个 choice 一个 `ToolCallStream`，把每个片段的
# `content` 改写成对应的增量。只有可能调用工具的请求走这条路，其他请求的服务方式和以前完全一样。代价是这些流的每个
# 片段多一次 JSON 读写，和一步的时间相比很小。

# %% serve tools
#| export serve.app
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import nanovllm.serve.app as app_module
from nanovllm.book.literate import add_to_class, add_to_init
from nanovllm.serve.app import Api, api_of, openai_routes, sse
from nanovllm.serve.protocol import ChatCompletionRequest, ServerError, check_text
from nanovllm.serve.tool_calls import (
    ToolCallStream,
    ToolRequest,
    conversation,
    parse_tool_calls,
    template_tool_style,
)


@add_to_init(Api)
def _init_tools(self) -> None:
    # en: Fields this server knows, never logged as unknown ones.
    # zh: 服务器认识的字段，从不当作不认识的字段写进日志。
    self.ignored |= {"tools", "tool_choice", "parallel_tool_calls"}
    # en: How the model's chat template takes tools ("native", "server" or None: refused), found once.
    # zh: 模型的对话模板怎样接收工具（"native"、"server"，或 None：拒绝），只探测一次。
    self.tool_style = template_tool_style(self.tokenizer)


@add_to_class(app_module)
@openai_routes.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    api = api_of(request)
    api.check_request(body)
    if getattr(api.tokenizer, "chat_template", None) is None:
        raise ServerError(400, f"the model {api.model_name!r} has no chat template: use /v1/completions",
                          param="messages")
    tools = body.tool_request()
    messages, native_tools = api.template_messages(body, tools)

    def tokenize() -> list[int]:
        try:
            return list(api.tokenizer.apply_chat_template(messages, tools=native_tools, add_generation_prompt=True,
                                                          tokenize=True, return_dict=False))
        # en: The template's own checks (jinja raises what it likes)
        # zh: 模板自己的检查（jinja 想抛什么就抛什么）
        except Exception as error:
            raise ServerError(400, f"the chat template refused the messages: {error}", param="messages") from None

    response = await api.generate(body, [await api.off_loop(tokenize)], True, request)
    return api.tool_calls_of(response) if tools is not None and tools.mode != "none" else response


@add_to_class(Api)
def template_messages(self, body: ChatCompletionRequest,
                      tools: ToolRequest | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages as the chat template gets them, checked (calls only on an assistant's message, their arguments
    JSON, a tool message's tool_call_id), and the tools for the template itself (None when the server writes them,
    or there are none)."""
    # zh: 对话模板收到的消息，检查过（调用只能出现在 assistant 消息上，参数必须是 JSON，tool 消息要有
    # zh: tool_call_id），以及交给模板本身的工具（由服务器写出工具或者没有工具时为 None）。
    if tools is not None and self.tool_style is None:
        raise ServerError(400, f"the chat template of {self.model_name!r} writes tools in a format this server "
                          "does not parse (it parses Hermes' <tool_call>)", param="tools")
    messages, length = [], 0
    for i, message in enumerate(body.messages):
        item = {"role": message.role, "content": message.text()}
        check_text(item["content"], f"messages[{i}]", "messages")
        if message.tool_calls and message.role != "assistant":
            raise ServerError(400, f"messages[{i}]: only an assistant's message holds tool_calls", param="messages")
        if message.role == "tool" and message.tool_call_id is None:
            raise ServerError(400, f"messages[{i}]: a tool message needs the tool_call_id it answers",
                              param="messages")
        for j, call in enumerate(message.tool_calls or []):
            check_text(call.function.arguments, f"messages[{i}].tool_calls[{j}]", "messages")
            try:
                json.loads(call.function.arguments)
            except ValueError:
                raise ServerError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not JSON",
                                  param="messages") from None
            length += len(call.function.arguments)
        if message.tool_calls:
            item["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        length += len(item["content"])
        messages.append(item)
    self.check_length(length, "the messages' text", "messages")
    # en: A native template writes the calls and results of a conversation even when this request offers no tools.
    # zh: 原生模板即使在本次请求没有提供工具时，也自己写出对话中的调用和结果。
    native = self.tool_style == "native"
    schemas = tools.schemas() if tools is not None else None
    return conversation(messages, schemas, native), schemas if native else None


@add_to_class(Api)
def tool_calls_of(self, response: Response) -> Response:
    """A chat response with each choice's calls parsed out of its text: ``message.tool_calls`` and
    ``finish_reason`` "tool_calls", or, streamed, OpenAI's tool-call deltas (`tool_call_events`)."""
    # zh: 把每个 choice 的调用从文本里解析出来的对话响应：``message.tool_calls`` 和 ``finish_reason``
    # zh: "tool_calls"；流式时则是 OpenAI 的工具调用增量（`tool_call_events`）。
    if isinstance(response, StreamingResponse):
        return StreamingResponse(tool_call_events(response.body_iterator), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    # en: A client that went away gets no body (499)
    # zh: 已经离开的客户端拿不到响应体（499）
    if not isinstance(response, JSONResponse):
        return response
    reply = json.loads(response.body)
    for choice in reply["choices"]:
        content, calls = parse_tool_calls(choice["message"]["content"])
        if calls:
            choice["message"] = {"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]}
            choice["finish_reason"] = "tool_calls" if choice["finish_reason"] == "stop" else choice["finish_reason"]
    return JSONResponse(reply)


async def tool_call_events(events: AsyncIterator[str]) -> AsyncGenerator[str, None]:
    """Chapter 22's chat chunks with each choice's ``content`` rewritten by its `ToolCallStream`: content, then
    tool-call deltas; a choice that called a tool finishes with "tool_calls"."""
    # zh: 第 22 章的对话片段，每个 choice 的 ``content`` 由它的 `ToolCallStream` 改写：先是内容，然后是工具调用的
    # zh: 增量；调用了工具的 choice 以 "tool_calls" 结束。
    streams: dict[int, ToolCallStream] = {}
    try:
        async for event in events:
            data = event.removeprefix("data: ").strip()
            chunk = json.loads(data) if data.startswith("{") else {}
            # en: The role's chunk, the usage, an error and [DONE] pass as they are.
            # zh: 角色片段、用量、错误和 [DONE] 原样通过。
            if not chunk.get("choices") or "role" in chunk["choices"][0]["delta"]:
                yield event
                continue
            choice = chunk["choices"][0]
            stream = streams.setdefault(choice["index"], ToolCallStream())
            reason = choice["finish_reason"]
            choice["delta"] = stream.feed(choice["delta"].get("content", ""), final=reason is not None)
            if reason == "stop" and stream.calls:
                choice["finish_reason"] = "tool_calls"
            if choice["delta"] or reason is not None or "token_ids" in choice:
                yield sse(chunk)
    finally:
        await events.aclose()


# %%
#| hide
# en: In the package the route above takes the place of chapter 22's; in this notebook both were registered, the old
# en: first: drop it, so that an application made here serves the new one.
# zh: 包里上面的路由取代了第 22 章的那个；在本 notebook 里两个都注册了，旧的在前：去掉它，这样这里建的应用用的是新的。
chat_routes = [route for route in openai_routes.routes if getattr(route, "path", None) == "/v1/chat/completions"]
openai_routes.routes.remove(chat_routes[0])
assert len(chat_routes) == 2 and chat_routes[1].endpoint is app_module.chat_completions

# %% [markdown] tags=["en"]
# ## See it: the loop, through the official client
#
# A server of the tiny model (with room for the tools' system block), and the `openai` client as
# an agent uses it. `"required"` and a named function give one call each whose arguments fit the
# schema, with `finish_reason` `"tool_calls"` and no content. The named call streamed comes as
# OpenAI's deltas that join into the same call. Then the loop: the assistant's call goes back into
# the history with the tool's result, and the model answers with `tool_choice` `"none"`; the
# random model's answer is noise, but it is an answer, through the server's Qwen-format rendering
# of the whole conversation. Last, three refusals.

# %% [markdown] tags=["zh"]
# ## 看它运行：通过官方客户端走完循环
#
# 一个小模型的服务器（给工具的 system 块留够位置），加上像智能体那样使用的 `openai` 客户端。`"required"` 和指名
# 函数各得到一个调用，参数符合 schema，`finish_reason` 为 `"tool_calls"`，没有 content。流式请求指名的函数，得到的是
# OpenAI 的增量，拼起来是同一个调用。然后是循环：assistant 的调用连同工具的结果放回历史，模型在 `tool_choice` 为
# `"none"` 时作答；随机权重模型的回答是噪声，但它确实是一个回答，经过服务器按 Qwen 格式对整段对话的渲染。最后是三个
# 拒绝。

# %%
import time

import openai

from nanovllm.serve.process import ServerProcess

began = time.perf_counter()
server = ServerProcess(["--model", str(tiny), "--served-model-name", "tiny", "--device", "cpu", "--max-model-len",
                        "2048", "--num-kvcache-blocks", "160", "--kvcache-block-size", "16"]).start()
client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
ask = {"model": "tiny", "messages": question, "tools": TOOLS, "parallel_tool_calls": False, "max_tokens": 120,
       "temperature": 0}
named = {"type": "function", "function": {"name": "get_weather"}}
for choice in ("required", named):
    reply = client.chat.completions.create(**ask, tool_choice=choice).choices[0]
    calls = reply.message.tool_calls
    print(say("{choice:<9} finish_reason {reason}, {calls}", choice=choice if isinstance(choice, str) else "named",
              reason=reply.finish_reason, calls=[(c.function.name, c.function.arguments) for c in calls]))
    assert reply.finish_reason == "tool_calls" and reply.message.content is None and len(calls) == 1
    assert jsonschema.Draft202012Validator(schemas[calls[0].function.name]).is_valid(
        json.loads(calls[0].function.arguments))
whole = calls[0]
chunks = [chunk.choices[0] for chunk in client.chat.completions.create(**ask, tool_choice=named, stream=True)
          if chunk.choices]
pieces = [piece for chunk in chunks for piece in chunk.delta.tool_calls or []]
joined = (pieces[0].function.name, "".join(piece.function.arguments or "" for piece in pieces))
print(say("streamed: {chunks} chunks, reassembled {calls}, finish_reason {reason}", chunks=len(chunks), calls=joined,
          reason=chunks[-1].finish_reason))
assert joined == (whole.function.name, whole.function.arguments) and chunks[-1].finish_reason == "tool_calls"
assert not any(chunk.delta.content for chunk in chunks)

history = [*question, reply.message.model_dump(exclude_none=True),
           {"role": "tool", "tool_call_id": whole.id, "content": json.dumps({"sky": "clear", "high": 21})}]
final = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=12, temperature=0).choices[0]
print(say("the loop's final answer ({reason}): {text}", reason=final.finish_reason, text=ascii(final.message.content)))
assert final.message.content and final.message.tool_calls is None

bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
for fields in ({"tools": bad_schema}, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
               {"functions": [{"name": "f"}]}):
    try:
        client.chat.completions.create(model="tiny", messages=question, max_tokens=4, **fields)
        raise AssertionError(f"{fields} was served")
    except openai.BadRequestError as error:
        print(say("refused: {error}", error=f"{error.body['param']}: {error.body['message'][:80]}"))
        assert error.body["param"] == ("tool_choice" if "tool_choice" in fields else next(iter(fields)))
server.stop()
print(say("server started, asked and stopped in {seconds:.1f} s", seconds=time.perf_counter() - began))

# %% [markdown] tags=["en"]
# ## What we built
#
# - The server (chapter 22) takes chapter 29's constraints: OpenAI's `response_format`
#   (`json_schema`, `json_object`, `text`) and vLLM's `structured_outputs` extra body on both
#   endpoints (`SamplingRequest.constraint_fields`, `response_format_fields`); `Api.constrained`
#   compiles the constraint on the tokenizer's thread, which now builds every request's sampling
#   parameters (`Api.generate`, written again); a bad schema or regex gets 400 naming the field.
#   `chat.completions.parse` returns a Pydantic object from the tiny model.
# - `nanovllm.serve.tool_calls`: OpenAI's tool shapes (`ToolDefinition`, `NamedToolChoice`,
#   `ToolCallMessage`) and `ToolRequest`; Hermes' format (`call_text`, `tools_prompt`);
#   `template_tool_style`, which tells a template that writes Hermes' tools (native) from one that
#   ignores them (the server writes them, `conversation`) and from one that writes another format
#   (refused); `tool_call_grammar`, llguidance's Lark for `"required"`, a named function and
#   `"auto"` (a lazy head: free text until `<tool_call>`), with each function's schema inlined by
#   `%json` and laid out as the templates write arguments; `ToolCallStream` and
#   `parse_tool_calls`, one parser for whole replies and streams.
# - The server: `tools`, `tool_choice` and `parallel_tool_calls` on chat completions
#   (`ChatCompletionRequest.tool_request`, strict, 400 naming the field), the grammar as the
#   request's constraint (`ChatCompletionRequest.constraint_fields`, compiled off the event loop,
#   a bad schema refused naming `tools[i].function.parameters`), `ChatMessage.tool_calls` and
#   `tool_call_id` for the loop, the chat route written again to render tools, and
#   `Api.tool_calls_of` / `tool_call_events`, which turn chapter 22's response into
#   `message.tool_calls` with `finish_reason` `"tool_calls"`, or into OpenAI's tool-call deltas.
#   `/v1/completions` refuses the three fields; `functions` and `function_call` stay refused.
#
# Not done:
#
# - Only Hermes' format (Qwen2.5, Qwen3, and models that follow them). Llama 3.1's JSON calls,
#   Mistral's `[TOOL_CALLS]`, SmolLM3's or DeepSeek's formats are refused, not parsed; a format
#   registry, as vLLM's `--tool-call-parser`, would be the next step.
# - Neither model here is trained for tools: that `"auto"` lets a model choose well is untested.
#   No real Qwen3 checkpoint is on this machine; its template's native road is tested with a small
#   stand-in template, and in a real Qwen3 tokenizer `<tool_call>` is one token of its own, which the
#   grammar (written in text) has not been checked against.
# - A tool call is constrained like any structured output, so it goes wherever chapter 29's masks
#   go: a tensor-parallel server constrains it on rank 0, a speculating one constrains its drafts.
# - `tool_choice` `"none"` still shows the tools to the model (as Qwen's template would); OpenAI's
#   `strict` on a function is accepted and has no further effect (every call is constrained to its
#   schema anyway). A streamed call cut by `max_tokens` has sent its first pieces; it ends with
#   `finish_reason` `"length"`.
#
# ## Exercises
#
# 1. A request has `tool_choice` `"auto"` and the model writes `I think <tool` and stops. What
#    does a streaming client receive as content, and when?
# 2. Why can the stream parser hold back only what could be `}\n</tool_call>`, and never mistake a
#    `}` inside the arguments for the end?
# 3. What does the grammar let the model write after its only call when `parallel_tool_calls` is
#    false?

# %% [markdown] tags=["zh"]
# ## 本章小结
#
# - 服务器（第 22 章）接受第 29 章的约束：在两个端点上都接受 OpenAI 的 `response_format`（`json_schema`、
#   `json_object`、`text`）和 vLLM 的额外请求体字段 `structured_outputs`（`SamplingRequest.constraint_fields`、
#   `response_format_fields`）；`Api.constrained` 在分词线程上编译约束，每个请求的采样参数现在都在那里构建（重写的
#   `Api.generate`）；错误的 schema 或正则表达式得到指明字段的 400。`chat.completions.parse` 从小模型得到一个
#   Pydantic 对象。
# - `nanovllm.serve.tool_calls`：OpenAI 的工具形状（`ToolDefinition`、`NamedToolChoice`、`ToolCallMessage`）和
#   `ToolRequest`；Hermes 的格式（`call_text`、`tools_prompt`）；`template_tool_style`，它把写出 Hermes 工具的模板
#   （原生）、忽略工具的模板（由服务器写出，见 `conversation`）和用别的格式写出工具的模板（拒绝）区分开；
#   `tool_call_grammar`，为 `"required"`、指名函数和 `"auto"`（惰性的开头：`<tool_call>` 之前是自由文本）写出
#   llguidance 的 Lark，每个函数的 schema 用 `%json` 内嵌，排版和模板写参数时一样；`ToolCallStream` 和
#   `parse_tool_calls`，整段的回复和流式输出共用一个解析器。
# - 服务器：对话补全上的 `tools`、`tool_choice` 和 `parallel_tool_calls`（`ChatCompletionRequest.tool_request`，
#   严格检查，400 时指明字段），调用的语法作为请求的约束（`ChatCompletionRequest.constraint_fields`，在事件循环之外
#   编译，错误的 schema 被拒绝时指明 `tools[i].function.parameters`），循环所需的 `ChatMessage.tool_calls` 和
#   `tool_call_id`，为渲染工具而重写的对话路由，以及 `Api.tool_calls_of` / `tool_call_events`，它们把第 22 章的响应
#   变成带 `finish_reason` `"tool_calls"` 的 `message.tool_calls`，或者 OpenAI 的工具调用增量。`/v1/completions`
#   拒绝这三个字段；`functions` 和 `function_call` 仍被拒绝。
#
# 还没有做的：
#
# - 只支持 Hermes 的格式（Qwen2.5、Qwen3 以及沿用它们的模型）。Llama 3.1 的 JSON 调用、Mistral 的 `[TOOL_CALLS]`、
#   SmolLM3 或 DeepSeek 的格式会被拒绝，而不是被解析；下一步是像 vLLM 的 `--tool-call-parser` 那样登记多种格式。
# - 这里的两个模型都没有为工具训练过：`"auto"` 能否让模型选得好，没有测试。本机没有真正的 Qwen3 权重；它模板的原生
#   这条路用一个小的替身模板测试；在真正的 Qwen3 分词器里，`<tool_call>` 是一个单独的 token，而用文本写成的语法还没有
#   在它上面检查过。
# - 工具调用像任何结构化输出一样受约束，所以第 29 章的掩码能去的地方它都能去：张量并行的服务器在 rank 0 上约束它，
#   做投机的服务器会约束它的草稿。
# - `tool_choice` 为 `"none"` 时，工具仍然展示给模型（Qwen 的模板也是这样）；函数上 OpenAI 的 `strict` 被接受，但
#   没有额外的作用（每个调用本来就被约束到它的 schema）。被 `max_tokens` 截断的流式调用已经发出了前面几段；它以
#   `finish_reason` `"length"` 结束。
#
# ## 练习
#
# 1. 一个请求的 `tool_choice` 为 `"auto"`，模型写出 `I think <tool` 就停了。流式客户端收到的 content 是什么，什么时候
#    收到？
# 2. 为什么流式解析器只需要扣住可能是 `}\n</tool_call>` 的部分，而且绝不会把参数里的 `}` 误当作结尾？
# 3. `parallel_tool_calls` 为 false 时，语法允许模型在它唯一的调用之后写什么？

# %%
from nanovllm.config import Config

# en: Exercise 1: "I think " at once; "<tool" is held back (it could open a call) and sent as content when the
# en: stream ends, since no call followed.
# zh: 练习 1：立即收到 "I think "；"<tool" 被扣住（它可能打开一个调用），流结束时由于后面没有调用，作为 content 发出。
stream = ToolCallStream()
assert stream.feed("I think <tool") == {"content": "I think "}
assert stream.feed("", final=True) == {"content": "<tool"}

# en: Exercise 2: the arguments are compact JSON, where a newline inside a string is written \n (two characters); a
# en: raw newline after a } can only be the frame's. A } inside the arguments is sent once the next character shows
# en: it is not followed by the newline.
# zh: 练习 2：参数是紧凑的 JSON，字符串里的换行写成 \n（两个字符）；紧跟在 } 之后的真正换行只能属于外框。参数里的
# zh: } 一旦下一个字符表明后面不是换行，就会发出。
stream = ToolCallStream()
held = stream.feed('<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}')
assert held["tool_calls"][-1]["function"]["arguments"] == '{"city": "Oslo"'
assert stream.feed("}\n</tool_call>")["tool_calls"][0]["function"]["arguments"] == "}"

# en: Exercise 3: nothing: the grammar is complete after the closing tag, so only an end-of-sequence token is allowed.
# zh: 练习 3：什么也不能写：闭标签之后语法已经完整，所以只允许 end-of-sequence token。
single = StructuredOutputsParams(grammar=tool_call_grammar([definitions[1].function], "named"))
matcher = LLMatcher(grammars_of_llm.tokenizer, single.llguidance_grammar)
assert matcher.consume_tokens(tokenizer.encode(call_text("get_time", '{"city": "Oslo"}'), add_special_tokens=False))
bitmask = torch.zeros(1, bitmask_words(grammars_of_llm.vocab_size), dtype=torch.int32)
fill_bitmask(matcher, bitmask, 0)
only = allowed_tokens(bitmask[0], grammars_of_llm.vocab_size).nonzero().flatten().tolist()
assert only and set(only) <= set(Config(str(tiny), device="cpu").eos_token_ids)
print(say("all exercise answers check out"))
