"""Block-causal (prefill) attention, pycalm.kernels.prefill_attention: block shapes, a check of
each against pycalm.reference.prefill_attention_ref, and TFLOP/s on the GPU (llm.c dev/cuda
style).

    python scripts/kernels/prefill_attention.py                       # the default, checked and timed
    python scripts/kernels/prefill_attention.py --variants all        # every block shape
    NUMBA_ENABLE_CUDASIM=1 python scripts/kernels/prefill_attention.py --variants all --tiny
        # every variant checked at a tiny shape under the simulator (no timing)

Versions (one kernel; a block takes ROWS (position, query head) rows of one kv head's group,
row groups of LANES threads, a thread 4 rows x 2 keys of a tile of 2 LANES keys for the scores
and 4 rows x head_dim / LANES dims for P V; fp32 SIMT, online softmax):
  default   the shipped shape: ROWS 4096 / head_dim (at most 64), LANES 16 (tile of 32 keys)
  r16       same as default but 16 rows a block (more blocks, K/V tiles serve fewer rows)
  r32       same as default but 32 rows a block (head_dim 64; the default at head_dim 128)
  l8        same as default but 8 lanes a row group (tiles of 16 keys, twice the dims a thread)
  l32r16    16 rows, 32 lanes (tiles of 64 keys: fewer barriers a key)
  l32r32    32 rows, 32 lanes
A shape whose shared memory passes the 48 KB of a static allocation is left out ("n/a").

Timing: one launch over a whole prompt of T tokens at positions 0 .. T - 1 (the K/V rows already
in the cache), captured in a CUDA graph and replayed (median); the cache holds random finite
fp16 / e5m2 bit patterns made on the GPU. TFLOP/s counts 4 head_dim per (query head, attended
key) pair (prefill_attention_flops), against the fp32 FMA peak of the GPU (SMs x 128 lanes x 2
x clock). GB/s counts q, out and the attended K/V rows once (prefill_attention_bytes); the
kernel is bound by arithmetic, not bytes, so it is small. The check runs each variant at T =
200 after pos0 = 60 (a later chunk of a prompt) against the reference on the host-decoded
cache: the worst |error| / (2^-11 |ref| + 2e-5), the tests' tolerance (fp16 output), must be
at most 1.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: gpubench
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: pycalm

from numba import config as numba_config  # noqa: E402
from numba import cuda  # noqa: E402

from pycalm import formats  # noqa: E402
from pycalm.config import ModelConfig  # noqa: E402
from pycalm.kernels.attention import KVCache  # noqa: E402
from pycalm.kernels.common import STATE_POS  # noqa: E402
from pycalm.kernels.prefill_attention import (  # noqa: E402
    KEYS_A_LANE,
    default_rows,
    prefill_attention,
    prefill_attention_bytes,
    prefill_attention_flops,
)
from pycalm.reference import prefill_attention_ref  # noqa: E402

SHAPES = {"Llama-3-8B": (32, 8, 128), "TinyLlama": (32, 4, 64)}  # n_heads, n_kv_heads, head_dim
TINY_SHAPES = {"tiny": (4, 2, 32)}
N_ROWS = (512, 2048, 4000)
SEQ_LEN = 4096
CHECK_ROWS, CHECK_POS0 = 200, 60
TINY_CHECK_ROWS, TINY_CHECK_POS0 = 21, 9
REPLAYS = 7
MASK = {"fp16": 0xBFFFBFFF, "fp8": 0xBFBFBFBF}  # clear an exponent bit: finite values only
SHARED_LIMIT = 48 * 1024  # bytes of static shared memory a block
VARIANTS = {
    "default": lambda hd: (default_rows(hd), 16),
    "r16": lambda hd: (16, 16),
    "r32": lambda hd: (32, 16),
    "l8": lambda hd: (default_rows(hd), 8),
    "l32r16": lambda hd: (16, 32),
    "l32r32": lambda hd: (32, 32),
}
TINY_VARIANTS = {"default": (16, 8), "r32l4": (32, 4), "r8l16": (8, 16)}  # one warp each, or two


def shared_bytes(rows: int, lanes: int, head_dim: int) -> int:
    """Static shared memory of a block: q rows, the K/V tile, the p tile (padded rows)."""
    tile = KEYS_A_LANE * lanes
    return 4 * (rows * (head_dim + 1) + tile * (head_dim + 1) + rows * (tile + 1))


def config(n_heads: int, n_kv_heads: int, head_dim: int) -> ModelConfig:
    """A config with these attention sizes (the kernel reads no other field)."""
    return ModelConfig(
        arch="llama", dim=n_heads * head_dim, hidden_dim=8, head_dim=head_dim, n_layers=1, n_heads=n_heads,
        n_kv_heads=n_kv_heads, vocab_size=8, max_seq_len=SEQ_LEN, rope_theta=1e4, rotary_dim=head_dim,
        norm_eps=1e-5, bos_id=1, eos_ids=(),
    )  # fmt: skip


def random_cache(seq_len: int, kv_dim: int, kv_dtype: str, seed: int) -> KVCache:
    """A cache of random finite values (on the GPU: gpubench.fill; simulator: NumPy)."""
    pair = []
    for which in range(2):
        if numba_config.ENABLE_CUDASIM:
            rng = np.random.default_rng(seed + which)
            rows = formats.encode(rng.uniform(-1, 1, (seq_len, kv_dim)).astype(np.float32), kv_dtype)
            pair.append(cuda.to_device(rows))
        else:
            from gpubench import fill

            words = cuda.device_array(seq_len * kv_dim * (2 if kv_dtype == "fp16" else 1) // 4, np.uint32)
            fill(words, seed + which + 1, MASK[kv_dtype])
            pair.append(words.view(np.float16 if kv_dtype == "fp16" else np.uint8).reshape(seq_len, kv_dim))
    return KVCache(pair[0], pair[1], kv_dtype)


def state_at(pos0: int) -> object:
    state = np.zeros(3, np.int32)
    state[STATE_POS] = pos0
    return cuda.to_device(state)


def check(cache: KVCache, cfg: ModelConfig, rows: int, lanes: int, n_rows: int, pos0: int) -> float:
    """Worst |kernel - reference| / (2^-11 |ref| + 2e-5) for T = n_rows rows after pos0."""
    q = (np.random.default_rng(1).standard_normal((n_rows, cfg.q_dim)) * 0.3).astype(np.float32)
    out = cuda.to_device(np.full((n_rows, cfg.q_dim), np.nan, np.float16))
    prefill_attention(cuda.to_device(q), cache, state_at(pos0), out, cfg, stream=0, rows=rows, lanes=lanes)
    cuda.synchronize()
    k, v = (formats.decode(a.copy_to_host(), cache.dtype).astype(np.float32) for a in (cache.k, cache.v))
    want = prefill_attention_ref(q, k, v, pos0, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    err = np.abs(out.copy_to_host().astype(np.float32) - want) / (2.0**-11 * np.abs(want) + 2e-5)
    return float(np.nanmax(np.where(np.isnan(err), np.inf, err)))


def fp32_peak() -> float:
    """TFLOP/s of fp32 FMAs: SMs x 128 lanes x 2 FLOPs x the clock."""
    dev = cuda.get_current_device()
    return dev.MULTIPROCESSOR_COUNT * 128 * 2 * dev.CLOCK_RATE * 1e3 / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="default", help="'all' or names: " + ",".join(VARIANTS))
    ap.add_argument("--tiny", action="store_true", help="check only, at a tiny shape (simulator)")
    ap.add_argument("--rows", default=",".join(map(str, N_ROWS)), help="prompt lengths T to time")
    args = ap.parse_args()
    tiny = args.tiny or numba_config.ENABLE_CUDASIM
    table = TINY_VARIANTS if tiny else VARIANTS
    names = list(table) if args.variants == "all" else args.variants.split(",")
    shapes = TINY_SHAPES if tiny else SHAPES
    seq_len = 64 if tiny else SEQ_LEN
    check_rows, check_pos0 = (TINY_CHECK_ROWS, TINY_CHECK_POS0) if tiny else (CHECK_ROWS, CHECK_POS0)
    stream = cuda.stream()
    peak = float("nan")
    if not tiny:
        peak = fp32_peak()
        print(f"device: {cuda.get_current_device().name}; fp32 FMA peak {peak:.1f} TFLOP/s", flush=True)
    results, failed = [], []
    for shape, (n_heads, n_kv_heads, head_dim) in shapes.items():
        cfg = config(n_heads, n_kv_heads, head_dim)
        for kv_dtype in ("fp16", "fp8"):
            cache = random_cache(seq_len, cfg.kv_dim, kv_dtype, seed=7)
            seen = set()
            for name in names:
                rows, lanes = table[name] if tiny else table[name](head_dim)
                if (rows, lanes) in seen:
                    continue  # the same shape as an earlier variant (r32 at head_dim 128)
                seen.add((rows, lanes))
                if shared_bytes(rows, lanes, head_dim) > SHARED_LIMIT:
                    print(
                        f"{shape:11s} {kv_dtype:5s} {name:8s} n/a: {shared_bytes(rows, lanes, head_dim)} B shared"
                    )
                    continue
                err = check(cache, cfg, rows, lanes, check_rows, check_pos0)
                status = "ok" if err <= 1 else "FAILED"
                print(
                    f"{shape:11s} {kv_dtype:5s} {name:8s} rows {rows:2d} lanes {lanes:2d}: check {err:.2f} {status}"
                )
                if err > 1:
                    failed.append(f"{shape} {kv_dtype} {name}: {err:.2f}")
                if tiny:
                    continue
                from gpubench import graph_seconds

                for n_rows in map(int, args.rows.split(",")):
                    q = cuda.device_array((n_rows, cfg.q_dim), np.float32)
                    q.copy_to_device(
                        (np.random.default_rng(2).standard_normal((n_rows, cfg.q_dim)) * 0.3).astype(
                            np.float32
                        )
                    )
                    out = cuda.device_array((n_rows, cfg.q_dim), np.float16)
                    state = state_at(0)
                    launch = functools.partial(
                        prefill_attention, q, cache, state, out, cfg, stream=stream, rows=rows, lanes=lanes
                    )
                    seconds = graph_seconds(stream, launch, REPLAYS)
                    tflops = prefill_attention_flops(n_rows, 0, cfg) / seconds / 1e12
                    gbs = prefill_attention_bytes(n_rows, 0, cfg, kv_dtype) / seconds / 1e9
                    results.append((shape, kv_dtype, name, rows, lanes, n_rows, seconds * 1e3, tflops, gbs))
                    print(f"{shape:11s} {kv_dtype:5s} {name:8s} T {n_rows:5d}: {seconds * 1e3:8.3f} ms "
                          f"{tflops:6.2f} TFLOP/s ({100 * tflops / peak:4.1f}% of fp32) {gbs:7.1f} GB/s",
                          flush=True)  # fmt: skip
    if results:
        print(f"\n=== summary: one layer's prefill attention over T tokens at positions 0..T-1 "
              f"(fp32 FMA peak {peak:.1f} TFLOP/s) ===")  # fmt: skip
        print(f"{'model':11s} {'kv':5s} {'variant':8s} {'rows':>4s} {'lanes':>5s} {'T':>5s} {'ms':>8s} "
              f"{'TFLOP/s':>8s} {'% fp32':>7s} {'GB/s':>7s}")  # fmt: skip
        for r in results:
            print(f"{r[0]:11s} {r[1]:5s} {r[2]:8s} {r[3]:4d} {r[4]:5d} {r[5]:5d} {r[6]:8.3f} {r[7]:8.2f} "
                  f"{100 * r[7] / peak:6.1f}% {r[8]:7.1f}")  # fmt: skip
    if failed:
        sys.exit("prefill attention variants off the reference:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
