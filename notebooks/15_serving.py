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
# # 15 · Serving: one engine loop, many clients

# %% [markdown] tags=["zh"]
# # 15 · 服务：一个引擎循环，许多客户端

# %% streamed tokens
#| export engine.sequence
from nanovllm.engine.sequence import Sequence

# en: How many completion tokens `LLMEngine.step_tokens` has reported for this sequence so far.
# zh: `LLMEngine.step_tokens` 至今为这个序列报告过多少个生成的 token。
Sequence.num_streamed_tokens: int = 0

# %% step tokens
#| export engine.llm_engine
from __future__ import annotations

from dataclasses import dataclass

from nanovllm.book.literate import add_to_class
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence


@dataclass(frozen=True)
class NewTokens:
    """What the last `LLMEngine.step_tokens` call added to one sample of a request: its new completion tokens,
    and whether the sample finished with them (then ``token_ids`` ends with its last token)."""

    request_id: int
    sample_index: int
    token_ids: list[int]
    finished: bool


@add_to_class(LLMEngine)
def _unreported_sequences(self) -> dict[int, Sequence]:
    """Every sequence that `step` has not reported yet, by seq_id: queued, running, in flight, or finished and
    waiting to be reported."""
    seqs = [*self.scheduler.waiting, *self.scheduler.running, *self.unreported]
    if self.in_flight is not None:
        seqs += self.in_flight.seqs
    return {seq.seq_id: seq for seq in seqs}


@add_to_class(LLMEngine)
def step_tokens(self) -> list[NewTokens]:
    """One `step`, reported token by token: every sample that has completion tokens it has not reported yet, with
    those tokens, finished or not. A server streams them; ``step()`` alone reports only finished sequences."""
    with self._one_call("step_tokens"):
        before = self._unreported_sequences()
    finished = self.step()[0]
    with self._one_call("step_tokens"):
        news = []
        for output in finished:
            seq_id, token_ids = output
            # en: A sample forked and finished within this very step was never seen: all its tokens are new.
            # zh: 在这一步之内分叉又结束的样本从未出现过：它的 token 全是新的。
            streamed = before[seq_id].num_streamed_tokens if seq_id in before else 0
            news.append(NewTokens(output.request_id, output.sample_index, token_ids[streamed:], True))
        for seq in self._unreported_sequences().values():
            known = _known_completion_tokens(seq)
            if known > seq.num_streamed_tokens:
                start = seq.num_prompt_tokens
                news.append(NewTokens(seq.request_id, seq.sample_index,
                                      seq.token_ids[start + seq.num_streamed_tokens : start + known], False))
                seq.num_streamed_tokens = known
        return news


def _known_completion_tokens(seq: Sequence) -> int:
    """The completion tokens of ``seq`` whose values are known: all but the one still computing, if any."""
    end = seq.num_tokens
    while end > seq.num_prompt_tokens and seq.token_ids[end - 1 - seq.first_token_index] == PENDING_TOKEN:
        end -= 1
    return end - seq.num_prompt_tokens


@add_to_class(LLMEngine)
def abort_request(self, request_id: int, sample_index: int | None = None) -> list[int]:
    """Drop a request of `add_request`, or only its sample ``sample_index``: out of the queues, its blocks freed now,
    never reported by `step`. Returns the seq_ids dropped (none once the request was reported, or if it never was)."""
    with self._one_call("abort_request"):
        dropped = []
        for seq in self._unreported_sequences().values():
            if seq.request_id == request_id and sample_index in (None, seq.sample_index):
                if not seq.is_finished:
                    self.scheduler.abort(seq)
                dropped.append(seq.seq_id)
        self.unreported = [seq for seq in self.unreported if seq.seq_id not in dropped]
        if sample_index is None:
            self._dropped.pop(request_id, None)
        return dropped
