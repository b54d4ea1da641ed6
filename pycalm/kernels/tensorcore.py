"""Tensor-core intrinsics: inline PTX for the warp-wide matrix instructions numba has no API for.

  mma_16816(a0..a3, b0, b1, c0..c3) -> d0..d3    mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
  ldmatrix_x4(smem, word) -> r0..r3              ldmatrix.sync.aligned.m8n8.x4.shared.b16
  ldmatrix_x4_trans(smem, word) -> r0..r3        ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16
  cp_async4(smem, word, src, row, col, nbytes)   cp.async.ca.shared.global, 4 bytes (zero-filled
                                                 past nbytes)
  cp_async16(smem, word, src, row, col, nbytes)  cp.async.cg.shared.global, 16 bytes (zero-filled
                                                 past nbytes), cp_async_commit, cp_async_wait_all
                                                 / cp_async_wait_one (wait_group 0 / 1),
                                                 cp_async_wait(n)() (wait_group n)
  sts128(smem, word, w0..w3)                     st.shared.v4.b32
  lds128(smem, word) -> w0..w3                   ld.shared.v4.b32
  ldg64(src, row, col) -> w0, w1                 ld.global.nc.v2.b32 (8 bytes) and
  ldg128w(src, row, col) -> w0..w3               ld.global.nc.v4.b32 (16 bytes) from src[row, col]
                                                 of a uint8 / int8 / uint32 / float16 array
  pack_f16x2(lo, hi) -> word                     cvt.rn.f16x2.f32 (two floats -> two fp16 halves)

Shared memory is a 1-D int32 array (`cuda.shared.array`) addressed by word: a word holds two
fp16 halves, the lower-indexed one in the low 16 bits. Fragment registers are int32 words of
two fp16 halves (f16x2, low half first) or float32.

Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16 with floating point type"), with
g = lane >> 2 (the group) and t = lane & 3 (the thread in the group):

  A (16 x 16, row-major, f16):  a0 = A[g, 2t:2t+2]      a1 = A[g+8, 2t:2t+2]
                                a2 = A[g, 2t+8:2t+10]   a3 = A[g+8, 2t+8:2t+10]
  B (16 x 8, k x n, "col": B^T row-major, so a row of B^T is a column of B):
                                b0 = B[2t:2t+2, g]      b1 = B[2t+8:2t+10, g]
  C, D (16 x 8, f32):           c0, c1 = C[g, 2t], C[g, 2t+1]   c2, c3 = C[g+8, 2t], C[g+8, 2t+1]

ldmatrix .x4 loads four 8 x 8 matrices of 16-bit elements: lanes 8i..8i+7 give the addresses
of rows 0..7 of matrix i (16 contiguous bytes each), and register i of lane l receives matrix i's
row l >> 2, elements 2 (l & 3) and 2 (l & 3) + 1: exactly an A or B fragment piece when the
matrices are the fragment's 8 x 8 quarters (pycalm.kernels.matmul picks the row addresses).
The .trans form hands out each matrix transposed: register i of lane l holds elements l >> 2 of
matrix i's rows 2 (l & 3) and 2 (l & 3) + 1, so a B fragment (b0 = B[2t:2t+2, g]) comes from B
stored k-major, a row of B a 16-byte row of shared memory (pycalm.kernels.prefill_attention's V
tile).

Each intrinsic has a simulator twin (NUMBA_ENABLE_CUDASIM=1), so the kernels that use them run
unmodified on a CPU: the warp-wide ones gather every lane's operands through the per-warp
exchange of pycalm.kernels._cudasim (the whole warp must call them together, as on the GPU),
rebuild the matrices and hand each lane its fragment; cp.async copies at once (commit and wait
are no-ops).
"""

from __future__ import annotations

import numpy as np
from numba import config as _numba_config

