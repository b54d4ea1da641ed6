"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w.

Reference here; on the GPU the norm is fused into the matvec that consumes it where possible.
"""

from __future__ import annotations

import numpy as np


def rmsnorm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x: (dim,) float32, w: (dim,) float32 -> (dim,) float32."""
    x = x.astype(np.float32)
    ms = np.float32(np.mean(x * x, dtype=np.float32))
    return (x * np.float32(1.0 / np.sqrt(ms + np.float32(eps))) * w).astype(np.float32)
