"""Attention and sampling on the GPU (run on the H200, simulator off; ~40 s with the defaults).

    python scripts/bench_attention.py [--variants all|NAME,NAME] [--check]

Attention: for each model shape x KV dtype x n_pos, one CUDA graph of LAYERS attention calls,
each over its own layer's cache (so the 50 MB L2 does not hold the cache between calls, as in a
real token step), replayed RUNS times and timed with CUDA events (median). Per-layer time
includes the ~1 us a kernel that a graph costs (two kernels a call). GB/s counts the KV bytes
read at n_pos (K and V rows of the attended positions); the ceiling is a uint64 grid-stride copy
measured in the same run (bytes read + written). Caches hold random finite fp16 / e5m2 bit
patterns made on the GPU. N_POS includes 64 (a short context: most tokens of a short chat) and
the chunk length + 1 (the shortest context that goes through the last-block combine). With --check, every variant's output for layer 0 is compared with
attention_ref on the host-decoded cache (max abs error over max |ref|; float32 order only).
Each n_pos is timed with the engine's grid (attention_span) and with a grid over the whole cache.

Variants (--variants) set attention.py's tuning knobs (THREADS a block; MAX_CHUNK and REG_WORDS:
the positions a block takes; K_WORDS / V_WORDS: words of a row a lane takes). Also: argmax (two passes with scratch, and one block) and sample (normal and peaked logits, four settings; --sample-only times these alone)
over 128256 logits, each as a graph of 32 launches. The last lines are a summary table.
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)

import numpy as np  # noqa: E402
from gpubench import copy_ceiling, fill, graph_seconds  # noqa: E402
from numba import cuda  # noqa: E402

from pycalm import formats  # noqa: E402
from pycalm.kernels import attention as att  # noqa: E402
from pycalm.kernels.sample import argmax, argmax_scratch_shape, sample  # noqa: E402

SHAPES = {"Llama-3-8B": (32, 8, 128), "TinyLlama": (32, 4, 64)}  # n_heads, n_kv_heads, head_dim
N_POS = (64, 256, 4000)
SEQ_LEN = 4096
LAYERS = 16
RUNS = 15
VOCAB = 128256
MASK = {"fp16": 0xBFFFBFFF, "fp8": 0xBFBFBFBF}  # clear an exponent bit: finite values only
VARIANTS = {  # name -> attention.py knobs
    "default": {},
    "t128": {"THREADS": 128},
    "t512": {"THREADS": 512},
    "c128": {"MAX_CHUNK": 128},
    "c64": {"MAX_CHUNK": 64},
    "c64t128": {"MAX_CHUNK": 64, "THREADS": 128},
    "c512": {"MAX_CHUNK": 512, "REG_WORDS": 32},
    "kw2": {"K_WORDS": 2},
    "kw8": {"K_WORDS": 8},
    "vw4": {"V_WORDS": 4},
    "vw1": {"V_WORDS": 1},
}


def timed(stream, record, runs=RUNS):
    """Seconds per replay of a graph of `record`'s launches (median of runs)."""
    return graph_seconds(stream, record, runs)


