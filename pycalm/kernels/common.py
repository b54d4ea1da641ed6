"""Device helpers shared by the kernels: the state layout, warp and block reductions, and the
bit-level decoders / encoders of the number formats (pycalm.model.formats is their spec; the tests tie
them to it bit for bit).

Decoding without conversion instructions (the KV caches in pycalm.kernels.attention, single
e5m2 bytes, and the gf4 codes and scales; the matvec kernels widen fp16 / e5m2 with cvt, fp8x4_cvt):

* fp16 and fp8 e5m2 share the fp16 layout (e5m2 is the top byte of an fp16). An fp16 bit pattern
  h placed in the top half of a 32-bit word, shifted right by 3 *arithmetically* and masked with
  0x8FFFE000, is an fp32 whose sign is h's sign and whose exponent and mantissa are h's, moved to
  the fp32 positions; read as a float it equals value(h) * 2**-112, exactly, for normals and
  subnormals alike (the fp32 result is subnormal or normal, never rounded). So one shift and one
  AND (two integer ops, no int-to-float conversion) decode a weight, and the factor 2**112
  (FP_RAW_SCALE) is applied once to the row's sum. For e5m2 the mask is 0x8FE00000 (the two
  mantissa bits only), and the byte is moved to the top of the word first (a left shift, free
  for the top byte).
* gf4: code q in bits p..p+2 of a word, masked in place and ORed with the exponent field
  (150 - p) << 23, reads as the float 2**(23-p) + q (the code lands in the mantissa with unit
  weight). Subtracting the constant 2**(23-p) + 4 leaves q - 4 exactly: one logic op and one
  float add per weight, no shift and no conversion. The group scale -s/4 is applied once per
  group of 8.

All integer work is in int32 (arithmetic right shifts, no signed/unsigned mixing: numba promotes
int32 op uint32 to int64, and uint64 op int64 to float64). Every literal is typed, and every
shift is wrapped in int32() (shl32 / sar32): real numba computes int32 op int32 in int64, so an
unwrapped (w << 24) >> 3 keeps bit 31 of w << 24 in bit 32 and the sign comes out wrong on the
GPU while the simulator (int32 arithmetic) passes.

Under the simulator (NUMBA_ENABLE_CUDASIM=1) libdevice is missing, so the two bit casts fall
back to NumPy views; everything else is the same code.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32
from numba.types import float16

from pycalm.model.formats import FP8_MAX_BYTE, FP16_MAX  # the largest finite values (formats: the spec)


@functools.cache
def sm90() -> bool:
    """Whether kernels compile for a GPU with griddepcontrol (compute capability 9.0 and up): the
    current GPU's, or, with none (CI compiling for sm_90 without a GPU), yes."""
    try:
        return tuple(cuda.get_current_device().compute_capability) >= (9, 0)
    except Exception:  # noqa: BLE001  (no GPU, no driver)
        return True


# The per-token state, an int32 array in device memory, so that a captured step needs no
# per-token launch argument (pycalm.kernels.step advances it at the end of every step):
STATE_TOKEN = 0  # state[0]: the token the step embeds (the sampler writes the next one here)
STATE_POS = 1  # state[1]: the step's position pos, 0-based; attention spans 0..pos
STATE_FEED_END = 2  # state[2]: positions below it take their token from `feed` (the prompt)
STATE_SIZE = 3
STATE_ROWS = 3  # state[3], where a state has it (a batched pass's): the pass's live rows

WARP = 32
FULL_MASK = 0xFFFFFFFF

# raw fp16 / e5m2 floats from the shift decoders times this are the values (cvt decoders: exact)
FP_RAW_SCALE = float(2.0**112)
GF4_RAW_SCALE = float(-(2.0**110))  # raw gf4 sums times this: 2**112 / 4, and the minus of -s/4
# int32 masks keeping the sign and the fp16 (e5m10) / e5m2 fields after the >> 3 that moves them
MASK_FP16 = 0x8FFFE000 - (1 << 32)
MASK_E5M2 = 0x8FE00000 - (1 << 32)

# ---------------------------------------------------------------------------------------------
# bit casts

