"""Grouped-query attention of one query position over the KV cache.

For query head h (kv head g = h // (n_heads // n_kv_heads)) and cached positions t in
[start, n_pos), start = max(0, n_pos - window) with a sliding window, else 0:
  score_t = q_h . k_t,g / sqrt(head_dim);  p = softmax(score);  out_h = sum_t p_t v_t,g
The caches hold (seq_len, n_kv_heads * head_dim) per layer, fp16 or fp8 e5m2.
"""

from __future__ import annotations

import numpy as np


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
    """q: (n_heads*head_dim,); caches: (>= n_pos, n_kv_heads*head_dim) float32 (already decoded).

    -> (n_heads*head_dim,) float32.
    """
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
