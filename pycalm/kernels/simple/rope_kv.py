"""RoPE and the KV-cache write: q and k rotated by their position, k and v stored in the cache.

Reference: pycalm.cpu.reference.qkv_ref / qkv_rows_ref (bias, rope_ref) and kv_round (the cache's
rounding). qkv[t] = Wqkv xb[t] holds q (n_heads heads), k and v (n_kv_heads heads each) side by
side; row t is at position pos = state[STATE_POS] + t. For a pair (x0, x1) = (x[2i], x[2i + 1])
of a head, i < rotary_dim / 2, and the angle a = pos * freqs[i]:

    (x0, x1) -> (x0 cos a - x1 sin a,  x0 sin a + x1 cos a)

Thread mapping: grid (ceil(qkv_dim / 2 / threads), T); thread j of row t takes columns 2j and
2j + 1 (a pair never straddles q, k and v: each is whole heads of even head_dim), adds the bias
(Qwen2), rotates q and k pairs, and writes q to `q`, k and v to cache row pos, rounded to the
cache's format (common.fp16_encode, fp8_encode: the bit-exact twins of formats.encode).

Bytes moved: qkv, the bias and freqs read; q (float32) and a K and a V row written.
"""

from __future__ import annotations

import functools

from numba import cuda, float32

from pycalm.kernels.common import STATE_POS, fp8_encode, fp16_encode, sincos

THREADS = 128


@functools.cache
def rope_kv_kernel(kv_dtype: str) -> object:
    """The kernel for one KV cache format (fp16 or fp8)."""
    encode = fp16_encode if kv_dtype == "fp16" else fp8_encode

    @cuda.jit(cache=True)
    def rope_kv_kernel(qkv, bias, has_bias, freqs, state, q, k_cache, v_cache, head_dim):  # noqa: ANN001, ANN202
        c = 2 * cuda.grid(1)  # the pair's first column
        t = cuda.blockIdx.y
        q_dim, kv_dim = q.shape[1], k_cache.shape[1]
        if c >= qkv.shape[1]:
            return
        pos = state[STATE_POS] + t
        x0, x1 = qkv[t, c], qkv[t, c + 1]
        if has_bias:
            x0, x1 = x0 + bias[c], x1 + bias[c + 1]
        i = (c % head_dim) // 2  # the pair's index in its head
        if c < q_dim + kv_dim and i < freqs.shape[0]:  # a q or k pair, in the rotated part
            sin, cos = sincos(float32(pos) * freqs[i])
            x0, x1 = x0 * cos - x1 * sin, x0 * sin + x1 * cos
        if c < q_dim:
            q[t, c], q[t, c + 1] = x0, x1
        elif c < q_dim + kv_dim:
            k_cache[pos, c - q_dim], k_cache[pos, c - q_dim + 1] = encode(x0), encode(x1)
        else:
            v_cache[pos, c - q_dim - kv_dim], v_cache[pos, c - q_dim - kv_dim + 1] = encode(x0), encode(x1)

    return rope_kv_kernel


def rope_kv(
    qkv: object,
    bias: object,
    freqs: object,
    state: object,
    q: object,
    cache: object,
    head_dim: int,
    *,
    stream: object,
) -> None:
    """q (T, q_dim) float32 and cache rows pos .. pos + T - 1 from qkv (T, q_dim + 2 kv_dim)
    float32 (+ bias (qkv_dim,) float32, or None); freqs (rotary_dim / 2,) float32; state: pos
    at STATE_POS; cache: a pycalm.kernels.attention.KVCache (k, v (seq_len, kv_dim), fp16 or fp8)."""
    has_bias, pairs = bias is not None, qkv.shape[1] // 2
    threads = min(THREADS, 32 * -(-pairs // 32))
    rope_kv_kernel(cache.dtype)[(-(-pairs // threads), qkv.shape[0]), threads, stream](
        qkv, bias if has_bias else freqs, has_bias, freqs, state, q, cache.k, cache.v, head_dim
    )