if _numba_config.ENABLE_CUDASIM:

    def as_f32(i: int) -> np.float32:
        """int32 bit pattern -> float32 (simulator: a NumPy view)."""
        return np.array(int(i) & 0xFFFFFFFF, dtype=np.uint32).view(np.float32)[()]

    def as_i32(f: float) -> np.int32:
        """float32 -> its int32 bit pattern (simulator: a NumPy view)."""
        return np.array(f, dtype=np.float32).view(np.int32)[()]

    def ldg128(a: np.ndarray, r: int, j: int) -> tuple[np.uint64, np.uint64]:
        """16-byte unit j of row r of a uint64 array (simulator: two element reads)."""
        return a[r, 2 * j], a[r, 2 * j + 1]

    def h2f2(w: int) -> tuple[np.float32, np.float32]:
        """The two fp16 halves of an int32 (low half first) as float32 (simulator: views)."""
        h = np.array([int(w) & 0xFFFFFFFF], dtype=np.uint32).view(np.float16)
        return np.float32(h[0]), np.float32(h[1])

    def prmt(a: int, b: int, sel: int) -> np.int32:
        """Byte permute (PTX prmt.b32, default mode): byte i of the result is byte
        (sel >> 4 i) & 7 of the 8 bytes b:a, sign-replicated when bit 3 of that nibble is set."""
        src = (int(a) & 0xFFFFFFFF) | ((int(b) & 0xFFFFFFFF) << 32)
        out = 0
        for i in range(4):
            nib = (int(sel) >> (4 * i)) & 0xF
            byte = (src >> (8 * (nib & 7))) & 0xFF
            if nib & 8:
                byte = 0xFF if byte & 0x80 else 0
            out |= byte << (8 * i)
        return np.array(out, dtype=np.uint32).view(np.int32)[()]

    def and_or(a: int, m: int, e: int) -> np.int32:
        """(a & m) | e on int32 (the GPU does it in one LOP3)."""
        return np.int32((np.int32(a) & np.int32(m)) | np.int32(e))

    def _half2(w: int) -> np.ndarray:
        """The two fp16 halves of an int32 word (low first) as float64."""
        return np.array([int(w) & 0xFFFFFFFF], dtype=np.uint32).view(np.float16).astype(np.float64)

    def _word(h: np.ndarray) -> np.int32:
        """Two float64 values rounded once to fp16 (nearest even) -> an int32 word, low first."""
        return np.array(h, dtype=np.float64).astype(np.float16).view(np.int32)[0]

    def hsub2(a: int, b: int) -> np.int32:
        """a - b on the two fp16 halves of int32 words, rounded once (sub.rn.f16x2)."""
        return _word(_half2(a) - _half2(b))

    def hfma2(a: int, b: int, c: int) -> np.int32:
        """a * b + c on the two fp16 halves of int32 words, rounded once (fma.rn.f16x2; the
        float64 twin is exact for the products and sums of the decoders' operands)."""
        return _word(_half2(a) * _half2(b) + _half2(c))

    def _dp4a(a: int, b: int, c: int, a_signed: bool) -> np.int32:
        """c + the four byte products of a and b (b's bytes signed; a's signed or not)."""
        t = int(c)
        for k in range(4):
            x, y = (int(a) >> (8 * k)) & 0xFF, (int(b) >> (8 * k)) & 0xFF
            x = x - 256 if a_signed and x & 0x80 else x
            t += x * (y - 256 if y & 0x80 else y)
        return np.array(t & 0xFFFFFFFF, dtype=np.uint32).view(np.int32)[()]

    def dp4a_us(a: int, b: int, c: int) -> np.int32:
        """c + sum_k a_k b_k over the bytes (a unsigned, b signed): dp4a.u32.s32."""
        return _dp4a(a, b, c, False)

    def dp4a_ss(a: int, b: int, c: int) -> np.int32:
        """c + sum_k a_k b_k over the bytes (both signed): dp4a.s32.s32."""
        return _dp4a(a, b, c, True)

    _ARRIVE = threading.Lock()

    def arrive(counter: np.ndarray, i: int) -> np.int32:
        """counter[i] += 1, returning the old count (simulator: under a lock; the simulator's
        threads share one memory, so the release and acquire need nothing more)."""
        with _ARRIVE:
            old = counter[i]
            counter[i] = old + 1
        return np.int32(old)

    def _sin_fast(r: float) -> np.float32:
        return np.float32(np.sin(np.float32(r)))

    def _cos_fast(r: float) -> np.float32:
        return np.float32(np.cos(np.float32(r)))

    def grid_dependency_wait() -> None:
        """(simulator: kernels run one after another, there is nothing to wait for)"""

    def launch_dependents() -> None:
        """(simulator: no programmatic launches)"""

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils, libdevice
    from numba.cuda.extending import intrinsic

    @intrinsic
    def ldg128(typingctx: object, a: object, r: object, j: object) -> object:
        """ldg128(a, r, j) -> (a[r, 2j], a[r, 2j + 1]): one 16-byte load (ld.global.nc.v2.u64)
        from a 2-D C-contiguous uint64 array whose rows are 16-byte aligned (the caller checks).

        numba itself only emits loads as wide as an element (uint64 at most); a 16-byte load
        halves the load instructions and doubles the bytes in flight a load. The weights are
        read once and never written while a kernel runs, so the read-only (.nc) path is safe;
        L1::no_allocate keeps them from evicting anything useful from L1."""
        if not (isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.uint64):
            return None
        sig = types.UniTuple(types.uint64, 2)(a, r, j)

        def codegen(context: object, builder: object, sig: object, args: object) -> object:
            aty, rty, jty = sig.args
            av, rv, jv = args
            rv = context.cast(builder, rv, rty, types.intp)
            jv = context.cast(builder, jv, jty, types.intp)
            jv = builder.shl(jv, ir.Constant(jv.type, 1))  # uint64 element 2j
            ary = context.make_array(aty)(context, builder, value=av)
            ptr = cgutils.get_item_pointer(context, builder, aty, ary, [rv, jv], wraparound=False)
            i64 = ir.IntType(64)
            fnty = ir.FunctionType(ir.LiteralStructType([i64, i64]), [ptr.type])
            asm = ir.InlineAsm(fnty, "ld.global.nc.L1::no_allocate.v2.u64 {$0, $1}, [$2];", "=l,=l,l")
            res = builder.call(asm, [ptr])
            parts = [builder.extract_value(res, 0), builder.extract_value(res, 1)]
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    def _ptx_sm90(text: str, doc: str) -> object:
        """A no-argument intrinsic that emits the PTX instruction `text` where the GPU has it
        (sm_90 and up: griddepcontrol) and nothing elsewhere (an older GPU, where a kernel is
        never a programmatic dependent)."""

        def impl(typingctx: object) -> object:
            def codegen(context: object, builder: object, sig: object, args: object) -> object:
                if sm90():
                    fnty = ir.FunctionType(ir.VoidType(), [])
                    builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()

            return types.void(), codegen

        impl.__doc__ = doc
        return intrinsic(impl)

    grid_dependency_wait = _ptx_sm90(
        "griddepcontrol.wait;",
        """Wait until the kernels this one depends on have finished and their writes are
        visible. A no-op unless the kernel was launched as a programmatic dependent (a graph
        captured with programmatic edges, pycalm.gpu.graph): then it may start while the kernel
        before it runs, and must read nothing that kernel (or any before it) writes before
        this call. Weights, which nothing writes, may be loaded before it.""",
    )
    launch_dependents = _ptx_sm90(
        "griddepcontrol.launch_dependents;",
        """Let the next kernel, if it is a programmatic dependent, launch once every block of
        this one has called this (or exited): its blocks then load their weights while this
        kernel finishes, and wait (grid_dependency_wait) for its results.""",
    )

    @intrinsic
    def arrive(typingctx: object, counter: object, i: object) -> object:
        """counter[i] += 1, returning the old count, as one atom.acq_rel.gpu.global.add.s32 on a
        1-D int32 array: a release of everything the calling thread has observed (after a block
        barrier, every thread's writes of the block) and an acquire of what the earlier arrivals
        released. One thread of a block calls it between two barriers (last_to_arrive), in place
        of every thread's membar.gl (fence.sc.gpu) before the count and after it."""
        if not (isinstance(counter, types.Array) and counter.ndim == 1 and counter.dtype == types.int32):
            return None
        sig = types.int32(counter, i)

        def codegen(context: object, builder: object, sig: object, args: object) -> object:
            aty, ity = sig.args
            ary = context.make_array(aty)(context, builder, value=args[0])
            iv = context.cast(builder, args[1], ity, types.intp)
            ptr = cgutils.get_item_pointer(context, builder, aty, ary, [iv], wraparound=False)
            fnty = ir.FunctionType(ir.IntType(32), [ptr.type])
            asm = ir.InlineAsm(
                fnty, "atom.acq_rel.gpu.global.add.s32 $0, [$1], 1;", "=r,l,~{memory}", side_effect=True
            )
            return builder.call(asm, [ptr])

        return sig, codegen

    def _asm_i32(typingctx: object, args: tuple, asm: str, constraints: str) -> object:
        """An int32 -> int32 inline-PTX intrinsic body (every argument cast to int32)."""
        sig = types.int32(*args)

        def codegen(context: object, builder: object, sig: object, vals: object) -> object:
            i32 = ir.IntType(32)
            vals = [context.cast(builder, v, t, types.int32) for v, t in zip(vals, sig.args, strict=True)]
            fn = ir.InlineAsm(ir.FunctionType(i32, [i32] * len(vals)), asm, constraints)
            return builder.call(fn, vals)

        return sig, codegen

    @intrinsic
    def prmt(typingctx: object, a: object, b: object, sel: object) -> object:
        """prmt.b32 (byte permute; numba has no byte shuffle): one instruction builds a word
        from any bytes of b:a, e.g. two e5m2 bytes moved into the top bytes of two fp16 halves."""
        return _asm_i32(typingctx, (a, b, sel), "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")

    @intrinsic
    def and_or(typingctx: object, a: object, m: object, e: object) -> object:
        """(a & m) | e in one lop3.b32. Written in C or numba with two constants, ptxas emits two
        LOP3s (one immediate each); the inline lop3 keeps one constant in a register."""
        return _asm_i32(typingctx, (a, m, e), "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r")

    @intrinsic
    def hsub2(typingctx: object, a: object, b: object) -> object:
        """a - b on the two fp16 halves of int32 words, one sub.rn.f16x2 (HADD2)."""
        return _asm_i32(typingctx, (a, b), "sub.rn.f16x2 $0, $1, $2;", "=r,r,r")

    @intrinsic
    def hfma2(typingctx: object, a: object, b: object, c: object) -> object:
        """a * b + c on the two fp16 halves of int32 words, rounded once: one fma.rn.f16x2 (HFMA2)."""
        return _asm_i32(typingctx, (a, b, c), "fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r")

    @intrinsic
    def dp4a_us(typingctx: object, a: object, b: object, c: object) -> object:
        """c + sum_k a_k b_k over the four bytes of a (unsigned) and b (signed), int32: one
        dp4a.u32.s32 (IDP.4A: four multiply-adds of 8-bit integers in one instruction)."""
        return _asm_i32(typingctx, (a, b, c), "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r")

    @intrinsic
    def dp4a_ss(typingctx: object, a: object, b: object, c: object) -> object:
        """c + sum_k a_k b_k over the four signed bytes of a and of b, int32: one dp4a.s32.s32."""
        return _asm_i32(typingctx, (a, b, c), "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r")

    @intrinsic
    def h2f2(typingctx: object, w: object) -> object:
        """The two fp16 halves of an int32 (low half first) -> two float32, exact: cvt.f32.f16,
        which Hopper runs as HADD2.F32 (one instruction a weight, no shift or mask)."""
        sig = types.UniTuple(types.float32, 2)(w)

        def codegen(context: object, builder: object, sig: object, args: object) -> object:
            f32 = ir.FloatType()
            v = context.cast(builder, args[0], sig.args[0], types.int32)
            fn = ir.InlineAsm(
                ir.FunctionType(ir.LiteralStructType([f32, f32]), [ir.IntType(32)]),
                "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
                "=f,=f,r",
            )
            res = builder.call(fn, [v])
            parts = [builder.extract_value(res, 0), builder.extract_value(res, 1)]
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def _sin_fast(r: float) -> float:
        return libdevice.fast_sinf(float32(r))

    @cuda.jit(device=True, inline=True)
    def _cos_fast(r: float) -> float:
        return libdevice.fast_cosf(float32(r))

    @intrinsic
    def as_f32(typingctx: object, i: object) -> object:
        """int32 bit pattern -> float32 (a register move on the GPU; any integer is cast to int32
        first). An intrinsic, not a device function: the generated kernels call it hundreds of
        times, and numba's IR-level inlining of device functions is what makes compiles slow."""
        if not isinstance(i, types.Integer):
            return None
        sig = types.float32(i)

        def codegen(context: object, builder: object, sig: object, args: object) -> object:
            v = context.cast(builder, args[0], sig.args[0], types.int32)
            return builder.bitcast(v, ir.FloatType())

        return sig, codegen

    @intrinsic
    def as_i32(typingctx: object, f: object) -> object:
        """float32 -> its int32 bit pattern (a register move on the GPU)."""
        if not isinstance(f, types.Float):
            return None
        sig = types.int32(f)

        def codegen(context: object, builder: object, sig: object, args: object) -> object:
            v = context.cast(builder, args[0], sig.args[0], types.float32)
            return builder.bitcast(v, ir.IntType(32))

        return sig, codegen


