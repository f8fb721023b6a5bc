"""Incremental detokenization with stop strings.

Text is decoded token by token with ``tokenizers.decoders.DecodeStream``, which buffers a
token that ends inside a multi-byte UTF-8 character until the character is complete, so no
half character (U+FFFD) is ever emitted. Stop strings are matched on the decoded text (so
they may span tokens); text that could still be the start of a stop string is held back
from the stream until it can no longer match.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Turns output tokens into safe-to-stream text deltas.

    Args:
        tokenizer: the backend ``tokenizers.Tokenizer``.
        prompt_token_ids: prompt tokens, used as decoding context (leading-space rules).
        stop: stop strings; the first match ends the text before the match.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str]):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(ids=prompt_token_ids[-4:], skip_special_tokens=True)
        self._stop = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self.text = ""
        self._sent = 0

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Decode one more token. Returns True if ``check_stop`` and the text now contains
        a stop string (the text is then cut just before it)."""
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return False
        start = max(self._sent, len(self.text) - self._max_stop + 1)
        self.text += piece
        if not check_stop:
            return False
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return True
        return False

    def take(self, final: bool) -> str:
        """Text not yet taken. Unless ``final``, a suffix that is a prefix of some stop
        string is held back."""
        end = len(self.text) if final else len(self.text) - self._held_back()
        delta = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return delta

    def _held_back(self) -> int:
        text = self.text
        for k in range(min(self._max_stop - 1, len(text) - self._sent), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
