"""Bandwidth of the weight-reading kernels on the GPU (run on the H200, simulator off).

    python scripts/bench_kernels.py            # every shape x dtype, the fused kernels, variants
    python scripts/bench_kernels.py --check    # first compare with float64 NumPy (one big shape)
    python scripts/bench_kernels.py --quick    # default variants only (fewer compiles)
    python scripts/bench_kernels.py --sweep    # only: rows x loads x warps a block, every shape

Timing: each measurement is a CUDA graph of back-to-back launches of one kernel, rotating over
enough weight copies (at least 4x the 50 MB L2) that no launch finds its weights in L2, replayed
REPLAYS times between two events; the median replay divided by the launches is the time of one
kernel as the token step's graph runs it (no Python launch cost, ~1 us of graph launch gap).
GB/s counts the bytes the launcher reports; the ceiling is a uint64 grid-stride copy timed the
same way (bytes read + written).

Weights are random bit patterns made on the GPU by a hash kernel (finite values only), so no
large host arrays cross the bus. The shapes are the Llama-3-8B layer matrices (wq/wo 4096x4096,
w1/w3 14336x4096, w2 4096x14336, fused qkv 6144x4096) and TinyLlama-1.1B's (2048x2048,
5632x2048, 2560x2048 qkv). Variants (pycalm.kernels.matvec.Variant: rows a warp, loads a row a
step, prefetch, cvt decode, 16- or 8-byte loads, warps a block, blocks an SM) are timed on a
few shapes so one run compares them; every variant costs a compile (~2-5 s).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)

import numpy as np  # noqa: E402
from gpubench import copy_ceiling, fill, graph_seconds  # noqa: E402
from numba import cuda  # noqa: E402

from pycalm import formats  # noqa: E402
from pycalm.kernels import matvec as mv  # noqa: E402
from pycalm.kernels import qkv as qk  # noqa: E402
from pycalm.kernels.common import STATE_POS  # noqa: E402
from pycalm.kernels.norm import rmsnorm_ref  # noqa: E402

LLAMA = [(14336, 4096), (4096, 14336), (4096, 4096), (6144, 4096)]
TINY = [(2048, 2048), (5632, 2048), (2560, 2048), (2048, 5632)]
DTYPES = ["fp16", "fp8", "gf4"]
ROTATE_BYTES = 200e6  # weight copies a graph cycles through: 4x the L2
REPLAYS = 7
V = mv.Variant
# variants compared (each one compile) on VARIANT_SHAPES; the defaults are mv.DEFAULT_VARIANT
VARIANTS = {
    "fp16": [V(2, 2, n_warps=16, early=False), V(2, 2, n_warps=16, wide=False)],
    "fp8": [V(2, 2, n_warps=16, early=False), V(2, 4, n_warps=16)],
    "gf4": [V(4, 1, prefetch=True, n_warps=16), V(2, 2, n_warps=8), V(2, 4, n_warps=16)],
}
VARIANT_SHAPES = [(14336, 4096), (4096, 14336), (4096, 4096), (2048, 2048)]
# launch shapes (no compile: warps a block, blocks an SM) tried with the default kernels
LAUNCH_KNOBS = [(8, 8), (8, 2), (16, 1), (16, 8)]
# finite-value masks on random uint32 words: clear one exponent bit of each fp16 / e5m2 / scale
MASK = {"fp16": 0xBFFFBFFF, "fp8": 0xBFBFBFBF, "gf4": 0xFFFFFFBF}


def random_weights(rows: int, cols: int, dtype: str, seed: int) -> object:
    w = cuda.device_array(formats.storage_shape(rows, cols, dtype), formats.STORAGE_DTYPE[dtype])
    fill(w.reshape(-1).view(np.uint32), seed, MASK[dtype])
    return w


def n_copies(rows: int, cols: int, dtype: str) -> int:
    one = rows * cols * {"fp16": 2, "fp8": 1, "gf4": 0.5}[dtype]
    return int(min(48, max(2, -(-ROTATE_BYTES // one))))


def timed(stream: object, launch: object, n_launches: int) -> float:
    """Seconds per launch: a graph of n_launches calls launch(i), replayed; the median replay."""
    return graph_seconds(stream, lambda: [launch(i) for i in range(n_launches)], REPLAYS) / n_launches


def _rel_err(got: np.ndarray, want: np.ndarray, scale: np.ndarray) -> float:
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got.astype(np.float64) - want) / scale))


def check(stream: object) -> bool:
    """The launchers against float64 NumPy at one big shape a dtype (x in two chunks for the
    plain / normed / residual products), ffn_gate at 2051x4096, qkv_rope at Llama-3-8B's."""
    rng = np.random.default_rng(0)
    ok_all = True
    for dtype in DTYPES:
        rows, cols = 4096, 14336
        w = random_weights(rows, cols, dtype, 7)
        wh = formats.decode(w.copy_to_host(), dtype).astype(np.float64)
        x = rng.standard_normal(cols).astype(np.float32)
        nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
        xd, nwd = cuda.to_device(x), cuda.to_device(nw)
        y = cuda.to_device(np.full(rows, np.nan, np.float32))
        errs = {}
        mv.matvec(w, xd, y, dtype, stream=stream)
        stream.synchronize()
        errs["plain"] = _rel_err(y.copy_to_host(), wh @ x, np.abs(wh) @ np.abs(x))
        mv.matvec(w, xd, y, dtype, stream=stream, norm_w=nwd, eps=1e-5)
        stream.synchronize()
        xn = rmsnorm_ref(x, nw, 1e-5).astype(np.float64)
        errs["normed"] = _rel_err(y.copy_to_host(), wh @ xn, np.abs(wh) @ np.abs(xn))
        r0 = rng.standard_normal(rows).astype(np.float32)
        r = cuda.to_device(r0)
        mv.matvec_residual(w, xd, r, dtype, stream=stream)
        stream.synchronize()
        errs["residual"] = _rel_err(r.copy_to_host(), r0 + wh @ x, np.abs(wh) @ np.abs(x) + np.abs(r0))
        del w, wh
        # ffn_gate 2051x4096 (a partial last row group)
        w1, w3 = random_weights(2051, 4096, dtype, 8), random_weights(2051, 4096, dtype, 9)
        w1h = formats.decode(w1.copy_to_host(), dtype).astype(np.float64)
        w3h = formats.decode(w3.copy_to_host(), dtype).astype(np.float64)
        x4 = rng.standard_normal(4096).astype(np.float32)
        nw4 = rng.uniform(0.5, 1.5, 4096).astype(np.float32)
        h = cuda.to_device(np.full(2051, np.nan, np.float32))
        mv.ffn_gate(w1, w3, cuda.to_device(x4), h, dtype, stream=stream, norm_w=cuda.to_device(nw4), eps=1e-5)
        stream.synchronize()
        xn4 = rmsnorm_ref(x4, nw4, 1e-5).astype(np.float64)
        a, b = w1h @ xn4, w3h @ xn4
        want = a / (1 + np.exp(-a)) * b
        scale = (np.abs(w1h) @ np.abs(xn4)) * (np.abs(b) + 1) + (np.abs(a) + 1) * (np.abs(w3h) @ np.abs(xn4))
        errs["ffn_gate"] = _rel_err(h.copy_to_host(), want, scale)
        del w1, w3, w1h, w3h
        # qkv_rope 6144x4096 (32 heads, 8 KV heads, head_dim 128), pos 100: q against float64
        wq = random_weights(6144, 4096, dtype, 10)
        wqh = formats.decode(wq.copy_to_host(), dtype).astype(np.float64)
        freqs = (1.0 / 500000.0 ** (np.arange(64) / 64)).astype(np.float32)
        state = cuda.to_device(np.array([1, 100, 0, 0], np.int32))
        q = cuda.to_device(np.full(4096, np.nan, np.float32))
        kc = cuda.device_array((128, 1024), np.float16)
        vc = cuda.device_array((128, 1024), np.float16)
        qk.qkv_rope(
            wq, None, cuda.to_device(x4), cuda.to_device(nw4), 1e-5, cuda.to_device(freqs), state, q, kc, vc,
            dtype, "fp16", 32, 8, 128, stream=stream,
        )  # fmt: skip
        stream.synchronize()
        raw = (wqh @ xn4)[:4096].reshape(32, 64, 2)
        ang = 100.0 * freqs.astype(np.float64)
        qr = np.stack(
            [
                raw[..., 0] * np.cos(ang) - raw[..., 1] * np.sin(ang),
                raw[..., 0] * np.sin(ang) + raw[..., 1] * np.cos(ang),
            ],
            -1,
        ).reshape(-1)
        row_scale = (np.abs(wqh) @ np.abs(xn4))[:4096].reshape(-1, 2).sum(1).repeat(2)
        errs["qkv q"] = _rel_err(q.copy_to_host(), qr, row_scale)
        vh = kc.copy_to_host()  # k row written at pos 100
        assert STATE_POS == 1
        del wq, wqh
        ok = all(e < 1e-5 for e in errs.values()) and np.all(np.isfinite(vh[100].astype(np.float32)))
        ok_all &= bool(ok)
        print(
            f"check {dtype}: max err / |W||x| " + " ".join(f"{k} {v:.1e}" for k, v in errs.items()),
            "OK" if ok else "FAIL",
        )
    return ok_all


