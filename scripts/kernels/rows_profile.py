"""Eager launches of skinny and the token step's matvec on the 8B gate shape, for ncu.

ncu -k regex:'skinny|ffn' python scripts/kernels/rows_profile.py q4 8
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import rows_matmul as rm  # noqa: E402

dtype, t = sys.argv[1], int(sys.argv[2])
rm.STREAM = cuda.stream()
name, n, k, mode = rm.SHAPES[int(sys.argv[3]) if len(sys.argv) > 3 else 2]
w = rm.random_weights(n, k, dtype, 1)
w3 = rm.random_weights(n, k, dtype, 2) if mode == "gate" else None
x = rm.random_words(64 * k // 2, 3, rm.MASK["fp16"]).view(np.float16).reshape(64, k)
out = cuda.device_array((64, n), np.float16 if mode == "gate" else np.float32)
x1 = cuda.to_device(np.random.default_rng(0).standard_normal(k).astype(np.float32) * 0.1)
out1 = cuda.device_array(n, np.float32)
for launch in (
    rm.skinny_launch(x[:t], w, w3, out[:t], dtype, mode, 0, 1),
    rm.matvec_launch(w, w3, x1, out1, dtype, mode),
):
    for _ in range(3):
        launch()
rm.STREAM.synchronize()
print("done", dtype, t, name)
