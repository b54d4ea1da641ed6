"""Hopper's tensor memory accelerator (TMA) and its barriers, as inline-PTX intrinsics with simulator twins.

  tensor_map_2d(array, box_rows, box_cols, swizzle) -> tmap  (host) a tile's map of a 2-D array:
                                                       a (16,) uint64 device array, the 128-byte
                                                       CUtensorMap cuTensorMapEncodeTiled writes
  tensormap_acquire(tmap)                                fence.proxy.tensormap::generic.acquire.gpu:
                                                       the map's bytes (written before the
                                                       launch) seen by TMA; once a thread,
                                                       before its first tma_load_2d
  tma_load_2d(smem, word, tmap, col, row, bar)           cp.async.bulk.tensor.2d ... tile
                                                       .mbarrier::complete_tx::bytes: the box
                                                       at (row, col) of the map's array into
                                                       smem[word ..], done on the mbarrier at
                                                       smem[bar]
  mbarrier_init(smem, bar, count)                        mbarrier.init.shared::cta.b64
  fence_mbarrier_init()                                  fence.mbarrier_init.release.cluster
  mbarrier_expect_tx(smem, bar, nbytes)                  mbarrier.arrive.expect_tx: one arrival,
                                                       and nbytes the phase waits for
  mbarrier_arrive(smem, bar)                             mbarrier.arrive: one arrival
  mbarrier_try_wait(smem, bar, parity) -> u32            mbarrier.try_wait.parity: 1 once the
                                                       phase of that parity has completed

A TMA copy moves a box of box_rows x box_cols elements (box_cols x the element size: 16 to 256
bytes a row) from global memory to shared memory without the threads: one thread issues it, and
the copy counts its bytes down on an mbarrier (a 64-bit word in shared memory: an expected arrival
count, the arrivals so far, a transaction byte count, and the phase). A phase completes when its
arrivals are in and its bytes have landed; waiting threads poll try_wait with the phase's parity
(0, 1, 0, ...). Elements of the box outside the array land as zeros, and the box's full size is
counted all the same.

With swizzle = SWIZZLE_128B (rows of 128 bytes: 64 fp16) the box lands in exactly the layout the
wgmma descriptors of pycalm.kernels.warpgroup read with their 128-byte swizzle: row r at r x 128
bytes, its 16-byte chunk c at chunk c ^ (r & 7) (the XOR taken from address bits 7-9, so the
destination must sit at a 1 KiB boundary). So a tile fetched by TMA is a wgmma operand as it is.

The map lives in global memory (a device array written before the launch), and the kernel passes
the array: its address is the instruction's tensor-map operand.

Simulator twins: tensor_map_2d records the array, box and swizzle, and returns a (16,) array whose
first word is the record's key; tma_load_2d copies the box at once (zeros outside the array,
swizzled by the same address rule) and completes its bytes on the barrier; a barrier is a record
of (count, arrivals, bytes, phase) a block's shared array and word. try_wait answers from it, so
a kernel that waits for the wrong parity, or reads a tile before its barrier completes, fails
under the simulator too (it spins, or reads zeros).
"""

from __future__ import annotations

import numpy as np
from numba import config as _numba_config
from numba import cuda

SWIZZLE_NONE, SWIZZLE_128B = 0, 3  # the map's swizzle modes used here (CUtensorMapSwizzle)
# CUtensorMapDataType of each element type (int8 copied as uint8: TMA moves the bytes as they are)
_DATA_TYPE = {
    np.dtype(np.uint8): 0,
    np.dtype(np.int8): 0,
    np.dtype(np.float16): 6,
    np.dtype(np.int32): 3,
    np.dtype(np.uint32): 2,
    np.dtype(np.float32): 7,
}

