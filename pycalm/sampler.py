"""Choosing the next token from the logits: greedy, temperature, top-k, min-p, top-p.

`sample_ref` is the specification, written as plain NumPy: the GPU sampling kernel
(pycalm/kernels/sample.py) is tested against it, and `Sampler` uses it on the CPU. It takes the
random number as an argument (a "coin" in [0, 1)) instead of drawing it, so that the CPU and the
GPU can be handed the same coin and must then pick the same token.

The steps, for temperature T > 0:

    p = softmax(logits / T)                     (float64)
    order tokens by p, descending; equal p: lower id first
    keep the first n of that order, where n is the smallest of
        top_k                                   (top_k > 0)
        #{i : p_i >= min_p * max p}             (min_p > 0)
        the shortest prefix whose share of the kept mass reaches top_p   (top_p < 1)
    walk the kept tokens in that order and return the first whose running sum of p
    exceeds coin * (sum of kept p)

top-p is measured on what top-k and min-p left (renormalised), as llama.cpp and transformers do.
At least one token is always kept. T == 0 is greedy: argmax, lowest id on ties.
"""

from __future__ import annotations

import numpy as np

from pycalm.errors import PycalmError


def _check(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    """Sampling options come from the command line: reject nonsense with a one-line message."""
    if not (temperature >= 0.0 and np.isfinite(temperature)):
        raise PycalmError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k < 0:
        raise PycalmError(f"top_k must be >= 0 (0: off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise PycalmError(f"top_p must be in (0, 1] (1: off), got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise PycalmError(f"min_p must be in [0, 1] (0: off), got {min_p}")


def filtered_distribution(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, their probabilities) that survive the filters, in walk order (not renormalised).

    The walk order is descending probability, lower id first among equals. Needs temperature > 0.
    """
    x = np.asarray(logits, dtype=np.float64).reshape(-1) / temperature  # (vocab_size,)
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")  # stable: equal probabilities keep ascending ids
    p_sorted = p[order]
    n = len(p_sorted)
    if top_k > 0:
        n = min(n, top_k)
    if min_p > 0.0:
        # p_sorted is descending, so the tokens above the threshold are a prefix of it
        n = min(n, int(np.count_nonzero(p_sorted >= min_p * p_sorted[0])))
    if top_p < 1.0:
        share = np.cumsum(p_sorted[:n]) / p_sorted[:n].sum()
        n = min(n, int(np.searchsorted(share, top_p, side="left")) + 1)  # first prefix with share >= top_p
    n = max(n, 1)
    return order[:n], p_sorted[:n]


def sample_ref(
    logits: np.ndarray,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    coin: float = 0.0,
) -> int:
    """The token chosen for a uniform `coin` in [0, 1): the specification the GPU kernel follows."""
    _check(temperature, top_k, top_p, min_p)
    logits = np.asarray(logits).reshape(-1)
    if temperature == 0.0:
        return int(np.argmax(logits))  # np.argmax returns the first (lowest) index among equals
    ids, p = filtered_distribution(logits, temperature, top_k, top_p, min_p)
    running = np.cumsum(p)
    i = int(np.searchsorted(running, coin * running[-1], side="right"))  # first running sum > target
    return int(ids[min(i, len(ids) - 1)])  # min(): coin * total can round up to the last sum


class Sampler:
    """Draws tokens with `sample_ref`; one coin from a seeded numpy Generator per token.

    The same seed gives the same sequence of coins, hence of tokens for the same logits.
    `next_coin()` hands the coin out on its own, for a GPU sampler that takes it as input.
    """

    def __init__(
        self,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
    ) -> None:
        _check(temperature, top_k, top_p, min_p)
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.min_p = float(min_p)
        self.seed = seed
        self._rng = np.random.default_rng(seed)

    def next_coin(self) -> float:
        """The next uniform number in [0, 1) of this sampler's sequence."""
        return float(self._rng.random())

    def sample(self, logits: np.ndarray) -> int:
        """The next token id for `logits` (vocab_size,). Draws one coin even when greedy, so the
        coin sequence does not depend on the temperature."""
        coin = self.next_coin()
        return sample_ref(logits, self.temperature, self.top_k, self.top_p, self.min_p, coin)
