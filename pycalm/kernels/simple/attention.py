"""Grouped-query attention of T query rows over the KV cache: a block a (head, row).

Reference: pycalm.cpu.reference.attention_ref (one row), prefill_attention_ref (T rows). Row t
is at position pos = state[STATE_POS] + t and sees the cached positions start .. pos (start =
pos + 1 - window with a sliding window, else 0). Query head h reads kv head h // group (group =
n_heads / n_kv_heads: the query heads of a group share one K and V):

    score_j = q_h . k_j / sqrt(head_dim);   p = softmax(score);   out_h = sum_j p_j v_j

Thread mapping: grid (n_heads, T). 1. thread i computes the scores of positions start + i,
start + i + threads, ... (a dot product of head_dim each) into scores[t, h, j]; 2. the block
finds their max and the sum of exp(score - max) (block_reduce_max / _sum), each thread turning
its own scores into exp(score - max) on the way; 3. thread d sums p_j v_j[d] over the positions
for its dimensions d of the head. `scores` is (T, n_heads, seq_len) float32 in global memory
(llama2.c's `att`); `out` is float32, or float16 for the prompt's rows (wo's matmul reads it).

Bytes moved: K and V rows of the attended positions (2 x n x head_dim x bytes each, a block a
query head: a group's heads read the same rows, from L2 after the first), q, the scores written
and read twice, out. The fast kernel (pycalm.kernels.attention) keeps the scores in shared
memory, splits long contexts over many blocks and issues every K and V load before any math.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32

from pycalm.kernels.common import STATE_POS, WARP, block_reduce_max, block_reduce_sum
from pycalm.kernels.simple.decode import DECODE


@functools.cache
def attention_kernel(kv_dtype: str) -> object:
    """The kernel for one KV cache format: its elements decode as fp16 or fp8 weights do."""
    decode = DECODE[kv_dtype]

    @cuda.jit(cache=True)
    def attention_kernel(q, k_cache, v_cache, state, scores, out, head_dim, group, window):  # noqa: ANN001, ANN202
        h, t = cuda.blockIdx.x, cuda.blockIdx.y
        tid, threads = cuda.threadIdx.x, cuda.blockDim.x
        scratch = cuda.shared.array(WARP, float32)  # the block reductions'
        pos = state[STATE_POS] + t
        start = max(0, pos + 1 - window) if window > 0 else 0
        qh, kh = h * head_dim, (h // group) * head_dim  # the head's first column in q, in the cache
        m = float32(-math.inf)
        for j in range(start + tid, pos + 1, threads):  # 1. scores
            s = float32(0.0)
            for d in range(head_dim):
                s += q[t, qh + d] * decode(k_cache, k_cache, j, kh + d)
            scores[t, h, j] = s / math.sqrt(float32(head_dim))
            m = max(m, scores[t, h, j])
        m = block_reduce_max(m, scratch)  # 2. softmax: the max over the block (barriers inside)
        total = float32(0.0)
        for j in range(start + tid, pos + 1, threads):  # (the thread's own scores: no barrier)
            p = math.exp(scores[t, h, j] - m)
            scores[t, h, j] = p
            total += p
        total = block_reduce_sum(total, scratch)  # its barriers also publish every thread's p
        for d in range(tid, head_dim, threads):  # 3. out = sum_j p_j v_j / total
            acc = float32(0.0)
            for j in range(start, pos + 1):
                acc += scores[t, h, j] * decode(v_cache, v_cache, j, kh + d)
            out[t, qh + d] = acc / total

    return attention_kernel


def attention(
    q: object, cache: object, state: object, scores: object, out: object, cfg: object, *, stream: object
) -> None:
    """out (T, q_dim) float32 or float16 = attention of q (T, q_dim) float32 over cache (a
    pycalm.kernels.attention.KVCache); scores (>= T, n_heads, seq_len) float32 scratch; cfg:
    n_heads, n_kv_heads, head_dim, sliding_window. Threads: the cache's positions rounded up to
    a warp, at most 128."""
    threads = min(128, WARP * -(-cache.k.shape[0] // WARP))
    group = cfg.n_heads // cfg.n_kv_heads
    attention_kernel(cache.dtype)[(cfg.n_heads, q.shape[0]), threads, stream](
        q, cache.k, cache.v, state, scores, out, cfg.head_dim, group, cfg.sliding_window
    )
