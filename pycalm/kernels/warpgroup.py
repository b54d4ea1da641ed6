"""Hopper's warpgroup tensor-core instructions (wgmma), as inline-PTX intrinsics with simulator twins.

  smem_desc(smem, word, lbo, sbo, swizzle) -> desc   a shared-memory matrix descriptor (u64)
  wgmma_f16(n)(acc, smem, desc_a, desc_b, scale_d)   wgmma.mma_async.sync.aligned.m64n{n}k16
                                                     .f32.f16.f16 (n = 16, 32, 64, 128 or 256)
  wgmma_f16_ra(n)(acc, a0, a1, a2, a3, smem, desc_b,  the same with A from registers: a warp's 16
               scale_d)                              rows of A as mma.sync m16n8k16's A fragment
                                                     (pycalm.kernels.tensorcore), n any multiple
                                                     of 8 up to 256
  wgmma_fence()                                      wgmma.fence.sync.aligned
  wgmma_commit()                                     wgmma.commit_group.sync.aligned
  wgmma_wait(n)()                                    wgmma.wait_group.sync.aligned n
  fence_proxy_async()                                fence.proxy.async.shared::cta
  setmaxnreg_inc(n)(), setmaxnreg_dec(n)()           setmaxnreg.{inc,dec}.sync.aligned.u32 n: this
                                                     warpgroup's registers a thread raised to /
                                                     lowered to n (a multiple of 8, 24..256), so a
                                                     producer warpgroup hands its registers to the
                                                     consumers
  shared_byte_address(smem, word) -> u32             the shared-memory address of smem[word]
  allow_dynamic_shared(kernel, args, nbytes)         lets a launch take more than 48 KiB of
                                                     dynamic shared memory (host side)
  launch_dynamic(kernel, grid, threads, stream,      kernel[grid, threads, stream, nbytes](*args),
                 nbytes, args)                       allow_dynamic_shared on its first launch

A warpgroup is four consecutive warps (threads 128 w .. 128 w + 127 of a block). One wgmma
computes D (64 x n, float32) = A (64 x 16, fp16) B (16 x n, fp16) + scale_d D, reading A and B
from shared memory through two descriptors and holding D in registers across the warpgroup: warp
q of the group (q = (tid >> 5) & 3) holds rows 16 q .. 16 q + 15, and lane l (g = l >> 2,
t = l & 3) holds, for each 8 columns j = 0 .. n / 8 - 1, the four elements

  acc[4 j + 0] = D[16 q + g, 8 j + 2 t]        acc[4 j + 1] = D[16 q + g, 8 j + 2 t + 1]
  acc[4 j + 2] = D[16 q + g + 8, 8 j + 2 t]    acc[4 j + 3] = D[16 q + g + 8, 8 j + 2 t + 1]

(mma.sync m16n8k16's C layout, n / 8 times side by side: pycalm.kernels.tensorcore). acc is a
thread's local float32 array of n / 2 elements. In wgmma_f16_ra's form A comes from registers,
laid out the same way: warp q's rows 16 q .. 16 q + 15 as an m16n8k16 A fragment (a0 = A[16 q +
g, 2t:2t+2], a1 = A[16 q + g + 8, 2t:2t+2], a2, a3 the same at 2t + 8), so a kernel that decodes
weights into mma.sync A fragments hands them to wgmma unchanged, and reads the B operand from
shared memory once a warpgroup rather than once a warp.

The descriptor (PTX ISA, "Matrix Descriptor Format", 64 bits): bits 0-13 the start address >> 4,
16-29 the leading byte offset (LBO) >> 4, 32-45 the stride byte offset (SBO) >> 4, 62-63 the
swizzle (0 none, 1 128-byte). Both operands are K-major here: a row of A (one of 64) and a
column of B (one of n: a row of the weight matrix W (N, K), as W is stored) hold 16 consecutive
fp16 values of K. The instruction reads them as 8 x 8 "core matrices" of 8 rows x 16 bytes:

  none:     element (r, k) at start + (r >> 3) SBO + (r & 7) 16 + (k >> 3) LBO + 2 (k & 7)
  128-byte: the row-major tile of 64 fp16 (128 bytes) a row, 8 rows (1 KiB) an atom, atoms SBO
            apart: byte a = start + (r >> 3) SBO + (r & 7) 128 + 2 k, then its 16-byte chunk
            XORed with the row in the atom: a ^ (((a >> 7) & 7) << 4). The k-th 16 of K is the
            same tile with start + 32 k. Atoms must sit at 1 KiB-aligned addresses (the XOR
            takes the address's own bits).

The 128-byte layout is what a kernel stores: each 16-byte chunk c of a tile row r goes to chunk
c ^ (r & 7) of that row, so the 8 rows of a core matrix fall in 8 distinct groups of banks.

wgmma is asynchronous: the instruction returns at once, the registers of acc (and of A, in the
register form) and the shared memory it reads belong to the tensor cores until a wgmma_wait
retires its group; a wgmma_fence separates the registers' last writes from the wgmma that read
them. The order a
kernel keeps:

  shared memory written (st.shared, cp.async) -> fence_proxy_async() (the generic proxy's
  writes made visible to the async proxy wgmma reads through) -> barrier -> wgmma_fence() ->
  wgmma_f16(...) x k -> wgmma_commit() -> ... -> wgmma_wait(n)() -> acc read, or the shared
  tiles it read overwritten.

Every thread of the warpgroup executes each of these together (.sync.aligned).

Simulator twins (NUMBA_ENABLE_CUDASIM=1) keep the asynchrony: a twin's wgmma records the
operation; wgmma_commit closes the thread's open group; wgmma_wait(n) carries out the thread's
committed groups but the n newest, in order, reading shared memory then, as the hardware may. A
kernel that reads acc before the wait, or overwrites a tile before it, gets wrong sums under the
simulator too. Each thread computes its own elements from shared memory through the descriptors,
decoded as above (the simulator's shared arrays start at address 0).
"""