def set_knobs(knobs):
    defaults = {"THREADS": 256, "MAX_CHUNK": 256, "REG_WORDS": 16, "K_WORDS": 4, "V_WORDS": 2}
    for k, v in {**defaults, **knobs}.items():
        setattr(att, k, v)
    att.attention_kernel.cache_clear()  # K_WORDS / V_WORDS / REG_WORDS are not in its cache key


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="default", help="'all' or names: " + ",".join(VARIANTS))
    ap.add_argument("--check", action="store_true", help="compare each variant with attention_ref")
    ap.add_argument("--diag", action="store_true", help="time the chunk and combine kernels alone")
    ap.add_argument("--sample-only", action="store_true", help="time argmax and sample only")
    args = ap.parse_args()
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    stream = cuda.stream()
    ceiling = copy_ceiling(stream)
    print(f"device: {cuda.get_current_device().name}")
    print(f"copy ceiling (uint64 grid-stride, read + write): {ceiling:,.0f} GB/s", flush=True)
    rows = []
    for name, (n_heads, n_kv_heads, head_dim) in ({} if args.sample_only else SHAPES).items():
        kv_dim = n_kv_heads * head_dim
        q_host = np.random.default_rng(0).standard_normal(n_heads * head_dim).astype(np.float32) * 0.3
        q = cuda.to_device(q_host)
        out = cuda.device_array(n_heads * head_dim, np.float32)
        for kv_dtype in ("fp16", "fp8"):
            elt = 2 if kv_dtype == "fp16" else 1
            dt = np.float16 if kv_dtype == "fp16" else np.uint8
            caches = []
            for layer in range(LAYERS):
                pair = []
                for which in range(2):
                    words = cuda.device_array(SEQ_LEN * kv_dim * elt // 4, np.uint32)
                    fill(words, 2 * layer + which + 1, MASK[kv_dtype], stream=stream)
                    pair.append(words.view(dt).reshape(SEQ_LEN, kv_dim))
                caches.append(pair)
            ref_kv = None
            if args.check:
                stream.synchronize()
                ref_kv = [formats.decode(c.copy_to_host(), kv_dtype).astype(np.float32) for c in caches[0]]
            for vname in names:
                set_knobs(VARIANTS[vname])
                part = att.attention_scratch(n_heads, head_dim, kv_dtype, SEQ_LEN, stream=stream)
                for n_pos in (*N_POS, part.chunk + 1):
                    state = cuda.to_device(np.array([0, n_pos - 1, 0, 0], np.int32))
                    span = att.attention_span(n_pos - 1, part.chunk, SEQ_LEN)  # the engine's grid
                    err = float("nan")
                    if ref_kv is not None:
                        out.copy_to_device(np.full(n_heads * head_dim, np.nan, np.float32))
                        att.attention(
                            q,
                            *caches[0],
                            state,
                            out,
                            n_heads,
                            n_kv_heads,
                            head_dim,
                            kv_dtype,
                            0,
                            part,
                            stream=stream,
                            span=span,
                        )
                        stream.synchronize()
                        want = att.attention_ref(q_host, *ref_kv, n_pos, n_heads, n_kv_heads, head_dim)
                        err = float(np.max(np.abs(out.copy_to_host() - want)) / np.max(np.abs(want)))
                    launch_args = (
                        caches,
                        q,
                        state,
                        out,
                        (n_heads, n_kv_heads, head_dim),
                        kv_dtype,
                        part,
                        stream,
                    )
                    t = timed(stream, functools.partial(_attention_layers, *launch_args, span)) / LAYERS
                    t_whole = timed(stream, functools.partial(_attention_layers, *launch_args, None)) / LAYERS
                    gbs = n_pos * kv_dim * 2 * elt / t / 1e9
                    rows.append(
                        (
                            name,
                            kv_dtype,
                            vname,
                            n_pos,
                            t * 1e6,
                            gbs,
                            100 * gbs / ceiling,
                            err,
                            part.chunk,
                            t_whole * 1e6,
                        )
                    )
                    if args.diag and vname == names[0]:
                        for what in ("noop",):
                            rec = functools.partial(_one_kernel, what, *launch_args)
                            td = timed(stream, rec) / LAYERS
                            print(
                                f"  diag {name} {kv_dtype} {n_pos}: {what} alone {td * 1e6:.2f} us",
                                flush=True,
                            )
                    print(
                        f"{name:11s} {kv_dtype:5s} {vname:9s} {n_pos:6d} {t * 1e6:8.2f} us {gbs:8,.0f} GB/s "
                        f"err {err:.1e} chunk {part.chunk}; whole-cache grid {t_whole * 1e6:.2f} us",
                        flush=True,
                    )
            del caches
    set_knobs({})
    vocab = VOCAB
    logits = cuda.to_device((np.random.default_rng(1).standard_normal(vocab) * 3).astype(np.float32))
    coins = cuda.to_device(np.random.default_rng(2).random(SEQ_LEN).astype(np.float32))
    state = cuda.to_device(np.array([0, 7, 0, 0], np.int32))
    scratch = cuda.device_array(argmax_scratch_shape(), np.int32)
    reps = 32
    other = []
    t = timed(stream, lambda: [argmax(logits, state, stream=stream, scratch=scratch) for _ in range(reps)])
    got = int(state.copy_to_host()[0])
    other.append(
        f"argmax over {vocab}, two passes: {t / reps * 1e6:.2f} us (token {got}, "
        f"want {int(np.argmax(logits.copy_to_host()))})"
    )
    t = timed(stream, lambda: [argmax(logits, state, stream=stream) for _ in range(reps)])
    other.append(f"argmax over {vocab}, one block: {t / reps * 1e6:.2f} us")
    # peaked: a language model's kind of distribution, 20 tokens far above the rest (the top-p
    # cut then leaves few candidates after one or two radix passes)
    peak = np.random.default_rng(1).standard_normal(vocab) * 3
    peak[np.random.default_rng(3).choice(vocab, 20, replace=False)] += 25
    peaked = cuda.to_device(peak.astype(np.float32))
    cases = [(0.8, 40, 0.95, 0.0), (1.0, 0, 1.0, 0.0), (1.0, 0, 0.9, 0.05), (0.7, 0, 0.9, 0.0)]
    for kind, lg in (("normal", logits), ("peaked", peaked)):
        for opts in cases:
            t = timed(
                stream,
                lambda o=opts, lg=lg: [sample(lg, state, coins, *o, stream=stream) for _ in range(reps)],
            )
            other.append(
                f"sample {kind} logits T={opts[0]} top_k={opts[1]} top_p={opts[2]} min_p={opts[3]}: "
                f"{t / reps * 1e6:.1f} us"
            )
    print("\n=== summary (us per layer; KV GB/s; % of the copy ceiling; max rel err vs attention_ref) ===")
    print(f"copy ceiling {ceiling:,.0f} GB/s")
    print(
        f"{'model':11s} {'kv':5s} {'variant':9s} {'n_pos':>6s} {'us/layer':>9s} {'KV GB/s':>8s} {'% ceil':>7s} "
        f"{'err':>8s} {'chunk':>6s} {'whole-cache grid us':>20s}"
    )
    for r in rows:
        print(
            f"{r[0]:11s} {r[1]:5s} {r[2]:9s} {r[3]:6d} {r[4]:9.2f} {r[5]:8,.0f} {r[6]:6.1f}% {r[7]:8.1e} {r[8]:6d} {r[9]:20.2f}"
        )
    for line in other:
        print(line)


@cuda.jit
def noop_kernel(q, k, v, state, part, count, out, window):
    if cuda.grid(1) == 1 << 30:
        state[0] = 0


def _one_kernel(what, caches, q, state, out, shape, kv_dtype, part, stream):
    """An empty kernel of the attention kernel's signature and grid per layer: what a graph
    costs for the launch alone."""
    n_heads = shape[0]
    for k, v in caches:
        args = (q, k.view(np.int64), v.view(np.int64), state, part.part, part.count, out, np.int32(0))
        noop_kernel[(n_heads, part.part.shape[1]), att.THREADS, stream](*args)


def _attention_layers(caches, q, state, out, shape, kv_dtype, part, stream, span):
    """The launches of one graph: attention over every layer's cache, the grid over span
    positions (None: the whole cache, SEQ_LEN)."""
    for k, v in caches:
        att.attention(q, k, v, state, out, *shape, kv_dtype, 0, part, stream=stream, span=span)


if __name__ == "__main__":
    main()
