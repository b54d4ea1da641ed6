"""Attention and sampling on the GPU (run on the H200, simulator off; about half a minute).

    python scripts/bench_attention.py

Attention: for each model shape x KV dtype x n_pos, one CUDA graph of LAYERS attention calls,
each over its own layer's cache (so the 50 MB L2 does not hold the cache between calls, as in a
real token step), replayed RUNS times and timed with CUDA events. Per-layer time includes the
~1 us a kernel that a graph costs (two kernels a call). GB/s counts the KV bytes read at n_pos
(K and V rows of the attended positions); the ceiling is a uint64 grid-stride copy measured in
the same run (bytes read + written). Caches hold random finite fp16 / e5m2 bit patterns made on
the GPU. Also: argmax and sample (temperature 0.8, top-k 40, top-p 0.95; and plain temperature)
over 128256 logits, each as a graph of 32 launches.
"""

from __future__ import annotations

import functools
import os

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)

import numpy as np  # noqa: E402
from numba import cuda, uint32  # noqa: E402

from pycalm.graph import GraphStep  # noqa: E402
from pycalm.kernels.attention import attention, attention_scratch_shape  # noqa: E402
from pycalm.kernels.sample import argmax, sample  # noqa: E402

SHAPES = {"Llama-3-8B": (32, 8, 128), "TinyLlama": (32, 4, 64)}  # n_heads, n_kv_heads, head_dim
N_POS = (256, 4000)
SEQ_LEN = 4096
LAYERS = 16
RUNS = 10
MASK = {"fp16": 0xBFFFBFFF, "fp8": 0xBFBFBFBF}  # clear an exponent bit: finite values only


@cuda.jit
def fill_kernel(words, seed, mask):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < words.shape[0]:
        h = uint32(i) * uint32(0x9E3779B9) + uint32(seed)
        h ^= h >> uint32(16)
        h *= uint32(0x7FEB352D)
        h ^= h >> uint32(15)
        h *= uint32(0x846CA68B)
        h ^= h >> uint32(16)
        words[i] = h & uint32(mask)
        i += stride


@cuda.jit
def copy_kernel(src, dst):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < src.shape[0]:
        dst[i] = src[i]
        i += stride


def timed(stream, record, runs=RUNS):
    """Seconds per replay of a graph of `record`'s launches (median of runs)."""
    g = GraphStep(stream, record)
    g.launch()
    stream.synchronize()
    times = []
    for _ in range(runs):
        a, b = cuda.event(), cuda.event()
        a.record(stream)
        g.launch()
        b.record(stream)
        b.synchronize()
        times.append(cuda.event_elapsed_time(a, b) / 1e3)
    return float(np.median(times))


def copy_ceiling(stream):
    n = 64 << 20  # 512 MB of uint64
    src = cuda.device_array(n, np.uint64)
    dst = cuda.device_array(n, np.uint64)
    t = timed(stream, lambda: copy_kernel[132 * 16, 256, stream](src, dst))
    return 2 * n * 8 / t / 1e9


def main():
    stream = cuda.stream()
    ceiling = copy_ceiling(stream)
    print(f"copy ceiling (uint64 grid-stride, read + write): {ceiling:,.0f} GB/s")
    print(f"{'model':11s} {'kv':5s} {'n_pos':>6s} {'us/layer':>9s} {'KV GB/s':>8s} {'% ceil':>7s}")
    for name, (n_heads, n_kv_heads, head_dim) in SHAPES.items():
        kv_dim = n_kv_heads * head_dim
        part = cuda.device_array(attention_scratch_shape(n_heads, n_kv_heads, head_dim, SEQ_LEN), np.float32)
        q = cuda.to_device(
            np.random.default_rng(0).standard_normal(n_heads * head_dim).astype(np.float32) * 0.3
        )
        out = cuda.device_array(n_heads * head_dim, np.float32)
        for kv_dtype in ("fp16", "fp8"):
            elt = 2 if kv_dtype == "fp16" else 1
            caches = []
            for layer in range(LAYERS):
                pair = []
                for which in range(2):
                    words = cuda.device_array(SEQ_LEN * kv_dim * elt // 4, np.uint32)
                    fill_kernel[1024, 256, stream](
                        words, uint32(2 * layer + which + 1), uint32(MASK[kv_dtype])
                    )
                    dt = np.float16 if kv_dtype == "fp16" else np.uint8
                    pair.append(_as(words, dt, kv_dim))
                caches.append(pair)
            for n_pos in N_POS:
                state = cuda.to_device(np.array([0, n_pos - 1, 0, 0], np.int32))

                record = functools.partial(
                    _attention_layers,
                    caches,
                    q,
                    state,
                    out,
                    (n_heads, n_kv_heads, head_dim),
                    kv_dtype,
                    part,
                    stream,
                )
                t = timed(stream, record) / LAYERS
                kv_bytes = n_pos * kv_dim * 2 * elt
                gbs = kv_bytes / t / 1e9
                print(
                    f"{name:11s} {kv_dtype:5s} {n_pos:6d} {t * 1e6:9.2f} {gbs:8,.0f} {100 * gbs / ceiling:6.1f}%"
                )
    vocab = 128256
    logits = cuda.to_device((np.random.default_rng(1).standard_normal(vocab) * 3).astype(np.float32))
    coins = cuda.to_device(np.random.default_rng(2).random(SEQ_LEN).astype(np.float32))
    state = cuda.to_device(np.array([0, 7, 0, 0], np.int32))
    reps = 32
    t = timed(stream, lambda: [argmax(logits, state, stream=stream) for _ in range(reps)]) / reps
    print(f"argmax over {vocab}: {t * 1e6:.1f} us")
    for opts in ((0.8, 40, 0.95, 0.0), (1.0, 0, 1.0, 0.0), (1.0, 0, 0.9, 0.05)):
        t = (
            timed(
                stream,
                lambda opts=opts: [sample(logits, state, coins, *opts, stream=stream) for _ in range(reps)],
            )
            / reps
        )
        print(
            f"sample T={opts[0]} top_k={opts[1]} top_p={opts[2]} min_p={opts[3]} over {vocab}: {t * 1e6:.1f} us"
        )


def _attention_layers(caches, q, state, out, shape, kv_dtype, part, stream):
    """The launches of one graph: attention over every layer's cache."""
    for k, v in caches:
        attention(q, k, v, state, out, *shape, kv_dtype, 0, stream=stream, part=part)


def _as(words, dt, kv_dim):
    """A (SEQ_LEN, kv_dim) view of the uint32 words in the cache dtype."""
    return words.view(dt).reshape(SEQ_LEN, kv_dim)


if __name__ == "__main__":
    main()