from __future__ import annotations

import numpy as np
from numba import config as _numba_config

WGMMA_N = (16, 32, 64, 128, 256)  # the n of the m64nNk16 forms built here
SWIZZLE_NONE, SWIZZLE_128B = 0, 1  # the descriptor's swizzle modes used here


def encode_descriptor(byte_address: int, lbo: int, sbo: int, swizzle: int) -> int:
    """The 64-bit descriptor (as an int) of a matrix at a shared byte address (see the module
    docstring): what smem_desc builds on the device."""
    return (
        ((int(byte_address) & 0x3FFFF) >> 4)
        | ((int(lbo) >> 4) << 16)
        | ((int(sbo) >> 4) << 32)
        | (int(swizzle) << 62)
    )


def descriptor_addresses(desc: int, rows: int) -> np.ndarray:
    """The byte address of each element (r, k), r < rows, k < 16, of a descriptor's K-major
    matrix, as the module docstring models the hardware's reads: (rows, 16) int64."""
    d = int(desc)
    start = (d & 0x3FFF) << 4
    lbo = ((d >> 16) & 0x3FFF) << 4
    sbo = ((d >> 32) & 0x3FFF) << 4
    swizzle = (d >> 62) & 3
    r = np.arange(rows, dtype=np.int64)[:, None]
    k = np.arange(16, dtype=np.int64)[None, :]
    if swizzle == SWIZZLE_NONE:
        return start + (r >> 3) * sbo + (r & 7) * 16 + (k >> 3) * lbo + 2 * (k & 7)
    if swizzle != SWIZZLE_128B:
        raise ValueError(f"descriptor swizzle mode {swizzle} is not modelled")
    a = start + (r >> 3) * sbo + (r & 7) * 128 + 2 * k
    return a ^ (((a >> 7) & 7) << 4)


def _check_ra(n: int) -> None:
    """wgmma_f16_ra's n: a multiple of 8 in 8..256 (the f16 forms' n)."""
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma with A from registers takes n a multiple of 8 in 8..256, got {n}")


