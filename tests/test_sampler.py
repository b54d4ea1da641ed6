"""pycalm.cpu.sampler: exact picks on crafted logits for each filter, determinism, and frequencies."""

from __future__ import annotations

import numpy as np
import pytest

from pycalm.cpu.reference import filtered_distribution, sample_ref
from pycalm.cpu.sampler import Sampler
from pycalm.errors import PycalmError

# probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1, deliberately not in id order
P = np.array([0.15, 0.5, 0.05, 0.3])
LOGITS = np.log(P) + 7.0  # an offset changes nothing


def test_greedy_is_argmax_lowest_id_on_ties() -> None:
    assert sample_ref(LOGITS, 0.0, coin=0.99) == 1
    assert sample_ref(np.array([1.0, 3.0, 3.0, 2.0], dtype=np.float32), 0.0) == 1
    s = Sampler(0.0, seed=1)
    assert [s.sample(LOGITS) for _ in range(5)] == [1] * 5


def test_coin_walks_descending_probability() -> None:
    # order: id 1 (0.5), id 3 (0.3), id 0 (0.15), id 2 (0.05); cumulative 0.5, 0.8, 0.95, 1.0
    picks = {
        coin: sample_ref(LOGITS, 1.0, coin=coin) for coin in (0.0, 0.49, 0.51, 0.79, 0.81, 0.94, 0.96, 0.999)
    }
    assert picks == {0.0: 1, 0.49: 1, 0.51: 3, 0.79: 3, 0.81: 0, 0.94: 0, 0.96: 2, 0.999: 2}


def test_equal_probabilities_walk_in_id_order() -> None:
    logits = np.zeros(4)
    assert [sample_ref(logits, 1.0, coin=c) for c in (0.0, 0.3, 0.6, 0.9)] == [0, 1, 2, 3]


def test_top_k() -> None:
    for coin in (0.0, 0.5, 0.999):
        assert sample_ref(LOGITS, 1.0, top_k=1, coin=coin) == 1  # top_k=1 is greedy
    # top_k=2 keeps ids 1 and 3, mass 0.8: coin 0.7 -> target 0.56 -> id 3; coin 0.6 -> 0.48 -> id 1
    assert sample_ref(LOGITS, 1.0, top_k=2, coin=0.7) == 3
    assert sample_ref(LOGITS, 1.0, top_k=2, coin=0.6) == 1
    assert sample_ref(LOGITS, 1.0, top_k=2, coin=0.999) == 3
    assert sample_ref(LOGITS, 1.0, top_k=100, coin=0.999) == 2  # larger than the vocabulary: off


def test_top_p() -> None:
    for coin in (0.0, 0.5, 0.999):
        assert sample_ref(LOGITS, 1.0, top_p=1e-9, coin=coin) == 1  # tiny top_p is greedy
    ids, _ = filtered_distribution(LOGITS, 1.0, top_p=0.75)
    assert ids.tolist() == [1, 3]  # 0.5 < 0.75 <= 0.8
    ids, _ = filtered_distribution(LOGITS, 1.0, top_p=0.81)
    assert ids.tolist() == [1, 3, 0]
    assert sample_ref(LOGITS, 1.0, top_p=0.81, coin=0.999) == 0
    # top-p is measured on what top-k left: of {0.5, 0.3} renormalised, 0.5/0.8 = 0.625 >= 0.6
    ids, _ = filtered_distribution(LOGITS, 1.0, top_k=2, top_p=0.6)
    assert ids.tolist() == [1]


def test_min_p() -> None:
    for coin in (0.0, 0.5, 0.999):
        assert sample_ref(LOGITS, 1.0, min_p=1.0, coin=coin) == 1  # min_p=1 is greedy
    ids, _ = filtered_distribution(LOGITS, 1.0, min_p=0.5)
    assert ids.tolist() == [1, 3]  # keeps p >= 0.25
    ids, _ = filtered_distribution(LOGITS, 1.0, min_p=0.25)
    assert ids.tolist() == [1, 3, 0]  # keeps p >= 0.125
    # min_p = 1 keeps every token tied for the maximum
    ids, _ = filtered_distribution(np.array([2.0, 5.0, 5.0]), 1.0, min_p=1.0)
    assert ids.tolist() == [1, 2]


def test_temperature_scales_logits() -> None:
    # at T = 2 the probabilities are proportional to sqrt(P)
    q = np.sqrt(P) / np.sqrt(P).sum()
    _, p = filtered_distribution(LOGITS, 2.0)
    np.testing.assert_allclose(p, np.sort(q)[::-1], rtol=1e-12)
    # coin just above the first share picks the second most likely token
    assert sample_ref(LOGITS, 2.0, coin=q[1] + 1e-6) == 3
    assert sample_ref(LOGITS, 2.0, coin=q[1] - 1e-6) == 1


def test_large_logits_do_not_overflow() -> None:
    logits = np.array([1000.0, 999.0, -1000.0], dtype=np.float32)
    _, p = filtered_distribution(logits, 0.5)
    np.testing.assert_allclose(
        p, [1 / (1 + np.exp(-2.0)), np.exp(-2.0) / (1 + np.exp(-2.0)), 0.0], atol=1e-12
    )


def test_same_seed_same_sequence() -> None:
    rng = np.random.default_rng(123)
    logits = rng.normal(size=(50, 1000)).astype(np.float32)
    a = Sampler(0.8, top_k=40, top_p=0.95, min_p=0.05, seed=7)
    b = Sampler(0.8, top_k=40, top_p=0.95, min_p=0.05, seed=7)
    c = Sampler(0.8, top_k=40, top_p=0.95, min_p=0.05, seed=8)
    seq_a = [a.sample(x) for x in logits]
    assert seq_a == [b.sample(x) for x in logits]
    assert seq_a != [c.sample(x) for x in logits]
    # sample() is sample_ref with the sampler's next coin
    d = Sampler(0.8, top_k=40, top_p=0.95, min_p=0.05, seed=7)
    coins = np.random.default_rng(7).random(len(logits))
    assert seq_a == [
        sample_ref(x, 0.8, 40, 0.95, 0.05, coin=float(k)) for x, k in zip(logits, coins, strict=True)
    ]
    assert d.next_coin() == coins[0]


def _assert_frequencies(counts: np.ndarray, expected: np.ndarray, n: int) -> None:
    """Each count within 4 standard deviations of its binomial expectation."""
    sigma = np.sqrt(n * expected * (1 - expected))
    assert np.all(np.abs(counts - n * expected) <= 4 * sigma + 1e-9), (counts, n * expected)


def test_empirical_frequencies() -> None:
    p = np.array([0.1, 0.2, 0.3, 0.4])
    n = 20000
    s = Sampler(1.0, seed=2024)
    counts = np.bincount([s.sample(np.log(p)) for _ in range(n)], minlength=4)
    _assert_frequencies(counts, p, n)
    # with top_k=3 the 0.1 token never appears and the rest are renormalised
    s = Sampler(1.0, top_k=3, seed=99)
    counts = np.bincount([s.sample(np.log(p)) for _ in range(n)], minlength=4)
    assert counts[0] == 0
    _assert_frequencies(counts[1:], p[1:] / 0.9, n)


def test_bad_options_are_user_errors() -> None:
    for kwargs, word in (
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": 1.0, "min_p": 2.0}, "min_p"),
    ):
        with pytest.raises(PycalmError, match=word):
            Sampler(**kwargs)