# staged x (shared memory) and direct x (read through L1, launches without a fused norm)
SWEEP = [V(r, u, n_warps=w) for r, u in ((1, 2), (1, 4), (2, 2), (2, 4), (4, 2)) for w in (4, 8, 16)] + [
    V(r, u, n_warps=w, direct=True) for r, u in ((1, 2), (1, 4), (2, 2), (4, 1)) for w in (2, 4, 8)
]


def shape_setup(rows: int, cols: int, dtype: str, rng: object, s: object) -> tuple:
    """-> (copies, the rotating weight copies, x, y, the bytes one matvec moves) for a shape."""
    c = n_copies(rows, cols, dtype)
    ws = [random_weights(rows, cols, dtype, i) for i in range(c)]
    x = cuda.to_device(rng.standard_normal(cols).astype(np.float32))
    y = cuda.device_array(rows, np.float32)
    return c, ws, x, y, mv.matvec(ws[0], x, y, dtype, stream=s)


def sweep(s: object, dtypes: list[str], shapes: list[tuple[int, int]]) -> None:
    """Time plain matvec for every (rows, loads, warps a block) on every shape; print the best."""
    rng = np.random.default_rng(1)
    for dtype in dtypes:
        for rows, cols in shapes:
            c, ws, x, y, nb = shape_setup(rows, cols, dtype, rng, s)
            res = []
            for v in SWEEP:

                def run(
                    i: int, v: object = v, ws: list = ws, x: object = x, y: object = y, dtype: str = dtype
                ) -> None:
                    w = ws[i % len(ws)]
                    mv.launch_family(w, w, x, None, 0.0, y, dtype, mv.PLAIN, stream=s, variant=v)

                t = timed(s, run, max(c, 16))
                res.append(
                    (nb / t / 1e9, t * 1e6, f"R{v.rows}U{v.unroll}w{v.n_warps}{'d' if v.direct else ''}")
                )
            res.sort(reverse=True)
            line = " ".join(f"{n}:{g:.0f}" for g, _, n in res)
            print(f"sweep {dtype} {rows}x{cols}: {line}", flush=True)
            del ws


