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
