"""GPU sample_rows (one block a row, each row its own options and coin, read from device memory)
against pycalm.cpu.reference.sample_ref row by row, token for token.

The kernel sums in float32 where the reference sums in float64, so a coin within ~1e-6 of the
kept mass of a boundary between two tokens may legitimately pick the neighbour (test_sample.py:
small vocabularies make that improbable). The realistic vocabulary on the GPU (128256 logits:
thousands of kept tokens, boundaries ~1e-5 apart) does not, so the random coins here are drawn
inside a token of the reference's walk whose share is at least WIDE, at least a quarter of that
share away from its ends; the edges of the walk (coin 0: the first kept token; the largest
float32 below 1 with a top-k cut: the last) are exact. Under the simulator the kernel runs with
64 threads over a few hundred logits (KEPT is 32 there: the top-k 20 and min-p rows sort their
kept tokens, the others take the radix passes); with PYCALM_TEST_GPU=1 over 128256 logits with
the launcher's default block.
"""

import re

import numpy as np
import pytest
from gpu import GPU
from numba import cuda

from pycalm.cpu.reference import filtered_distribution, sample_ref
from pycalm.cpu.sampler import SamplingParams
from pycalm.errors import PycalmError
from pycalm.kernels.sample import HostRows, RowSampling, host_rows, sample_rows

THREADS = {} if GPU else {"threads": 64}  # the simulator runs a Python thread per GPU thread
VOCAB = 128256 if GPU else 1237
WIDE = 1e-4  # the least share of the token a random coin lands in
LAST = float(np.nextafter(np.float32(1.0), np.float32(0.0)))  # the largest float32 coin


def _run(logits: np.ndarray, params: RowSampling, coins: np.ndarray, stream, **options) -> list[int]:
    tokens = cuda.to_device(np.full(len(coins), -1, np.int32))
    sample_rows(
        cuda.to_device(logits), params, cuda.to_device(coins), tokens, stream=stream, **THREADS, **options
    )
    stream.synchronize()
    return tokens.copy_to_host().tolist()


def _want(logits: np.ndarray, settings: list[SamplingParams], coins: np.ndarray) -> list[int]:
    """sample_ref applied row by row."""
    return [
        sample_ref(row, s.temperature, s.top_k, s.top_p, s.min_p, float(c))
        for row, s, c in zip(logits, settings, coins, strict=True)
    ]


def _coin_inside(rng: np.random.Generator, row: np.ndarray, s: SamplingParams) -> float:
    """A float32 coin in the middle half of the share of a random token of the reference's walk
    (one of at least WIDE): far from every boundary, where float32 and float64 sums agree."""
    if s.temperature == 0.0:
        return float(np.float32(rng.random()))  # greedy: the coin is not used
    _, p = filtered_distribution(row, s.temperature, s.top_k, s.top_p, s.min_p)
    share = p / p.sum()
    start = np.cumsum(share) - share
    wide = np.flatnonzero(share >= WIDE)
    assert len(wide), "no token of the walk is wide enough for a coin"  # a guard on the test's logits
    i = rng.choice(wide)
    return float(np.float32(start[i] + share[i] * (0.25 + 0.5 * rng.random())))


def test_sample_rows_matches_ref_row_by_row():
    # five rows of different logits, each with its own options; three launches on the same
    # arrays, the options moved one row down between them (the kernel reads them at run time)
    rng = np.random.default_rng(29)
    settings = [
        SamplingParams(0.0),  # greedy: the row's argmax, three equal maxima
        SamplingParams(0.7, top_k=20),
        SamplingParams(1.3, top_p=0.9),
        SamplingParams(1.0, min_p=0.05),
        SamplingParams(0.8, top_k=40, top_p=0.95, min_p=0.02),
    ]
    rows = len(settings)
    logits = (rng.standard_normal((rows, VOCAB)) * 3).astype(np.float32)  # (rows, vocab)
    stream = cuda.stream()
    params = RowSampling.allocate(rows, stream=stream)
    for launch in range(3):
        row_settings = settings[-launch:] + settings[:-launch]  # launch 1: row 1 greedy, ...
        greedy = row_settings.index(SamplingParams(0.0))
        logits[greedy, [999, 400, 17]] = logits[greedy].max() + 1.0  # the lowest id (17) wins
        params.set_rows(row_settings, stream=stream)
        coins = np.array(
            [_coin_inside(rng, x, s) for x, s in zip(logits, row_settings, strict=True)], np.float32
        )
        if launch == 2:  # the edges of the walk: the first kept token, the last one of a top-k cut
            for r, s in enumerate(row_settings):
                coins[r] = LAST if s.top_k else 0.0 if s.temperature else coins[r]
        got = _run(logits, params, coins, stream)
        want = _want(logits, row_settings, coins)
        assert got[greedy] == 17
        assert got == want, (launch, coins.tolist())


