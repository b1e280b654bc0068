"""The OpenAI API's shapes: request bodies (checked by pydantic), response bodies and errors."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nanovllm.sampling_params import SamplingParams


class ServerError(Exception):
    """An error the client gets in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields both endpoints share. Unknown fields are refused (a typo must not pass silently); fields of
    the OpenAI API that this server does not implement are accepted only at their neutral values."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extra body fields, as vLLM accepts them (the openai client sends them with ``extra_body``).
    top_k: int | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # each choice (each chunk) also carries its token ids, as vLLM's option does
    # Accepted, but only where they change nothing.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None

    def unsupported(self) -> dict[str, Any]:
        """Fields set to something this server cannot do: name -> value."""
        neutral = {"presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
                   "logprobs": (None, False)}
        return {name: getattr(self, name) for name, ok in neutral.items() if getattr(self, name) not in ok}

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise ServerError(400, "stop strings must not be empty", param="stop")
        return stops

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's sampling parameters (``max_tokens``: what to use when the request gives none)."""
        for name, value in self.unsupported().items():
            raise ServerError(400, f"{name}={value!r} is not supported by this server", param=name)
        top_k = None if self.top_k in (None, -1, 0) else self.top_k  # vLLM's "no limit" values
        fields = {"temperature": 1.0 if self.temperature is None else self.temperature,
                  "top_p": 1.0 if self.top_p is None else self.top_p, "max_tokens": self.requested_max_tokens(),
                  "n": self.n, "seed": self.seed, "top_k": top_k, "ignore_eos": self.ignore_eos}
        if fields["max_tokens"] is None:
            fields["max_tokens"] = max_tokens
        try:
            return SamplingParams(**fields)
        except (TypeError, ValueError) as error:
            name = str(error).split(" ", 1)[0]
            raise ServerError(400, str(error), param=name if name in fields else None) from None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: a prompt (text or token ids), or a list of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> dict[str, Any]:
        extra = {"echo": self.echo} if self.echo else {}
        if self.suffix:
            extra["suffix"] = self.suffix
        if self.best_of not in (None, 1, self.n):
            extra["best_of"] = self.best_of
        return {**super().unsupported(), **extra}

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a str or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ServerError(400, "prompt is empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [prompt]
        return list(prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: messages, formatted by the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_chunk(rid: str, model: str, created: int, index: int, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def now() -> int:
    return int(time.time())
