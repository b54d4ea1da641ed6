"""Attention launches to profile with Nsight Compute, and the kernels' SASS (GPU machine).

    ncu --kernel-name regex:attention --launch-skip 2 --launch-count 2 \
        --metrics smsp__inst_executed.sum,sm__cycles_elapsed.max \
        python3 scripts/profile_attention.py 8b 256
    python3 scripts/profile_attention.py tiny 4000 OUTDIR   # also writes the SASS to OUTDIR

Runs attention three times over a random fp16 cache (Llama-3-8B or TinyLlama heads) at n_pos
positions; the figures in pycalm/kernels/attention.py's docstring came from this.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)

import numpy as np  # noqa: E402
from gpubench import fill  # noqa: E402
from numba import cuda  # noqa: E402

from pycalm.kernels import attention as att  # noqa: E402


def main() -> None:
    n_heads, n_kv, hd = (32, 8, 128) if sys.argv[1] == "8b" else (32, 4, 64)
    n_pos = int(sys.argv[2])
    kv_dim = n_kv * hd
    s = cuda.stream()
    caches = [
        fill(cuda.device_array(4096 * kv_dim // 2, np.uint32), seed, 0xBFFFBFFF)
        .view(np.float16)
        .reshape(4096, kv_dim)
        for seed in (1, 2)
    ]
    q = cuda.to_device(np.random.default_rng(0).standard_normal(n_heads * hd).astype(np.float32))
    out = cuda.device_array(n_heads * hd, np.float32)
    part = att.attention_scratch(n_heads, hd, "fp16", 4096, stream=s)
    state = cuda.to_device(np.array([0, n_pos - 1, 0, 0], np.int32))
    for _ in range(3):
        att.attention(q, *caches, state, out, n_heads, n_kv, hd, "fp16", 0, part, stream=s)
    s.synchronize()
    if len(sys.argv) > 3:
        kern = att.attention_kernel(hd, n_heads // n_kv, "fp16", part.chunk, att.THREADS)
        sass = kern.inspect_sass()
        text = sass if isinstance(sass, str) else "\n".join(sass.values())
        with open(os.path.join(sys.argv[3], f"attention_{sys.argv[1]}.sass"), "w") as f:
            f.write(text)
        print("attention SASS lines", text.count("\n"))


if __name__ == "__main__":
    main()