@cuda.jit(device=True, inline=True)
def last_to_arrive(counter: cuda.devicearray, i: int, n: int, flag: cuda.devicearray, slot: int) -> bool:
    """Whether this block is the last of n to arrive at counter[i] (split-K's "the last block
    adds the partials"): a barrier, so that every thread's writes (its partials) precede thread
    0's arrive, whose release publishes them with the block's count and whose acquire, with the
    barrier after it, gives the block every earlier arrival's writes; flag[slot] (shared int32,
    free at the call) carries the answer to the block. Every thread of the block calls it; the last block
    resets the counter for the next launch once it has read it (the caller's job). The pattern
    of cutlass's GenericBarrier: one acq_rel atomic instead of a membar.gl a thread on each side."""
    cuda.syncthreads()  # every thread's writes precede thread 0's release
    if cuda.threadIdx.x == 0 and cuda.threadIdx.y == 0 and cuda.threadIdx.z == 0:
        flag[slot] = int32(1) if arrive(counter, i) == n - 1 else int32(0)
    cuda.syncthreads()  # flag[slot] and the earlier arrivals' writes are visible to the block
    return flag[slot] != 0


@cuda.jit(device=True, inline=True)
def dependent_start() -> None:
    """The start of a kernel whose first reads are what earlier kernels wrote: wait for the
    earlier ones (grid_dependency_wait), then let a programmatic next kernel launch
    (launch_dependents): in that order a kernel runs at most one ahead of the one it waits for.
    Both are no-ops outside a graph with programmatic edges (pycalm.gpu.graph). The weight-reading
    kernels (pycalm.kernels.matvec, qkv) instead issue their first loads before the wait and
    trigger the next launch once a warp's last row group's loads are in, so that the next
    kernel's launch and first loads overlap their reductions and writes, not their own loads.
    Measured on the H200 (scripts/bench.py, programmatic / plain edges, fp8, tok/s): TinyLlama
    1,263 / 1,228 with that late trigger, 1,242 / 1,231 with the trigger right after the wait;
    Llama-3-8B 351 / 337 either way."""
    grid_dependency_wait()
    launch_dependents()


