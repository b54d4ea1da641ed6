"""QKV projection fused with bias, RoPE and the KV-cache write.

qkv = Wqkv x (+ bqkv)            rows: q (n_heads * head_dim), k, v (n_kv_heads * head_dim each)
q, k rotated in interleaved pairs: for i < rotary_dim / 2, with a = pos * freqs[i],
    (x[2i], x[2i+1]) -> (x[2i] cos a - x[2i+1] sin a, x[2i] sin a + x[2i+1] cos a)
k, v written to the caches at row `pos`; q goes to the attention step.
"""

from __future__ import annotations

import numpy as np

from pycalm.kernels.matvec import matvec_ref


def rope_ref(x: np.ndarray, pos: int, freqs: np.ndarray, head_dim: int) -> np.ndarray:
    """x: (n_heads * head_dim,) float32, freqs: (rotary_dim // 2,) float32 -> rotated copy."""
    out = x.astype(np.float32).reshape(-1, head_dim).copy()
    half = freqs.shape[0]
    angle = np.float32(pos) * freqs.astype(np.float32)  # (rotary_dim // 2,) float32, as the GPU does
    c, s = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    x0 = out[:, 0 : 2 * half : 2].copy()
    x1 = out[:, 1 : 2 * half : 2].copy()
    out[:, 0 : 2 * half : 2] = x0 * c - x1 * s
    out[:, 1 : 2 * half : 2] = x0 * s + x1 * c
    return out.reshape(-1)


