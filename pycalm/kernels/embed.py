"""Embedding lookup: x = decode(tok_embeddings[token]).

Reference here; the GPU kernel reads one stored row (dim * bytes-per-weight) and writes dim fp32.
"""

from __future__ import annotations

import numpy as np

from pycalm import formats


def embed_ref(table: np.ndarray, token: int, dtype: str) -> np.ndarray:
    """table: stored (vocab_size, dim) in `dtype` -> (dim,) float32."""
    return formats.decode(table[token], dtype).astype(np.float32)