def test_sample_rows_equal_logits_in_id_order():
    # ten equal top logits in every row (different ids a row): the walk takes them in id order,
    # over the whole vocabulary (row 0) or a top-k cut that the sorted walk handles (row 1: ten
    # of them and two of the next logit), and the greedy row takes the lowest id (row 2)
    rng = np.random.default_rng(3)
    vocab = 300
    logits = np.full((3, vocab), -5.0, np.float32)  # (rows, vocab)
    ids = [rng.choice(vocab, 10, replace=False) for _ in range(3)]
    for r in range(3):
        logits[r, ids[r]] = 20.0
    logits[1, rng.choice(np.setdiff1d(np.arange(vocab), ids[1]), 3, replace=False)] = 19.5
    settings = [SamplingParams(1.0), SamplingParams(1.0, top_k=12), SamplingParams(0.0)]
    stream = cuda.stream()
    params = RowSampling.allocate(3, stream=stream)
    params.set_rows(settings, stream=stream)
    for coins in ([0.35, 0.05, 0.5], [0.95, 0.999, 0.0]):
        coins = np.array(coins, np.float32)
        got = _run(logits, params, coins, stream)
        assert got == _want(logits, settings, coins), coins.tolist()
        assert got[0] == np.sort(ids[0])[int(coins[0] * 10)]
        assert got[2] == ids[2].min()


def test_sample_rows_wide_takes_the_rows_without_top_k_or_min_p():
    # with the wide scratch the rows above temperature 0 without a top-k or min-p cut (is_wide:
    # top_k 0 or the whole vocabulary, min_p 0; top-p or not) take pycalm.kernels.sample_wide's
    # launches and the others one block each, in one call; the options move a row down between launches (the kernels read
    # them at run time, as a captured graph replays them); a row more than the scratch holds
    # takes one block a row each
    from pycalm.kernels.sample_wide import WideScratch

    rng = np.random.default_rng(31)
    settings = [
        SamplingParams(0.8),
        SamplingParams(0.0),
        SamplingParams(1.3, top_p=0.9),
        SamplingParams(1.1, top_k=VOCAB),  # a top-k of the whole vocabulary cuts nothing
        SamplingParams(0.6),
        SamplingParams(0.9, top_k=20, top_p=0.8),  # one block
        SamplingParams(0.7, top_p=0.5),
    ]
    rows = len(settings)
    logits = (rng.standard_normal((rows + 1, VOCAB)) * 3).astype(np.float32)  # (rows + 1, vocab)
    stream = cuda.stream()
    wide = WideScratch.allocate(rows)
    for launch in range(3):
        row_settings = settings[-launch:] + settings[:-launch]
        params = RowSampling.allocate(rows, stream=stream)
        params.set_rows(row_settings, stream=stream)
        coins = np.array(
            [_coin_inside(rng, x, s) for x, s in zip(logits, row_settings, strict=False)], np.float32
        )
        if launch == 2:
            coins[:] = 0.0  # the first token of each walk
        tokens = cuda.to_device(np.full(rows, -1, np.int32))
        sample_rows(cuda.to_device(logits[:rows]), params, cuda.to_device(coins), tokens, stream=stream,
                    wide=wide, **THREADS)  # fmt: skip
        stream.synchronize()
        assert tokens.copy_to_host().tolist() == _want(logits[:rows], row_settings, coins), (launch, coins)
    more = [*settings, SamplingParams(0.9)]
    params = RowSampling.allocate(rows + 1, stream=stream)
    params.set_rows(more, stream=stream)
    coins = np.array([_coin_inside(rng, x, s) for x, s in zip(logits, more, strict=True)], np.float32)
    assert _run(logits, params, coins, stream, wide=wide) == _want(logits, more, coins)