@cuda.jit(device=True, inline=True)
def sincos(angle: float) -> tuple[float, float]:
    """(sin, cos) of a float32 angle (RoPE: pos * freq, |angle| < 4e5), to ~1e-6 absolute.

    libdevice's precise sinf/cosf carry a Payne-Hanek slow path (a local-memory array, float64);
    instead the angle is reduced to [-pi, pi] with a two-constant Cody-Waite step (2 pi =
    6.28125 + 1.9353e-3; k * 6.28125 is exact for k < 2**16) and the fast hardware sin / cos
    (absolute error ~2**-21 on [-pi, pi]) finish it."""
    k = math.floor(angle * float32(0.15915494309189535) + float32(0.5))
    r = angle - k * float32(6.28125)
    r = r - k * float32(0.0019353071795864769)
    return _sin_fast(r), _cos_fast(r)


# ---------------------------------------------------------------------------------------------
# reductions


@cuda.jit(device=True, inline=True)
def warp_reduce_sum(v: float) -> float:
    """Sum over the 32 lanes of a warp; every lane gets the result (xor butterfly).
    All 32 lanes must call it."""
    v += cuda.shfl_xor_sync(FULL_MASK, v, 16)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 8)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 4)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 2)
    v += cuda.shfl_xor_sync(FULL_MASK, v, 1)
    return v


