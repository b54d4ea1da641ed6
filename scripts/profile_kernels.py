"""Launches to profile with Nsight Compute, and the kernels' SASS (GPU machine, simulator off).

    ncu --kernel-name regex:attention --launch-skip 2 --launch-count 1 \\
        --metrics smsp__inst_executed.sum,sm__cycles_elapsed.max \\
        python3 scripts/profile_kernels.py attention 8b 256
    ncu --kernel-name regex:matvec --launch-skip 2 --launch-count 1 --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python3 scripts/profile_kernels.py matvec 2048x2048 fp8 residual
    python3 scripts/profile_kernels.py attention tiny 4000 OUTDIR   # also writes the SASS to OUTDIR
    ncu --profile-from-start off --cache-control none --clock-control none --csv \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        python3 scripts/profile_kernels.py step tinyllama-1.1b fp8 128

attention 8b|tiny N_POS: attention three times over a random fp16 cache (Llama-3-8B or TinyLlama
heads) at N_POS positions. matvec ROWSxCOLS DTYPE plain|residual|gate: the matvec family's
default launch three times on random weights (gate: W1 and W3 of that shape, with the fused
norm). step SHAPE DTYPE POS: one replay of bench.py's whole token step (random weights) at
POS, after warm-up, between cudaProfilerStart and Stop: each kernel of the step alone. The figures in pycalm/kernels/attention.py's docstring and docs/BENCHMARKS.md came from
these.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)

import numpy as np  # noqa: E402
from bench_kernels import random_weights  # noqa: E402
from gpubench import fill  # noqa: E402
from numba import cuda  # noqa: E402

from pycalm.kernels import attention as att  # noqa: E402
from pycalm.kernels import matvec as mv  # noqa: E402


def write_sass(kern: object, outdir: str, name: str) -> None:
    sass = kern.inspect_sass()
    text = sass if isinstance(sass, str) else "\n".join(sass.values())
    with open(os.path.join(outdir, f"{name}.sass"), "w") as f:
        f.write(text)
    print(name, "SASS lines", text.count("\n"))


def attention(model: str, n_pos: int, outdir: str | None) -> None:
    n_heads, n_kv, hd = (32, 8, 128) if model == "8b" else (32, 4, 64)
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
    if outdir:
        kern = att.attention_kernel(hd, n_heads // n_kv, "fp16", part.chunk, att.THREADS)
        write_sass(kern, outdir, f"attention_{model}")


def matvec(shape: str, dtype: str, mode: str, outdir: str | None) -> None:
    rows, cols = (int(v) for v in shape.split("x"))
    s = cuda.stream()
    w = random_weights(rows, cols, dtype, 1)
    w3 = random_weights(rows, cols, dtype, 2) if mode == "gate" else w
    x = cuda.to_device(np.random.default_rng(0).standard_normal(cols).astype(np.float32))
    norm_w = cuda.to_device(np.ones(cols, np.float32)) if mode == "gate" else None
    y = cuda.to_device(np.zeros(rows, np.float32))
    code = {"plain": mv.PLAIN, "residual": mv.RESIDUAL, "gate": mv.GATE}[mode]
    for _ in range(3):
        mv.launch_family(w, w3, x, norm_w, 1e-5, y, dtype, code, stream=s)
    s.synchronize()
    if outdir:
        _, kind = mv.weight_kind(w, dtype)
        v = mv.variant_for(kind, None)
        write_sass(mv.kernel_for_variant(kind, v), outdir, f"matvec_{dtype}_{shape}")


def step(shape: str, dtype: str, pos: int) -> None:
    from bench import RandomDeviceModel, config_for

    from pycalm.gpu import GpuEngine
    from pycalm.sampler import SamplingParams

    engine = GpuEngine(RandomDeviceModel(config_for(shape, dtype, 4096)), seq_len=4096, kv_dtype="fp16")
    graph = engine.graph(SamplingParams(), pos)
    for _ in range(3):
        engine._set_state(token=1, pos=pos, feed_end=0)
        graph.launch()
    engine._set_state(token=1, pos=pos, feed_end=0)
    engine.stream.synchronize()
    cuda.profile_start()
    graph.launch()
    engine.stream.synchronize()
    cuda.profile_stop()


def main() -> None:
    what, args = sys.argv[1], sys.argv[2:]
    if what == "attention":
        attention(args[0], int(args[1]), args[2] if len(args) > 2 else None)
    elif what == "matvec":
        matvec(args[0], args[1], args[2], args[3] if len(args) > 3 else None)
    elif what == "step":
        step(args[0], args[1], int(args[2]))
    else:
        sys.exit(f"unknown target {what!r}: attention, matvec or step")


if __name__ == "__main__":
    main()