if _numba_config.ENABLE_CUDASIM:
    from pycalm.kernels._cudasim import warp_once

    _G = np.arange(32) >> 2  # (32,) a lane's group g
    _T2 = 2 * (np.arange(32) & 3)[:, None] + np.arange(2)  # (32, 2) its columns 2t, 2t + 1

    def _halves(words: list) -> np.ndarray:
        """int32 words -> their fp16 halves (low first) as float32, (..., 2)."""
        w = np.array(words, dtype=np.int64).astype(np.uint32)
        return w.view(np.float16).reshape(*w.shape, 2).astype(np.float32)

    def a_fragment_matrix(frags: list) -> np.ndarray:
        """The 16 x 16 float32 A of an m16n8k16 from every lane's (a0, a1, a2, a3, ...) (the
        module docstring's A layout; wgmma's register form takes a warp's rows the same way)."""
        h = _halves([f[:4] for f in frags])  # (32, 4, 2): a0..a3 as pairs
        a = np.zeros((16, 16), np.float32)
        g = _G[:, None]
        a[g, _T2], a[g + 8, _T2], a[g, _T2 + 8], a[g + 8, _T2 + 8] = h[:, 0], h[:, 1], h[:, 2], h[:, 3]
        return a

    def _mma_warp(frags: list) -> np.ndarray:
        """The warp's D = A B + C (16 x 8 float32) from every lane's (a0..a3, b0, b1, c0..c3)."""
        h = _halves([f[4:6] for f in frags])  # (32, 2, 2): b0, b1 as pairs
        cf = np.array([f[6:] for f in frags], np.float32)  # (32, 4)
        a = a_fragment_matrix(frags)
        b = np.zeros((16, 8), np.float32)
        c = np.zeros((16, 8), np.float32)
        g = _G[:, None]
        b[_T2, g], b[_T2 + 8, g] = h[:, 0], h[:, 1]
        c[g, _T2], c[g + 8, _T2] = cf[:, 0:2], cf[:, 2:4]
        return (a @ b + c).astype(np.float32)

    def mma_16816(
        a0: int, a1: int, a2: int, a3: int, b0: int, b1: int, c0: float, c1: float, c2: float, c3: float
    ) -> tuple[np.float32, np.float32, np.float32, np.float32]:
        """D = A B + C over the warp (simulator: every lane's fragments gathered, the 16 x 8
        product in float32 once a warp, this lane's four D elements returned)."""
        d, lane = warp_once((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _mma_warp)
        g, t = lane >> 2, lane & 3
        return d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]

    def _ldmatrix_warp(rows: list) -> np.ndarray:
        """The four 8 x 8 matrices of an ldmatrix_x4, (4, 8, 8) fp16: matrix i's row r the 4
        words at the address lane 8 i + r gave."""
        m = np.array([arr[base : base + 4] for arr, base in rows], np.int32)  # (32, 4) words
        return m.view(np.float16).reshape(4, 8, 8)

    def _ldmatrix(smem: np.ndarray, word: int, trans: bool) -> tuple[np.int32, np.int32, np.int32, np.int32]:
        """ldmatrix_x4 (trans: its .trans form) over the warp: the row addresses gathered, the
        four 8 x 8 matrices rebuilt once a warp, this lane's register of each returned."""
        mats, lane = warp_once((smem, int(word)), _ldmatrix_warp)
        _aligned16(word)  # after the gather: a lane that raised before it would hang the warp
        g, t = lane >> 2, lane & 3
        out = []
        for i in range(4):
            m = mats[i]
            pair = m[g, 2 * t : 2 * t + 2] if not trans else m[2 * t : 2 * t + 2, g]
            out.append(np.ascontiguousarray(pair).view(np.int32)[0])
        return out[0], out[1], out[2], out[3]

    def ldmatrix_x4(smem: np.ndarray, word: int) -> tuple[np.int32, np.int32, np.int32, np.int32]:
        """Four 8 x 8 fp16 matrices from shared memory, this lane's row `word` (4 words) one of
        them (simulator: register i of lane l is word l & 3 of the row that lane 8 i + (l >> 2)
        addressed)."""
        return _ldmatrix(smem, word, False)

    def ldmatrix_x4_trans(smem: np.ndarray, word: int) -> tuple[np.int32, np.int32, np.int32, np.int32]:
        """ldmatrix_x4 with each matrix transposed (simulator: register i of lane l holds half
        l >> 2 of the rows that lanes 8 i + 2 (l & 3) and + 1 addressed)."""
        return _ldmatrix(smem, word, True)

    def cp_async16(smem: np.ndarray, word: int, src: np.ndarray, row: int, col: int, nbytes: int) -> None:
        """Copy 8 fp16 src[row, col:col+8] into smem words word..word+3, bytes past nbytes (0 or
        16) zero (simulator: at once)."""
        _aligned16(word)
        if col % 8:
            raise ValueError(f"cp.async source column {col} is not 16-byte aligned")
        vals = np.zeros(8, np.float16)
        if nbytes:
            for e in range(8):
                vals[e] = src[row, col + e]
        words = vals.view(np.int32)
        for e in range(4):
            smem[word + e] = words[e]

    def cp_async4(smem: np.ndarray, word: int, src: np.ndarray, row: int, col: int, nbytes: int) -> None:
        """Copy 2 fp16 src[row, col:col+2] into smem[word], zero where nbytes is 0 (simulator:
        at once)."""
        if col % 2:
            raise ValueError(f"cp.async source column {col} is not 4-byte aligned")
        vals = np.zeros(2, np.float16)
        if nbytes:
            vals[0], vals[1] = src[row, col], src[row, col + 1]
        smem[word] = vals.view(np.int32)[0]

    def _words_at(src: np.ndarray, row: int, col: int, n_bytes: int) -> np.ndarray:
        """The n_bytes from element [row, col] of a 2-D array as int32 words (element reads)."""
        step = src.dtype.itemsize
        if (col * step) % n_bytes:
            raise ValueError(f"a {n_bytes}-byte load at column {col} is not aligned")
        vals = [src[row, col + e] for e in range(n_bytes // step)]
        return np.array(vals, dtype=src.dtype).view(np.int32)

    def ldg64(src: np.ndarray, row: int, col: int) -> tuple[np.int32, np.int32]:
        """The 8 bytes from src[row, col] of a uint8 / int8 / uint32 / float16 array as two int32 words,
        low bytes first (simulator: element reads)."""
        b = _words_at(src, row, col, 8)
        return b[0], b[1]

    def ldg128w(src: np.ndarray, row: int, col: int) -> tuple[np.int32, np.int32, np.int32, np.int32]:
        """The 16 bytes from src[row, col] of a uint8 / int8 / uint32 / float16 array as four int32 words,
        low bytes first (simulator: element reads)."""
        b = _words_at(src, row, col, 16)
        return b[0], b[1], b[2], b[3]

    def cp_async_commit() -> None:
        """(simulator: the copies are done)"""

    def cp_async_wait_all() -> None:
        """(simulator: the copies are done)"""

    def cp_async_wait_one() -> None:
        """(simulator: the copies are done)"""

    def cp_async_wait(n: int) -> object:
        """cp.async.wait_group n as a no-argument function (simulator: the copies are done)."""

        def wait() -> None:
            pass

        return wait

    def sts128(smem: np.ndarray, word: int, w0: int, w1: int, w2: int, w3: int) -> None:
        """Four words into smem[word:word+4] (simulator: four stores)."""
        _aligned16(word)
        smem[word] = w0
        smem[word + 1] = w1
        smem[word + 2] = w2
        smem[word + 3] = w3

    def lds128(smem: np.ndarray, word: int) -> tuple[np.int32, np.int32, np.int32, np.int32]:
        """smem[word:word+4] (simulator: four loads)."""
        _aligned16(word)
        return smem[word], smem[word + 1], smem[word + 2], smem[word + 3]

    def pack_f16x2(lo: float, hi: float) -> np.int32:
        """Two floats rounded to fp16 (to nearest even) in one word, lo in the low half."""
        return np.array([lo, hi], dtype=np.float32).astype(np.float16).view(np.int32)[0]

    def _aligned16(word: int) -> None:
        """The GPU faults (misaligned address) on a 16-byte shared access off a 16-byte
        boundary; so does the twin (shared arrays start 16-byte aligned)."""
        if int(word) % 4:
            raise ValueError(f"shared word {word} is not 16-byte aligned")

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)
    _F32 = ir.FloatType()

    def _shared_word_address(
        context: object, builder: object, aty: object, av: object, word: object, wty: object
    ):  # noqa: ANN202
        """The 32-bit shared-memory address of word `word` of a 1-D shared int32 array (numba
        hands shared arrays around as generic pointers; the cast back lets NVVM fold it)."""
        word = context.cast(builder, word, wty, types.intp)
        ary = context.make_array(aty)(context, builder, value=av)
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, [word], wraparound=False)
        shared = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 3))
        return builder.ptrtoint(shared, _I32)

    def _is_word_array(a: object) -> bool:
        return isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.int32

    @intrinsic
    def mma_16816(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):  # noqa: ANN001, ANN201
        """D = A B + C, one m16n8k16 tile over the warp: A 16 x 16 and B 16 x 8 in fp16 (f16x2
        words), C and D 16 x 8 in float32, fragments as in the module docstring. Every lane of
        the warp must call it (.sync.aligned)."""
        sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context: object, builder: object, sig: object, args: object) -> object:
            ints = [
                context.cast(builder, v, t, types.int32) for v, t in zip(args[:6], sig.args[:6], strict=True)
            ]
            floats = [
                context.cast(builder, v, t, types.float32)
                for v, t in zip(args[6:], sig.args[6:], strict=True)
            ]
            fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4)
            asm = ir.InlineAsm(
                fnty,
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
            )
            res = builder.call(asm, ints + floats)
            parts = [builder.extract_value(res, i) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    def _shared_load4(smem: object, word: object, text: str) -> object:
        """The typing and codegen of a 16-byte shared load into four int32 registers: the PTX
        instruction `text`, its outputs $0..$3 and its address $4."""
        if not _is_word_array(smem):
            return None
        sig = types.UniTuple(types.int32, 4)(smem, word)

        def codegen(context: object, builder: object, sig: object, args: object) -> object:
            addr = _shared_word_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            fnty = ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I32])
            asm = ir.InlineAsm(
                fnty,
                text,
                "=r,=r,=r,=r,r,~{memory}",
                side_effect=True,  # reads shared memory: keep it between the barriers it sits in
            )
            res = builder.call(asm, [addr])
            parts = [builder.extract_value(res, i) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    def _ldmatrix(smem: object, word: object, shape: str) -> object:
        """The typing and codegen of ldmatrix.sync.aligned.m8n8.x4{shape}.shared.b16."""
        return _shared_load4(
            smem, word, f"ldmatrix.sync.aligned.m8n8.x4{shape}.shared.b16 {{$0, $1, $2, $3}}, [$4];"
        )

    @intrinsic
    def ldmatrix_x4(typingctx, smem, word):  # noqa: ANN001, ANN201
        """Four 8 x 8 fp16 matrices from shared memory into four f16x2 words a lane (ldmatrix
        .x4): this lane gives the address of one 16-byte row, word `word` of the 1-D int32 shared
        array `smem` (lanes 8i..8i+7: rows 0..7 of matrix i); register i of lane l is matrix
        i's row l >> 2, elements 2 (l & 3), 2 (l & 3) + 1. Every lane must call it."""
        return _ldmatrix(smem, word, "")

    @intrinsic
    def ldmatrix_x4_trans(typingctx, smem, word):  # noqa: ANN001, ANN201
        """ldmatrix_x4 with each 8 x 8 matrix transposed (.trans): register i of lane l holds
        element l >> 2 of matrix i's rows 2 (l & 3) and 2 (l & 3) + 1. Every lane must call it."""
        return _ldmatrix(smem, word, ".trans")

    def _cp_async(smem: object, word: object, src: object, row: object, col: object, nbytes: object,
                  text: str) -> object:  # fmt: skip
        """The intrinsic body of a cp.async of src[row, col:...] (a 2-D C-contiguous float16
        array) to word `word` of the shared int32 array smem: `text` the instruction, on
        operands (shared address, global address, bytes read)."""
        if not _is_word_array(smem):
            return None
        if not (isinstance(src, types.Array) and src.ndim == 2 and src.dtype == types.float16):
            return None
        sig = types.void(smem, word, src, row, col, nbytes)

        def codegen(context: object, builder: object, sig: object, args: object) -> object:
            addr = _shared_word_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            sty = sig.args[2]
            r = context.cast(builder, args[3], sig.args[3], types.intp)
            c = context.cast(builder, args[4], sig.args[4], types.intp)
            ary = context.make_array(sty)(context, builder, value=args[2])
            ptr = cgutils.get_item_pointer(context, builder, sty, ary, [r, c], wraparound=False)
            n = context.cast(builder, args[5], sig.args[5], types.int32)
            fnty = ir.FunctionType(ir.VoidType(), [_I32, ptr.type, _I32])
            asm = ir.InlineAsm(fnty, text, "r,l,r,~{memory}", side_effect=True)
            builder.call(asm, [addr, ptr, n])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async16(typingctx, smem, word, src, row, col, nbytes):  # noqa: ANN001, ANN201
        """Start a 16-byte copy of src[row, col:col+8] (a 2-D C-contiguous float16 array in
        global memory, the 16 bytes aligned) to words word..word+3 of the shared int32 array
        `smem`, without passing through registers (cp.async.cg: cached in L2 only). Only the
        first nbytes (0 or 16) are read, the rest is zero-filled: a masked row passes 0 (with
        an in-bounds row and col). Visible after cp_async_commit, cp_async_wait_all and a
        barrier."""
        return _cp_async(smem, word, src, row, col, nbytes, "cp.async.cg.shared.global [$0], [$1], 16, $2;")

    @intrinsic
    def cp_async4(typingctx, smem, word, src, row, col, nbytes):  # noqa: ANN001, ANN201
        """cp_async16's 4-byte form: src[row, col:col+2] (4-byte aligned) to word `word`, nbytes
        0 or 4 (cp.async.ca: the 4-byte form is cached in L1 too, so a thread's copies of
        neighbouring words share their sectors)."""
        return _cp_async(smem, word, src, row, col, nbytes, "cp.async.ca.shared.global [$0], [$1], 4, $2;")

    _BYTE_WORD_ARRAYS = (types.uint8, types.int8, types.uint32, types.float16)

    def _ldg_words(n_words: int, src: object, row: object, col: object) -> object:
        """The intrinsic body of an n_words-word (8- or 16-byte) ld.global.nc.v{n}.b32 from
        element [row, col] of a 2-D C-contiguous uint8 / int8 / uint32 / float16 array."""
        if not (isinstance(src, types.Array) and src.ndim == 2 and src.dtype in _BYTE_WORD_ARRAYS):
            return None
        sig = types.UniTuple(types.int32, n_words)(src, row, col)
        regs = ", ".join(f"${i}" for i in range(n_words))

        def codegen(context: object, builder: object, sig: object, args: object) -> object:
            sty = sig.args[0]
            r = context.cast(builder, args[1], sig.args[1], types.intp)
            c = context.cast(builder, args[2], sig.args[2], types.intp)
            ary = context.make_array(sty)(context, builder, value=args[0])
            ptr = cgutils.get_item_pointer(context, builder, sty, ary, [r, c], wraparound=False)
            fnty = ir.FunctionType(ir.LiteralStructType([_I32] * n_words), [ptr.type])
            asm = ir.InlineAsm(
                fnty, f"ld.global.nc.v{n_words}.b32 {{{regs}}}, [${n_words}];", "=r," * n_words + "l"
            )
            res = builder.call(asm, [ptr])
            parts = [builder.extract_value(res, i) for i in range(n_words)]
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    @intrinsic
    def ldg64(typingctx, src, row, col):  # noqa: ANN001, ANN201
        """The 8 bytes from src[row, col] of a 2-D C-contiguous uint8 / int8 / uint32 / float16 array
        (8-byte aligned) as two int32 words, low bytes first: one ld.global.nc.v2.b32 (the
        weights are read-only while a kernel runs)."""
        return _ldg_words(2, src, row, col)

    @intrinsic
    def ldg128w(typingctx, src, row, col):  # noqa: ANN001, ANN201
        """The 16 bytes from src[row, col] of a 2-D C-contiguous uint8 / int8 / uint32 / float16 array
        (16-byte aligned) as four int32 words, low bytes first: one ld.global.nc.v4.b32."""
        return _ldg_words(4, src, row, col)

    def _ptx_void(text: str, doc: str) -> object:
        """A no-argument intrinsic that emits the PTX instruction `text` (a memory fence for
        the compiler: nothing is moved across it)."""

        def impl(typingctx: object) -> object:
            def codegen(context: object, builder: object, sig: object, args: object) -> object:
                fnty = ir.FunctionType(ir.VoidType(), [])
                builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()

            return types.void(), codegen

        impl.__doc__ = doc
        return intrinsic(impl)

    cp_async_commit = _ptx_void(
        "cp.async.commit_group;",
        "Close the group of this thread's cp.async copies issued since the last commit.",
    )
    cp_async_wait_all = _ptx_void(
        "cp.async.wait_group 0;",
        "Wait until all of this thread's committed cp.async groups have landed (then a barrier "
        "makes every thread's copies visible to the block).",
    )
    cp_async_wait_one = _ptx_void(
        "cp.async.wait_group 1;",
        "Wait until all but the newest of this thread's committed cp.async groups have landed.",
    )

    def ptx_counted(text: str, doc: str) -> object:
        """A function of a constant n -> the no-argument intrinsic that emits text.format(n)
        (doc.format(n) its docstring), one an n (the wait_group instructions)."""
        made: dict[int, object] = {}

        def of(n: int) -> object:
            if n not in made:
                made[n] = _ptx_void(text.format(int(n)), doc.format(n))
            return made[n]

        return of

    cp_async_wait = ptx_counted(
        "cp.async.wait_group {};",
        "Wait until all but the {} newest of this thread's committed cp.async groups have landed.",
    )

    @intrinsic
    def sts128(typingctx, smem, word, w0, w1, w2, w3):  # noqa: ANN001, ANN201
        """Store four int32 words at smem[word:word+4] in one 16-byte shared store (word a
        multiple of 4)."""
        if not _is_word_array(smem):
            return None
        sig = types.void(smem, word, w0, w1, w2, w3)

        def codegen(context: object, builder: object, sig: object, args: object) -> object:
            addr = _shared_word_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            ws = [
                context.cast(builder, v, t, types.int32) for v, t in zip(args[2:], sig.args[2:], strict=True)
            ]
            fnty = ir.FunctionType(ir.VoidType(), [_I32] * 5)
            asm = ir.InlineAsm(
                fnty, "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r,~{memory}", side_effect=True
            )
            builder.call(asm, [addr, *ws])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def lds128(typingctx, smem, word):  # noqa: ANN001, ANN201
        """Four int32 words smem[word:word+4] in one 16-byte shared load (word a multiple of 4)."""
        return _shared_load4(smem, word, "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];")

    @intrinsic
    def pack_f16x2(typingctx, lo, hi):  # noqa: ANN001, ANN201
        """Two float32 rounded to fp16 (to nearest even) in one int32 word, lo in the low half:
        one cvt.rn.f16x2.f32 (whose first source goes to the upper half)."""
        sig = types.int32(lo, hi)

        def codegen(context: object, builder: object, sig: object, args: object) -> object:
            lo_v = context.cast(builder, args[0], sig.args[0], types.float32)
            hi_v = context.cast(builder, args[1], sig.args[1], types.float32)
            fn = ir.InlineAsm(ir.FunctionType(_I32, [_F32, _F32]), "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f")
            return builder.call(fn, [hi_v, lo_v])

        return sig, codegen
