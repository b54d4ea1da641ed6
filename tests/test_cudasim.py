"""The simulator's barriers (pycalm.kernels._cudasim): syncthreads with threads that have returned,
many warp shuffles in a row (the two slot tables in turn), and a thread that raises. With
PYCALM_TEST_GPU=1 the kernels run on the GPU, but the raising one."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from gpu import GPU
from numba import cuda, float32, int32

import pycalm.kernels  # noqa: F401 - under the simulator, installs the warp intrinsics (_cudasim)

FULL = 0xFFFFFFFF


@cuda.jit(device=True)
def _dead(i: int) -> bool:
    return i == 5 or i == 40


@cuda.jit
def _barrier_kernel(out):  # noqa: ANN001, ANN202
    """Threads 5 and 40 return before the barriers; each other thread reads its mirror's slot
    after the first (0 for a returned thread's) and adds its neighbour's after the second."""
    i = cuda.threadIdx.x
    if _dead(i):
        return
    sm = cuda.shared.array(64, int32)
    sm[i] = i + 1
    cuda.syncthreads()  # every live thread's slot is written
    v = sm[63 - i] if not _dead(63 - i) else 0
    cuda.syncthreads()  # every read is done before the slots change
    sm[i] = 1000 * v
    cuda.syncthreads()  # the new values are written
    n = (i + 1) % 64
    out[cuda.blockIdx.x, i] = sm[i] + (sm[n] if not _dead(n) else 0)


def test_syncthreads_with_returned_threads():
    out = np.full((3, 64), -1, np.int32)
    _barrier_kernel[3, 64](out)
    first = np.arange(1, 65)
    first[[5, 40]] = 0  # the returned threads' slots count as 0
    mirrored = 1000 * first[::-1]
    mirrored[[5, 40]] = 0
    want = mirrored + np.roll(mirrored, -1)
    want[[5, 40]] = -1  # their outputs untouched
    np.testing.assert_array_equal(out, np.broadcast_to(want, (3, 64)))


@cuda.jit
def _shuffle_kernel(x, out):  # noqa: ANN001, ANN202
    """Each lane: 40 rounds of an xor-butterfly sum of x[lane] * round, then a rotate by one."""
    lane = cuda.threadIdx.x % 32
    total = float32(0.0)
    for r in range(40):
        v = x[cuda.threadIdx.x] * float32(r + 1)
        for off in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(FULL, v, off)
        total += v
    out[cuda.threadIdx.x] = total + cuda.shfl_sync(FULL, x[cuda.threadIdx.x], (lane + 1) % 32)


def test_many_shuffles_in_a_row():
    rng = np.random.default_rng(0)
    x = rng.integers(-8, 8, 64).astype(np.float32)  # small integers: every sum exact
    out = np.zeros(64, np.float32)
    _shuffle_kernel[1, 64](x, out)
    sums = x.reshape(2, 32).sum(axis=1).repeat(32) * sum(range(1, 41))
    np.testing.assert_array_equal(out, sums + np.roll(x.reshape(2, 32), -1, axis=1).ravel())


@cuda.jit
def _raising_kernel(out):  # noqa: ANN001, ANN202
    i = cuda.threadIdx.x
    cuda.syncthreads()  # everyone arrives
    if i == 7:
        out[1000] = 1  # out of bounds: the simulator raises IndexError
    cuda.syncthreads()  # the others wait here for thread 7, which never comes
    out[i] = 1


@pytest.mark.skipif(GPU, reason="the GPU does not raise on an out-of-bounds store")
def test_a_raising_thread_fails_the_launch_without_a_hang():
    result: list[BaseException | None] = []

    def launch() -> None:
        try:
            _raising_kernel[1, 32](np.zeros(32, np.float32))
            result.append(None)
        except BaseException as e:  # noqa: BLE001 - the launch's exception is the result
            result.append(e)

    runner = threading.Thread(target=launch, daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive(), "the launch hangs"
    assert isinstance(result[0], IndexError) and "tid=[7, 0, 0]" in str(result[0])
