"""Launches to profile with Nsight Compute, and the attention kernel's SASS (GPU machine).

    ncu --kernel-name regex:attention --launch-skip 2 --launch-count 1 \\
        --metrics smsp__inst_executed.sum,sm__cycles_elapsed.max \\
        python3 scripts/kernels/profile_kernels.py attention 8b 256
    ncu --kernel-name regex:matvec --launch-skip 2 --launch-count 1 --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python3 scripts/kernels/profile_kernels.py matvec 2048x2048 fp8 residual
    python3 scripts/kernels/profile_kernels.py attention tiny 4000 OUTDIR   # also writes the SASS to OUTDIR
    ncu --profile-from-start off --cache-control none --clock-control none --csv \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        python3 scripts/kernels/profile_kernels.py step tinyllama-1.1b fp8 128
    ncu --profile-from-start off --launch-count 9 --section Occupancy --section WarpStateStats \\
        --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum \\
        python3 scripts/kernels/profile_kernels.py prefill llama3-8b fp16 2048

attention 8b|tiny N_POS: attention three times over a random fp16 cache (Llama-3-8B or TinyLlama
heads) at N_POS positions (the SASS: scripts/kernels/attention.py's copy of the kernel at the
shipped tuning, the same code). matvec ROWSxCOLS DTYPE plain|residual|gate: the engine's matvec,
matvec_residual or ffn_gate launch three times on random weights (gate: W1 and W3 of that shape,
with the fused norm). step SHAPE DTYPE POS: one replay of scripts/bench.py's whole token step
(random weights) at POS, after warm-up, between cudaProfilerStart and Stop: each kernel of the
step alone. The profiles in docs/BENCHMARKS.md at b282afd came from these.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: gpubench, bench
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: pycalm

import numpy as np  # noqa: E402
from gpubench import fill  # noqa: E402
from numba import cuda  # noqa: E402

from pycalm.kernels.attention import KVCache, attention_scratch  # noqa: E402
from pycalm.kernels.attention import attention as attention_launch  # noqa: E402

SEQ_LEN = 4096


def write_sass(kern: object, outdir: str, name: str) -> None:
    sass = kern.inspect_sass()
    text = sass if isinstance(sass, str) else "\n".join(sass.values())
    with open(os.path.join(outdir, f"{name}.sass"), "w") as f:
        f.write(text)
    print(name, "SASS lines", text.count("\n"))


def attention(model: str, n_pos: int, outdir: str | None) -> None:
    from bench import config_for

    cfg = config_for("llama3-8b" if model == "8b" else "tinyllama-1.1b", "fp16", SEQ_LEN)
    s = cuda.stream()
    k, v = (
        fill(cuda.device_array(SEQ_LEN * cfg.kv_dim // 2, np.uint32), seed, 0xBFFFBFFF)
        .view(np.float16)
        .reshape(SEQ_LEN, cfg.kv_dim)
        for seed in (1, 2)
    )
    cache = KVCache(k, v, "fp16")
    q = cuda.to_device(np.random.default_rng(0).standard_normal(cfg.q_dim).astype(np.float32))
    out = cuda.device_array(cfg.q_dim, np.float32)
    scratch = attention_scratch(cfg.n_heads, cfg.head_dim, "fp16", SEQ_LEN, stream=s)
    state = cuda.to_device(np.array([0, n_pos - 1, 0], np.int32))
    for _ in range(3):
        attention_launch(q, cache, state, out, cfg, scratch, stream=s)
    s.synchronize()
    if outdir:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/kernels: the copy
        from attention import DEFAULT, tuned_attention, tuned_kernel, tuned_scratch

        tuned = tuned_scratch(cfg.n_heads, cfg.head_dim, "fp16", SEQ_LEN, DEFAULT, s)
        tuned_attention(q, cache, state, out, cfg, tuned, stream=s)  # compiles it
        s.synchronize()
        t, group = DEFAULT, cfg.n_heads // cfg.n_kv_heads
        kern = tuned_kernel(
            cfg.head_dim, group, "fp16", tuned.chunk, t.threads, t.k_words, t.v_words, t.unroll
        )
        write_sass(kern, outdir, f"attention_{model}")


def matvec(shape: str, dtype: str, mode: str) -> None:
    from bench import random_weights

    from pycalm.kernels.matvec import ffn_gate, matvec, matvec_residual

    rows, cols = (int(v) for v in shape.split("x"))
    s = cuda.stream()
    w = random_weights(rows, cols, dtype, 1)
    x = cuda.to_device(np.random.default_rng(0).standard_normal(cols).astype(np.float32))
    y = cuda.to_device(np.zeros(rows, np.float32))
    for _ in range(3):
        if mode == "plain":
            matvec(w, x, y, dtype, stream=s)
        elif mode == "residual":
            matvec_residual(w, x, y, dtype, stream=s)
        else:
            norm_w = cuda.to_device(np.ones(cols, np.float32))
            ffn_gate(w, random_weights(rows, cols, dtype, 2), x, y, dtype, stream=s, norm_w=norm_w, eps=1e-5)
    s.synchronize()


def step(shape: str, dtype: str, pos: int) -> None:
    from bench import RandomDeviceModel, config_for, set_state

    from pycalm.cpu.sampler import SamplingParams
    from pycalm.gpu.engine import GpuEngine

    engine = GpuEngine(RandomDeviceModel(config_for(shape, dtype, SEQ_LEN)), seq_len=SEQ_LEN, kv_dtype="fp16")
    graph = engine.graph(SamplingParams(), pos)
    for _ in range(3):
        set_state(engine, token=1, pos=pos)
        graph.launch()
    set_state(engine, token=1, pos=pos)
    engine.stream.synchronize()
    cuda.profile_start()
    graph.launch()
    engine.stream.synchronize()
    cuda.profile_stop()


def prefill(shape: str, dtype: str, n_tokens: int) -> None:
    from bench import RandomDeviceModel, config_for, fit_layers

    from pycalm.gpu.engine import GpuEngine

    cfg = fit_layers(config_for(shape, dtype, SEQ_LEN), 2048, SEQ_LEN)
    engine = GpuEngine(RandomDeviceModel(cfg), seq_len=SEQ_LEN, kv_dtype="fp16")
    ids = [int(t) for t in np.random.default_rng(0).integers(3, cfg.vocab_size, n_tokens)]
    engine.prefill(ids, 0)  # compiles and warms every kernel
    engine.stream.synchronize()
    cuda.profile_start()
    engine.prefill(ids, 0)
    engine.stream.synchronize()
    cuda.profile_stop()


def main() -> None:
    what, args = sys.argv[1], sys.argv[2:]
    if what == "attention":
        attention(args[0], int(args[1]), args[2] if len(args) > 2 else None)
    elif what == "matvec":
        matvec(args[0], args[1], args[2])
    elif what == "step":
        step(args[0], args[1], int(args[2]))
    elif what == "prefill":
        prefill(args[0], args[1], int(args[2]))
    else:
        sys.exit(f"unknown target {what!r}: attention, matvec, step or prefill")


if __name__ == "__main__":
    main()