# TinyLlama's launches as the token step makes them (mode, fused norm), and the split variants
# (row groups shared by S warps) timed against the default launch (variant None)
SPLIT_LAUNCHES = [
    ("wo", 2048, 2048, mv.RESIDUAL),
    ("w2", 2048, 5632, mv.RESIDUAL),
    ("ffn_gate", 5632, 2048, mv.GATE),
    ("classifier", 32000, 2048, mv.PLAIN),
    ("llama3 w2", 4096, 14336, mv.RESIDUAL),
    ("llama3 ffn_gate", 14336, 4096, mv.GATE),
]
SPLIT_VARIANTS = [None] + [
    V(r, u, n_warps=w, split=sp, max_regs=m)
    for r, u, w, sp, m in (
        (2, 2, 16, 2, 0),
        (2, 4, 16, 1, 0),
        (2, 4, 8, 1, 0),
        (4, 2, 16, 1, 0),
        (2, 2, 8, 1, 64),
        (2, 2, 16, 1, 64),
        (2, 1, 16, 1, 0),
        (2, 2, 16, 2, 64),
        (2, 4, 16, 2, 0),
        (1, 4, 16, 1, 0),
    )
]


def split_sweep(s: object, dtypes: list[str], only: str = "", n_variants: int = 0) -> None:
    """Time the token step's launches of SPLIT_LAUNCHES (TinyLlama's wo and w2 residual, ffn_gate
    and the classifier with their norms; Llama-3-8B's w2 and ffn_gate) for the default launch and
    SPLIT_VARIANTS (split row groups, loads a step, rows a warp, a register cap)."""
    rng = np.random.default_rng(1)
    for dtype in dtypes:
        for name, rows, cols, mode in SPLIT_LAUNCHES:
            if only and name not in only.split(","):
                continue
            c, ws, x, y, _ = shape_setup(rows, cols, dtype, rng, s)
            nw = cuda.to_device(np.ones(cols, np.float32)) if mode != mv.RESIDUAL else None
            nb = ws[0].nbytes * (2 if mode == mv.GATE else 1)
            res = []
            for v in SPLIT_VARIANTS[: n_variants or None]:

                def run(i: int, v: object = v, ws: list = ws, x: object = x, y: object = y,
                        nw: object = nw, mode: int = mode, dtype: str = dtype) -> None:  # fmt: skip
                    w = ws[i % len(ws)]
                    w3 = ws[(i + 1) % len(ws)] if mode == mv.GATE else w
                    mv.launch_family(w, w3, x, nw, 1e-5, y, dtype, mode, stream=s, variant=v)

                t = timed(s, run, max(c, 16))
                label = "default" if v is None else (
                    f"R{v.rows}U{v.unroll}{'p' if v.prefetch else ''}w{v.n_warps}s{v.split}m{v.max_regs}"
                )  # fmt: skip
                res.append((t * 1e6, nb / t / 1e9, label))
            line = "  ".join(f"{lab} {us:.2f}us/{g:.0f}" for us, g, lab in res)
            print(f"split {dtype} {name} {rows}x{cols}: {line}", flush=True)
            del ws


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="first compare with float64 NumPy")
    ap.add_argument("--quick", action="store_true", help="default variants only")
    ap.add_argument("--sweep", default="", help="only sweep variants for these dtypes (fp8,gf4)")
    ap.add_argument("--tiny", action="store_true", help="sweep the TinyLlama shapes only")
    ap.add_argument(
        "--split", default="", help="only time SPLIT_LAUNCHES with SPLIT_VARIANTS, for these dtypes (fp8)"
    )
    ap.add_argument("--launches", default="", help="with --split: these launches only (wo,w2,..)")
    ap.add_argument("--n-variants", type=int, default=0, help="with --split: the first N variants only")
    args = ap.parse_args()
    t0 = time.time()
    s = cuda.stream()
    print(f"device: {cuda.get_current_device().name}", flush=True)
    if args.split:
        split_sweep(s, args.split.split(","), args.launches, args.n_variants)
        return
    if args.sweep:
        sweep(s, args.sweep.split(","), TINY if args.tiny else LLAMA + TINY)
        return
    if args.check:
        ok = check(s)
        print(f"check {'OK' if ok else 'FAILED'}   [{time.time() - t0:.0f} s]", flush=True)
    ceiling = copy_ceiling(s)
    print(f"uint64 copy ceiling: {ceiling:,.0f} GB/s (read + write)   [{time.time() - t0:.0f} s]", flush=True)
    table = []

    def report(name: str, dtype: str, shape: tuple, nbytes: int, t: float) -> None:
        gbs = nbytes / t / 1e9
        table.append((name, dtype, f"{shape[0]}x{shape[1]}", t * 1e6, gbs))
        print(f"{name:34s} {dtype:5s} {shape[0]:>6}x{shape[1]:<6} {t * 1e6:8.2f} us {gbs:7.0f} GB/s "
              f"{100 * gbs / ceiling:5.1f}%   [{time.time() - t0:.0f} s]", flush=True)  # fmt: skip

    rng = np.random.default_rng(1)
    for dtype in DTYPES:
        for rows, cols in LLAMA + TINY:
            c, ws, x, y, nb = shape_setup(rows, cols, dtype, rng, s)
            n = max(c, 16)

            def plain(
                i: int, v: object = None, ws: list = ws, x: object = x, y: object = y, dtype: str = dtype
            ) -> None:
                mv.launch_family(
                    ws[i % len(ws)], ws[i % len(ws)], x, None, 0.0, y, dtype, mv.PLAIN, stream=s, variant=v
                )

            report("matvec", dtype, (rows, cols), nb, timed(s, plain, n))
            if not args.quick and (rows, cols) in VARIANT_SHAPES:
                d = mv.DEFAULT_VARIANT[dtype]
                for v in VARIANTS[dtype]:
                    name = f"  R{v.rows} U{v.unroll}{' pf' if v.prefetch else ''}{'' if v.cvt else ' shift'}"
                    name += ("" if v.wide else " 8B") + ("" if v.early else " late") + f" w{v.n_warps}"
                    report(name, dtype, (rows, cols), nb, timed(s, lambda i, v=v: plain(i, v), n))
                if (rows, cols) in (VARIANT_SHAPES[0], (4096, 4096)):
                    for n_warps, bps in LAUNCH_KNOBS:
                        v = d._replace(n_warps=n_warps, blocks_per_sm=bps)
                        t = timed(s, lambda i, v=v: plain(i, v), n)
                        report(f"  default warps={n_warps} bps<={bps}", dtype, (rows, cols), nb, t)
            if (rows, cols) in ((4096, 14336), (4096, 4096)):
                nb = mv.matvec_residual(ws[0], x, y, dtype, stream=s)
                t = timed(
                    s,
                    lambda i, ws=ws, x=x, y=y, dtype=dtype: mv.matvec_residual(
                        ws[i % len(ws)], x, y, dtype, stream=s
                    ),
                    n,
                )
                report("matvec_residual", dtype, (rows, cols), nb, t)
            if (rows, cols) == (14336, 4096):
                nw = cuda.to_device(np.ones(cols, np.float32))
                nb = mv.ffn_gate(ws[0], ws[1], x, y, dtype, stream=s, norm_w=nw, eps=1e-5)
                t = timed(
                    s,
                    lambda i, ws=ws, x=x, y=y, nw=nw, dtype=dtype: mv.ffn_gate(
                        ws[i % len(ws)], ws[(i + 1) % len(ws)], x, y, dtype, stream=s, norm_w=nw, eps=1e-5
                    ),
                    n,
                )
                report("ffn_gate (w1+w3, norm)", dtype, (rows, cols), nb, t)
            if (rows, cols) == (6144, 4096):
                nw = cuda.to_device(np.ones(cols, np.float32))
                freqs = cuda.to_device((1.0 / 500000.0 ** (np.arange(64) / 64)).astype(np.float32))
                state = cuda.to_device(np.array([1, 100, 0, 0], np.int32))
                q = cuda.device_array(4096, np.float32)
                kc = cuda.device_array((4096, 1024), np.float16)
                vc = cuda.device_array((4096, 1024), np.float16)

                def qkv(i: int, ws: list = ws, x: object = x, nw: object = nw, freqs: object = freqs,
                        state: object = state, q: object = q, kc: object = kc, vc: object = vc,
                        dtype: str = dtype) -> int:  # fmt: skip
                    return qk.qkv_rope(
                        ws[i % len(ws)], None, x, nw, 1e-5, freqs, state, q, kc, vc, dtype, "fp16", 32, 8, 128,
                        stream=s,
                    )  # fmt: skip

                nb = qkv(0)
                report("qkv_rope (norm, rope, kv fp16)", dtype, (rows, cols), nb, timed(s, qkv, n))
            del ws
    print(f"\n== summary (copy ceiling {ceiling:,.0f} GB/s, total {time.time() - t0:.0f} s) ==")
    print(f"{'kernel':34s} {'dtype':5s} {'shape':>12s} {'us':>8s} {'GB/s':>7s} {'%ceil':>6s}")
    for name, dtype, shape, us, gbs in table:
        print(f"{name:34s} {dtype:5s} {shape:>12s} {us:8.2f} {gbs:7.0f} {100 * gbs / ceiling:6.1f}")


if __name__ == "__main__":
    main()