if _numba_config.ENABLE_CUDASIM:
    import threading
    import time

    _MAPS: dict[int, tuple] = {}  # key -> (array, box_rows, box_cols, swizzle)
    _BARRIERS: dict[
        tuple[int, int], list
    ] = {}  # (id of the shared array, word) -> [count, arrived, bytes, phase]
    _LOCK = threading.Lock()

    def tensor_map_2d(array: object, box_rows: int, box_cols: int, swizzle: int) -> object:
        """The map of box_rows x box_cols tiles of a 2-D array (simulator: a record's key)."""
        _check_box(array, box_cols, swizzle)
        key = len(_MAPS) + 1
        _MAPS[key] = (array, int(box_rows), int(box_cols), int(swizzle))
        words = np.zeros(16, np.uint64)
        words[0] = key
        return cuda.to_device(words)

    def _key(smem: np.ndarray, bar: int) -> tuple[int, int]:
        """A barrier's record key: the block's shared memory (its data address: every thread's
        view of a dynamic shared array is a new object over the same memory) and the word."""
        return smem.__array_interface__["data"][0], int(bar)

    def _complete(state: list) -> None:
        if state[1] == state[0] and state[2] == 0:  # every arrival and every byte: the phase ends
            state[1] = 0
            state[3] ^= 1

    def mbarrier_init(smem: np.ndarray, bar: int, count: int) -> None:
        """A barrier expecting `count` arrivals a phase, at phase 0 (simulator: a record)."""
        if int(bar) % 2:
            raise ValueError(f"an mbarrier takes 8 aligned bytes: word {bar} is odd")
        with _LOCK:
            _BARRIERS[_key(smem, bar)] = [int(count), 0, 0, 0]

    def fence_mbarrier_init() -> None:
        """(simulator: one memory)"""

    def tensormap_acquire(tmap: np.ndarray) -> None:
        """(simulator: one memory)"""

    def mbarrier_expect_tx(smem: np.ndarray, bar: int, nbytes: int) -> None:
        """One arrival, and nbytes more for the phase to wait for."""
        with _LOCK:
            state = _BARRIERS[_key(smem, bar)]
            state[1] += 1
            state[2] += int(nbytes)
            _complete(state)

    def mbarrier_arrive(smem: np.ndarray, bar: int) -> None:
        """One arrival."""
        mbarrier_expect_tx(smem, bar, 0)

    def mbarrier_try_wait(smem: np.ndarray, bar: int, parity: int) -> int:
        """1 once the phase of this parity has completed (the barrier has moved past it); a 0
        first lets the other threads run a while (the hardware's try_wait waits a while too)."""
        with _LOCK:
            done = _BARRIERS[_key(smem, bar)][3] != (int(parity) & 1)
        if not done:
            time.sleep(1e-3)
        return int(done)

    def tma_load_2d(smem: np.ndarray, word: int, tmap: np.ndarray, col: int, row: int, bar: int) -> None:
        """Copy the box at (row, col) into smem[word ..] at once, swizzled as the hardware does,
        and count its bytes down on the barrier."""
        array, box_rows, box_cols, swizzle = _MAPS[int(tmap[0])]
        src = np.asarray(getattr(array, "_ary", array))  # (a simulator device array's data)
        item = src.dtype.itemsize
        start = 4 * int(word)
        if start % (1024 if swizzle == SWIZZLE_128B else 128):
            raise ValueError(f"a TMA box lands at a 1 KiB (swizzled) or 128-byte boundary, not byte {start}")
        box = np.zeros((box_rows, box_cols), src.dtype)
        r0, c0 = int(row), int(col)
        rows = src[max(r0, 0) : max(r0 + box_rows, 0), max(c0, 0) : max(c0 + box_cols, 0)]
        box[max(-r0, 0) : max(-r0, 0) + rows.shape[0], max(-c0, 0) : max(-c0, 0) + rows.shape[1]] = rows
        data = box.reshape(-1).view(np.uint8)
        a = start + np.arange(data.size, dtype=np.int64)
        if swizzle == SWIZZLE_128B:
            a ^= ((a >> 7) & 7) << 4
        smem.view(np.uint8)[a] = data
        with _LOCK:
            state = _BARRIERS[_key(smem, bar)]
            state[2] -= box_rows * box_cols * item
            _complete(state)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from pycalm.kernels.tensorcore import _is_word_array, _ptx_void, _shared_word_address

    _I32, _I64 = ir.IntType(32), ir.IntType(64)

    def tensor_map_2d(array: object, box_rows: int, box_cols: int, swizzle: int) -> object:
        """The map of box_rows x box_cols tiles of a 2-D C-contiguous device array, by
        cuTensorMapEncodeTiled, in a (16,) uint64 device array."""
        from cuda.bindings import driver as drv

        _check_box(array, box_cols, swizzle)
        rows, cols = array.shape
        item = array.dtype.itemsize
        u64, u32 = drv.cuuint64_t, drv.cuuint32_t
        err, tmap = drv.cuTensorMapEncodeTiled(
            drv.CUtensorMapDataType(_DATA_TYPE[np.dtype(array.dtype)]),
            2,
            array.device_ctypes_pointer.value,
            [u64(cols), u64(rows)],  # innermost first
            [u64(cols * item)],  # the row stride in bytes (the innermost is implied)
            [u32(box_cols), u32(box_rows)],
            [u32(1), u32(1)],
            drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            drv.CUtensorMapSwizzle(swizzle),
            drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed: {err}")
        words = np.array([int(v) for v in tmap.opaque], dtype=np.uint64)  # the 128 bytes
        return cuda.to_device(words)

    def _address_of(context: object, builder: object, aty: object, av: object) -> object:
        """The 64-bit global address of a device array's first element."""
        ary = context.make_array(aty)(context, builder, value=av)
        return builder.ptrtoint(ary.data, _I64)

    def _call(builder: object, text: str, constraints: str, args: list, ret: object = None) -> object:
        fnty = ir.FunctionType(ret or ir.VoidType(), [a.type for a in args])
        return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), args)

    def _barrier_op(text: str, doc: str, counted: bool) -> object:
        """An intrinsic (smem, bar, n) (counted) or (smem, bar) that emits `text` with $0 the
        shared address of the barrier at smem[bar] and $1 the int32 n."""

        def codegen(context: object, builder: object, sig: object, args: object) -> object:
            addr = _shared_word_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            operands = [addr] + (
                [context.cast(builder, args[2], sig.args[2], types.int32)] if counted else []
            )
            _call(builder, text, ",".join(["r"] * len(operands) + ["~{memory}"]), operands)
            return context.get_dummy_value()

        if counted:

            def impl(typingctx, smem, bar, n):  # noqa: ANN001, ANN202
                return (types.void(smem, bar, n), codegen) if _is_word_array(smem) else None

        else:

            def impl(typingctx, smem, bar):  # noqa: ANN001, ANN202
                return (types.void(smem, bar), codegen) if _is_word_array(smem) else None

        impl.__doc__ = doc
        return intrinsic(impl)

    mbarrier_init = _barrier_op(
        "mbarrier.init.shared::cta.b64 [$0], $1;",
        "A barrier at smem[bar] (two words, 8-byte aligned) expecting n arrivals a phase, at phase 0. "
        "One thread calls it; then fence_mbarrier_init and a barrier.",
        counted=True,
    )
    mbarrier_expect_tx = _barrier_op(
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;",
        "Arrive on the barrier at smem[bar], and add n bytes to the bytes its phase waits for.",
        counted=True,
    )
    mbarrier_arrive = _barrier_op(
        "mbarrier.arrive.shared::cta.b64 _, [$0];", "Arrive on the barrier at smem[bar].", counted=False
    )

    fence_mbarrier_init = _ptx_void(
        "fence.mbarrier_init.release.cluster;",
        "Make this thread's mbarrier.init visible to the async proxy (TMA's completions).",
    )

    @intrinsic
    def tensormap_acquire(typingctx, tmap):  # noqa: ANN001, ANN201
        """Order this thread's later TMA reads of the map in the (16,) uint64 array tmap after
        the generic-proxy writes that made it (the copy to the device before the launch)."""
        if not (isinstance(tmap, types.Array) and tmap.dtype == types.uint64):
            return None
        sig = types.void(tmap)

        def codegen(context: object, builder: object, sig: object, args: object) -> object:
            tm = _address_of(context, builder, sig.args[0], args[0])
            _call(builder, "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;", "l,~{memory}", [tm])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def mbarrier_try_wait(typingctx, smem, bar, parity):  # noqa: ANN001, ANN201
        """1 once the phase of this parity of the barrier at smem[bar] has completed, else 0
        (after a time-limited wait in the hardware); callers loop on it."""
        if not _is_word_array(smem):
            return None
        sig = types.uint32(smem, bar, parity)

        def codegen(context: object, builder: object, sig: object, args: object) -> object:
            addr = _shared_word_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            p = context.cast(builder, args[2], sig.args[2], types.int32)
            text = (
                "{ .reg .pred done; mbarrier.try_wait.parity.shared::cta.b64 done, [$1], $2; "
                "selp.u32 $0, 1, 0, done; }"
            )
            return _call(builder, text, "=r,r,r,~{memory}", [addr, p], _I32)

        return sig, codegen

    @intrinsic
    def tma_load_2d(typingctx, smem, word, tmap, col, row, bar):  # noqa: ANN001, ANN201
        """Start the TMA copy of the box at (row, col) of tmap's array into smem[word ..] (1 KiB
        aligned for the 128-byte swizzle), its bytes counted down on the barrier at smem[bar].
        One thread issues it."""
        if not (_is_word_array(smem) and isinstance(tmap, types.Array) and tmap.dtype == types.uint64):
            return None
        sig = types.void(smem, word, tmap, col, row, bar)

        def codegen(context: object, builder: object, sig: object, args: object) -> object:
            dst = _shared_word_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            mbar = _shared_word_address(context, builder, sig.args[0], args[0], args[5], sig.args[5])
            tm = _address_of(context, builder, sig.args[2], args[2])
            c = context.cast(builder, args[3], sig.args[3], types.int32)
            r = context.cast(builder, args[4], sig.args[4], types.int32)
            text = (
                "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                "[$0], [$1, {$2, $3}], [$4];"
            )
            _call(builder, text, "r,l,r,r,r,~{memory}", [dst, tm, c, r, mbar])
            return context.get_dummy_value()

        return sig, codegen


def _check_box(array: object, box_cols: int, swizzle: int) -> None:
    """A box the hardware takes: a 2-D array of a known element type, rows of 16-byte multiples
    (128 bytes with the 128-byte swizzle), at most 256 elements a side."""
    if len(array.shape) != 2 or np.dtype(array.dtype) not in _DATA_TYPE:
        raise ValueError(f"a TMA map takes a 2-D array of {sorted(str(t) for t in _DATA_TYPE)}")
    row_bytes = box_cols * np.dtype(array.dtype).itemsize
    if row_bytes % 16 or row_bytes > (128 if swizzle == SWIZZLE_128B else 256 * 16):
        raise ValueError(f"a box row of {row_bytes} bytes: a multiple of 16, at most 128 swizzled")
    if (array.shape[1] * np.dtype(array.dtype).itemsize) % 16:
        raise ValueError("a TMA map's array rows must be a multiple of 16 bytes")
