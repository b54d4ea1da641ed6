"""Choosing the next token from the logits: the sampling options, and the CPU sampler.

`SamplingParams` holds the options (greedy, temperature, top-k, top-p, min-p, the seed, the
penalties, the logit bias, and when an EOS may end the reply) that both engines take. `Sampler`
draws one uniform coin a token from a seeded NumPy generator and picks the token with
pycalm.cpu.reference.sample_ref, the specification that the GPU sampling kernel
(pycalm/kernels/sample.py) follows; the GPU engine takes the same coins (`next_coin`), so the CPU
and the GPU pick the same tokens from the same logits. `MinTokens` keeps the EOS ids out of a
reply's first min_tokens tokens, as a constraint the engines mask the logits with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pycalm.cpu.reference import (
    check_penalties,
    check_sampling,
    logit_bias_dense,
    penalties_ref,
    prompt_flags,
    sample_ref,
)
from pycalm.errors import PycalmError


@dataclass(frozen=True)
class SamplingParams:
    """Hashable: the GPU engine keys its captured token steps by it (GpuEngine.graph)."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    seed: int = 0
    # penalties of the tokens seen and the logit bias (pycalm.cpu.reference.penalties_ref)
    presence_penalty: float = 0.0  # 0: off; in [-2, 2], counts the generated tokens
    frequency_penalty: float = 0.0  # 0: off; in [-2, 2], counts the generated tokens
    repetition_penalty: float = 1.0  # 1: off; > 0, over the prompt and the generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) pairs
    # when an EOS may end the reply (vLLM's fields): no EOS among its first min_tokens tokens
    # (their logits at -inf: MinTokens), and no stop string ends it before it has that many;
    # ignore_eos: an EOS does not end it (it runs to max_tokens, a stop string or the context's end)
    min_tokens: int = 0
    ignore_eos: bool = False
    # the place in the seed's sequence of coins of the first sampled token's coin (a speculative
    # loop that hands the plain token steps a stretch of its tokens: pycalm.app.speculative)
    first_coin: int = 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes the logits before sampling."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    def end_ids(self, eos_ids: tuple[int, ...] | list[int]) -> frozenset[int]:
        """The token ids that end a reply: the model's EOS ids, or none under ignore_eos."""
        return frozenset() if self.ignore_eos else frozenset(int(t) for t in eos_ids)

    def unseeded(self) -> SamplingParams:
        """The options a captured token step bakes in (GpuEngine.graph's key): the seed and the
        penalties' values live in device memory, set by each generate."""
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p)


def check_min_tokens(min_tokens: object, ignore_eos: object, max_tokens: int | None = None) -> None:
    """min_tokens a whole number from 0 (to max_tokens where given), ignore_eos a bool; else a
    PycalmError naming the field."""
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int | np.integer) or min_tokens < 0:
        raise PycalmError(f"min_tokens must be a whole number >= 0, not {min_tokens!r}")
    if max_tokens is not None and min_tokens > max_tokens:
        raise PycalmError(f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens})")
    if not isinstance(ignore_eos, bool | np.bool_):
        raise PycalmError(f"ignore_eos must be True or False, not {ignore_eos!r}")


