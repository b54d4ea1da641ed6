"""Log-probabilities on the GPU: the sampled token's, and the K most likely tokens'.

The reference is pycalm.cpu.reference.logprobs_ref: log p_i = l_i - logsumexp(l) over the raw
logits l (vocab_size,) (before temperature), and the top K by descending logit, lower id first
on ties. The kernel runs inside the token step after the sampler (it reads the chosen token from
state[STATE_TOKEN]) and writes out (OUT_SIZE,) int32, the host subtracting in float64:
  out[0]              logsumexp(l), float32 bits
  out[1]              l[token], float32 bits
  out[2 .. 2+K]       the top K ids, by descending logit, lower id first on ties
  out[2+K .. 2+2K]    their logits, float32 bits
K = MAX_TOP_LOGPROBS (20) is a compile-time constant; a request for fewer takes a prefix.

One block of THREADS threads reads the logits once. Thread t takes ids t, t + THREADS, ...
(ascending), and keeps:
  * a running (max m_t, sum s_t of exp(l - m_t)): on a larger logit the sum is rescaled
    (online logsumexp), so one read gives both;
  * its own best K (value, id) pairs, sorted, in its column of shared memory (list[r, t], rank
    r: consecutive threads in consecutive banks); a logit enters by insertion when it beats the
    K-th (_beats: larger logit, then lower id).
Then the block merges the columns in K rounds: each thread offers the head of its column, a block
argmax (pycalm.kernels.argmax's pair reduction: larger value, then lower id) picks the winner,
and the thread that offered it moves its head on. The winner of round 0 is the maximum M; each
thread scales its sum to M (s_t exp(m_t - M)) and a block sum gives logsumexp = M + log(sum).
Empty slots hold (-inf, vocab_size), which lose to every real logit, -inf included (a row of
fewer than K finite logits lists -inf ones by id, as the reference does); NaN logits are never
kept and add nothing.

Bytes moved: vocab_size * 4 (the logits, once) and OUT_SIZE * 4. Shared memory: 2 * K * THREADS
* 4 = 40 KB at 256 threads. Launched only when a caller asks for logprobs (a step variant of its
own): one block, latency-bound, a few microseconds at 128k logits.
"""

from __future__ import annotations

import math

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32

from pycalm.cpu.reference import MAX_TOP_LOGPROBS, TokenLogprobs
from pycalm.kernels.argmax import _block_best
from pycalm.kernels.common import STATE_TOKEN, as_f32, as_i32, block_reduce_sum, dependent_start

K = MAX_TOP_LOGPROBS
OUT_SIZE = 2 + 2 * K  # (logsumexp, chosen logit, K ids, K logits)
# threads of the block: 256 keep the shared lists at 40 KB (under the 48 KB of static shared
# memory); the simulator runs a Python thread a GPU thread, so fewer there
THREADS = 64 if _numba_config.ENABLE_CUDASIM else 256


@cuda.jit(device=True, inline=True)
def _beats(v, i, w, j):  # noqa: ANN001, ANN202
    """Whether (v, i) comes before (w, j) in the order: larger logit, then lower id (a thread's
    later logit has a higher id than those it keeps, so it beats only the empty slots' id n among
    equals). NaN beats nothing."""
    return v > w or (v == w and i < j)


@cuda.jit(cache=True)
def logprobs_kernel(logits, state, out):  # noqa: ANN001, ANN201
    """One block of THREADS threads: out <- (logsumexp, logits[state[STATE_TOKEN]], top K ids,
    their logits) as the module docstring lays out."""
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    top_v = cuda.shared.array((K, THREADS), float32)  # (K, THREADS) each column a thread's best, sorted
    top_i = cuda.shared.array((K, THREADS), int32)  # (K, THREADS) their ids
    warp_v = cuda.shared.array(32, float32)  # (32,) the block argmax's per-warp pairs
    warp_i = cuda.shared.array(32, int32)  # (32,)
    win = cuda.shared.array(2, int32)  # (2,) the round's winner: value bits, id
    scratch = cuda.shared.array(32, float32)  # (32,) block_reduce_sum's partials
    n = logits.shape[0]
    t = cuda.threadIdx.x
    neg_inf = float32(-math.inf)
    for r in range(K):
        top_v[r, t] = neg_inf
        top_i[r, t] = int32(n)
    # 1. one pass: this thread's online (max, sum of exp) and its best K, ids ascending
    m = neg_inf
    s = float32(0.0)
    for i in range(t, n, THREADS):
        v = logits[i]
        if v > m:
            s = s * math.exp(m - v) + float32(1.0)  # m = -inf: s is 0 and exp(-inf) = 0
            m = v
        elif v > neg_inf:  # (v = m = -inf would give exp(nan))
            s += math.exp(v - m)
        if _beats(v, i, top_v[K - 1, t], top_i[K - 1, t]):
            r = K - 1
            while r > 0 and _beats(v, i, top_v[r - 1, t], top_i[r - 1, t]):  # shift the worse ones down
                top_v[r, t] = top_v[r - 1, t]
                top_i[r, t] = top_i[r - 1, t]
                r -= 1
            top_v[r, t] = v
            top_i[r, t] = int32(i)
    # 2. K rounds of a block argmax over the columns' heads
    head = 0
    big = neg_inf  # the maximum M, the winner of round 0
    for r in range(K):
        v = top_v[head, t] if head < K else neg_inf
        i = top_i[head, t] if head < K else int32(n)
        best_v, best_i = _block_best(v, i, warp_v, warp_i, n)  # (a barrier inside)
        if t == 0:
            win[0] = as_i32(best_v)
            win[1] = best_i
            out[2 + r] = best_i
            out[2 + K + r] = as_i32(best_v)
        cuda.syncthreads()  # the winner is in win; warp 0 has read warp_v / warp_i
        if head < K and i == win[1]:  # ids are unique but for the empty slots' n (all -inf)
            head += 1
        if r == 0:
            big = as_f32(win[0])
        cuda.syncthreads()  # everyone has read win before the next round writes it
    # 3. logsumexp = M + log(sum over the threads of s_t exp(m_t - M))
    part = s * math.exp(m - big) if m > neg_inf else float32(0.0)
    total = block_reduce_sum(part, scratch)
    if t == 0:
        out[0] = as_i32(big + math.log(total) if big > neg_inf else neg_inf)
        out[1] = as_i32(logits[state[STATE_TOKEN]])


def logprobs(logits: object, state: object, out: object, *, stream: object) -> None:
    """out (OUT_SIZE,) int32 <- the logsumexp of logits (vocab_size,) float32, the logit of the
    token state[STATE_TOKEN], and the top K ids and logits (module docstring)."""
    logprobs_kernel[1, THREADS, stream](logits, state, out)


def token_logprobs(out: np.ndarray, token: int, k: int) -> TokenLogprobs:
    """The host's side: a copy of out (OUT_SIZE,) int32 -> the token's TokenLogprobs with its top
    k (0 <= k <= K), subtracted in float64 (what logprobs_ref returns)."""
    bits = np.asarray(out, np.int32)
    floats = bits.view(np.float32).astype(np.float64)
    lse = floats[0]
    return TokenLogprobs(
        int(token),
        float(floats[1] - lse),
        [int(i) for i in bits[2 : 2 + k]],
        [float(v - lse) for v in floats[2 + K : 2 + K + k]],
    )