if _numba_config.ENABLE_CUDASIM:
    import threading

    from pycalm.kernels._cudasim import warp_once
    from pycalm.kernels.tensorcore import a_fragment_matrix

    _pending = threading.local()  # a thread's open group and committed groups of wgmma

    def _state() -> tuple[list, list]:
        if not hasattr(_pending, "open"):
            _pending.open, _pending.groups = [], []
        return _pending.open, _pending.groups

    def shared_byte_address(smem: np.ndarray, word: int) -> np.uint32:
        """The byte address of smem[word] (simulator: a shared array starts at address 0)."""
        return np.uint32(4 * int(word))

    def smem_desc(smem: np.ndarray, word: int, lbo: int, sbo: int, swizzle: int) -> np.int64:
        """The descriptor of a matrix whose first element is smem[word] (see the module docstring)."""
        return np.int64(encode_descriptor(4 * int(word), lbo, sbo, swizzle))

    def _operand(smem: np.ndarray, desc: int, rows: int) -> np.ndarray:
        """A descriptor's (rows, 16) fp16 matrix from the shared array, as float32."""
        addr = descriptor_addresses(desc, rows)
        if addr.min() < 0 or addr.max() + 2 > smem.nbytes or np.any(addr & 1):
            raise ValueError("a wgmma descriptor addresses outside its shared array")
        halves = smem.view(np.float16).reshape(-1)
        return halves[addr >> 1].astype(np.float32)

    def _tid() -> int:
        return threading.current_thread().thread_id

    def _run(op: tuple) -> None:
        """Carry out one recorded wgmma for this thread: its acc elements of D."""
        n, acc, smem, a_src, desc_b, scale_d, tid = op
        q, lane = (tid >> 5) & 3, tid & 31
        g, t = lane >> 2, lane & 3
        if isinstance(a_src, np.ndarray):  # the register form: this thread's rows of A as issued
            a = a_src
        else:
            a = _operand(smem, a_src, 64)[[16 * q + g, 16 * q + g + 8]]  # (2, 16) this thread's rows of A
        b = _operand(smem, desc_b, n)  # (n, 16) B^T: a row a column of B
        d = a @ b.T  # (2, n) float32
        for j in range(n // 8):
            for e in range(4):
                row, col = e >> 1, 8 * j + 2 * t + (e & 1)
                old = acc[4 * j + e] if scale_d else np.float32(0.0)
                acc[4 * j + e] = np.float32(old + d[row, col])

    def wgmma_f16(n: int) -> object:
        """The twin of wgmma m64n{n}k16 (see the GPU form): recorded, carried out by wgmma_wait."""
        if n not in WGMMA_N:
            raise ValueError(f"wgmma n is one of {WGMMA_N}, got {n}")

        def wgmma(acc: np.ndarray, smem: np.ndarray, desc_a: int, desc_b: int, scale_d: int) -> None:
            if len(acc) != n // 2:
                raise ValueError(f"wgmma m64n{n}k16 takes {n // 2} accumulators a thread, got {len(acc)}")
            _state()[0].append((n, acc, smem, int(desc_a), int(desc_b), int(scale_d), _tid()))

        return wgmma

    def wgmma_f16_ra(n: int) -> object:
        """The twin of wgmma m64n{n}k16 with A from registers: the warp's A fragments gathered
        when it is issued (the registers may change after), the product recorded with B's
        descriptor and carried out by wgmma_wait."""
        _check_ra(n)

        def wgmma(acc: np.ndarray, a0: int, a1: int, a2: int, a3: int, smem: np.ndarray, desc_b: int,
                  scale_d: int) -> None:  # fmt: skip
            if len(acc) != n // 2:
                raise ValueError(f"wgmma m64n{n}k16 takes {n // 2} accumulators a thread, got {len(acc)}")
            a, lane = warp_once((a0, a1, a2, a3), a_fragment_matrix)
            rows = a[[lane >> 2, (lane >> 2) + 8]].copy()  # (2, 16) this thread's rows g, g + 8
            _state()[0].append((n, acc, smem, rows, int(desc_b), int(scale_d), _tid()))

        return wgmma

    def wgmma_fence() -> None:
        """(simulator: nothing to order)"""

    def wgmma_commit() -> None:
        """Close this thread's open group of wgmma (simulator: they wait for wgmma_wait)."""
        open_ops, groups = _state()
        groups.append(list(open_ops))
        open_ops.clear()

    def wgmma_wait(n: int) -> object:
        """wgmma.wait_group n as a no-argument function (simulator: the thread's committed
        groups but the n newest are carried out, oldest first)."""

        def wait() -> None:
            groups = _state()[1]
            while len(groups) > n:
                for op in groups.pop(0):
                    _run(op)

        return wait

    def fence_proxy_async() -> None:
        """(simulator: one memory)"""

    def _setmaxnreg(n: int) -> object:
        if n % 8 or not 24 <= n <= 256:
            raise ValueError(f"setmaxnreg takes a multiple of 8 in 24..256, got {n}")

        def set_registers() -> None:
            """(simulator: registers are Python's)"""

        return set_registers

    setmaxnreg_inc = setmaxnreg_dec = _setmaxnreg

    def allow_dynamic_shared(kernel: object, args: tuple, nbytes: int) -> None:
        """(simulator: no limit)"""

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from pycalm.kernels.tensorcore import _is_word_array, _ptx_void, _shared_word_address, ptx_counted

    _I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()

    @intrinsic
    def shared_byte_address(typingctx, smem, word):  # noqa: ANN001, ANN201
        """The 32-bit shared-memory address of word `word` of the 1-D int32 shared array smem."""
        if not _is_word_array(smem):
            return None
        sig = types.uint32(smem, word)

        def codegen(context: object, builder: object, sig: object, args: object) -> object:
            return _shared_word_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])

        return sig, codegen

    from numba import cuda as _cuda

    @_cuda.jit(device=True, inline=True)
    def smem_desc(smem, word, lbo, sbo, swizzle):  # noqa: ANN001, ANN201
        """The wgmma descriptor (int64) of a matrix whose first element is smem[word]: start
        address, leading and stride byte offsets, swizzle mode (see the module docstring)."""
        addr = types.int64(shared_byte_address(smem, word))
        return (
            ((addr & 0x3FFFF) >> 4)
            | ((types.int64(lbo) >> 4) << 16)
            | ((types.int64(sbo) >> 4) << 32)
            | (types.int64(swizzle) << 62)
        )

    def _acc_asm(context, builder, aty, acc, regs, text, ins, in_types, in_constraints):  # noqa: ANN001, ANN202
        """One wgmma's inline asm: the thread's regs accumulators (the local float32 array acc, of
        type aty) as $0 .. $regs - 1 and as tied inputs, then the inputs `ins` (their LLVM types
        and constraints), through `text`; the results stored back into the array."""
        from numba.cuda import cgutils

        ary = context.make_array(aty)(context, builder, value=acc)
        ptrs = [
            cgutils.get_item_pointer(context, builder, aty, ary, [context.get_constant(types.intp, i)],
                                     wraparound=False)
            for i in range(regs)
        ]  # fmt: skip
        olds = [builder.load(p) for p in ptrs]
        constraints = ",".join(["=f"] * regs + [str(i) for i in range(regs)] + in_constraints + ["~{memory}"])
        fnty = ir.FunctionType(ir.LiteralStructType([_F32] * regs), [_F32] * regs + in_types)
        res = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), [*olds, *ins])
        for i, p in enumerate(ptrs):
            builder.store(builder.extract_value(res, i), p)
        return context.get_dummy_value()

    _WGMMAS: dict[int, object] = {}

    def wgmma_f16(n: int) -> object:
        """The intrinsic wgmma.mma_async m64n{n}k16 .f32.f16.f16 with both operands in shared
        memory (K-major, no transpose): acc (the thread's n / 2 float32, a local array) = A B +
        (acc if scale_d else 0), asynchronously (see the module docstring). smem: the shared array
        the descriptors point into (the simulator reads it; here it only types the call)."""
        if n not in WGMMA_N:
            raise ValueError(f"wgmma n is one of {WGMMA_N}, got {n}")
        if n in _WGMMAS:
            return _WGMMAS[n]
        regs = n // 2

        def impl(typingctx, acc, smem, desc_a, desc_b, scale_d):  # noqa: ANN001, ANN202
            if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and acc.ndim == 1):
                return None
            sig = types.void(acc, smem, desc_a, desc_b, scale_d)

            def codegen(context: object, builder: object, sig: object, args: object) -> object:
                da = context.cast(builder, args[2], sig.args[2], types.int64)
                db = context.cast(builder, args[3], sig.args[3], types.int64)
                sd = context.cast(builder, args[4], sig.args[4], types.int32)
                outs = ", ".join(f"${i}" for i in range(regs))
                text = (
                    "{ .reg .pred p; "
                    f"setp.ne.b32 p, ${2 * regs + 2}, 0; "
                    f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 "
                    f"{{{outs}}}, ${2 * regs}, ${2 * regs + 1}, p, 1, 1, 0, 0; }}"
                )
                return _acc_asm(context, builder, sig.args[0], args[0], regs, text, [da, db, sd],
                                [_I64, _I64, _I32], ["l", "l", "r"])  # fmt: skip

            return sig, codegen

        impl.__doc__ = wgmma_f16.__doc__
        _WGMMAS[n] = intrinsic(impl)
        return _WGMMAS[n]

    _WGMMAS_RA: dict[int, object] = {}

    def wgmma_f16_ra(n: int) -> object:
        """The intrinsic wgmma.mma_async m64n{n}k16 .f32.f16.f16 with A from registers (a0..a3:
        the warp's 16 rows of A as an mma.sync A fragment, int32 words of two fp16) and B from
        shared memory (K-major, no transpose): acc (the thread's n / 2 float32, a local array) =
        A B + (acc if scale_d else 0), asynchronously; a0..a3 are read until the group retires."""
        _check_ra(n)
        if n in _WGMMAS_RA:
            return _WGMMAS_RA[n]
        regs = n // 2

        def impl(typingctx, acc, a0, a1, a2, a3, smem, desc_b, scale_d):  # noqa: ANN001, ANN202
            if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and acc.ndim == 1):
                return None
            sig = types.void(acc, a0, a1, a2, a3, smem, desc_b, scale_d)

            def codegen(context: object, builder: object, sig: object, args: object) -> object:
                words = [context.cast(builder, args[1 + i], sig.args[1 + i], types.int32) for i in range(4)]
                db = context.cast(builder, args[6], sig.args[6], types.int64)
                sd = context.cast(builder, args[7], sig.args[7], types.int32)
                outs = ", ".join(f"${i}" for i in range(regs))
                a_regs = ", ".join(f"${2 * regs + i}" for i in range(4))
                text = (
                    "{ .reg .pred p; "
                    f"setp.ne.b32 p, ${2 * regs + 5}, 0; "
                    f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 "
                    f"{{{outs}}}, {{{a_regs}}}, ${2 * regs + 4}, p, 1, 1, 0; }}"
                )
                return _acc_asm(context, builder, sig.args[0], args[0], regs, text, [*words, db, sd],
                                [_I32] * 4 + [_I64, _I32], ["r"] * 4 + ["l", "r"])  # fmt: skip

            return sig, codegen

        impl.__doc__ = wgmma_f16_ra.__doc__
        _WGMMAS_RA[n] = intrinsic(impl)
        return _WGMMAS_RA[n]

    wgmma_fence = _ptx_void(
        "wgmma.fence.sync.aligned;",
        "Order this warpgroup's register and shared-memory accesses before the wgmma that follow.",
    )
    wgmma_commit = _ptx_void(
        "wgmma.commit_group.sync.aligned;",
        "Close the group of this warpgroup's wgmma issued since the last commit.",
    )
    fence_proxy_async = _ptx_void(
        "fence.proxy.async.shared::cta;",
        "Make this thread's shared-memory writes (generic proxy) visible to the async proxy wgmma reads through.",
    )

    # wgmma_wait(n): the intrinsic wgmma.wait_group n (n a constant): wait until at most the n
    # newest of this warpgroup's committed wgmma groups are still running
    wgmma_wait = ptx_counted(
        "wgmma.wait_group.sync.aligned {};",
        "Wait until all but the {} newest of this warpgroup's wgmma groups have retired.",
    )
    # setmaxnreg_inc(n) / setmaxnreg_dec(n): this warpgroup's registers a thread raised / lowered
    # to n (every thread of the warpgroup calls it)
    setmaxnreg_inc = ptx_counted(
        "setmaxnreg.inc.sync.aligned.u32 {};", "Raise this warpgroup's registers a thread to {}."
    )
    setmaxnreg_dec = ptx_counted(
        "setmaxnreg.dec.sync.aligned.u32 {};", "Lower this warpgroup's registers a thread to {}."
    )

    def allow_dynamic_shared(kernel: object, args: tuple, nbytes: int) -> None:
        """Raise the dynamic shared memory a launch of `kernel` with `args` may take to nbytes
        (past 48 KiB a kernel must ask: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)."""
        from numba.cuda.cudadrv.driver import binding, driver

        argtypes = tuple(kernel.typeof_pyval(a) for a in args)
        compiled = kernel.compile(argtypes)
        if not hasattr(compiled, "_codelibrary"):
            return  # a recorded compile (pycalm.gpu.precompile's walk): nothing runs
        cufunc = compiled._codelibrary.get_cufunc()
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attr, int(nbytes), cufunc.handle, cufunc.device.id)


_ALLOWED: set = set()  # (kernel, dynamic shared bytes) whose limit is raised


def launch_dynamic(
    kernel: object, grid: tuple, threads: int, stream: object, nbytes: int, args: tuple
) -> None:
    """kernel[grid, threads, stream, nbytes](*args): a launch with nbytes of dynamic shared
    memory, whose limit allow_dynamic_shared raises on the (kernel, nbytes)'s first launch."""
    if (kernel, nbytes) not in _ALLOWED:
        allow_dynamic_shared(kernel, args, nbytes)
        _ALLOWED.add((kernel, nbytes))
    kernel[grid, threads, stream, nbytes](*args)
