"""Warp intrinsics (and libdevice's fast_expf) for numba's CUDA simulator, which lacks them, and
the warp-wide rendezvous behind the tensor-core intrinsics' simulator twins (warp_once).

The simulator runs every thread of a block as a Python thread. A shuffle here is a rendezvous
of the lanes of one warp: each lane posts its value in one of the warp's two slot tables (they
alternate from one shuffle to the next), waits at a per-warp barrier until all lanes have
posted, and reads the source lane's slot. One barrier a shuffle suffices: a lane can post in a
table again only two shuffles later, after the next barrier, which every lane reaches only once
it has read this one. Like the hardware with a full mask, it expects every lane of the warp to
take part (a partial last warp counts only its lanes).

The warp's barrier and the block's (cuda.syncthreads, in place of the simulator's loop that
polls every thread until all are blocked) are _GateBarrier: a gate a thread that the last to
arrive opens. With the one-barrier shuffles, a simulated kernel runs about twice as fast.

The shim also replaces the simulator's cuda.shared.array (numba-cuda 0.30.4), which looks a
call site's array up and, on a miss, allocates and stores it without a lock: two threads of a
block that both miss get two arrays, and what one writes the other never sees (a rare wrong
result, seen once in tests/test_moe.py). Here the look-up and the first allocation hold a lock.

Only used when NUMBA_ENABLE_CUDASIM=1; the real GPU uses numba's own intrinsics.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import numpy as np
from numba.cuda import types
from numba.cuda.np import numpy_support

_WARP = 32


class _GateBarrier:
    """A cyclic barrier of n threads on raw locks, a gate a thread (indexed 0 .. n - 1): each
    thread but the last to arrive blocks on its own gate, and the last opens the gates of those
    waiting. (threading.Barrier wakes its waiters through one condition, whose lock each then
    takes again in turn: about half the time a simulated kernel spent in its shuffles.) A gate is
    closed whenever its thread is not between a barrier's last arrival and its own wake-up, so a
    gate is opened once a wait. A thread that leaves (returns) no longer counts, as on the
    hardware, where exited threads do not hold a barrier."""

    def __init__(self, n: int) -> None:
        self.lock = threading.Lock()
        self.alive = n  # the threads that count (have not left)
        self.waiting: list[int] = []  # the threads blocked at the barrier
        self.gates = [threading.Lock() for _ in range(n)]
        for gate in self.gates:
            gate.acquire()  # closed

    def _open(self) -> None:
        for i in self.waiting:
            self.gates[i].release()
        self.waiting.clear()

    def wait(self, i: int) -> None:
        with self.lock:
            last = len(self.waiting) + 1 >= self.alive
            if last:
                self._open()
            else:
                self.waiting.append(i)
        if not last:
            self.gates[i].acquire()  # blocks until the last thread opens it, and closes it

    def leave(self) -> None:
        with self.lock:
            self.alive -= 1
            if self.waiting and len(self.waiting) >= self.alive:
                self._open()  # the threads still counted all wait


class _WarpExchange:
    def __init__(self, lanes: int) -> None:
        self.lanes = lanes
        self.slots: tuple[list[object], list[object]] = ([None] * _WARP, [None] * _WARP)
        self.turn = [0] * _WARP  # each lane's next table: 0, 1, 0, ...
        self.rounds = [0] * _WARP  # each lane's rendezvous so far
        self.memo: list[tuple[int, object] | None] = [None, None]  # a table's (round, warp_once result)
        self.barrier = _GateBarrier(lanes)

    def post(self, lane: int, value: object) -> tuple[list[object], int, int]:
        """Post a lane's value and wait for every lane's: the table that holds them, its index
        and the rendezvous' number."""
        turn, n = self.turn[lane], self.rounds[lane]
        slots = self.slots[turn]
        self.turn[lane] ^= 1
        self.rounds[lane] = n + 1
        slots[lane] = value
        self.barrier.wait(lane)  # every lane has posted its value
        return slots, turn, n


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
    slots, _, _ = ex.post(lane, value)
    src = src_of_lane(lane)
    return slots[src] if 0 <= src < ex.lanes else value


