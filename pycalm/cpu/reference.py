"""The whole forward pass in NumPy, in order: the specification of every GPU kernel, and the CPU
engine. Read it first; it is pycalm's run.c.

Each `<op>_ref` function is what the GPU kernel of the same name (`<op>_kernel`, launched by
`<op>` in pycalm/kernels/) computes, and the kernel's tests compare the two. The sections follow
one token through the model:

    embedding        x = tok_embeddings[token]                          embed_ref
    attention block  xb = rmsnorm(x) * attn_norm                        rmsnorm_ref
                     q, k, v = Wqkv xb (+ bqkv), q and k rotated        qkv_ref, rope_ref
                     att = softmax(q k^T / sqrt(head_dim)) v            attention_ref
                     x += Wo att                                        matvec_residual_ref
    FFN block        xb = rmsnorm(x) * ffn_norm
                     h = silu(W1 xb) * (W3 xb)                          ffn_gate_ref
                     x += W2 h                                          matvec_residual_ref
    (MoE: the router picks experts, each one's FFN weighted)            moe_*_ref
    classifier       logits = Wcls rmsnorm(x) * norm                    matvec_ref
    (a request's penalties and logit bias change them for the sampler)  penalties_ref
    (embeddings: the rows rmsnorm(x) * norm pooled, L2-normalised)      embed_pool_ref
    sampling         the next token from the logits                     sample_ref
                     its log-probability and the k most likely tokens'  logprobs_ref
    speculation      a drafted token kept, or drawn anew               speculative_accept_ref
    advance          what the next step feeds, at which position       advance_ref
                     (batched, run ahead: the tokens still on the device) feed_tokens_ref

Beside a step's one-token reference stands its form for T tokens at once (the prefill:
`*_rows_ref`, `matmul*_ref`, `prefill_attention_ref`, `moe_group_ref`). The CPU engine runs
both: ReferenceEngine.forward a token, ReferenceEngine.forward_rows a prompt's rows. Batched
serving (M sequences advanced a token each) reads a paged cache: `batch_attention_ref`.

Weights come as stored by pycalm.model.formats (`dtype` "fp16", "fp8", "gf4", or "q8" and "q4" as a
formats.Quantized; each matrix's dtype is config.dtype_of(name)) and are decoded with it; "fp32"
is a matrix already decoded to float32 (the engine decodes each once). Activations are
float32; the q8 and q4 matvecs multiply x rounded to 16-bit integers, a scale a group of 32
columns (x_int16_ref; the CPU engine, on decoded weights, multiplies x as it is). This module
imports no numba: the CPU engine runs without it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pycalm.errors import PycalmError
from pycalm.model import formats
from pycalm.model.config import KV_DTYPES, ModelConfig

# =============================================================================================
# embedding and RMSNorm


def embed_ref(table: np.ndarray | formats.Quantized, token: int, dtype: str) -> np.ndarray:
    """table: stored (vocab_size, dim) in `dtype` -> (dim,) float32."""
    return formats.decode(formats.take_rows(table, token), dtype).astype(np.float32)


def rmsnorm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w; x, w: (dim,) float32 -> (dim,) float32."""
    x = x.astype(np.float32)
    ms = np.float32(np.mean(x * x, dtype=np.float32))
    return (x * np.float32(1.0 / np.sqrt(ms + np.float32(eps))) * w).astype(np.float32)


def embed_rows_ref(table: np.ndarray | formats.Quantized, tokens: np.ndarray, dtype: str) -> np.ndarray:
    """T tokens at once (prefill): tokens (T,) int -> (T, dim) float32, row t embed_ref(tokens[t])."""
    return formats.decode(formats.take_rows(table, np.asarray(tokens)), dtype).astype(np.float32)


def rmsnorm_rows_ref(x: np.ndarray, w: np.ndarray, eps: float, fp16: bool = True) -> np.ndarray:
    """rmsnorm_ref of each row of x (T, dim) float32 -> (T, dim) float16: the tensor-core
    matmuls' input, rounded to nearest even (formats.fp16_encode); fp16=False: float32, the
    CPU engine's matrix products' input."""
    x = x.astype(np.float32)
    ms = np.mean(x * x, axis=1, keepdims=True, dtype=np.float32)  # (T, 1)
    y = x * (np.float32(1.0) / np.sqrt(ms + np.float32(eps))) * w  # (T, dim) float32
    return formats.fp16_encode(y) if fp16 else y.astype(np.float32, copy=False)


# =============================================================================================
# matrix-vector products and their fusions


X_GROUP = 32  # columns of x that share a scale in the q8 / q4 matvecs (pycalm.kernels.qdecode)
X_INT16_MAX = 32639  # the largest |X| of x's 16-bit form (127 * 256 + 127: two signed bytes)