class MinTokens:
    """min_tokens as a constraint (what the engines take as pycalm.app.constrain.Constraint:
    vocab_size, fill_mask, accept, finished): no EOS id is allowed until n tokens have been
    accepted, over the mask of `inner` (the request's own constraint) or over every id. So the
    EOS logits are at -inf for the first n tokens wherever a constraint's mask applies (the CPU
    engine, the GPU's masked sampling, the batch runner's host rows), and a reply's logprobs
    there are over the other ids, as under any constraint. Where the inner mask allows nothing but
    an EOS, the EOS stays allowed: a mask with nothing allowed has no token to sample."""

    def __init__(
        self, n: int, eos_ids: tuple[int, ...] | list[int], vocab_size: int, inner: object | None = None
    ) -> None:
        self.n = int(n)
        self.eos_ids = tuple(int(t) for t in eos_ids)
        self.vocab_size = int(vocab_size)
        self.inner = inner
        self.accepted = 0  # tokens sampled so far

    @classmethod
    def over(
        cls, constraint: object | None, sampling: SamplingParams, eos_ids: tuple[int, ...], vocab_size: int
    ) -> object | None:
        """The constraint a generation under `sampling` follows: `constraint` itself without
        min_tokens, else a MinTokens over it."""
        if sampling.min_tokens <= 0:
            return constraint
        return cls(sampling.min_tokens, eos_ids, vocab_size, constraint)

    @property
    def banning(self) -> bool:
        """Whether the next token may not be an EOS."""
        return self.accepted < self.n

    def fill_mask(self, out: np.ndarray) -> None:
        """The allowed next ids into `out` (ceil(vocab_size / 32),) uint32, a bit an id, as
        Constraint.fill_mask writes them."""
        if self.inner is not None:
            self.inner.fill_mask(out)
        else:
            out[:] = np.uint32(0xFFFFFFFF)
            if self.vocab_size % 32:  # no bit past the last id
                out[-1] = np.uint32((1 << (self.vocab_size % 32)) - 1)
        if self.banning:
            allowed = out.copy()
            for t in self.eos_ids:
                out[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
            if not out.any():
                out[:] = allowed

    def accept(self, token: int) -> None:
        if self.inner is not None:
            self.inner.accept(token)
        self.accepted += 1

    @property
    def finished(self) -> bool:
        """The inner constraint's: min_tokens alone never ends a reply."""
        return self.inner is not None and self.inner.finished


class Penalties:
    """A choice's penalties on the host (penalties_ref): the generated tokens' counts, the
    prompt's tokens and the dense bias; apply() the logits, then add() the token sampled."""

    def __init__(self, sampling: SamplingParams, prompt: list[int], vocab_size: int) -> None:
        s = sampling
        check_penalties(
            s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.logit_bias, vocab_size
        )
        self.sampling = s
        self.counts = np.zeros(vocab_size, np.int32)  # (vocab_size,) generated so far
        self.prompt = prompt_flags(prompt, vocab_size)  # (vocab_size,) uint8
        self.bias = logit_bias_dense(s.logit_bias, vocab_size)  # (vocab_size,) float32

    def apply(self, logits: np.ndarray) -> np.ndarray:
        s = self.sampling
        return penalties_ref(
            logits,
            self.counts,
            self.prompt,
            s.presence_penalty,
            s.frequency_penalty,
            s.repetition_penalty,
            self.bias,
        )

    def add(self, token: int) -> None:
        self.counts[token] += 1


class Sampler:
    """Draws tokens with `sample_ref`; one coin from a seeded numpy Generator per token.

    The same seed gives the same sequence of coins, hence of tokens for the same logits;
    first_coin starts this sampler that many coins into the sequence.
    `next_coin()` hands the coin out on its own, for a GPU sampler that takes it as input.
    penalties: applied to the logits before each draw, and told each token drawn.
    """

    def __init__(
        self,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        first_coin: int = 0,
        penalties: Penalties | None = None,
    ) -> None:
        check_sampling(temperature, top_k, top_p, min_p)
        self.penalties = penalties
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.min_p = float(min_p)
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self._rng.random(first_coin)  # the coins before the first one this sampler hands out

    @classmethod
    def of(cls, sampling: SamplingParams) -> Sampler:
        """The sampler of these options, its first coin sampling.first_coin of the seed's sequence."""
        s = sampling
        return cls(s.temperature, s.top_k, s.top_p, s.min_p, s.seed, s.first_coin)

    def next_coin(self) -> float:
        """The next uniform number in [0, 1) of this sampler's sequence."""
        return float(self._rng.random())

    def sample(self, logits: np.ndarray) -> int:
        """The next token id for `logits` (vocab_size,). Draws one coin even when greedy, so the
        coin sequence does not depend on the temperature."""
        coin = self.next_coin()
        if self.penalties is not None:
            logits = self.penalties.apply(logits)
        token = sample_ref(logits, self.temperature, self.top_k, self.top_p, self.min_p, coin)
        if self.penalties is not None:
            self.penalties.add(token)
        return token

    @classmethod
    def for_request(cls, sampling: SamplingParams, prompt: list[int], vocab_size: int) -> Sampler:
        """The sampler of `sampling`, with its Penalties (over `prompt`, the request's whole
        prompt) where it asks for any."""
        penalties = Penalties(sampling, prompt, vocab_size) if sampling.penalized else None
        s = sampling
        return cls(s.temperature, s.top_k, s.top_p, s.min_p, s.seed, s.first_coin, penalties)
