"""Warp intrinsics (and libdevice's fast_expf) for numba's CUDA simulator, which lacks them, and
the warp-wide gather behind the tensor-core intrinsics' simulator twins.

The simulator runs every thread of a block as a Python thread. A shuffle here is a rendezvous
of the lanes of one warp: each lane posts its value in the warp's slot table, waits at a
per-warp barrier until all lanes have posted, reads the source lane's slot, and waits again so
that no lane overwrites a slot before everyone has read it. Like the hardware with a full mask,
it expects every lane of the warp to take part (a partial last warp counts only its lanes).

The shim also replaces the simulator's cuda.shared.array (numba-cuda 0.30.4), which looks a
call site's array up and, on a miss, allocates and stores it without a lock: two threads of a
block that both miss get two arrays, and what one writes the other never sees (a rare wrong
result, seen once in tests/test_moe.py). Here the look-up and the first allocation hold a lock.

Only used when NUMBA_ENABLE_CUDASIM=1; the real GPU uses numba's own intrinsics.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
from numba.cuda import types
from numba.cuda.np import numpy_support

_WARP = 32


class _WarpExchange:
    def __init__(self, lanes: int) -> None:
        self.lanes = lanes
        self.slots: list[object] = [None] * _WARP
        self.barrier = threading.Barrier(lanes)


def _exchange_for(thread: threading.Thread) -> tuple[_WarpExchange, int]:
    manager = thread._manager  # the simulator's BlockManager for the running block
    lock = manager.__dict__.setdefault("_pycalm_lock", threading.Lock())
    tid = thread.thread_id
    warp, lane = divmod(tid, _WARP)
    with lock:
        table = manager.__dict__.setdefault("_pycalm_warps", {})
        ex = table.get((thread.blockIdx.x, thread.blockIdx.y, thread.blockIdx.z, warp))
        if ex is None:
            bx, by, bz = manager._block_dim
            n_threads = bx * by * bz
            ex = _WarpExchange(min(_WARP, n_threads - warp * _WARP))
            table[(thread.blockIdx.x, thread.blockIdx.y, thread.blockIdx.z, warp)] = ex
    return ex, lane


def _shuffle(value: object, src_of_lane) -> object:  # noqa: ANN001
    thread = threading.current_thread()
    ex, lane = _exchange_for(thread)
    ex.slots[lane] = value
    ex.barrier.wait()  # every lane has posted its value
    src = src_of_lane(lane)
    out = ex.slots[src] if 0 <= src < ex.lanes else value
    ex.barrier.wait()  # every lane has read before any lane posts again
    return out


def warp_gather(value: object) -> list[object]:
    """Every lane's `value`, indexed by lane: the rendezvous behind the warp-wide tensor-core
    twins (pycalm.kernels.tensorcore), which rebuild a whole matrix from the lanes' fragments.
    Like the hardware's .sync.aligned instructions, the whole warp must call it together."""
    thread = threading.current_thread()
    ex, lane = _exchange_for(thread)
    ex.slots[lane] = value
    ex.barrier.wait()  # every lane has posted its value
    out = list(ex.slots[: ex.lanes])
    ex.barrier.wait()  # every lane has copied the table before any lane posts again
    return out


def shfl_sync(self, mask: int, value: object, src_lane: int) -> object:  # noqa: ANN001
    return _shuffle(value, lambda lane: int(src_lane) % _WARP)


def shfl_down_sync(self, mask: int, value: object, delta: int) -> object:  # noqa: ANN001
    return _shuffle(value, lambda lane: lane + int(delta) if lane + int(delta) < _WARP else lane)


def shfl_up_sync(self, mask: int, value: object, delta: int) -> object:  # noqa: ANN001
    return _shuffle(value, lambda lane: lane - int(delta) if lane - int(delta) >= 0 else lane)


def shfl_xor_sync(self, mask: int, value: object, lane_mask: int) -> object:  # noqa: ANN001
    return _shuffle(value, lambda lane: lane ^ int(lane_mask))


def syncwarp(self, mask: int = 0xFFFFFFFF) -> None:  # noqa: ANN001
    _shuffle(0, lambda lane: lane)


def fast_expf(x: float) -> float:
    """libdevice's fast_expf (ex2.approx on the GPU), which the simulator only declares."""
    return np.exp(np.float32(x))


_SHARED_LOCK = threading.Lock()  # the simulator runs one kernel at a time: one lock serves all
_sim_shared_array = None  # the simulator's own FakeCUDAShared.array (install() keeps it)


def _shared_array(self, shape, dtype, alignment=None):  # noqa: ANN001, ANN202
    """The simulator's FakeCUDAShared.array with its look-up and first allocation under a lock:
    one array a call site (file, line) a launch, keyed as the simulator keys them, the same for
    every thread (the blocks run one after another, each on the arrays the last one left)."""
    if shape == 0 or alignment is not None:  # dynamic shared memory (no allocation); alignment: an error
        return _sim_shared_array(self, shape, dtype, alignment)
    caller = sys._getframe(1)
    key = (caller.f_code.co_filename, caller.f_lineno)
    with _SHARED_LOCK:
        res = self._allocations.get(key)
        if res is None:
            if isinstance(dtype, types.Type):
                dtype = numpy_support.as_dtype(dtype)
            res = self._allocations[key] = np.empty(shape, dtype)
    return res


def _yielding_is_alive(self: threading.Thread) -> bool:
    """The simulator's block loop polls every thread's is_alive() without pause, holding the
    GIL against the very threads it waits for; a zero sleep hands the GIL over at each poll
    (measured: a 64x32 matvec of 16 blocks went from 17 s to a fraction of that)."""
    time.sleep(0)
    return threading.Thread.is_alive(self)


def install() -> None:
    """Add the warp intrinsics to the simulator's fake `cuda` module (idempotent), make the
    simulator's block loop yield the GIL while it polls, and its shared arrays race-free."""
    global _sim_shared_array
    from numba.cuda import libdevice
    from numba.cuda.simulator.kernel import BlockThread
    from numba.cuda.simulator.kernelapi import FakeCUDAModule, FakeCUDAShared

    BlockThread.is_alive = _yielding_is_alive
    if FakeCUDAShared.array is not _shared_array:
        _sim_shared_array = FakeCUDAShared.array
        FakeCUDAShared.array = _shared_array
    FakeCUDAModule.shfl_sync = shfl_sync
    FakeCUDAModule.shfl_down_sync = shfl_down_sync
    FakeCUDAModule.shfl_up_sync = shfl_up_sync
    FakeCUDAModule.shfl_xor_sync = shfl_xor_sync
    FakeCUDAModule.syncwarp = syncwarp
    libdevice.fast_expf = fast_expf
