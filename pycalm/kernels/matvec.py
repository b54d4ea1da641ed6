"""Matrix-vector products with fp16 / fp8 e5m2 / gf4 weights, and their fusions.

  matvec:           y = W x
  matvec_residual:  r += W x         (wo and w2: the residual add fused into the product)
  ffn_gate:         h = silu(W1 x) * (W3 x)   (the SiLU gate fused into w1/w3)

W is the stored array of pycalm.formats (float16 / uint8 / uint32 groups of 8); x, y float32.
"""

from __future__ import annotations

import numpy as np

from pycalm import formats


def matvec_ref(w: np.ndarray, x: np.ndarray, dtype: str) -> np.ndarray:
    """w: stored (rows, cols) in `dtype`, x: (cols,) float32 -> (rows,) float32."""
    return (formats.decode(w, dtype) @ x.astype(np.float32)).astype(np.float32)


def matvec_residual_ref(w: np.ndarray, x: np.ndarray, dtype: str, residual: np.ndarray) -> np.ndarray:
    """residual + W x."""
    return (residual + matvec_ref(w, x, dtype)).astype(np.float32)


def silu_ref(x: np.ndarray) -> np.ndarray:
    return (x / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


def ffn_gate_ref(w1: np.ndarray, w3: np.ndarray, x: np.ndarray, dtype: str) -> np.ndarray:
    """silu(W1 x) * (W3 x): (hidden_dim,) float32."""
    return (silu_ref(matvec_ref(w1, x, dtype)) * matvec_ref(w3, x, dtype)).astype(np.float32)