@cuda.jit(device=True, inline=True)
def warp_reduce_max(v: float) -> float:
    """Maximum over the 32 lanes of a warp; every lane gets the result. All lanes must call."""
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 16))
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 8))
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 4))
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 2))
    v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 1))
    return v


@cuda.jit(device=True, inline=True)
def block_reduce_sum(v: float, scratch: cuda.devicearray) -> float:
    """Sum over all threads of the block (blockDim.x a multiple of 32, at most 1024); every
    thread gets the result. scratch: a float32 shared array of >= 32 elements. Every thread
    must call it; it contains two barriers, so scratch may be reused right after it returns."""
    lane = cuda.threadIdx.x % WARP
    warp = cuda.threadIdx.x // WARP
    n_warps = cuda.blockDim.x // WARP
    v = warp_reduce_sum(v)
    if lane == 0:
        scratch[warp] = v
    cuda.syncthreads()  # every warp's partial sum is in scratch
    total = float32(0.0)
    for i in range(n_warps):
        total += scratch[i]
    cuda.syncthreads()  # everyone has read scratch before a later call overwrites it
    return total


@cuda.jit(device=True, inline=True)
def block_reduce_max(v: float, scratch: cuda.devicearray) -> float:
    """Maximum over all threads of the block; same contract as block_reduce_sum."""
    lane = cuda.threadIdx.x % WARP
    warp = cuda.threadIdx.x // WARP
    n_warps = cuda.blockDim.x // WARP
    v = warp_reduce_max(v)
    if lane == 0:
        scratch[warp] = v
    cuda.syncthreads()  # every warp's partial maximum is in scratch
    total = scratch[0]
    for i in range(1, n_warps):
        total = max(total, scratch[i])
    cuda.syncthreads()  # everyone has read scratch before a later call overwrites it
    return total


# ---------------------------------------------------------------------------------------------
# 32-bit integer helpers
#
# Real numba types int32 <op> int32 as int64 (intp), shifts included, while the simulator keeps
# int32 (NumPy rules). A shift whose result must wrap at 32 bits (w << 24 moving a byte into the
# sign bit) or an arithmetic right shift of such a result is therefore wrapped in int32() at
# every step: the cast makes the real compiler truncate, and LLVM then narrows the whole chain
# to 32-bit PTX (shl.b32 / shr.s32 / and.b32; tests/test_ptx.py checks that no 64-bit shift or
# logic op is left in the decoders).