def x_int16_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (cols,) float32 -> (X int32 (cols,), s float32 (groups,)): in each group of X_GROUP
    columns (the last one may be shorter) s = max |x| / X_INT16_MAX and X = round(x / s) (half
    up), so that s X is x to within s / 2. The q8 and q4 matvecs multiply their integer codes by
    X (pycalm.kernels.qdecode)."""
    x = np.asarray(x, np.float32)
    cols = x.shape[0]
    pad = np.zeros(-(-cols // X_GROUP) * X_GROUP, np.float32)
    pad[:cols] = x
    g = pad.reshape(-1, X_GROUP)
    a = np.abs(g).max(axis=1)  # (groups,) float32
    with np.errstate(divide="ignore"):
        inv = np.where(a > 0, np.float32(X_INT16_MAX) / a, np.float32(0)).astype(np.float32)
    s = (a / np.float32(X_INT16_MAX)).astype(np.float32)
    xi = np.floor(g * inv[:, None] + np.float32(0.5)).astype(np.int32)
    return xi.reshape(-1)[:cols], s


def matvec_x_ref(x: np.ndarray, dtype: str) -> np.ndarray:
    """The x a matvec of `dtype` multiplies: q8, q4 s X (x_int16_ref, float64); else x."""
    if dtype not in ("q8", "q4"):
        return x.astype(np.float32)
    xi, s = x_int16_ref(x)
    return xi * np.repeat(s.astype(np.float64), X_GROUP)[: x.shape[0]]


def matvec_ref(w: np.ndarray, x: np.ndarray, dtype: str) -> np.ndarray:
    """y = W x; w: stored (rows, cols) in `dtype`, x: (cols,) float32 -> (rows,) float32. q8
    and q4 take x in 16-bit integers (matvec_x_ref)."""
    return (formats.decode(w, dtype) @ matvec_x_ref(x, dtype)).astype(np.float32)


def matvec_residual_ref(w: np.ndarray, x: np.ndarray, dtype: str, residual: np.ndarray) -> np.ndarray:
    """residual + W x: the residual add fused into the product (wo, w2)."""
    return (residual + matvec_ref(w, x, dtype)).astype(np.float32)


def silu_ref(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x)."""
    return (x / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


def ffn_gate_ref(w1: np.ndarray, w3: np.ndarray, x: np.ndarray, dtype: str) -> np.ndarray:
    """silu(W1 x) * (W3 x): (hidden_dim,) float32, the SiLU gate fused into w1 / w3."""
    return (silu_ref(matvec_ref(w1, x, dtype)) * matvec_ref(w3, x, dtype)).astype(np.float32)


# matrix products for T tokens (the multi-token forward; pycalm.kernels.matmul on the GPU)


def matmul_ref(x: np.ndarray, w: np.ndarray, dtype: str, scale: np.ndarray | None = None) -> np.ndarray:
    """Y = X W^T; x: (T, K) float16 (or float32) activations, w: stored (N, K) in `dtype` -> (T,
    N) float32; scale (T,): row t of Y times scale[t] (X written by matmul_residual_fold_ref)."""
    y = (x.astype(np.float32, copy=False) @ formats.decode(w, dtype).T).astype(np.float32, copy=False)
    return y if scale is None else (y * scale[:, None].astype(np.float32)).astype(np.float32)


def matmul_residual_ref(x: np.ndarray, w: np.ndarray, dtype: str, residual: np.ndarray) -> np.ndarray:
    """residual (T, N) float32 + X W^T: the residual add fused into the product (wo, w2)."""
    return (residual + matmul_ref(x, w, dtype)).astype(np.float32)


def matmul_residual_fold_ref(
    x: np.ndarray,
    w: np.ndarray,
    dtype: str,
    residual: np.ndarray,
    norm_w: np.ndarray,
    rho: np.ndarray,
    eps: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """matmul_residual_ref with the next RMSNorm folded in (the rows pass's wo and w2): y =
    residual + X W^T (T, N) float32; rms (T,) = rsqrt(mean(y^2) + eps); xb = fp16(y norm_w rho)
    (T, N), y at the scale rho (T,) of the last norm; scale = rms / rho (T,). The next product's
    matmul_ref(xb, W', scale) is matmul_ref(rmsnorm_rows_ref(y, norm_w), W') up to the fp16
    rounding of xb. -> (y, xb, rms, scale)."""
    y = matmul_residual_ref(x, w, dtype, residual)
    ms = np.mean(y.astype(np.float64) ** 2, axis=1)  # (T,)
    rms = (1.0 / np.sqrt(ms + eps)).astype(np.float32)
    rho = rho.astype(np.float32)
    xb = formats.fp16_encode(y * norm_w.astype(np.float32) * rho[:, None])
    return y, xb, rms, (rms / rho).astype(np.float32)


def matmul_gate_ref(
    x: np.ndarray,
    w1: np.ndarray,
    w3: np.ndarray,
    dtype: str,
    fp16: bool = True,
    scale: np.ndarray | None = None,
) -> np.ndarray:
    """silu(X W1^T) * (X W3^T) -> (T, hidden_dim) float16 (w2's activations), saturating;
    fp16=False: float32 (the CPU engine's); scale as matmul_ref's, on both products."""
    h = silu_ref(matmul_ref(x, w1, dtype, scale)) * matmul_ref(x, w3, dtype, scale)  # (T, hidden_dim) float32
    return formats.fp16_encode(h) if fp16 else h


# =============================================================================================
# QKV projection and RoPE


def rope_ref(x: np.ndarray, pos: int, freqs: np.ndarray, head_dim: int) -> np.ndarray:
    """Rotate the interleaved pairs of each head: for i < rotary_dim / 2 and a = pos * freqs[i],
    (x[2i], x[2i+1]) -> (x[2i] cos a - x[2i+1] sin a, x[2i] sin a + x[2i+1] cos a).

    x: (n_heads * head_dim,) float32, freqs: (rotary_dim // 2,) float32 -> rotated copy."""
    out = x.astype(np.float32).reshape(-1, head_dim).copy()  # (n_heads, head_dim)
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
    """qkv = Wqkv x (+ bqkv), rows q (n_heads * head_dim), k, v (n_kv_heads * head_dim each);
    -> q, k, v float32 with q and k rotated (rope_ref)."""
    qkv = matvec_ref(wqkv, x, dtype)  # (q_dim + 2 kv_dim,)
    if bqkv is not None:
        qkv = qkv + bqkv.astype(np.float32)
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    q = rope_ref(qkv[:q_dim], pos, freqs, head_dim)
    k = rope_ref(qkv[q_dim : q_dim + kv_dim], pos, freqs, head_dim)
    v = qkv[q_dim + kv_dim :].astype(np.float32)
    return q, k, v


def kv_round(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """A float32 vector rounded the way the KV cache stores it (fp16, fp8 e5m2, or fp32: as is)."""
    if kv_dtype == "fp32":
        return x.astype(np.float32)
    return formats.decode(formats.encode(x, kv_dtype), kv_dtype)


def rope_rows_ref(x: np.ndarray, pos0: int, freqs: np.ndarray, head_dim: int) -> np.ndarray:
    """rope_ref of each row of x (T, n_heads * head_dim) float32, row t at position pos0 + t."""
    n_rows = x.shape[0]
    out = x.astype(np.float32).reshape(n_rows, -1, head_dim).copy()  # (T, n_heads, head_dim)
    half = freqs.shape[0]
    pos = np.arange(pos0, pos0 + n_rows, dtype=np.float32)[:, None]  # (T, 1)
    angle = (pos * freqs.astype(np.float32)[None, :])[:, None, :]  # (T, 1, half) float32, as the GPU
    c, s = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    x0 = out[:, :, 0 : 2 * half : 2].copy()
    x1 = out[:, :, 1 : 2 * half : 2].copy()
    out[:, :, 0 : 2 * half : 2] = x0 * c - x1 * s
    out[:, :, 1 : 2 * half : 2] = x0 * s + x1 * c
    return out.reshape(n_rows, -1)


def qkv_rows_ref(
    qkv: np.ndarray,
    bqkv: np.ndarray | None,
    pos0: int,
    freqs: np.ndarray,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The QKV epilogue of T rows (prefill): qkv (T, q_dim + 2 kv_dim) float32, the matmul
    X Wqkv^T of the normed rows; row t at position pos0 + t. -> q (T, q_dim), k, v (T, kv_dim)
    float32: bias added, q and k rotated (rope_rows_ref); k and v go to cache rows pos0.. rounded
    by kv_round."""
    qkv = qkv.astype(np.float32)
    if bqkv is not None:
        qkv = qkv + bqkv.astype(np.float32)[None, :]
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    q = rope_rows_ref(qkv[:, :q_dim], pos0, freqs, head_dim)
    k = rope_rows_ref(qkv[:, q_dim : q_dim + kv_dim], pos0, freqs, head_dim)
    v = qkv[:, q_dim + kv_dim :].copy()
    return q, k, v


# =============================================================================================
# attention


def attention_ref(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    n_pos: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    window: int = 0,
) -> np.ndarray:
    """Grouped-query attention of one query position over cached positions [start, n_pos),
    start = max(0, n_pos - window) with a sliding window (window > 0), else 0. Query head h reads
    kv head h // (n_heads // n_kv_heads):
        score_t = q_h . k_t / sqrt(head_dim);  p = softmax(score);  out_h = sum_t p_t v_t

    q: (n_heads * head_dim,); caches: (>= n_pos, n_kv_heads * head_dim) float32 (decoded)
    -> (n_heads * head_dim,) float32."""
    start = max(0, n_pos - window) if window > 0 else 0
    qh = q.astype(np.float32).reshape(n_heads, head_dim)
    k = k_cache[start:n_pos].astype(np.float32).reshape(n_pos - start, n_kv_heads, head_dim)
    v = v_cache[start:n_pos].astype(np.float32).reshape(n_pos - start, n_kv_heads, head_dim)
    group = n_heads // n_kv_heads
    kh = np.repeat(k, group, axis=1)  # (T, n_heads, head_dim)
    vh = np.repeat(v, group, axis=1)
    scores = np.einsum("hd,thd->ht", qh, kh) / np.float32(np.sqrt(head_dim))  # (n_heads, T)
    scores = scores - scores.max(axis=1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("ht,thd->hd", p, vh).reshape(-1).astype(np.float32)


def prefill_attention_ref(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    pos0: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    window: int = 0,
) -> np.ndarray:
    """Block-causal attention of T query rows (prefill): row t is attention_ref of q[t] at
    n_pos = pos0 + t + 1, so it sees keys max(0, pos0 + t + 1 - window) .. pos0 + t. The query
    heads that share a kv head go together: two matrix products a kv head, whose scores
    (group, T, keys) float32 are the one large temporary.

    q: (T, n_heads*head_dim); caches: (>= pos0 + T, n_kv_heads*head_dim) float32 (already
    decoded) -> (T, n_heads*head_dim) float32 (the kernel writes it as fp16)."""
    n_rows, n_pos = q.shape[0], pos0 + q.shape[0]
    group = n_heads // n_kv_heads
    first = max(0, pos0 + 1 - window) if window > 0 else 0  # the first key that row 0 sees
    n_keys = n_pos - first
    # query head h = j group + g reads kv head j: (n_kv_heads, group, T, head_dim)
    qh = q.astype(np.float32).reshape(n_rows, n_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    k = np.asarray(k_cache[first:n_pos], np.float32).reshape(n_keys, n_kv_heads, head_dim)
    v = np.asarray(v_cache[first:n_pos], np.float32).reshape(n_keys, n_kv_heads, head_dim)
    pos = np.arange(pos0, n_pos)[:, None]  # (T, 1): each row's position
    key = np.arange(first, n_pos)[None, :]  # (1, n_keys)
    hidden = key > pos  # (T, n_keys): causal
    if window > 0:
        hidden |= key <= pos - window  # the sliding window
    out = np.empty((n_kv_heads, group, n_rows, head_dim), np.float32)
    for j in range(n_kv_heads):  # kv head j and its group of query heads
        scores = (qh[j] @ k[:, j].T) / np.float32(np.sqrt(head_dim))  # (group, T, n_keys)
        np.copyto(scores, -np.inf, where=hidden)
        scores -= scores.max(axis=2, keepdims=True)
        p = np.exp(scores, out=scores)  # in place: the largest array here
        p /= p.sum(axis=2, keepdims=True)
        out[j] = p @ v[:, j]  # (group, T, head_dim)
    return out.transpose(2, 0, 1, 3).reshape(n_rows, -1)  # row t, head j group + g


def batch_attention_ref(
    q: np.ndarray,
    k_pool: np.ndarray,
    v_pool: np.ndarray,
    block_table: np.ndarray,
    seq_of_row: np.ndarray,
    positions: np.ndarray,
    page_size: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    window: int = 0,
) -> np.ndarray:
    """Decode attention of M rows, each of its own sequence (batched serving: many sequences
    advanced one token each): row r of sequence s = seq_of_row[r] at position p = positions[r] is
    attention_ref of q[r] over s's keys 0..p (n_pos = p + 1; the window as there). The caches are
    a pool of pages of page_size rows: key t of sequence s is pool row
    block_table[s, t // page_size] * page_size + t % page_size. A row with s < 0 is padding: zeros.

    q: (M, n_heads*head_dim); pools: (n_pages * page_size, n_kv_heads*head_dim) float32 (already
    decoded); block_table (n_seqs, max_pages) int; seq_of_row, positions (M,) int
    -> (M, n_heads*head_dim) float32 (the kernel writes it as fp16)."""
    out = np.zeros((q.shape[0], n_heads * head_dim), np.float32)
    for r, (s, p) in enumerate(zip(seq_of_row, positions, strict=True)):
        if s < 0:
            continue
        n_pos = int(p) + 1
        t = np.arange(n_pos)
        rows = block_table[s, t // page_size].astype(np.int64) * page_size + t % page_size  # (n_pos,)
        out[r] = attention_ref(q[r], k_pool[rows], v_pool[rows], n_pos, n_heads, n_kv_heads, head_dim, window)
    return out


# =============================================================================================
# mixture of experts (Mixtral): route, then the chosen experts' FFN
#
#   logits = G xb (G: (n_experts, dim) float32); chosen = the k largest (ties: lower index first)
#   weights = softmax(logits[chosen]);  x += sum_j weights_j * W2_e(silu(W1_e xb) * W3_e xb)


def moe_route_ref(gate: np.ndarray, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (expert ids (k,) int32 in descending logit order, weights (k,) float32 summing to 1)."""
    logits = (gate.astype(np.float32) @ x.astype(np.float32)).astype(np.float32)  # (n_experts,)
    order = np.argsort(-logits, kind="stable")[:k]
    chosen = logits[order]
    w = np.exp(chosen - chosen.max())
    return order.astype(np.int32), (w / w.sum()).astype(np.float32)


def moe_route_rows_ref(
    gate: np.ndarray, x: np.ndarray, norm_w: np.ndarray, eps: float, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """moe_route_ref of each row of x (T, dim) float32 (the residual stream, normed here with
    norm_w, as the decode router does) -> ids (T, k) int32, weights (T, k) float32."""
    routes = [moe_route_ref(gate, rmsnorm_ref(row, norm_w, eps), k) for row in x]
    ids = np.array([r[0] for r in routes], np.int32).reshape(len(routes), k)
    weights = np.array([r[1] for r in routes], np.float32).reshape(len(routes), k)
    return ids, weights


def moe_group_ref(
    ids: np.ndarray, weights: np.ndarray, n_experts: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows grouped by expert, so that a pass reads each expert's weights once: ids,
    weights (T, k) -> count (n_experts,) int32, rows (n_experts, T) int32 (expert e's rows in
    increasing order in rows[e, :count[e]], -1 after), row_w (n_experts, T) float32 (their
    routing weights, 0 after)."""
    n_rows = ids.shape[0]
    count = np.zeros(n_experts, np.int32)
    rows = np.full((n_experts, n_rows), -1, np.int32)
    row_w = np.zeros((n_experts, n_rows), np.float32)
    for e in range(n_experts):
        t, j = np.nonzero(ids == e)  # row-major: increasing t (a row picks an expert once)
        count[e] = len(t)
        rows[e, : len(t)] = t
        row_w[e, : len(t)] = weights[t, j]
    return count, rows, row_w


def expert_gate_ref(
    x: np.ndarray, w1: np.ndarray, w3: np.ndarray, dtype: str, ids: np.ndarray, fp16: bool = True
) -> np.ndarray:
    """The experts' gate for T rows (prefill): x (T, dim) float16, the normed rows; w1, w3 stored
    (n_experts, hidden_dim, dim) stacks; ids (T, k) -> h (T k, hidden_dim) float16 (fp16=False:
    float32), slot t k + j = matmul_gate_ref of row t through expert ids[t, j] (unweighted: the
    weight comes in moe_combine_rows_ref)."""
    n_rows, k = ids.shape
    h = np.zeros((n_rows * k, w1.shape[1]), np.float16 if fp16 else np.float32)
    for e in range(w1.shape[0]):  # each expert's rows at once, as its weights are read once
        t, j = np.nonzero(ids == e)
        if len(t):
            h[t * k + j] = matmul_gate_ref(x[t], w1[e], w3[e], dtype, fp16)
    return h


def expert_matmul_ref(h: np.ndarray, w2: np.ndarray, dtype: str, ids: np.ndarray) -> np.ndarray:
    """h (T k, hidden_dim) float16 slots; w2 stored (n_experts, dim, hidden_dim) stack; ids (T, k)
    -> y (T k, dim) float32, slot t k + j = h[t k + j] W2_e^T with e = ids[t, j]."""
    k = ids.shape[1]
    y = np.zeros((h.shape[0], w2.shape[1]), np.float32)
    for e in range(w2.shape[0]):
        slots = np.flatnonzero(ids.reshape(-1) == e)  # t k + j
        if len(slots):
            y[slots] = matmul_ref(h[slots], w2[e], dtype)
    assert y.shape[0] == ids.shape[0] * k
    return y


def moe_combine_rows_ref(y: np.ndarray, weights: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """residual (T, dim) float32 + sum over j = 0..k-1, in order, of weights[t, j] y[t k + j]: the
    experts' outputs added to the residual stream (y from expert_matmul_ref)."""
    n_rows, k = weights.shape
    out = residual.astype(np.float32)
    slots = y.reshape(n_rows, k, -1)
    for j in range(k):
        out = (out + weights[:, j : j + 1] * slots[:, j]).astype(np.float32)
    return out


def moe_ffn_gate_ref(
    w1: np.ndarray, w3: np.ndarray, x: np.ndarray, dtype: str, ids: np.ndarray, weights: np.ndarray
) -> np.ndarray:
    """w1, w3: stored (n_experts, hidden_dim, dim) stacks; x (dim,) float32 (normed already);
    ids, weights (k,) -> h (k * hidden_dim,) float32: slot s is weights[s] * silu(W1_e x) * (W3_e x)."""
    h = [
        w * silu_ref(matvec_ref(w1[e], x, dtype)) * matvec_ref(w3[e], x, dtype)
        for e, w in zip(ids, weights, strict=True)
    ]
    return np.concatenate(h).astype(np.float32)


def moe_matvec_residual_ref(
    w2: np.ndarray, h: np.ndarray, dtype: str, ids: np.ndarray, residual: np.ndarray
) -> np.ndarray:
    """w2: stored (n_experts, dim, hidden_dim) stack; h (k * hidden_dim,) -> residual + sum over
    slots s of W2_e h[s] (slot by slot, as the kernel adds them)."""
    hidden_dim = h.shape[0] // len(ids)
    out = residual.astype(np.float32)
    for s, e in enumerate(ids):
        out = (out + matvec_ref(w2[e], h[s * hidden_dim : (s + 1) * hidden_dim], dtype)).astype(np.float32)
    return out


# =============================================================================================
# penalties and logit bias: the logits the sampler reads (the model's, changed by what was seen)
#
# A request may penalise the tokens it has seen, and bias any token, before sampling. counts[v]
# is how often v was generated so far in this choice; prompt[v] is 1 where v is in the request's
# prompt (the whole prompt, the cached prefix included). For each token v, in float32:
#
#     l = logits[v]
#     if counts[v] > 0 or prompt[v]:  l = l / r if l > 0 else l * r       repetition_penalty r
#     l = l - frequency * counts[v]                                      frequency_penalty
#     if counts[v] > 0:  l = l - presence                                presence_penalty
#     l = l + bias[v]                                                    logit_bias
#
# Repetition is the CTRL rule of transformers, vLLM and llama.cpp (r > 1 makes a seen token less
# likely whatever its sign) over the prompt and the tokens generated, as vLLM and transformers
# count them (llama.cpp's --repeat-penalty counts only the last 64 tokens). Presence and
# frequency are OpenAI's and count only the generated tokens. The bias comes last, so that +100
# forces a token and -100 bans it, whatever the penalties. The sampler then reads l (temperature,
# top-k, top-p, min-p, or the argmax); the logprobs stay the model's, before any of this.

MAX_LOGIT_BIAS = 300  # entries of a request's logit_bias at most (OpenAI's limit)


def check_penalties(
    presence: float,
    frequency: float,
    repetition: float,
    logit_bias: tuple[tuple[int, float], ...] = (),
    vocab_size: int | None = None,
) -> None:
    """Reject penalties and biases outside OpenAI's ranges with a one-line message: presence and
    frequency in [-2, 2], repetition > 0 (1: off), at most MAX_LOGIT_BIAS biases in [-100, 100],
    each on a token id of the vocabulary (when vocab_size is given)."""
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2.0 <= value <= 2.0:
            raise PycalmError(f"{name} must be from -2 to 2 (0: off), got {value}")
    if not (repetition > 0.0 and np.isfinite(repetition)):
        raise PycalmError(f"repetition_penalty must be a finite number above 0 (1: off), got {repetition}")
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise PycalmError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(logit_bias)}")
    for token, bias in logit_bias:
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise PycalmError(
                f"logit_bias: token id {token} is outside the vocabulary (0 to {vocab_size - 1})"
            )
        if not -100.0 <= bias <= 100.0:
            raise PycalmError(f"logit_bias: the bias of token {token} must be from -100 to 100, got {bias}")


def logit_bias_dense(logit_bias: tuple[tuple[int, float], ...], vocab_size: int) -> np.ndarray:
    """The (vocab_size,) float32 bias of every token: the given ones, zero elsewhere."""
    bias = np.zeros(vocab_size, np.float32)
    for token, value in logit_bias:
        bias[token] = value
    return bias


def prompt_flags(prompt: list[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """(vocab_size,) uint8: 1 for the tokens of the prompt, repetition_penalty's seen set."""
    flags = np.zeros(vocab_size, np.uint8)
    flags[np.asarray(prompt, np.int64)] = 1
    return flags


def penalties_ref(
    logits: np.ndarray,
    counts: np.ndarray,
    prompt: np.ndarray,
    presence: float,
    frequency: float,
    repetition: float,
    bias: np.ndarray,
) -> np.ndarray:
    """The logits (vocab_size,) float32 the sampler reads: the penalties of the tokens seen and
    the bias applied, as the section above says. counts (vocab_size,) int32, the generated
    tokens' counts; prompt (vocab_size,) uint8, 1 for the prompt's tokens; bias (vocab_size,)
    float32. The GPU kernel is pycalm.kernels.penalty."""
    f32 = np.float32
    logits = np.asarray(logits, f32).reshape(-1)
    seen = (counts > 0) | (prompt != 0)
    repeated = np.where(logits > 0, logits / f32(repetition), logits * f32(repetition))
    out = np.where(seen, repeated, logits).astype(f32)
    out = out - f32(frequency) * counts.astype(f32)
    out = np.where(counts > 0, out - f32(presence), out)
    return (out + bias).astype(f32)


# =============================================================================================
# sampling: the next token from the logits
#
# sample_ref takes the random number as an argument (a "coin" in [0, 1)) instead of drawing it,
# so that the CPU and the GPU can be handed the same coin and must then pick the same token
# (pycalm.cpu.sampler.Sampler draws the coins). For temperature T > 0:
#
#     p = softmax(logits / T)                     (float64)
#     order tokens by p, descending; equal p: lower id first
#     keep the first n of that order, where n is the smallest of
#         top_k                                   (top_k > 0)
#         #{i : p_i >= min_p * max p}             (min_p > 0)
#         the shortest prefix whose share of the kept mass reaches top_p   (top_p < 1)
#     walk the kept tokens in that order and return the first whose running sum of p
#     exceeds coin * (sum of kept p)
#
# top-p is measured on what top-k and min-p left (renormalised), as llama.cpp and transformers
# do. At least one token is always kept. T == 0 is greedy: argmax, lowest id on ties.


def mask_logits_ref(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Constrained decoding (pycalm.app.constrain): the logits (vocab_size,) with every id that
    the bitmask `mask` (ceil(vocab_size / 32),) uint32 does not allow set to -inf; id i is allowed
    where bit i % 32 of word i // 32 is set. Sampling then draws among the allowed ids only (an
    -inf logit has probability 0; greedy takes the best allowed)."""
    logits = np.asarray(logits, np.float32).reshape(-1)
    ids = np.arange(len(logits))
    allowed = (np.asarray(mask, np.uint32)[ids // 32] >> (ids % 32).astype(np.uint32)) & 1
    return np.where(allowed == 1, logits, np.float32(-np.inf)).astype(np.float32)


def check_constraint(constraint: object | None, vocab_size: int) -> None:
    """A generation's constraint (pycalm.app.constrain.Constraint, or None) masks this model's
    vocabulary: its mask has a bit for each of the vocab_size ids."""
    if constraint is not None and constraint.vocab_size != vocab_size:
        raise PycalmError(
            f"the constraint masks {constraint.vocab_size} ids, the model has a vocabulary of {vocab_size}"
        )


def check_sampling(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    """Sampling options come from the command line: reject nonsense with a one-line message."""
    if not (temperature >= 0.0 and np.isfinite(temperature)):
        raise PycalmError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k < 0:
        raise PycalmError(f"top_k must be >= 0 (0: off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise PycalmError(f"top_p must be in (0, 1] (1: off), got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise PycalmError(f"min_p must be in [0, 1] (0: off), got {min_p}")


def filtered_distribution(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, their probabilities) that survive the filters, in walk order (not renormalised).

    The walk order is descending probability, lower id first among equals. Needs temperature > 0.
    """
    x = np.asarray(logits, dtype=np.float64).reshape(-1) / temperature  # (vocab_size,)
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")  # stable: equal probabilities keep ascending ids
    p_sorted = p[order]
    n = len(p_sorted)
    if top_k > 0:
        n = min(n, top_k)
    if min_p > 0.0:
        # p_sorted is descending, so the tokens above the threshold are a prefix of it
        n = min(n, int(np.count_nonzero(p_sorted >= min_p * p_sorted[0])))
    if top_p < 1.0:
        share = np.cumsum(p_sorted[:n]) / p_sorted[:n].sum()
        n = min(n, int(np.searchsorted(share, top_p, side="left")) + 1)  # first prefix with share >= top_p
    n = max(n, 1)
    return order[:n], p_sorted[:n]


def sample_ref(
    logits: np.ndarray,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    coin: float = 0.0,
) -> int:
    """The token chosen for a uniform `coin` in [0, 1): the specification the GPU kernel follows."""
    check_sampling(temperature, top_k, top_p, min_p)
    logits = np.asarray(logits).reshape(-1)
    if temperature == 0.0:
        return int(np.argmax(logits))  # np.argmax returns the first (lowest) index among equals
    ids, p = filtered_distribution(logits, temperature, top_k, top_p, min_p)
    running = np.cumsum(p)
    i = int(np.searchsorted(running, coin * running[-1], side="right"))  # first running sum > target
    return int(ids[min(i, len(ids) - 1)])  # min(): coin * total can round up to the last sum


# =============================================================================================
# speculative decoding: a drafted token kept or replaced, so the output is still the target's
#
# A drafter proposes x drawn from its distribution q; the target's distribution at that position
# is p, the plain sampler's (target_distribution_ref: softmax(logits / T) through top-k, min-p
# and top-p, renormalised; T == 0: one-hot at the argmax). The rule (Leviathan et al. 2023;
# Chen et al. 2023):
#
#     accept x with probability min(1, p(x) / q(x))          (coin u: accept when u q(x) < p(x))
#     else draw from r = max(0, p - q) / sum(max(0, p - q))   (a second coin walks r)
#
# The kept token is distributed as p exactly: P(y) = min(q(y), p(y)) + (1 - sum min(p, q)) r(y)
# = p(y). A pass checks the drafts x_1 .. x_k in order and stops at the first one replaced;
# when all are kept, the (k+1)-th row's p gives one more token (verify_ref).
#
# A deterministic drafter (n-gram lookup, a greedy draft model) has q one-hot on x: x is kept
# with probability p(x), else the token comes from p without x. That is the same as drawing
# y from p with the plain sampler's coin and keeping x when y == x, which is how the loop runs it
# on the GPU (pycalm.app.speculative: only token ids come back).


def target_distribution_ref(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """The distribution (vocab_size,) float64 that sample_ref draws from: the kept tokens'
    probabilities renormalised, zero elsewhere; at temperature 0, one-hot at the argmax."""
    logits = np.asarray(logits).reshape(-1)
    p = np.zeros(logits.shape[0], np.float64)
    if temperature == 0.0:
        p[int(np.argmax(logits))] = 1.0
        return p
    ids, kept = filtered_distribution(logits, temperature, top_k, top_p, min_p)
    p[ids] = kept / kept.sum()
    return p


def speculative_accept_ref(
    p: np.ndarray, q: np.ndarray, draft: int, accept_coin: float, resample_coin: float
) -> tuple[bool, int]:
    """(kept, token) for the drafted token `draft` of distribution q (vocab_size,) under the
    target's p (vocab_size,): (True, draft) with probability min(1, p / q), else (False, a draw
    from normalize(max(0, p - q)) by resample_coin). Coins are uniform in [0, 1)."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    if not q[draft] > 0.0:
        raise PycalmError(f"drafted token {draft} has probability 0 under its own distribution")
    if accept_coin * q[draft] < p[draft]:
        return True, int(draft)
    residual = np.maximum(p - q, 0.0)
    if not residual.sum() > 0.0:  # p == q up to rounding: nothing to correct, draw from p
        residual = p
    running = np.cumsum(residual)
    i = int(np.searchsorted(running, resample_coin * running[-1], side="right"))
    return False, int(min(i, len(running) - 1))


def verify_ref(p: np.ndarray, q: np.ndarray, drafts: list[int], coins: np.ndarray) -> list[int]:
    """The tokens one verification pass keeps: p (k + 1, vocab_size) the target's distributions
    after the last kept token and after each draft, q (k, vocab_size) the drafter's, drafts (k,),
    coins (k + 1, 2) uniform. Each draft in turn through speculative_accept_ref; the first one
    replaced ends the list with its replacement; all kept, a last token drawn from p[k]."""
    out: list[int] = []
    for i, x in enumerate(drafts):
        kept, token = speculative_accept_ref(p[i], q[i], x, coins[i, 0], coins[i, 1])
        out.append(token)
        if not kept:
            return out
    running = np.cumsum(p[len(drafts)])
    i = int(np.searchsorted(running, coins[len(drafts), 0] * running[-1], side="right"))
    return [*out, min(i, len(running) - 1)]


MAX_TOP_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI's limit too)


class TokenLogprobs(NamedTuple):
    """A sampled token's log-probability under the model (log_softmax of the raw logits, before
    temperature or any cut), and the k most likely tokens' ids and log-probabilities, by
    descending logit, lower id first on ties."""

    token: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def check_logprobs(k: int | None) -> None:
    """A request's count of top logprobs: None (none asked) or 0 to MAX_TOP_LOGPROBS."""
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise PycalmError(f"top logprobs must be 0 to {MAX_TOP_LOGPROBS}, not {k}")


def logprobs_ref(logits: np.ndarray, token: int, k: int) -> TokenLogprobs:
    """log_softmax(logits)[token] and the top k (0 <= k <= MAX_TOP_LOGPROBS) of log_softmax(logits),
    in float64: log p_i = l_i - logsumexp(l), logsumexp(l) = m + log(sum exp(l - m)), m = max(l)."""
    check_logprobs(k)
    logits = np.asarray(logits, np.float64).reshape(-1)
    m = logits.max()
    lse = m + np.log(np.exp(logits - m).sum()) if np.isfinite(m) else m
    order = np.lexsort((np.arange(len(logits)), -logits))[:k]  # descending logit, then lower id
    return TokenLogprobs(
        int(token),
        float(logits[token] - lse),
        [int(i) for i in order],
        [float(logits[i] - lse) for i in order],
    )


def advance_ref(token: int, pos: int, feed_end: int, feed: np.ndarray) -> tuple[int, int]:
    """The end of a token step: (the token the next step embeds, its position). `token` is what
    the sampler just picked at `pos`; positions below `feed_end` take theirs from `feed` (the
    prompt), so a prompt is prefilled by the same step as generation; past it the pick is
    written into feed at its position (feed: every position's token)."""
    nxt = pos + 1
    if nxt < feed_end:
        return int(feed[nxt]), nxt
    if nxt < len(feed):  # (the context's last step has no next position)
        feed[nxt] = token
    return token, nxt


def feed_tokens_ref(tokens: np.ndarray, prev: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """A batched step's tokens when it runs ahead of the host: row r feeds chosen[prev[r]], the
    token the step before sampled for its sequence (on the device, not yet read), where prev[r]
    >= 0, else tokens[r]."""
    return np.where(prev >= 0, chosen[np.maximum(prev, 0)], tokens).astype(np.int32)


# =============================================================================================
# embeddings: a text's vector from its final hidden states (llama-server's --embedding)
#
# A text's hidden rows are the final RMSNorm's output at every position, hidden[t] =
# rmsnorm(x[t]) * norm (the classifier's input, ReferenceEngine.hidden_rows), the text fed alone
# from position 0. Pooling makes one (dim,) vector of them, then it is scaled to unit L2 norm:
#
#     mean:  e = sum over t of hidden[t] / T
#     last:  e = hidden[T - 1]                  (the one row that has attended to every token)
#     e = e / ||e||_2                           (a zero vector stays zero, as llama.cpp leaves it)

POOLINGS = ("mean", "last")  # the pooling options, the default first


def check_pooling(pooling: str) -> None:
    """A one-line error for a pooling that is not one of POOLINGS."""
    if pooling not in POOLINGS:
        raise PycalmError(f"pooling must be {' or '.join(POOLINGS)}, not {pooling!r}")


def embed_pool_ref(hidden: np.ndarray, pooling: str = "mean", normalize: bool = True) -> np.ndarray:
    """hidden (T, dim) float32, a text's rows after the final RMSNorm -> its embedding (dim,)
    float32: the rows' mean or the last row, scaled to unit L2 norm when normalize."""
    check_pooling(pooling)
    hidden = np.asarray(hidden, np.float32)
    if hidden.ndim != 2 or hidden.shape[0] == 0:
        raise PycalmError(f"embedding: hidden rows must be (T, dim) with T >= 1, not {hidden.shape}")
    e = np.mean(hidden, axis=0, dtype=np.float32) if pooling == "mean" else hidden[-1].copy()  # (dim,)
    if normalize:
        norm = np.float32(np.sqrt(np.sum(e * e, dtype=np.float32)))
        e = e / norm if norm > 0 else e
    return e.astype(np.float32, copy=False)


# =============================================================================================
# the CPU engine

REFERENCE_KV_DTYPES = (*KV_DTYPES, "fp32")  # the GPU's KV formats, and float32 for comparisons


class ReferenceEngine:
    """forward(token, pos) -> logits, with a KV cache of up to `seq_len` positions; for T tokens
    at once (a prompt), forward_rows(tokens, pos0) then classify_rows.

    Weights are decoded from the model file once, when the engine is made, and kept as float32,
    so a token costs only the arithmetic. The KV cache holds float32 values rounded through the
    KV dtype (kv_round), so that the CPU and GPU engines see the same cached values.
    """

    def __init__(self, model: object, seq_len: int | None = None, kv_dtype: str = "fp16") -> None:
        # model: a pycalm.model.loader.ModelFile (anything with .config and .tensor(name))
        cfg: ModelConfig = model.config
        self.config = cfg
        self.model = model
        self.seq_len = min(seq_len or cfg.max_seq_len, cfg.max_seq_len)
        if kv_dtype not in REFERENCE_KV_DTYPES:
            raise PycalmError(
                f"unsupported KV cache dtype {kv_dtype!r} (one of {', '.join(REFERENCE_KV_DTYPES)})"
            )
        self.kv_dtype = kv_dtype
        self.rope_freqs = model.tensor("rope_freqs").astype(np.float32)  # (rotary_dim // 2,)
        self.tok_embeddings = model.tensor("tok_embeddings")  # stored (vocab_size, dim), rows decoded per use
        self.norm = model.tensor("norm").astype(np.float32)  # (dim,)
        out_name = "tok_embeddings" if cfg.tied_embeddings else "output"
        out = model.tensor(out_name)
        self.output = formats.decode(out, cfg.dtype_of(out_name))  # (vocab_size, dim) float32
        self._decoded: dict[str, np.ndarray] = {}  # name -> the weight decoded to float32
        for layer in range(cfg.n_layers):
            names = ["attn_norm", "wqkv", "wo", "ffn_norm", "w1", "w3", "w2"]
            names += ["bqkv"] * cfg.qkv_bias + ["moe_gate"] * bool(cfg.n_experts)
            for name in names:
                self._w(f"layers.{layer}.{name}")
        # KV cache: (n_layers, seq_len, kv_dim) float32, values rounded through kv_dtype; laid
        # out position by position (every layer's row of a position together), so that a short
        # prompt writes the first pages of the zeroed memory only, each page costing a fault
        shape = (self.seq_len, cfg.n_layers, cfg.kv_dim)
        self.key_cache = np.zeros(shape, np.float32).transpose(1, 0, 2)
        self.value_cache = np.zeros(shape, np.float32).transpose(1, 0, 2)

    def _w(self, name: str) -> np.ndarray:
        """A weight decoded to float32 (norms, biases and router are float32 already)."""
        w = self._decoded.get(name)
        if w is None:
            w = self.model.tensor(name)
            if isinstance(w, formats.Quantized) or w.dtype != np.float32:
                w = formats.decode(w, self.config.dtype_of(name))
            self._decoded[name] = w
        return w

    def reset(self) -> None:
        self.key_cache[:] = 0
        self.value_cache[:] = 0

    def forward(self, token: int, pos: int) -> np.ndarray:
        """Logits (vocab_size,) float32 for `token` at position `pos` (0-based)."""
        cfg, dt = self.config, "fp32"  # weights come decoded from _w
        if not 0 <= token < cfg.vocab_size:
            raise PycalmError(f"token id {token} outside the vocabulary (0..{cfg.vocab_size - 1})")
        if not 0 <= pos < self.seq_len:
            raise PycalmError(f"position {pos} is past the context length {self.seq_len}")

        x = embed_ref(self.tok_embeddings, token, cfg.dtype_of("tok_embeddings"))  # (dim,) residual stream
        for layer in range(cfg.n_layers):
            p = f"layers.{layer}."
            # attention block
            xb = rmsnorm_ref(x, self._w(p + "attn_norm"), cfg.norm_eps)
            bqkv = self._w(p + "bqkv") if cfg.qkv_bias else None
            wqkv = self._w(p + "wqkv")
            q, k, v = qkv_ref(
                wqkv, bqkv, xb, dt, pos, self.rope_freqs, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
            )
            self.key_cache[layer, pos] = kv_round(k, self.kv_dtype)
            self.value_cache[layer, pos] = kv_round(v, self.kv_dtype)
            att = attention_ref(
                q,
                self.key_cache[layer],
                self.value_cache[layer],
                pos + 1,
                cfg.n_heads,
                cfg.n_kv_heads,
                cfg.head_dim,
                cfg.sliding_window,
            )
            x = matvec_residual_ref(self._w(p + "wo"), att, dt, x)
            # feed-forward block
            xb = rmsnorm_ref(x, self._w(p + "ffn_norm"), cfg.norm_eps)
            if cfg.n_experts:
                ids, weights = moe_route_ref(self._w(p + "moe_gate"), xb, cfg.n_experts_active)
                w1, w3, w2 = self._w(p + "w1"), self._w(p + "w3"), self._w(p + "w2")
                h = moe_ffn_gate_ref(w1, w3, xb, dt, ids, weights)
                x = moe_matvec_residual_ref(w2, h, dt, ids, x)
            else:
                h = ffn_gate_ref(self._w(p + "w1"), self._w(p + "w3"), xb, dt)
                x = matvec_residual_ref(self._w(p + "w2"), h, dt, x)
        x = rmsnorm_ref(x, self.norm, cfg.norm_eps)
        return matvec_ref(self.output, x, dt)  # the classifier

    def forward_rows(self, tokens: np.ndarray, pos0: int) -> np.ndarray:
        """The multi-token forward (a prompt's chunk): tokens (T,) at positions pos0 .. pos0 + T
        - 1 through the layers as matrix products, in forward's order with the rows forms (as
        pycalm.gpu.prefill runs them), their keys and values cached -> the residual stream after
        the last layer, (T, dim) float32 (classify_rows makes it logits). The activations stay
        float32 (fp16=False), so row t is forward(tokens[t], pos0 + t) to float32 rounding."""
        cfg, dt = self.config, "fp32"  # weights come decoded from _w
        tokens = np.asarray(tokens, np.int64).reshape(-1)  # (T,)
        n_rows = tokens.shape[0]
        bad = tokens[(tokens < 0) | (tokens >= cfg.vocab_size)]
        if len(bad):
            raise PycalmError(f"token id {bad[0]} outside the vocabulary (0..{cfg.vocab_size - 1})")
        if not (n_rows > 0 and 0 <= pos0 and pos0 + n_rows <= self.seq_len):
            raise PycalmError(
                f"{n_rows} tokens at position {pos0} do not fit the context length {self.seq_len}"
            )
        rows = slice(pos0, pos0 + n_rows)  # their KV cache rows

        x = embed_rows_ref(self.tok_embeddings, tokens, cfg.dtype_of("tok_embeddings"))  # (T, dim) residual
        for layer in range(cfg.n_layers):
            p = f"layers.{layer}."
            # attention block
            xb = rmsnorm_rows_ref(x, self._w(p + "attn_norm"), cfg.norm_eps, fp16=False)  # (T, dim)
            bqkv = self._w(p + "bqkv") if cfg.qkv_bias else None
            qkv = matmul_ref(xb, self._w(p + "wqkv"), dt)  # (T, q_dim + 2 kv_dim)
            q, k, v = qkv_rows_ref(
                qkv, bqkv, pos0, self.rope_freqs, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
            )
            self.key_cache[layer, rows] = kv_round(k, self.kv_dtype)
            self.value_cache[layer, rows] = kv_round(v, self.kv_dtype)
            att = prefill_attention_ref(
                q,
                self.key_cache[layer],
                self.value_cache[layer],
                pos0,
                cfg.n_heads,
                cfg.n_kv_heads,
                cfg.head_dim,
                cfg.sliding_window,
            )  # (T, q_dim)
            x = matmul_residual_ref(att, self._w(p + "wo"), dt, x)
            # feed-forward block
            x = self.ffn_rows(x, p)
        return x

    def ffn_rows(self, x: np.ndarray, p: str) -> np.ndarray:
        """The feed-forward block of the layer whose weights are named p... for rows x (T, dim)
        float32: x + the gated FFN (Mixtral: the routed experts' weighted sum) of rmsnorm(x)."""
        cfg, dt = self.config, "fp32"  # weights come decoded from _w
        xb = rmsnorm_rows_ref(x, self._w(p + "ffn_norm"), cfg.norm_eps, fp16=False)  # (T, dim)
        w1, w3, w2 = self._w(p + "w1"), self._w(p + "w3"), self._w(p + "w2")
        if cfg.n_experts:
            gate, norm = self._w(p + "moe_gate"), self._w(p + "ffn_norm")
            ids, weights = moe_route_rows_ref(gate, x, norm, cfg.norm_eps, cfg.n_experts_active)  # (T, k)
            h = expert_gate_ref(xb, w1, w3, dt, ids, fp16=False)  # (T k, hidden_dim)
            return moe_combine_rows_ref(expert_matmul_ref(h, w2, dt, ids), weights, x)
        h = matmul_gate_ref(xb, w1, w3, dt, fp16=False)  # (T, hidden_dim)
        return matmul_residual_ref(h, w2, dt, x)

    def hidden_rows(self, x: np.ndarray) -> np.ndarray:
        """The final RMSNorm of rows of forward_rows's output: x (T, dim) -> rmsnorm(x) * norm
        (T, dim) float32, the classifier's input and the embeddings' hidden states."""
        return rmsnorm_rows_ref(x, self.norm, self.config.norm_eps, fp16=False)

    def classify_rows(self, x: np.ndarray) -> np.ndarray:
        """The classifier of rows of forward_rows's output: x (T, dim) -> logits (T, vocab_size)
        float32."""
        return matmul_ref(self.hidden_rows(x), self.output, "fp32")
