"""A generation as the API hands it out, and the stop strings' text filter: what LLM.generate,
the server's workers and the continuous-batching runner (pycalm.app.batching) share.

  Generation   an iterator of text pieces, and its counts, logprobs and tool calls
  StopText     holds back the text that may begin a stop string, cuts at the first one (that
               ends at or after the min_tokens-th token's text)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pycalm.cpu.reference import TokenLogprobs


@dataclass
class Generation:
    """One generation: an iterator of text pieces, and its counts (final once it is exhausted).

    prompt_tokens: the prompt's length; reused_tokens: how many of those came from the KV cache
    (not fed again); completion_tokens: tokens sampled (an EOS included); finish_reason: "stop"
    (an EOS or a stop string), "length" (max_tokens or the end of the context), or None while
    running or when closed early; prompt_s: seconds from the start to the first token (feeding
    the prompt and sampling one token); decode_s: seconds from the first token to the last.
    text: the text handed out so far. logprobs: when asked for (LLM.generate's logprobs=k), a
    TokenLogprobs (pycalm.cpu.reference) for each sampled token but an EOS that ends it,
    appended as each is made (before its text, which a stop string's check may hold back, is
    handed out); else None.
    tool_calls: a chat offered tools (LLM.chat's tools=): the calls parsed out of the reply, in
    OpenAI's shape, appended as each is complete (an empty piece marks it), their text kept out
    of `text` (finish_reason "tool_calls" when the reply ends after them); else None. message:
    the reply as OpenAI's assistant message (content, tool_calls), for the next turn's messages.
    """

    prompt_tokens: int
    reused_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    prompt_s: float = 0.0
    decode_s: float = 0.0
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    tool_calls: list[dict] | None = None
    _pieces: Iterator[str] | None = field(default=None, repr=False)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        piece = next(self._pieces)
        self.text += piece
        return piece

    def close(self) -> None:
        """Stop generating (at the token being made) and free the engine for the next request."""
        self._pieces.close()

    @property
    def message(self) -> dict[str, Any]:
        from pycalm.app.tools import reply_message

        return reply_message(self.text, self.tool_calls)

    @property
    def decode_tok_s(self) -> float:
        """Tokens a second after the first one (nan with fewer than two)."""
        n = self.completion_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


def _stop_at(text: str, stops: list[str], armed: int = 0) -> int:
    """Where the first stop string in `text` that ends past text[armed - 1] begins (-1: none)."""
    found = (text.find(s, max(0, armed - len(s) + 1)) for s in stops)
    return min((i for i in found if i >= 0), default=-1)


def _held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` could start a stop string (kept back until the
    next piece shows whether one follows)."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:k]):
                keep = k
                break
    return keep


class StopText:
    """Decoded text pieces in, one a token, the text to hand out: cut where a stop string first
    appears (it and what follows are dropped, `stopped` is set), and an end that could start one
    held back until the next piece shows. min_tokens: as vLLM's, a stop string ends the text only
    from the min_tokens-th piece on, where its last character comes from that piece or a later
    one (the text before is not searched again). Used by LLM.start, the batch runner and the
    CLI's prompt mode."""

    def __init__(self, stops: list[str], min_tokens: int = 0) -> None:
        self.stops = stops
        self.min_tokens = min_tokens
        self.pushed = 0  # pieces (tokens) pushed
        self.pending = ""  # text not handed out yet: it may be the start of a stop string
        self.armed = 0  # a stop string found in pending must end past pending[armed - 1]
        self.stopped = False

    def push(self, piece: str) -> str:
        if not self.stops:  # (nothing to cut or hold back: pending stays "")
            self.pushed += 1
            return piece
        self.pending += piece
        self.pushed += 1
        if self.pushed < self.min_tokens:  # no stop string ends in the text so far
            self.armed = len(self.pending)
        cut = _stop_at(self.pending, self.stops, self.armed)
        if cut >= 0:
            self.pending, self.stopped = self.pending[:cut], True
            return ""
        keep = _held_back(self.pending, self.stops)
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        self.armed = max(0, self.armed - len(out))
        return out

    def finish(self, flush: Callable[[], str]) -> str:
        """What is left: the decoder's last bytes (flush(), read only if no stop string was found:
        they may complete one) and the held-back end."""
        if not self.stopped:
            self.pending += flush()
            if self.pushed < self.min_tokens:  # (the last piece's bytes)
                self.armed = len(self.pending)
            cut = _stop_at(self.pending, self.stops, self.armed)
            if cut >= 0:
                self.pending, self.stopped = self.pending[:cut], True
        out, self.pending = self.pending, ""
        return out
