"""Generated token ids -> text deltas for one request: whole UTF-8 characters, stop strings cut;
and the text of single tokens for logprobs (``TokenPieces``).

Tokens are pushed one at a time, so the place where a stop string completes (and therefore the
number of completion tokens) does not depend on how many tokens a decode call produced. Text that
could be the start of a stop string is held back until it is known not to be one, so a client never
sees a partial stop string; the stop string itself is never sent.
"""

from __future__ import annotations

from typing import Iterable

from hsdjax.errors import HsdjaxError
from hsdjax.runtime.tokenizer import IncrementalDecoder, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop_ids: Iterable[int], stops: list[str]):
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens=True)
        self._stop_ids = frozenset(int(i) for i in stop_ids)
        self._stops = list(stops)
        self._longest = max((len(s) for s in self._stops), default=0)
        self.text = ""  # all text decoded so far (cut at a stop string once one is found)
        self.sent = 0  # characters of ``text`` already handed out
        self.tokens = 0  # completion tokens consumed (a stop token or the token completing a stop string included)
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> str:
        """Consume one generated token; return the text that may be sent now."""
        if self.finished:
            return ""
        self.tokens += 1
        if int(token) in self._stop_ids:
            return self.finish("stop")
        self.text += self._decoder.push([int(token)])
        return self._emit(final=False)

    def finish(self, reason: str) -> str:
        """The generation ended (``reason``: "stop" or "length"): flush everything that is left."""
        if self.finished:
            return ""
        self.text += self._decoder.flush()
        delta = self._emit(final=True)
        if self.finish_reason is None:
            self.finish_reason = reason
        return delta

    def _emit(self, final: bool) -> str:
        if self._stops:
            start = max(0, self.sent - self._longest)
            hits = [i for s in self._stops if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.finish_reason = "stop"
                final = True
        end = len(self.text) if final else len(self.text) - self._held_back()
        if end <= self.sent:
            return ""
        delta = self.text[self.sent: end]
        self.sent = end
        return delta

    def _held_back(self) -> int:
        """Length of the longest unsent suffix of ``text`` that is a proper prefix of a stop string."""
        unsent = len(self.text) - self.sent
        for k in range(min(unsent, self._longest - 1), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0


class TokenPieces:
    """Token id -> (text, UTF-8 bytes) as logprobs report a token, cached. A token whose bytes are not
    whole UTF-8 characters (part of a multi-byte character) is spelled ``bytes:\\xe6\\x97`` (as vLLM
    does); its ``bytes`` are the raw bytes, which concatenate to the completion's text."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._cache.get(token_id)
        if piece is None:
            piece = self._cache[token_id] = self._spell(token_id)
        return piece

    def _spell(self, token_id: int) -> tuple[str, list[int]]:
        try:
            data = self._tokenizer.token_bytes(token_id)
        except HsdjaxError:  # not a byte-level tokenizer
            data = self._tokenizer.decode([token_id]).encode("utf-8")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
        return text, list(data)
