"""GPU argmax / sample against pycalm.cpu.reference.sample_ref, token for token.

Random logits have no ties, and the coins are random: a coin that lands within float32 rounding
(~1e-6 of the kept mass) of a boundary between two tokens could legitimately differ from the
float64 spec, which these small vocabularies make improbable (~1e-4 per draw in total).
The kernels run with 64 threads here (the simulator runs a Python thread per thread). The coin
walk (and a top-p cut after a top-k / min-p cut) sorts the kept tokens when they are at most
KEPT (32 under the simulator: top-k 20 and min-p here; top-k 40 and the whole vocabulary take
the radix passes), and a top-p select alone stops once a pass leaves at most KEPT candidates
(the peaked distributions).
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from pycalm.cpu.reference import sample_ref
from pycalm.cpu.sampler import SamplingParams
from pycalm.kernels.argmax import argmax
from pycalm.kernels.sample import sample

THREADS = 64


def _argmax_gpu(logits, blocks=0):
    state = cuda.to_device(np.array([-1, 0, 0, 0], np.int32))
    stream = cuda.stream()
    scratch = cuda.to_device(np.full((2, blocks), -7, np.int32)) if blocks else None
    argmax(cuda.to_device(logits), state, stream=stream, threads=THREADS, scratch=scratch)
    stream.synchronize()
    return int(state.copy_to_host()[0])


@pytest.mark.parametrize("blocks", [0, 5])  # one block; two passes over 5 blocks (via scratch)
def test_argmax_lowest_id_on_ties(blocks):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(1000).astype(np.float32)
    assert _argmax_gpu(logits, blocks) == int(np.argmax(logits))
    logits[[400, 999, 17]] = 9.0  # three equal maxima in different blocks: the lowest id wins
    assert _argmax_gpu(logits, blocks) == 17
    logits[:] = -np.inf  # nothing finite: token 0
    assert _argmax_gpu(logits, blocks) == 0


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p,vocab",
    [
        (1.0, 0, 1.0, 0.0, 301),  # plain temperature sampling: the walk over the whole vocabulary
        (0.7, 20, 1.0, 0.0, 301),  # top-k
        (1.3, 0, 0.9, 0.0, 301),  # top-p
        (1.0, 0, 1.0, 0.05, 301),  # min-p
        (0.8, 40, 0.95, 0.02, 301),  # all three
        (0.9, 20, 0.8, 0.0, 301),  # top-p within a few kept tokens (the sorted walk's own cut)
        (0.8, 40, 0.95, 0.02, 1237),  # a thread's loads come in several batches, the last partial
    ],
)
def test_sample_matches_ref(temperature, top_k, top_p, min_p, vocab):
    rng = np.random.default_rng(top_k + int(100 * top_p) + vocab)
    steps = 4
    logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
    coins = rng.random(steps).astype(np.float32)
    coins[0] = 0.0  # the first kept token
    # the end of the walk: with top-k the last kept token (its p is far above float32 rounding);
    # over the whole vocabulary the tail holds p ~ 1e-9, where float32 cannot follow float64
    coins[1] = np.nextafter(np.float32(1.0), np.float32(0.0)) if top_k else 0.999
    d_logits, d_coins = cuda.to_device(logits), cuda.to_device(coins)
    stream = cuda.stream()
    for step in range(steps):
        state = cuda.to_device(np.array([-1, step, 0, 0], np.int32))  # the coin index is state[1]
        settings = SamplingParams(temperature, top_k, top_p, min_p)
        sample(d_logits, state, d_coins, settings, stream=stream, threads=THREADS)
        stream.synchronize()
        want = sample_ref(logits, temperature, top_k, top_p, min_p, float(coins[step]))
        assert int(state.copy_to_host()[0]) == want, (step, float(coins[step]))


def test_sample_rising_logits():
    # logits rising with the id: every logit a thread loads is its largest so far, so the pass
    # that finds the largest and the total mass together rescales its running sum at every one
    vocab = 1237
    logits = np.linspace(-12.0, 9.0, vocab).astype(np.float32)
    coins = np.array([0.0, 0.1, 0.37, 0.62, 0.9, 0.999], np.float32)
    d_logits, d_coins = cuda.to_device(logits), cuda.to_device(coins)
    stream = cuda.stream()
    for settings in (SamplingParams(0.7), SamplingParams(1.5, top_p=0.8)):
        for step, coin in enumerate(coins):
            state = cuda.to_device(np.array([-1, step, 0, 0], np.int32))
            sample(d_logits, state, d_coins, settings, stream=stream, threads=THREADS)
            stream.synchronize()
            want = sample_ref(logits, settings.temperature, 0, settings.top_p, 0.0, float(coin))
            assert int(state.copy_to_host()[0]) == want, (settings, float(coin))


@pytest.mark.parametrize("equal", [10, 40])
def test_sample_orders_equal_logits_by_id(equal):
    # equal top logits: the walk takes them in id order, so coin c picks the floor(equal c)-th;
    # ten fit KEPT (32 here: the crossing bin is sorted), forty take the radix passes over the ids
    logits = np.full(300, -5.0, np.float32)
    ids = np.random.default_rng(equal).permutation(300)[:equal]
    logits[ids] = 20.0
    coins = np.array([0.0125, 0.3375, 0.9625], np.float32)  # halfway between tenths and fortieths
    d_logits, d_coins = cuda.to_device(logits), cuda.to_device(coins)
    stream = cuda.stream()
    for step, coin in enumerate(coins):
        state = cuda.to_device(np.array([-1, step, 0, 0], np.int32))
        sample(d_logits, state, d_coins, SamplingParams(1.0), stream=stream, threads=THREADS)
        stream.synchronize()
        assert int(state.copy_to_host()[0]) == sample_ref(logits, 1.0, coin=float(coin))
        assert int(state.copy_to_host()[0]) == np.sort(ids)[int(coin * equal)]


@pytest.mark.parametrize("top_k", [5, 12])
def test_sample_kept_ties_walk_in_id_order(top_k):
    # ten equal top logits and a top-k cut: the kept tokens (the five lowest ids of the ten, or
    # all ten and two of the next logit) are few, so the walk sorts them (ties by id)
    logits = np.full(300, -5.0, np.float32)
    ids = np.array([250, 3, 77, 120, 9, 199, 44, 160, 281, 60])
    logits[ids] = 20.0
    logits[[5, 290, 100]] = 19.5
    coins = np.array([0.0, 0.05, 0.35, 0.5, 0.95, 0.999], np.float32)
    d_logits, d_coins = cuda.to_device(logits), cuda.to_device(coins)
    stream = cuda.stream()
    for step, coin in enumerate(coins):
        state = cuda.to_device(np.array([-1, step, 0, 0], np.int32))
        sample(d_logits, state, d_coins, SamplingParams(1.0, top_k), stream=stream, threads=THREADS)
        stream.synchronize()
        assert int(state.copy_to_host()[0]) == sample_ref(logits, 1.0, top_k, coin=float(coin)), coin


@pytest.mark.parametrize("temperature,top_p,tie", [(1.0, 0.9, False), (0.7, 0.6, False), (1.0, 0.5, True)])
def test_sample_top_p_alone_over_a_peaked_distribution(temperature, top_p, tie):
    # a few logits far above the rest (as a language model's): the top-p select stops once a
    # pass leaves at most KEPT candidates and sorts them; with `tie` ten of them are equal
    rng = np.random.default_rng(int(100 * top_p))
    logits = rng.standard_normal(1237).astype(np.float32)
    top = rng.choice(1237, 10, replace=False)
    logits[top] = 20.0 if tie else (20.0 + rng.random(10)).astype(np.float32)
    coins = np.array([0.0, 0.1, 0.45, 0.7, 0.93, 0.999], np.float32)
    d_logits, d_coins = cuda.to_device(logits), cuda.to_device(coins)
    stream = cuda.stream()
    for step, coin in enumerate(coins):
        state = cuda.to_device(np.array([-1, step, 0, 0], np.int32))
        sample(
            d_logits, state, d_coins, SamplingParams(temperature, 0, top_p), stream=stream, threads=THREADS
        )
        stream.synchronize()
        want = sample_ref(logits, temperature, 0, top_p, 0.0, float(coin))
        assert int(state.copy_to_host()[0]) == want, coin


@pytest.fixture(scope="module")
def wide():
    """The scratch of the walk over many blocks (pycalm.kernels.sample_wide), for one row."""
    from pycalm.kernels.sample_wide import WideScratch

    return WideScratch.allocate(1)


def _sample_wide(logits, coins, temperature, wide, top_p=1.0):
    """sample without top-k or min-p, with the wide scratch: the token for each coin in turn."""
    d_logits, d_coins = cuda.to_device(logits), cuda.to_device(coins)
    stream = cuda.stream()
    got = []
    for step in range(len(coins)):
        state = cuda.to_device(np.array([-1, step, 0, 0], np.int32))
        sample(d_logits, state, d_coins, SamplingParams(temperature, top_p=top_p), stream=stream, wide=wide)
        stream.synchronize()
        got.append(int(state.copy_to_host()[0]))
    return got


@pytest.mark.parametrize("vocab", [301, 1237])
def test_sample_wide_matches_ref(vocab, wide):
    # temperature alone over many blocks a row (WIDE_BLOCKS chunks of the vocabulary): the
    # coins of test_sample_matches_ref's whole-vocabulary case, and logits rising with the id
    # (the largest logit in the last chunk, every chunk's max below it)
    rng = np.random.default_rng(vocab)
    coins = rng.random(5).astype(np.float32)
    coins[:2] = 0.0, 0.999
    for logits, temperature in (
        ((rng.standard_normal(vocab) * 3).astype(np.float32), 0.8),
        (np.linspace(-12.0, 9.0, vocab).astype(np.float32), 1.5),
    ):
        want = [sample_ref(logits, temperature, coin=float(c)) for c in coins]
        assert _sample_wide(logits, coins, temperature, wide) == want, coins.tolist()


@pytest.mark.parametrize(
    "temperature,top_p,kind", [(0.7, 0.9, "normal"), (1.3, 0.5, "peaked"), (1.0, 0.8, "ties")]
)
def test_sample_wide_top_p(temperature, top_p, kind, wide):
    # top-p over many blocks: the cut's launches (the first prefix whose mass reaches top_p of
    # the whole, its last token the j-th by id among equal logits), then the walk's within it;
    # the coins reach both ends (the first kept token, and the last, which rounding may walk
    # past and the pick clamps to)
    rng = np.random.default_rng(int(100 * top_p))
    logits = (rng.standard_normal(1237) * 3).astype(np.float32)
    if kind == "peaked":
        logits[rng.choice(1237, 10, replace=False)] += 15.0
    if kind == "ties":
        logits = np.round(logits)  # hundreds of equal logits at every value, the cut among them
    coins = rng.random(5).astype(np.float32)
    coins[:2] = 0.0, np.nextafter(np.float32(1.0), np.float32(0.0))
    want = [sample_ref(logits, temperature, 0, top_p, 0.0, float(c)) for c in coins]
    assert _sample_wide(logits, coins, temperature, wide, top_p) == want, coins.tolist()


@pytest.mark.parametrize("blocks", [1, 2])
def test_sample_wide_any_block_count(blocks, wide):
    # the picks do not depend on how many chunks a row is cut into (wide_blocks' count is the
    # test above's): one block is the whole row, two take 151 and 150 logits
    rng = np.random.default_rng(blocks)
    logits = (rng.standard_normal(301) * 3).astype(np.float32)
    coins = np.array([0.0, 0.2, 0.55, 0.9, 0.999], np.float32)
    d_logits, d_coins = cuda.to_device(logits), cuda.to_device(coins)
    stream = cuda.stream()
    for step, coin in enumerate(coins):
        state = cuda.to_device(np.array([-1, step, 0, 0], np.int32))
        wide.sample_state(d_logits, state, d_coins, 1.0 / 0.9, 1.0, stream=stream, blocks=blocks)
        stream.synchronize()
        assert int(state.copy_to_host()[0]) == sample_ref(logits, 0.9, coin=float(coin)), coin


@pytest.mark.parametrize("equal", [10, 40])
def test_sample_wide_orders_equal_logits_by_id(equal, wide):
    # equal top logits spread over the chunks: the walk takes them in id order, so coin c picks
    # the floor(equal c)-th (the pick launch finds the chunk that holds it, then the id in it)
    logits = np.full(300, -5.0, np.float32)
    ids = np.random.default_rng(equal).permutation(300)[:equal]
    logits[ids] = 20.0
    coins = np.array([0.0125, 0.3375, 0.9625, 0.0], np.float32)  # halfway between tenths and fortieths
    got = _sample_wide(logits, coins, 1.0, wide)
    assert got == [np.sort(ids)[int(c * equal)] for c in coins]


def test_sample_wide_masked_chunks(wide):
    # constrained decoding's masked logits: whole chunks of -inf (no mass, no max) and a few
    # allowed ids; an allowed id is picked, as the reference picks
    logits = np.full(300, -np.inf, np.float32)
    allowed = [7, 201, 202, 290]
    logits[allowed] = [1.0, 3.0, 2.5, 0.5]
    coins = np.array([0.0, 0.5, 0.8, 0.99, 0.999], np.float32)
    want = [sample_ref(logits, 1.0, coin=float(c)) for c in coins]
    got = _sample_wide(logits, coins, 1.0, wide)
    assert got == want and set(got) <= set(allowed)


def test_sample_block_size_is_checked():
    # one histogram a warp in shared memory: at most SAMPLE_THREADS threads, whole warps
    from pycalm.errors import PycalmError
    from pycalm.kernels.sample import SAMPLE_THREADS

    d = cuda.to_device(np.zeros(64, np.float32))
    state = cuda.to_device(np.zeros(4, np.int32))
    for threads in (SAMPLE_THREADS + 32, 48, 0):
        with pytest.raises(PycalmError, match="threads"):
            sample(d, state, d, SamplingParams(1.0), stream=cuda.stream(), threads=threads)


def test_kernel_script_runs_its_check():
    # scripts/kernels/sample.py (the versions and their timing table): every version's picks
    # checked against the reference over a small vocabulary (on the simulator or the GPU, as here)
    script = Path(__file__).resolve().parents[1] / "scripts" / "kernels" / "sample.py"
    p = subprocess.run([sys.executable, str(script), "--tiny"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.count("(ok)") == 20  # every version, the wide walk and sample_rows (1 and 3 rows) too
