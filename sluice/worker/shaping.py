"""The worker's response shaping: engine deltas (``sluice.worker.outputs.RequestOutput``) →
OpenAI choices, with token texts and logprobs in the legacy completions shape
``{tokens, token_logprobs, top_logprobs, text_offset}`` or the chat shape
``{content: [{token, logprob, bytes, top_logprobs: [...]}]}``.

Both engines' outputs go through it; the contract it shapes into (choices, envelopes,
usage) is ``sluice.api.openai``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

from sluice.api.openai import (LOGPROB_FLOOR, chat_choice, chat_delta_choice, completion_choice,
                               envelope, now, usage)

# --------------------------------------------------------------------------- tokens


class TokenizerLike(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...
    def convert_ids_to_tokens(self, token_id: int) -> str: ...


def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: each byte is shown as one printable char."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
             *range(ord("®"), ord("ÿ") + 1)]
    char_of = {b: chr(b) for b in shown}
    for extra, b in enumerate(b for b in range(256) if b not in char_of):
        char_of[b] = chr(256 + extra)
    return {c: b for b, c in char_of.items()}


class TokenTexts:
    """Token id → (display text, raw UTF-8 bytes), cached; for logprob entries.

    With a byte-level BPE tokenizer the raw bytes of a token that ends mid-character are
    exact (and its text shows U+FFFD for the partial character, like vLLM).
    """

    def __init__(self, tokenizer: TokenizerLike):
        self._tokenizer = tokenizer
        self._alphabet = _byte_level_alphabet() if _is_byte_level(tokenizer) else None
        self.entry = lru_cache(maxsize=65536)(self._entry)

    def text(self, token_id: int) -> str:
        return self.entry(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return list(self.entry(token_id)[1])

    def _entry(self, token_id: int) -> tuple[str, bytes]:
        if self._alphabet is not None:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if piece and all(c in self._alphabet for c in piece):
                raw = bytes(self._alphabet[c] for c in piece)
                return raw.decode("utf-8", errors="replace"), raw
        text = self._tokenizer.decode([token_id])
        return text, text.encode("utf-8")


def _is_byte_level(tokenizer: Any) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


class LogprobLike(Protocol):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class LegacyLogprobs:
    """Builds completions ``logprobs`` objects, keeping ``text_offset`` across chunks."""

    def __init__(self, texts: TokenTexts, num_top: int):
        self.texts = texts
        self.num_top = num_top
        self.offset = 0  # characters of returned text so far

    def build(self, token_ids: Sequence[int], entries: Sequence[LogprobLike | None] | None
              ) -> dict:
        """``{tokens, token_logprobs, top_logprobs, text_offset}`` for ``token_ids``.

        Args:
            token_ids: the tokens shown, in order.
            entries: their logprobs, aligned with ``token_ids``; an entry may be None (the
                first prompt token, which has no context) and gets logprob and top None.
        """
        entries = list(entries) if entries is not None else [None] * len(token_ids)
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = self.texts.text(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top = {self.texts.text(t): _finite(lp) for t, lp in entry.top[: self.num_top]}
            top.setdefault(text, _finite(entry.logprob))
            out["token_logprobs"].append(_finite(entry.logprob))
            out["top_logprobs"].append(top)
        return out


def chat_logprobs(texts: TokenTexts, entries: Sequence[LogprobLike], num_top: int) -> dict:
    """Chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def item(token_id: int, logprob: float) -> dict:
        return {"token": texts.text(token_id), "logprob": _finite(logprob),
                "bytes": texts.bytes(token_id)}

    return {"content": [
        {**item(e.token_id, e.logprob),
         "top_logprobs": [item(t, lp) for t, lp in e.top[:num_top]]}
        for e in entries
    ], "refusal": None}


# --------------------------------------------------------------------------- shaping


class OutputLike(Protocol):
    """What the shapers read from an engine delta (sluice.worker.engine RequestOutput)."""

    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[LogprobLike] | None
    prompt_logprobs: list[LogprobLike | None] | None
    finished: bool
    finish_reason: str | None
    num_output_tokens: int


@dataclass
class ChoiceView:
    """How one choice (one engine request) is shown.

    Attributes:
        index: the choice index in the response.
        prompt_ids: the prompt tokens (echo shows them, with logprobs if asked).
        prompt_text: the prompt as text, shown first when ``echo``.
        count_prompt: add this prompt's tokens to usage (False for the 2nd..nth choice of
            one prompt: OpenAI counts a prompt once).
        echo: prepend the prompt to the output.
        show_output: False for echo with max_tokens 0 (the engine still makes one token,
            which is dropped).
    """

    index: int
    prompt_ids: list[int]
    prompt_text: str = ""
    count_prompt: bool = True
    echo: bool = False
    show_output: bool = True