@cuda.jit(device=True, inline=True)
def shl32(a: int, n: int) -> int:
    """int32 a << n, wrapping at 32 bits (n a constant 0..31)."""
    return int32(int32(a) << int32(n))


@cuda.jit(device=True, inline=True)
def sar32(a: int, n: int) -> int:
    """int32 a >> n, arithmetic (the sign bit copied down), n a constant 0..31."""
    return int32(int32(a) >> int32(n))


# ---------------------------------------------------------------------------------------------
# decoders: "raw" results are value * 2**-112 (multiply by FP_RAW_SCALE once, outside loops)


@cuda.jit(device=True, inline=True)
def fp8_byte_raw(w: int, k: int) -> float:
    """Byte k (0..3, k a constant after inlining) of the int32 w as e5m2 -> value * 2**-112:
    the byte moved to the top (a left shift, none for byte 3), then >> 3 and the mask."""
    return as_f32(int32(sar32(shl32(w, 24 - 8 * k), 3) & int32(MASK_E5M2)))


@cuda.jit(device=True, inline=True)
def fp8x4_cvt(w: int) -> tuple[float, float, float, float]:
    """Four e5m2 bytes of the int32 w (byte 0 first) -> four exact float32 values: two byte
    permutes make two fp16 pairs (an e5m2 byte is the top byte of an fp16), and four
    cvt.f32.f16 widen them. 6 instructions for 4 weights (the matvec kernels' fp8 decoder)."""
    f0, f1 = h2f2(prmt(w, int32(0), int32(0x1404)))  # bytes 0, 1 -> top bytes of the halves
    f2, f3 = h2f2(prmt(w, int32(0), int32(0x3424)))  # bytes 2, 3
    return f0, f1, f2, f3


@cuda.jit(device=True, inline=True)
def fp8_decode(b: int) -> float:
    """One e5m2 byte (the low 8 bits of b) -> its float32 value (exact)."""
    return fp8_byte_raw(int32(b), 0) * float32(FP_RAW_SCALE)


@cuda.jit(device=True, inline=True)
def gf4_scale(w: int) -> float:
    """The group factor -s/4 of a gf4 word (s: its low byte as e5m2), exact: weight k of the
    group is (q_k - 4) * gf4_scale(w)."""
    return fp8_byte_raw(int32(w), 0) * float32(GF4_RAW_SCALE)


@cuda.jit(device=True, inline=True)
def gf4_code(w: int, k: int) -> float:
    """q_k - 4 of a gf4 word as an exact float32 (k a constant after inlining): the code is
    masked in place and given an exponent that makes its mantissa unit 1, see the docstring.
    Codes 5..7 (bits 23..31) are moved down 12 bits first so that their mantissa fits."""
    w = int32(w)
    if k >= 5:
        w = sar32(w, 12)  # the copied sign bits land above bit 22, masked off
        p = 8 + 3 * k - 12
    else:
        p = 8 + 3 * k
    e = int32(150 - p) << int32(23)  # exponent field: the mantissa unit becomes 1 (fits int32)
    return (as_f32(int32((w & (int32(7) << int32(p))) | e)) - as_f32(int32(e))) - float32(4.0)


@cuda.jit(device=True, inline=True)
def gf4_decode(w: int, k: int) -> float:
    """Weight k (0..7) of a gf4 word -> float32 (exact)."""
    return gf4_code(w, k) * gf4_scale(w)