def test_host_rows_kept_match_host_rows():
    """HostRows (a batch's steps' options, each object checked and encoded once) gives host_rows's
    arrays step after step, as requests come and go and share objects, and host_rows's errors for
    a bad option: the same exception and message, whether the bad row comes first, after kept rows
    or among new ones, and nothing of a refused step kept."""
    rng = np.random.default_rng(5)
    pool = [
        SamplingParams(float(rng.choice([0.0, 0.7, 1.3])), int(rng.integers(0, 50)), float(rng.uniform(0.1, 1.0)),
                       float(rng.uniform(0.0, 0.5)), seed=int(rng.integers(9)))
        for _ in range(40)
    ]  # fmt: skip
    rows = HostRows()
    for _ in range(60):
        step = [pool[i] for i in rng.integers(0, len(pool), int(rng.integers(0, 20)))]
        got, want = rows(step), host_rows(step)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape and g.flags.c_contiguous
            assert g.tobytes() == w.tobytes()
        assert set(rows.kept) <= {id(s) for s in pool}
    assert len(rows.kept) <= 20  # (the objects of one step at most)
    bad = [
        SamplingParams(0.5, top_p=0.0),
        SamplingParams(-1.0),
        SamplingParams(float("nan")),
        SamplingParams(0.5, min_p=2.0),
        SamplingParams(0.5, top_k=-1),
        SamplingParams(0.5, frequency_penalty=0.5),
        SamplingParams(0.5, top_k=2**40),  # (numpy's OverflowError: after every row's check)
    ]
    for b in bad:
        for step in (
            [b],
            [pool[0], b, pool[1]],
            [SamplingParams(0.9), b],
            [b, SamplingParams(0.5, top_p=0.0)],
        ):
            with pytest.raises(Exception) as want:
                host_rows(step)
            kept = dict(rows.kept)
            with pytest.raises(want.type, match=f"^{re.escape(str(want.value))}$"):
                rows(step)
            assert rows.kept == kept


def test_row_sampling_rows_and_checks():
    stream = cuda.stream()
    params = RowSampling.allocate(3, stream=stream)  # every row greedy
    assert [a.copy_to_host().tolist() for a in params] == [[0.0] * 3, [0] * 3, [1.0] * 3, [0.0] * 3]
    params.set_row(2, SamplingParams(0.5, 7, 0.25, 0.125), stream=stream)
    host = [a.copy_to_host().tolist() for a in params]
    assert host == [[0.0, 0.0, 0.5], [0, 0, 7], [1.0, 1.0, 0.25], [0.0, 0.0, 0.125]]
    assert [a.dtype for a in params] == [np.float32, np.int32, np.float32, np.float32]
    with pytest.raises(PycalmError, match="top_p"):
        params.set_row(0, SamplingParams(1.0, top_p=0.0), stream=stream)
    with pytest.raises(PycalmError, match="rows"):
        params.set_row(3, SamplingParams(1.0), stream=stream)
    logits = cuda.to_device(np.zeros((3, 64), np.float32))
    tokens = cuda.to_device(np.zeros(3, np.int32))
    with pytest.raises(PycalmError, match="sample_rows"):  # a coin short
        sample_rows(logits, params, cuda.to_device(np.zeros(2, np.float32)), tokens, stream=stream)
    with pytest.raises(PycalmError, match="sample_rows"):  # float64 coins
        sample_rows(logits, params, cuda.to_device(np.zeros(3)), tokens, stream=stream)
    with pytest.raises(PycalmError, match="threads"):
        sample_rows(
            logits, params, cuda.to_device(np.zeros(3, np.float32)), tokens, stream=stream, threads=48
        )
