"""Choosing the next token from the logits: the sampling options, and the CPU sampler.

`SamplingParams` holds the options (greedy, temperature, top-k, top-p, min-p, the seed) that both
engines take. `Sampler` draws one uniform coin a token from a seeded NumPy generator and picks
the token with pycalm.cpu.reference.sample_ref, the specification that the GPU sampling kernel
(pycalm/kernels/sample.py) follows; the GPU engine takes the same coins (`next_coin`), so the CPU
and the GPU pick the same tokens from the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pycalm.cpu.reference import check_sampling, sample_ref


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    seed: int = 0
    # the place in the seed's sequence of coins of the first sampled token's coin (a speculative
    # loop that hands the plain token steps a stretch of its tokens: pycalm.app.speculative)
    first_coin: int = 0


class Sampler:
    """Draws tokens with `sample_ref`; one coin from a seeded numpy Generator per token.

    The same seed gives the same sequence of coins, hence of tokens for the same logits;
    first_coin starts this sampler that many coins into the sequence.
    `next_coin()` hands the coin out on its own, for a GPU sampler that takes it as input.
    """

    def __init__(
        self,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        first_coin: int = 0,
    ) -> None:
        check_sampling(temperature, top_k, top_p, min_p)
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
        return sample_ref(logits, self.temperature, self.top_k, self.top_p, self.min_p, coin)
