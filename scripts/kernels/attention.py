"""Decode attention: the shipped kernel's tunings, each checked against the reference and timed.

Versions (pycalm.kernels.attention.AttentionTuning; one kernel, a block per query head and chunk
of positions, the last block of a head combining the chunks):
  default   the shipped tuning: 256 threads, chunks of up to 256 positions, 16 K and 16 V words
            a thread, 4 K / 2 V words of a row a lane, 8 partial loads in flight in the combine
  t128      same as default but 128 threads a block
  t512      same as default but 512 threads a block
  c128      same as default but chunks of up to 128 positions
  c64       same as default but chunks of up to 64 positions
  c64t128   same as c64 but 128 threads a block
  c512      same as default but chunks of up to 512 positions (32 words a thread: more registers)
  kw2, kw8  same as default but 2 / 8 words of a K row a lane (more / fewer lanes a position)
  vw1, vw4  same as default but 1 / 4 words of a V row a lane

How to run (on the GPU machine, from the repository root):

    python3 scripts/kernels/attention.py                      # the default, timed
    python3 scripts/kernels/attention.py --variants all --check
    NUMBA_ENABLE_CUDASIM=1 python3 scripts/kernels/attention.py --variants all --tiny
        # every variant checked at a tiny shape under the simulator (no timing)

For each model shape x KV dtype x n_pos: one CUDA graph of LAYERS attention launches, each over
its own layer's cache (so the 50 MB L2 does not hold the cache between launches, as in a real
token step), replayed RUNS times and timed with CUDA events (median); each n_pos is timed with
the engine's grid (attention_span) and with a grid over the whole cache. GB/s counts the K and V
rows read at n_pos; the ceiling is a uint64 grid-stride copy measured in the same run (bytes read
+ written). Caches hold random finite fp16 / e5m2 bit patterns made on the GPU. N_POS includes
64 (a short chat) and the chunk + 1 (the shortest context that goes through the combine).
--check compares every variant's output for layer 0 with pycalm.cpu.reference.attention_ref on the
host-decoded cache: max |error| / max |ref| (float32 summation order only), against 1e-5.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: gpubench
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: pycalm

from numba import config as numba_config  # noqa: E402
from numba import cuda  # noqa: E402

from pycalm.cpu.reference import attention_ref  # noqa: E402
from pycalm.kernels.attention import (  # noqa: E402
    AttentionTuning,
    KVCache,
    attention,
    attention_scratch,
    attention_span,
)
from pycalm.model import formats  # noqa: E402
from pycalm.model.config import ModelConfig  # noqa: E402

SHAPES = {"Llama-3-8B": (32, 8, 128), "TinyLlama": (32, 4, 64)}  # n_heads, n_kv_heads, head_dim
TINY_SHAPES = {"tiny": (3, 1, 32)}
N_POS = (64, 256, 4000)
TINY_N_POS = (5, 37)
SEQ_LEN = 4096
LAYERS = 16
RUNS = 15
TOLERANCE = 1e-5  # max |error| / max |ref|
MASK = {"fp16": 0xBFFFBFFF, "fp8": 0xBFBFBFBF}  # clear an exponent bit: finite values only
DEFAULT = AttentionTuning()
VARIANTS = {
    "default": DEFAULT,
    "t128": dataclasses.replace(DEFAULT, threads=128),
    "t512": dataclasses.replace(DEFAULT, threads=512),
    "c128": dataclasses.replace(DEFAULT, max_chunk=128),
    "c64": dataclasses.replace(DEFAULT, max_chunk=64),
    "c64t128": dataclasses.replace(DEFAULT, max_chunk=64, threads=128),
    "c512": dataclasses.replace(DEFAULT, max_chunk=512, reg_words=32),
    "kw2": dataclasses.replace(DEFAULT, k_words=2),
    "kw8": dataclasses.replace(DEFAULT, k_words=8),
    "vw1": dataclasses.replace(DEFAULT, v_words=1),
    "vw4": dataclasses.replace(DEFAULT, v_words=4),
}


def for_simulator(tuning: AttentionTuning) -> AttentionTuning:
    """The same tuning with at most 64 threads and chunks of 16 (a Python thread per thread)."""
    return dataclasses.replace(tuning, threads=min(tuning.threads, 64), max_chunk=min(tuning.max_chunk, 16))


def config(n_heads: int, n_kv_heads: int, head_dim: int) -> ModelConfig:
    """A config with these attention sizes (attention reads no other field)."""
    return ModelConfig(
        arch="llama",
        dim=n_heads * head_dim,
        hidden_dim=8,
        head_dim=head_dim,
        n_layers=1,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=8,
        max_seq_len=SEQ_LEN,
        rope_theta=1e4,
        rotary_dim=head_dim,
        norm_eps=1e-5,
        bos_id=1,
        eos_ids=(),
    )


def random_caches(n_layers: int, seq_len: int, kv_dim: int, kv_dtype: str, seed: int) -> list[KVCache]:
    """n_layers caches of random finite values (on the GPU: gpubench.fill; simulator: NumPy)."""
    rng = np.random.default_rng(seed)
    caches = []
    for layer in range(n_layers):
        pair = []
        for which in range(2):
            if numba_config.ENABLE_CUDASIM:
                rows = formats.encode(rng.uniform(-1, 1, (seq_len, kv_dim)).astype(np.float32), kv_dtype)
                pair.append(cuda.to_device(rows))
            else:
                from gpubench import fill

                words = cuda.device_array(seq_len * kv_dim * (2 if kv_dtype == "fp16" else 1) // 4, np.uint32)
                fill(words, 2 * layer + which + 1 + seed, MASK[kv_dtype])
                dt = np.float16 if kv_dtype == "fp16" else np.uint8
                pair.append(words.view(dt).reshape(seq_len, kv_dim))
        caches.append(KVCache(pair[0], pair[1], kv_dtype))
    return caches


def check(q: np.ndarray, cache: KVCache, cfg: ModelConfig, scratch: object, n_pos: int, span: int) -> float:
    """Max |kernel - attention_ref| / max |ref| at n_pos, the grid over span positions."""
    state = cuda.to_device(np.array([0, n_pos - 1, 0], np.int32))
    out = cuda.to_device(np.full(q.shape[0], np.nan, np.float32))
    attention(cuda.to_device(q), cache, state, out, cfg, scratch, stream=0, span=span)
    cuda.synchronize()
    k, v = (formats.decode(a.copy_to_host(), cache.dtype).astype(np.float32) for a in (cache.k, cache.v))
    want = attention_ref(q, k, v, n_pos, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    return float(np.max(np.abs(out.copy_to_host() - want)) / np.max(np.abs(want)))


def attention_layers(caches: list[KVCache], q: object, state: object, out: object, cfg: ModelConfig,
                     scratch: object, stream: object, span: int | None) -> None:  # fmt: skip
    """The launches of one timed graph: attention over every layer's cache."""
    for cache in caches:
        attention(q, cache, state, out, cfg, scratch, stream=stream, span=span)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="default", help="'all' or names: " + ",".join(VARIANTS))
    ap.add_argument("--check", action="store_true", help="compare each variant with attention_ref")
    ap.add_argument("--tiny", action="store_true", help="check only, at a tiny shape (simulator)")
    args = ap.parse_args()
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    tiny = args.tiny or numba_config.ENABLE_CUDASIM
    shapes, positions = (TINY_SHAPES, TINY_N_POS) if tiny else (SHAPES, N_POS)
    seq_len = 64 if tiny else SEQ_LEN
    stream = cuda.stream()
    ceiling = float("nan")
    if not tiny:
        from gpubench import copy_ceiling

        ceiling = copy_ceiling(stream)
        print(f"device: {cuda.get_current_device().name}")
        print(f"copy ceiling (uint64 grid-stride, read + write): {ceiling:,.0f} GB/s", flush=True)
    rows, failed = [], []
    for shape, (n_heads, n_kv_heads, head_dim) in shapes.items():
        cfg = config(n_heads, n_kv_heads, head_dim)
        kv_dim = n_kv_heads * head_dim
        q_host = (np.random.default_rng(0).standard_normal(n_heads * head_dim) * 0.3).astype(np.float32)
        q = cuda.to_device(q_host)
        out = cuda.device_array(n_heads * head_dim, np.float32)
        for kv_dtype in ("fp16", "fp8"):
            caches = random_caches(1 if tiny else LAYERS, seq_len, kv_dim, kv_dtype, seed=0)
            for name in names:
                tuning = for_simulator(VARIANTS[name]) if tiny else VARIANTS[name]
                scratch = attention_scratch(
                    n_heads, head_dim, kv_dtype, seq_len, tuning=tuning, stream=stream
                )
                for n_pos in (*positions, scratch.chunk + 1):
                    span = attention_span(n_pos - 1, scratch.chunk, seq_len)  # the engine's grid
                    err = (
                        check(q_host, caches[0], cfg, scratch, n_pos, span)
                        if args.check or tiny
                        else float("nan")
                    )
                    if err > TOLERANCE:
                        failed.append(f"{shape} {kv_dtype} {name} n_pos {n_pos}: error {err:.1e}")
                    if tiny:
                        print(f"{shape} {kv_dtype} {name:8s} n_pos {n_pos:3d}: error {err:.1e}", flush=True)
                        continue
                    from gpubench import graph_seconds

                    state = cuda.to_device(np.array([0, n_pos - 1, 0], np.int32))
                    launch = functools.partial(attention_layers, caches, q, state, out, cfg, scratch, stream)
                    t = graph_seconds(stream, functools.partial(launch, span), RUNS) / LAYERS
                    t_whole = graph_seconds(stream, functools.partial(launch, None), RUNS) / LAYERS
                    gbs = n_pos * kv_dim * 2 * (2 if kv_dtype == "fp16" else 1) / t / 1e9
                    rows.append((shape, kv_dtype, name, n_pos, t * 1e6, gbs, 100 * gbs / ceiling, err,
                                 scratch.chunk, t_whole * 1e6))  # fmt: skip
                    print(f"{shape:11s} {kv_dtype:5s} {name:9s} {n_pos:6d} {t * 1e6:8.2f} us {gbs:8,.0f} GB/s "
                          f"err {err:.1e} chunk {scratch.chunk}; whole-cache grid {t_whole * 1e6:.2f} us",
                          flush=True)  # fmt: skip
            del caches
    if rows:
        print(
            "\n=== summary (us a layer; KV GB/s; % of the copy ceiling; max rel. error vs attention_ref) ==="
        )
        print(f"copy ceiling {ceiling:,.0f} GB/s")
        print(f"{'model':11s} {'kv':5s} {'variant':9s} {'n_pos':>6s} {'us/layer':>9s} {'KV GB/s':>8s} "
              f"{'% ceil':>7s} {'err':>8s} {'chunk':>6s} {'whole-cache grid us':>20s}")  # fmt: skip
        for r in rows:
            print(f"{r[0]:11s} {r[1]:5s} {r[2]:9s} {r[3]:6d} {r[4]:9.2f} {r[5]:8,.0f} {r[6]:6.1f}% "
                  f"{r[7]:8.1e} {r[8]:6d} {r[9]:20.2f}")  # fmt: skip
    if failed:
        sys.exit("attention variants off the reference:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