@cuda.jit(device=True, inline=True)
def gf4_dot8_raw(
    w: int, x0: float, x1: float, x2: float, x3: float, x4: float, x5: float, x6: float, x7: float
) -> float:
    """sum_k (q_k - 4) x_k * s_raw over one gf4 group (s_raw = s * 2**-112, the raw e5m2
    scale): multiply by GF4_RAW_SCALE (-2**110) once per row. Each code is masked in place and
    ORed with an exponent (one LOP3), the exact float subtraction of 2**(23-p) + 4 leaves q - 4,
    then one FMA: 3 instructions a weight, the scale once a group (the matvec kernels' gf4
    decoder)."""
    w = int32(w)
    u = sar32(w, 12)  # codes 5..7 moved down so that their mantissa fits
    # line k: code k sits at bit p = 8 + 3k (p - 12 in u for k >= 5); mask 7 << p, exponent field
    # (150 - p) << 23 (the float 2**(23 - p) + q: the code's unit is 1), minus 2**(23 - p) + 4
    acc = (as_f32(and_or(w, int32(0x700), int32(142 << 23))) - float32(2.0**15 + 4.0)) * x0
    acc += (as_f32(and_or(w, int32(0x3800), int32(139 << 23))) - float32(2.0**12 + 4.0)) * x1
    acc += (as_f32(and_or(w, int32(0x1C000), int32(136 << 23))) - float32(2.0**9 + 4.0)) * x2
    acc += (as_f32(and_or(w, int32(0xE0000), int32(133 << 23))) - float32(2.0**6 + 4.0)) * x3
    acc += (as_f32(and_or(w, int32(0x700000), int32(130 << 23))) - float32(2.0**3 + 4.0)) * x4
    acc += (as_f32(and_or(u, int32(0x3800), int32(139 << 23))) - float32(2.0**12 + 4.0)) * x5
    acc += (as_f32(and_or(u, int32(0x1C000), int32(136 << 23))) - float32(2.0**9 + 4.0)) * x6
    acc += (as_f32(and_or(u, int32(0xE0000), int32(133 << 23))) - float32(2.0**6 + 4.0)) * x7
    return acc * fp8_byte_raw(w, 0)


@cuda.jit(device=True, inline=True)
def q4_code(w: int, k: int) -> float:
    """Code q_k (0..15) of a q4 word, nibble k (k a constant after inlining), as an exact float32:
    the nibble is masked in place and given the exponent that makes its mantissa unit 1 (one
    LOP3, then the float subtraction of 2**(23-p)), as gf4_code; nibbles 4..7 are moved down 16
    bits first so that their mantissa fits. The weight is d * q_k + m (pycalm.model.formats q4)."""
    w = int32(w)
    if k >= 4:
        w = sar32(w, 16)  # the copied sign bits land above bit 15, masked off
        p = 4 * k - 16
    else:
        p = 4 * k
    e = int32(150 - p) << int32(23)  # exponent field: the mantissa unit becomes 1 (fits int32)
    return as_f32(and_or(w, int32(15) << int32(p), e)) - as_f32(int32(e))


# ---------------------------------------------------------------------------------------------
# decoders to f16x2 words (the tensor-core kernels' weight tiles: pycalm.kernels.skinny's A
# fragments, pycalm.kernels.matmul's and wgmma_matmul's shared W tiles): two weights an f16x2
# word, lo in the low half, each pair in a few half-precision instructions and no conversion


def f16x2_const(lo: float, hi: float) -> int:
    """Two fp16 values as the int32 word of an f16x2 (lo in the low half)."""
    return int(np.array([lo, hi], np.float16).view(np.int32)[0])


Q8_BIAS = 0x64806480  # (1152, 1152) as f16x2: 1024 + 128, the exponent and the code's bias
Q4_BIAS = 0x54006400  # (1024, 64) as f16x2: a low nibble's exponent, a high nibble's
NEG_ZERO2 = f16x2_const(-0.0, -0.0)  # the addend of a product alone: x * y + (-0) keeps its sign
GF4_QUARTER = f16x2_const(-0.25, -0.25)  # gf4's weights are (q - 4) (-s / 4)
# gf4's code pairs (0, 1), (2, 3), (4, 5), (6, 7) of a word (code k at bits 8 + 3k, the scale in
# bits 0-7) as two fp16 halves: a byte permute puts the byte(s) holding the pair's codes into each
# half, a LOP3 keeps each code's 3 bits and ORs an exponent under which the code's lowest bit is
# worth 1 (code bit b of a half: exponent 10 - b), then the subtraction of that power of two and
# of 4 leaves q - 4 exactly: (prmt selector, mask, exponents, subtrahends) a pair
# byte 1 in both halves: bits 0-2, 3-5
GF4_PAIR0 = (0x4141, 0x00380007, f16x2_const(1024.0, 128.0), f16x2_const(1028.0, 132.0))
# bytes 1-2 | byte 2: bits 6-8, 1-3
GF4_PAIR1 = (0x4221, 0x000E01C0, f16x2_const(16.0, 512.0), f16x2_const(20.0, 516.0))
# byte 2 | bytes 2-3: bits 4-6, 7-9
GF4_PAIR2 = (0x3222, 0x03800070, f16x2_const(64.0, 8.0), f16x2_const(68.0, 12.0))
# byte 3 in both halves: bits 2-4, 5-7
GF4_PAIR3 = (0x4343, 0x00E0001C, f16x2_const(256.0, 32.0), f16x2_const(260.0, 36.0))


@cuda.jit(device=True, inline=True)
def gf4_factor(v: int) -> int:
    """The gf4 word v's group factor as an f16x2 word (-s/4, -s/4), exact: its e5m2 scale byte is
    the top byte of an fp16 in both halves (a prmt), times -1/4."""
    return hfma2(prmt(v, int32(0), int32(0x0404)), int32(GF4_QUARTER), int32(NEG_ZERO2))


