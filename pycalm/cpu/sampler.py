"""Choosing the next token from the logits: the sampling options, and the CPU sampler.

`SamplingParams` holds the options (greedy, temperature, top-k, top-p, min-p, the seed, the
penalties and the logit bias) that both engines take. `Sampler` draws one uniform coin a token from a seeded NumPy generator and picks
the token with pycalm.cpu.reference.sample_ref, the specification that the GPU sampling kernel
(pycalm/kernels/sample.py) follows; the GPU engine takes the same coins (`next_coin`), so the CPU
and the GPU pick the same tokens from the same logits.
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

    def unseeded(self) -> SamplingParams:
        """The options a captured token step bakes in (GpuEngine.graph's key): the seed and the
        penalties' values live in device memory, set by each generate."""
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p)


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
