"""What the GPU benchmark scripts share: random device words, graph-replay timing, copy ceiling.

bench.py and the kernel scripts (scripts/kernels/*.py) import it: scripts/ is on sys.path as
the folder of the running script, or put there by the script.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import cuda, uint32

from pycalm.gpu.graph import GraphStep


@cuda.jit
def fill_kernel(words, seed, mask, bits):
    """words[i] = hash(i, seed) & mask | bits (lowbias32, a 32-bit integer hash): masks and bits
    pin exponent fields so that every fp16 / e5m2 / gf4 value is finite."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < words.shape[0]:
        h = uint32(i) * uint32(0x9E3779B9) + uint32(seed)
        h ^= h >> uint32(16)
        h *= uint32(0x7FEB352D)
        h ^= h >> uint32(15)
        h *= uint32(0x846CA68B)
        h ^= h >> uint32(16)
        words[i] = h & uint32(mask) | uint32(bits)
        i += stride


def fill(words: object, seed: int, mask: int, bits: int = 0, stream: object = 0) -> object:
    """Fill a uint32 device array in place (see fill_kernel); returns it."""
    fill_kernel[1024, 256, stream](words, uint32(seed), uint32(mask), uint32(bits))
    return words


@cuda.jit
def copy_kernel(src, dst):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < src.shape[0]:
        dst[i] = src[i]
        i += stride


def graph_seconds(stream: object, record: Callable[[], object], replays: int) -> float:
    """Median seconds of one replay of a CUDA graph of the launches record() makes on stream.
    record() runs once eagerly first, so compilation stays outside the capture."""
    record()
    stream.synchronize()
    g = GraphStep(stream, record)
    g.launch()
    stream.synchronize()
    times = []
    for _ in range(replays):
        a, b = cuda.event(), cuda.event()
        a.record(stream)
        g.launch()
        b.record(stream)
        b.synchronize()
        times.append(cuda.event_elapsed_time(a, b) / 1e3)
    return float(np.median(times))


def copy_ceiling(stream: object, n_words: int = 64 << 20) -> float:
    """GB/s of a numba uint64 grid-stride device copy, bytes read + written."""
    src = cuda.device_array(n_words, np.uint64)
    dst = cuda.device_array(n_words, np.uint64)
    return (
        2 * n_words * 8 / graph_seconds(stream, lambda: copy_kernel[132 * 16, 256, stream](src, dst), 9) / 1e9
    )