@dataclass
class _ChoiceState:
    view: ChoiceView
    started: bool = False
    text: list[str] = field(default_factory=list)
    logprobs: dict | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0
    legacy: LegacyLogprobs | None = None


class Shaper:
    """Turns engine deltas into OpenAI chunks (``on_output``) or one response (``response``).

    Subclasses say how a delta becomes text + logprobs and how a choice is laid out.
    Usage counts each prompt once and the shown output tokens of every choice.
    """

    kind: str = ""
    chunk_kind: str = ""

    def __init__(self, response_id: str, model: str, views: Sequence[ChoiceView],
                 texts: TokenTexts, num_logprobs: int | None):
        self.response_id = response_id
        self.model = model
        self.created = now()
        self.texts = texts
        self.num_logprobs = num_logprobs
        self.states = {v.index: _ChoiceState(v) for v in views}

    def on_output(self, index: int, out: OutputLike) -> dict | None:
        """Record one delta; return the chunk to stream, or None when it shows nothing."""
        state = self.states[index]
        text, logprobs = self._delta(state, out)
        state.text.append(text)
        state.logprobs = self._merge(state.logprobs, logprobs)
        if out.finished:
            state.finish_reason = out.finish_reason
            state.completion_tokens = out.num_output_tokens if state.view.show_output else 0
        if not text and logprobs is None and not out.finished:
            return None
        return self._chunk(index, text, logprobs, state.finish_reason)

    def usage(self) -> dict:
        prompt = sum(len(s.view.prompt_ids) for s in self.states.values() if s.view.count_prompt)
        return usage(prompt, sum(s.completion_tokens for s in self.states.values()))

    def usage_chunk(self) -> dict:
        """The last chunk under ``include_usage``: no choices, only usage."""
        return envelope(self.chunk_kind, self.response_id, self.created, self.model, [],
                        self.usage())

    def response(self) -> dict:
        """The non-streamed body, choices in index order."""
        choices = [self._choice(i, "".join(s.text), s.logprobs, s.finish_reason)
                   for i, s in sorted(self.states.items())]
        return envelope(self.kind, self.response_id, self.created, self.model, choices,
                        self.usage())

    def first_chunks(self) -> list[dict]:
        """Chunks to send before any output (chat: the assistant role)."""
        return []

    def _chunk(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        raise NotImplementedError

    def _choice(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        raise NotImplementedError

    def _delta(self, state: _ChoiceState, out: OutputLike) -> tuple[str, dict | None]:
        raise NotImplementedError

    @staticmethod
    def _merge(into: dict | None, more: dict | None) -> dict | None:
        if into is None or more is None:
            return into if more is None else more
        for key, values in more.items():
            if isinstance(values, list):
                into[key].extend(values)
        return into


class CompletionShaper(Shaper):
    """/v1/completions: echo, legacy logprobs (``num_logprobs`` alternatives or None)."""

    kind = chunk_kind = "text_completion"

    def _delta(self, state: _ChoiceState, out: OutputLike) -> tuple[str, dict | None]:
        view = state.view
        text, ids, entries = "", [], []
        if not state.started:
            state.started = True
            if self.num_logprobs is not None:
                state.legacy = LegacyLogprobs(self.texts, self.num_logprobs)
            if view.echo:
                text = view.prompt_text
                ids += view.prompt_ids
                entries += out.prompt_logprobs or [None] * len(view.prompt_ids)
        if view.show_output:
            text += out.new_text
            ids += out.new_token_ids
            entries += out.new_logprobs or [None] * len(out.new_token_ids)
        if state.legacy is None or not ids:
            return text, None
        return text, state.legacy.build(ids, entries)

    def _chunk(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        return envelope(self.chunk_kind, self.response_id, self.created, self.model,
                        [completion_choice(index, text, logprobs, finish)])

    def _choice(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        return completion_choice(index, text, logprobs, finish)


class ChatShaper(Shaper):
    """/v1/chat/completions: assistant messages, chat logprobs (``num_logprobs`` = top_logprobs
    when ``logprobs`` is true, else None)."""

    kind = "chat.completion"
    chunk_kind = "chat.completion.chunk"

    def first_chunks(self) -> list[dict]:
        return [envelope(self.chunk_kind, self.response_id, self.created, self.model,
                         [chat_delta_choice(i, {"role": "assistant", "content": ""}, None, None)])
                for i in sorted(self.states)]

    def _delta(self, state: _ChoiceState, out: OutputLike) -> tuple[str, dict | None]:
        if self.num_logprobs is None or not out.new_logprobs:
            return out.new_text, None
        return out.new_text, chat_logprobs(self.texts, out.new_logprobs, self.num_logprobs)

    def _chunk(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        delta = {"content": text} if text or finish is None else {}
        return envelope(self.chunk_kind, self.response_id, self.created, self.model,
                        [chat_delta_choice(index, delta, logprobs, finish)])

    def _choice(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        return chat_choice(index, text, logprobs, finish)
