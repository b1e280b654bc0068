"""Incremental detokenization: the text of a stream of token ids, sent piece by piece."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns one sample's token ids, as they arrive, into text deltas whose concatenation is exactly
    ``tokenizer.decode(all_ids, skip_special_tokens=True)``, the text a non-streamed request gets.

    A character that spans several tokens (a Chinese character or an emoji in a byte-level vocabulary) decodes
    to U+FFFD until its last byte arrives: such text is held back, never sent. Each new token is decoded within a
    short window of the tokens before it (from ``prefix_offset``), so a step costs the same at token 10 and at
    token 10,000. ``stop`` strings end the text before their first match; the last ``len(longest stop) - 1``
    characters wait, since they may be the start of a match.
    """

    def __init__(self, tokenizer: Any, stop: list[str] | tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # where the decoding window starts
        self.read_offset = 0  # tokens before it are already text
        self.text = ""  # every character decoded so far (sent or held back)
        self.sent = 0  # characters of ``text`` already sent
        self.stopped = False  # a stop string matched: the text ends at ``len(text)``

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> str:
        """Take the next token ids; return the text that can be sent now ("" while a character is incomplete)."""
        if self.stopped:
            return ""
        for token in token_ids:
            self.token_ids.append(token)
            before = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            after = self._decode(self.token_ids[self.prefix_offset :])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
                if self._find_stop():
                    break
        return self._release(len(self.text) - (0 if self.stopped else self.hold))

    def finish(self) -> str:
        """The sample ended: the rest of its text, decoded once in full, so the whole equals the non-streamed text."""
        if not self.stopped:
            full = self._decode(self.token_ids)
            # The windows already gave exactly this prefix; the full decode adds what was held back, such as an
            # incomplete character that the sample ended on (decoded as U+FFFD, like the non-streamed text).
            if full.startswith(self.text[: self.sent]):
                self.text = full
                self._find_stop()
        return self._release(len(self.text))

    def _find_stop(self) -> bool:
        """Cut ``text`` before the first stop string in it; True if one was found."""
        # A match may begin in the characters held back by the previous call, never before them.
        start = max(0, self.sent - self.hold)
        matches = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if matches:
            self.text, self.stopped = self.text[: min(matches)], True
        return self.stopped

    def _release(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : end], end
        return piece