def qkv_ref(
    wqkv: np.ndarray,
    bqkv: np.ndarray | None,
    x: np.ndarray,
    dtype: str,
    pos: int,
    freqs: np.ndarray,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> q (n_heads*head_dim,), k, v (n_kv_heads*head_dim,), float32; q and k rotated."""
    qkv = matvec_ref(wqkv, x, dtype)
    if bqkv is not None:
        qkv = qkv + bqkv.astype(np.float32)
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    q = rope_ref(qkv[:q_dim], pos, freqs, head_dim)
    k = rope_ref(qkv[q_dim : q_dim + kv_dim], pos, freqs, head_dim)
    v = qkv[q_dim + kv_dim :].astype(np.float32)
    return q, k, v


# =============================================================================================
# GPU kernel: RMSNorm + QKV matvec + bias + RoPE + KV-cache write, one launch
#
# Thread mapping: the row-pair matvec of pycalm.kernels.matvec (one warp, rows 2p and 2p + 1 of
# Wqkv, x = rmsnorm(x) * norm_w staged in shared memory). head_dim is even, so a pair never
# straddles a head and is exactly one rotary pair (i = (row % head_dim) / 2): the warp holds
# both values after its reduction and rotates them with no barrier. Lane 0 writes q, or
# encodes k / v to the cache dtype and writes them at row pos = state[STATE_POS].
#
# Bytes moved: Wqkv, x, norm_w, the bias, q written (4 q_dim) and one cache row of k and v.
# =============================================================================================

from numba import cuda, float32, uint8  # noqa: E402

from pycalm.kernels.common import STATE_POS, WARP, fp8_encode, fp16_encode, sincos, warp_reduce_sum  # noqa: E402
from pycalm.kernels.matvec import (  # noqa: E402
    N_WARPS,
    ROW_SCALE,
    WORD_WEIGHTS,
    XCHUNK,
    grid_for,
    make_pair_dot,
    make_stage_x,
    rms_factor,
    word_view,
)


def _make_qkv_kernel(word_dtype: str, kv_dtype: str, has_bias: bool):  # noqa: ANN202
    pair_dot = make_pair_dot(word_dtype)
    stage_x = make_stage_x(word_dtype, True)
    e_w = WORD_WEIGHTS[word_dtype]
    row_scale = ROW_SCALE[word_dtype]
    fp8_kv = kv_dtype == "fp8"

    @cuda.jit
    def qkv_rope_kernel(w, bias, x, norm_w, eps, freqs, state, q, k_cache, v_cache, q_dim, kv_dim, head_dim):  # noqa: ANN001, ANN202
        xs = cuda.shared.array(XCHUNK, float32)  # x chunk, transposed by word
        scratch = cuda.shared.array(32, float32)  # block reduction
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        n_warps = cuda.blockDim.x // WARP
        rows = w.shape[0]
        cols = x.shape[0]
        n_pairs = rows // 2
        n_chunks = (cols + XCHUNK - 1) // XCHUNK
        pos = state[STATE_POS]
        scale = float32(row_scale) * rms_factor(x, eps, scratch)
        per_round = cuda.gridDim.x * n_warps
        n_rounds = (n_pairs + per_round - 1) // per_round  # the same for every warp: barriers
        for rnd in range(n_rounds):
            p = rnd * per_round + cuda.blockIdx.x * n_warps + warp
            r0 = 2 * p
            acc_a = float32(0.0)
            acc_b = float32(0.0)
            for c in range(n_chunks):
                if rnd == 0 or n_chunks > 1:
                    c0 = c * XCHUNK
                    cuda.syncthreads()  # every warp is done with the previous chunk of xs
                    stage_x(x, norm_w, xs, c0, min(XCHUNK, cols - c0))
                    cuda.syncthreads()  # xs holds this chunk for every warp
                if p < n_pairs:
                    j0 = c * (XCHUNK // e_w)
                    n_words = min(XCHUNK // e_w, w.shape[1] - j0)
                    da, db = pair_dot(w, r0, w, r0 + 1, xs, j0, n_words, lane)
                    acc_a += da
                    acc_b += db
            if p < n_pairs:
                a = warp_reduce_sum(acc_a) * scale  # row r0, every lane has it
                b = warp_reduce_sum(acc_b) * scale  # row r0 + 1
                if lane == 0:
                    if has_bias:
                        a += bias[r0]
                        b += bias[r0 + 1]
                    i = (r0 % head_dim) // 2  # the rotary pair within the head
                    if r0 < q_dim + kv_dim and i < freqs.shape[0]:
                        angle = float32(pos) * freqs[i]
                        sn, cs = sincos(angle)
                        a, b = a * cs - b * sn, a * sn + b * cs
                    if r0 < q_dim:
                        q[r0] = a
                        q[r0 + 1] = b
                    else:
                        if r0 < q_dim + kv_dim:
                            c = r0 - q_dim
                            cache = k_cache
                        else:
                            c = r0 - q_dim - kv_dim
                            cache = v_cache
                        if fp8_kv:
                            cache[pos, c] = uint8(fp8_encode(a))
                            cache[pos, c + 1] = uint8(fp8_encode(b))
                        else:
                            cache[pos, c] = fp16_encode(a)
                            cache[pos, c + 1] = fp16_encode(b)

    return qkv_rope_kernel


QKV_KERNELS = {
    (wd, kv, bias): _make_qkv_kernel(wd, kv, bias)
    for wd in WORD_WEIGHTS
    for kv in ("fp16", "fp8")
    for bias in (False, True)
}


def qkv_rope(
    wqkv: object,
    bqkv: object,
    x: object,
    norm_w: object,
    eps: float,
    rope_freqs: object,
    state: object,
    q: object,
    k_cache: object,
    v_cache: object,
    dtype: str,
    kv_dtype: str,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    *,
    stream: object,
) -> int:
    """q = rope(Wq xn + bq); k_cache[pos] = enc(rope(Wk xn + bk)); v_cache[pos] = enc(Wv xn + bv).

    wqkv: stored (q_dim + 2 kv_dim, dim); bqkv (q_dim + 2 kv_dim,) float32 or None; x, norm_w
    (dim,) float32; rope_freqs (rotary_dim // 2,) float32; state int32 (pos = state[STATE_POS]);
    q (q_dim,) float32; caches (seq_len, kv_dim) float16 ("fp16") or uint8 ("fp8").
    -> bytes moved.
    """
    if kv_dtype not in ("fp16", "fp8"):
        raise ValueError(f"unknown KV-cache dtype {kv_dtype!r}")
    wv, wd = word_view(wqkv, dtype)
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    rows = wqkv.shape[0]
    assert rows == q_dim + 2 * kv_dim and head_dim % 2 == 0
    has_bias = bqkv is not None
    kernel = QKV_KERNELS[(wd, kv_dtype, has_bias)]
    blocks = grid_for(rows // 2, x.shape[0])
    kernel[blocks, N_WARPS * WARP, stream](
        wv, bqkv if has_bias else x, x, norm_w, np.float32(eps), rope_freqs, state, q, k_cache, v_cache,
        q_dim, kv_dim, head_dim,
    )  # fmt: skip
    kv_row = 2 * kv_dim * k_cache.dtype.itemsize
    extra = int(bqkv.nbytes) if has_bias else 0
    return int(wqkv.nbytes) + int(x.nbytes) + int(norm_w.nbytes) + extra + 4 * q_dim + kv_row


_SIG_WORD = {"fp16": "uint64", "fp8": "uint64", "gf4": "uint64", "gf4w": "uint32"}
_SIG_KV = {"fp16": "float16", "fp8": "uint8"}
COMPILE_CHECK = [
    (
        k,
        f"void({_SIG_WORD[wd]}[:, ::1], float32[::1], float32[::1], float32[::1], float32, float32[::1], "
        f"int32[::1], float32[::1], {_SIG_KV[kv]}[:, ::1], {_SIG_KV[kv]}[:, ::1], int64, int64, int64)",
    )
    for (wd, kv, _bias), k in QKV_KERNELS.items()
]