def warp_once(value: object, compute: Callable[[list[object]], object]) -> tuple[object, int]:
    """compute(every lane's `value`, indexed by lane), computed by one lane of the warp for all
    (the others take its result), and this lane's index: a warp-wide instruction's twin
    (pycalm.kernels.tensorcore) builds its matrices once a warp, not once a lane. The result
    of a rendezvous is kept beside its slot table until that table's next use, which no lane
    reaches before every lane has read this one (the next rendezvous' barrier stands between)."""
    thread = threading.current_thread()
    ex, lane = _exchange_for(thread)
    slots, turn, n = ex.post(lane, value)
    memo = ex.memo[turn]
    if memo is not None and memo[0] == n:
        return memo[1], lane
    result = compute(slots[: ex.lanes])  # (two lanes may both compute it: the same result)
    ex.memo[turn] = (n, result)
    return result, lane


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
    every thread (the blocks run one after another, each on the arrays the last one left).
    alignment places an array on the GPU (where its start falls in shared memory); the
    simulator's arrays are NumPy's, and it is ignored."""
    if shape == 0:  # dynamic shared memory (no allocation)
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


class _BlockBarrier(_GateBarrier):
    """syncthreads for one block's threads (a gate a thread_id), without the simulator's polling
    loop, which checks every thread's state over and over, holding the GIL against the threads
    it waits for. A thread that raises aborts the others: those at the barrier wake and raise
    the simulator's "abort flag set" (those inside a warp shuffle stay blocked, daemons, as in
    the simulator), and the block reports the first exception."""

    def __init__(self, threads: list) -> None:
        super().__init__(len(threads))
        self.threads = threads
        self.done = threading.Event()  # every thread has ended, or one has raised
        self.failed: threading.Thread | None = None  # the first thread that raised

    def end(self, thread: threading.Thread, raised: bool) -> None:
        """A thread's kernel has returned, or raised."""
        with self.lock:
            if raised and self.failed is None:
                self.failed = thread
                for t in self.threads:
                    t.abort = True
                self._open()
                self.done.set()
        self.leave()
        if self.alive == 0:  # (only falls: any thread that reads 0 may say so)
            self.done.set()


def _syncthreads(self: threading.Thread) -> None:
    """The simulator's BlockThread.syncthreads on the block's _BlockBarrier."""
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    self._manager._pycalm_barrier.wait(self.thread_id)
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _run_block(self, grid_point, *args: object) -> None:  # noqa: ANN001
    """The simulator's BlockManager.run: a thread a CUDA thread of the block, started together,
    synchronised by a _BlockBarrier; returns when every thread has, or raises the first
    thread's exception."""
    from numba.cuda.simulator.kernel import BlockThread

    threads = []
    for block_point in np.ndindex(*self._block_dim):

        def target() -> None:
            me = threading.current_thread()
            try:
                self._f(*args)
            except BaseException:
                barrier.end(me, raised=True)
                raise
            barrier.end(me, raised=False)

        threads.append(BlockThread(target, self, grid_point, block_point, self._debug))
    barrier = self._pycalm_barrier = _BlockBarrier(threads)
    for t in threads:
        t.start()
    barrier.done.wait()
    if barrier.failed is not None:
        barrier.failed.join()  # BlockThread.run records the exception as the thread ends
        exc, tb = barrier.failed.exception
        raise exc.with_traceback(tb)


def install() -> None:
    """Add the warp intrinsics to the simulator's fake `cuda` module (idempotent), run its blocks
    on _BlockBarrier instead of its polling loop, and make its shared arrays race-free."""
    global _sim_shared_array
    from numba.cuda import libdevice
    from numba.cuda.simulator.kernel import BlockManager, BlockThread
    from numba.cuda.simulator.kernelapi import FakeCUDAModule, FakeCUDAShared

    BlockManager.run = _run_block
    BlockThread.syncthreads = _syncthreads
    if FakeCUDAShared.array is not _shared_array:
        _sim_shared_array = FakeCUDAShared.array
        FakeCUDAShared.array = _shared_array
    FakeCUDAModule.shfl_sync = shfl_sync
    FakeCUDAModule.shfl_down_sync = shfl_down_sync
    FakeCUDAModule.shfl_up_sync = shfl_up_sync
    FakeCUDAModule.shfl_xor_sync = shfl_xor_sync
    FakeCUDAModule.syncwarp = syncwarp
    libdevice.fast_expf = fast_expf