@cuda.jit(device=True, inline=True)
def gf4_pair(v: int, p: int, f: int) -> int:
    """Code pair p (a constant after unrolling) of the gf4 word v as an f16x2 word of weights:
    (q - 4) of each code exact (GF4_PAIR0 .. GF4_PAIR3), times f = gf4_factor(v), exact (the -0 addend keeps a
    zero's sign). A prmt, a LOP3, an HADD2 and an HFMA2."""
    # (a chain of constant tuples, not a tuple of them indexed by p: numba compiles a tuple index
    # by a literal as a device function of its own, which a compile without a GPU cannot)
    if p == 0:
        sel, mask, exponents, subtrahends = GF4_PAIR0
    elif p == 1:
        sel, mask, exponents, subtrahends = GF4_PAIR1
    elif p == 2:
        sel, mask, exponents, subtrahends = GF4_PAIR2
    else:
        sel, mask, exponents, subtrahends = GF4_PAIR3
    q = hsub2(and_or(prmt(v, int32(0), int32(sel)), int32(mask), int32(exponents)), int32(subtrahends))
    return hfma2(q, f, int32(NEG_ZERO2))


@cuda.jit(device=True, inline=True)
def q8_pairs(w: int) -> tuple[int, int]:
    """The four q8 codes of the int32 w (byte 0 first) as two f16x2 words, exact: each byte, biased
    to unsigned (one XOR a word), goes under the fp16 exponent of 1024 (a prmt a pair), minus 1152
    (an HADD2 a pair)."""
    u = int32(int32(w) ^ int32(0x80808080 - (1 << 32)))
    magic = int32(0x64646464)
    return (
        hsub2(prmt(u, magic, int32(0x5140)), int32(Q8_BIAS)),
        hsub2(prmt(u, magic, int32(0x5342)), int32(Q8_BIAS)),
    )


@cuda.jit(device=True, inline=True)
def q4_pair(v: int, b: int, dd: int, mm: int) -> int:
    """Byte b (a constant after unrolling) of the q4 word v, codes 2b and 2b + 1, as the f16x2
    word of weights d q + m, each rounded once to fp16 (dd = (d, d), mm = (m, m): the group's step
    and offset, fp16 in both halves). A prmt puts the byte into both halves, a LOP3 keeps its low
    nibble under the exponent of 1024 and its high one under that of 64 (mantissa unit 1 either
    way), an HADD2 subtracts those powers (the codes, exact) and an HFMA2 makes d q + m."""
    sel = int32(0x4040 + 0x0101 * b)
    q = hsub2(and_or(prmt(v, int32(0), sel), int32(0x00F0000F), int32(Q4_BIAS)), int32(Q4_BIAS))
    return hfma2(q, dd, mm)


# ---------------------------------------------------------------------------------------------
# encoders for the KV-cache write (bit-exact with pycalm.model.formats)


@cuda.jit(device=True, inline=True)
def fp16_encode(x: float) -> float:
    """float32 -> float16, round to nearest even, saturating at +-65504 (formats.fp16_encode)."""
    return float16(min(max(float32(x), float32(-FP16_MAX)), float32(FP16_MAX)))


@cuda.jit(device=True, inline=True)
def fp8_encode(x: float) -> int:
    """float32 -> e5m2 byte (int32 0..255): round to nearest even straight from the float32,
    saturating to +-57344 (formats.fp8_encode). NaN -> 0x7F."""
    u = int32(as_i32(float32(x)))
    sign = int32(sar32(u, 24) & int32(0x80))
    a = int32(u & int32(0x7FFFFFFF))
    if a > int32(0x7F800000):  # NaN
        return int32(0x7F)
    if a >= int32(0x47600000):  # >= 57344 (and inf): saturate
        return int32(sign | int32(FP8_MAX_BYTE))
    if a >= int32(0x38800000):  # >= 2**-14: normal in e5m2; round the low 21 bits to even
        r = int32(a + int32(0xFFFFF) + int32(sar32(a, 21) & int32(1)))  # a < 0x47600000: no wrap
        return int32(sign | int32(sar32(r, 21) - int32(448)))  # 448 = (127 - 15) << 2, the rebias
    # subnormal in e5m2: a multiple of 2**-16; round |x| * 2**16 (exact) to an integer, ties to
    # even, with the 1.5 * 2**23 magic: the float32 add rounds to nearest even and leaves the
    # integer in the low mantissa bits
    y = as_f32(a) * float32(65536.0)
    return int32(sign | int32(as_i32(y + float32(12582912.0)) - int32(0x4B400000)))
