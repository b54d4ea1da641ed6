"""Hopper's warpgroup intrinsics (pycalm.kernels.warpgroup) against NumPy: wgmma over tiles staged
in both descriptor layouts, the k-th 16 of K reached through the descriptor's start, and the
asynchrony the simulator twin keeps. Under the simulator these test the twins; with
PYCALM_TEST_GPU=1 the same tests run the inline PTX on the GPU (compute capability 9.0).
"""

import re

import numpy as np
import pytest
from gpu import GPU
from numba import cuda, float32, int32

from pycalm.kernels.warpgroup import (
    SWIZZLE_128B,
    SWIZZLE_NONE,
    fence_proxy_async,
    shared_byte_address,
    smem_desc,
    wgmma_commit,
    wgmma_f16,
    wgmma_f16_ra,
    wgmma_fence,
    wgmma_wait,
)

K = 64  # a staged tile's columns: 128 bytes a row, the 128-byte swizzle's row
_KERNELS: dict = {}


def _kernel(n: int) -> object:
    """A warpgroup that stages A (64, K) and B^T (n, K) in shared memory in the layout `swizzle`
    names, then out (64, n) = A B by K / 16 wgmma (the first with scale_d = 0 over garbage
    accumulators), read after the wait. early: also out2 = the accumulators read BEFORE the wait
    (on the GPU undefined; the twin gives the values from before the group)."""
    if n in _KERNELS:
        return _KERNELS[n]
    wgmma = wgmma_f16(n)
    wait_all = wgmma_wait(0)
    words_a, words_b = 64 * K // 2, n * K // 2
    acc_n = n // 2
    smem_words = words_a + words_b + 256  # the tiles, and 1 KiB to align them

    @cuda.jit
    def kernel(a, bt, out, swizzle):  # noqa: ANN001, ANN202
        # a (64, K / 2) and bt (n, K / 2) int32 words of fp16 pairs; out (64, n) float32
        smem = cuda.shared.array(smem_words, int32)  # the tiles, and 1 KiB to align them
        tid = cuda.threadIdx.x
        pad = ((1024 - (shared_byte_address(smem, 0) & 1023)) & 1023) >> 2  # words to a 1 KiB boundary
        for i in range(tid, (64 + n) * 8, 128):  # 16-byte chunks: row r, chunk c (8 fp16 of K)
            r, c = i >> 3, i & 7
            base = pad
            src_row = r
            if r >= 64:
                base, src_row = pad + words_a, r - 64
            rr = src_row
            if swizzle == SWIZZLE_128B:  # 8 rows of 128 bytes an atom, chunk c at c ^ (row & 7)
                w = base + (rr >> 3) * 256 + (rr & 7) * 32 + ((c ^ (rr & 7)) << 2)
            else:  # core matrices of 8 rows x 16 bytes: K's 8 of them 128 bytes apart (LBO)
                w = base + (rr >> 3) * 256 + c * 32 + (rr & 7) * 4
            for e in range(4):
                if r < 64:
                    smem[w + e] = a[src_row, 4 * c + e]
                else:
                    smem[w + e] = bt[src_row, 4 * c + e]
        fence_proxy_async()  # the stores above, visible to the tensor cores' reads
        cuda.syncthreads()  # every thread's stores in place before any wgmma reads them
        acc = cuda.local.array(acc_n, float32)
        for i in range(acc_n):
            acc[i] = 1e30  # garbage: the first wgmma's scale_d = 0 ignores it
        wgmma_fence()
        for kk in range(K // 16):
            # the kk-th 16 of K: 32 bytes on in the swizzled rows; 2 core matrices (256 bytes) on
            step = 8 * kk if swizzle == SWIZZLE_128B else 64 * kk
            lbo = 16 if swizzle == SWIZZLE_128B else 128  # (the swizzled K-major form has no use for it)
            da = smem_desc(smem, pad + step, lbo, 1024, swizzle)
            db = smem_desc(smem, pad + words_a + step, lbo, 1024, swizzle)
            wgmma(acc, smem, da, db, 1 if kk > 0 else 0)
        wgmma_commit()
        wait_all()
        q, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        for j in range(n // 8):
            out[16 * q + g, 8 * j + 2 * t] = acc[4 * j]
            out[16 * q + g, 8 * j + 2 * t + 1] = acc[4 * j + 1]
            out[16 * q + g + 8, 8 * j + 2 * t] = acc[4 * j + 2]
            out[16 * q + g + 8, 8 * j + 2 * t + 1] = acc[4 * j + 3]

    _KERNELS[n] = kernel
    return kernel


def _fp16_words(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype(np.float16)).view(np.int32)


@pytest.mark.parametrize("swizzle", [SWIZZLE_128B, SWIZZLE_NONE])
@pytest.mark.parametrize("n", [32, 64, 128])
def test_wgmma_matches_numpy(n: int, swizzle: int) -> None:
    rng = np.random.default_rng(n + swizzle)
    a = rng.standard_normal((64, K)).astype(np.float16)
    bt = rng.standard_normal((n, K)).astype(np.float16)
    out = cuda.to_device(np.zeros((64, n), np.float32))
    _kernel(n)[1, 128](cuda.to_device(_fp16_words(a)), cuda.to_device(_fp16_words(bt)), out, swizzle)
    got = out.copy_to_host()
    want = a.astype(np.float64) @ bt.astype(np.float64).T
    scale = np.abs(a.astype(np.float64)) @ np.abs(bt.astype(np.float64)).T
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-6), np.max(np.abs(got - want) / (scale + 1e-9))


def test_wgmma_twin_layouts_differ() -> None:
    """The two layouts put an element in different places: the same bytes read through the other
    descriptor give other sums (a layout the twin ignored would pass both tests above)."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((64, K)).astype(np.float16)
    bt = rng.standard_normal((64, K)).astype(np.float16)
    outs = []
    for swizzle in (SWIZZLE_128B, SWIZZLE_NONE):
        out = cuda.to_device(np.zeros((64, 64), np.float32))
        _kernel(64)[1, 128](cuda.to_device(_fp16_words(a)), cuda.to_device(_fp16_words(bt)), out, swizzle)
        outs.append(out.copy_to_host())
    want = a.astype(np.float32) @ bt.astype(np.float32).T
    assert np.allclose(outs[0], want, rtol=1e-3, atol=1e-3) and np.allclose(
        outs[1], want, rtol=1e-3, atol=1e-3
    )


_RA_KERNELS: dict = {}


def _ra_kernel(n: int) -> object:
    """wgmma_f16_ra: each warp's 16 rows of A (64, K) loaded from global memory straight into its
    A fragments, B^T (n, K) staged in shared memory (the core-matrix layout), out (64, n) = A B
    by K / 16 wgmma, each with the fragments of its own 16 of K (a register set a k16, all in
    flight until the one wait)."""
    if n in _RA_KERNELS:
        return _RA_KERNELS[n]
    wgmma = wgmma_f16_ra(n)
    wait_all = wgmma_wait(0)
    words_b, acc_n, frag_n = n * K // 2, n // 2, 4 * (K // 16)

    @cuda.jit
    def kernel(a, bt, out):  # noqa: ANN001, ANN202
        # a (64, K / 2) and bt (n, K / 2) int32 words of fp16 pairs; out (64, n) float32
        smem = cuda.shared.array(words_b, int32)  # B^T in core matrices: K's 8 of them 128 bytes apart
        tid = cuda.threadIdx.x
        for i in range(tid, n * 8, 128):  # 16-byte chunks: row r, chunk c (8 fp16 of K)
            r, c = i >> 3, i & 7
            w = (r >> 3) * 256 + c * 32 + (r & 7) * 4
            for e in range(4):
                smem[w + e] = bt[r, 4 * c + e]
        fence_proxy_async()  # the stores above, visible to the tensor cores' reads
        cuda.syncthreads()  # every thread's stores in place before any wgmma reads them
        acc = cuda.local.array(acc_n, float32)
        for i in range(acc_n):
            acc[i] = 0.0
        q, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        frag = cuda.local.array(frag_n, int32)  # (K / 16, 4) the A fragments of each k16
        for kk in range(K // 16):
            frag[4 * kk] = a[16 * q + g, 8 * kk + t]
            frag[4 * kk + 1] = a[16 * q + g + 8, 8 * kk + t]
            frag[4 * kk + 2] = a[16 * q + g, 8 * kk + t + 4]
            frag[4 * kk + 3] = a[16 * q + g + 8, 8 * kk + t + 4]
        wgmma_fence()  # the fragments' loads before the wgmma that read them
        for kk in range(K // 16):
            db = smem_desc(smem, 64 * kk, 128, 1024, SWIZZLE_NONE)
            wgmma(acc, frag[4 * kk], frag[4 * kk + 1], frag[4 * kk + 2], frag[4 * kk + 3], smem, db, 1)
        wgmma_commit()
        wait_all()
        for j in range(n // 8):
            out[16 * q + g, 8 * j + 2 * t] = acc[4 * j]
            out[16 * q + g, 8 * j + 2 * t + 1] = acc[4 * j + 1]
            out[16 * q + g + 8, 8 * j + 2 * t] = acc[4 * j + 2]
            out[16 * q + g + 8, 8 * j + 2 * t + 1] = acc[4 * j + 3]

    _RA_KERNELS[n] = kernel
    return kernel


@pytest.mark.parametrize("n", [24, 64])
def test_wgmma_with_a_from_registers_matches_numpy(n: int) -> None:
    rng = np.random.default_rng(n)
    a = rng.standard_normal((64, K)).astype(np.float16)
    bt = rng.standard_normal((n, K)).astype(np.float16)
    out = cuda.to_device(np.zeros((64, n), np.float32))
    _ra_kernel(n)[1, 128](cuda.to_device(_fp16_words(a)), cuda.to_device(_fp16_words(bt)), out)
    got = out.copy_to_host()
    want = a.astype(np.float64) @ bt.astype(np.float64).T
    scale = np.abs(a.astype(np.float64)) @ np.abs(bt.astype(np.float64)).T
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-6), np.max(np.abs(got - want) / (scale + 1e-9))


@cuda.jit
def _early_kernel(a, bt, out):  # noqa: ANN001, ANN202
    # a (64, 32), bt (64, 32) int32 words; out (2, 64, 64): the accumulators before and after the wait
    smem = cuda.shared.array(64 * 32 * 2 + 256, int32)
    tid = cuda.threadIdx.x
    pad = ((1024 - (shared_byte_address(smem, 0) & 1023)) & 1023) >> 2
    for i in range(tid, 128 * 8, 128):
        r, c = i >> 3, i & 7
        rr = r & 63
        w = pad + (r >> 6) * 2048 + (rr >> 3) * 256 + (rr & 7) * 32 + ((c ^ (rr & 7)) << 2)
        for e in range(4):
            smem[w + e] = a[rr, 4 * c + e] if r < 64 else bt[rr, 4 * c + e]
    fence_proxy_async()  # the stores, visible to the tensor cores
    cuda.syncthreads()  # every store in place before the wgmma
    acc = cuda.local.array(32, float32)
    for i in range(32):
        acc[i] = 0.0
    wgmma_fence()
    _wgmma64(acc, smem, smem_desc(smem, pad, 16, 1024, SWIZZLE_128B),
             smem_desc(smem, pad + 2048, 16, 1024, SWIZZLE_128B), 1)  # fmt: skip
    wgmma_commit()
    q, lane = tid >> 5, tid & 31
    g, t = lane >> 2, lane & 3
    for j in range(8):  # read before the wait: what a kernel must not do
        out[0, 16 * q + g, 8 * j + 2 * t] = acc[4 * j]
    _wait0()
    for j in range(8):
        out[1, 16 * q + g, 8 * j + 2 * t] = acc[4 * j]


_wgmma64 = wgmma_f16(64)
_wait0 = wgmma_wait(0)


@pytest.mark.skipif(GPU, reason="the twin's asynchrony: on the GPU an early read is undefined")
def test_wgmma_twin_is_asynchronous() -> None:
    """Under the simulator the sums land at the wait, not at the wgmma: a kernel that reads its
    accumulators early sees the old values (zeros here), as it may on the GPU."""
    rng = np.random.default_rng(4)
    a = rng.standard_normal((64, K)).astype(np.float16)
    bt = rng.standard_normal((64, K)).astype(np.float16)
    out = cuda.to_device(np.zeros((2, 64, 64), np.float32))
    _early_kernel[1, 128](cuda.to_device(_fp16_words(a)), cuda.to_device(_fp16_words(bt)), out)
    got = out.copy_to_host()
    want = a[:, :16].astype(np.float32) @ bt[:, :16].astype(np.float32).T  # one k16: the first 16 of K
    rows = np.arange(64)[np.arange(64) % 16 < 8]  # rows 16 q + g, and of those the even columns
    written = np.ix_(rows, (np.arange(0, 64, 8)[:, None] + 2 * np.arange(4)[None, :]).ravel())
    assert np.all(got[0][written] == 0.0)
    assert np.allclose(got[1][written], want[written], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# the real compiler: sm_90a PTX through ptxas (no GPU needed)


def ptxas_report(kernel: object, sig: tuple, label: str) -> dict:
    """Compile kernel's Python function for sm_90a (wgmma needs the arch-specific target) and run
    ptxas -v on it -> {label, rc, regs, spills, warnings, wgmma}: what the machine code shows
    (ptxas warns where it must serialize wgmma, e.g. accumulators touched while one runs)."""
    import re
    import subprocess
    import tempfile

    from test_ptx import _ptxas

    bounds = kernel.targetoptions.get("launch_bounds")
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0, "a"), launch_bounds=bounds)
    with tempfile.TemporaryDirectory() as d:
        src = f"{d}/k.ptx"
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run(
            [_ptxas(), "-arch=sm_90a", "-v", src, "-o", f"{d}/k.cubin"], capture_output=True, text=True
        )
    return {
        "label": label,
        "rc": r.returncode,
        "regs": max([int(m) for m in re.findall(r"Used (\d+) registers", r.stderr)] or [-1]),
        "spills": max([int(m) for m in re.findall(r"(\d+) bytes spill stores", r.stderr)] or [0]),
        "stack": max([int(m) for m in re.findall(r"(\d+) bytes stack frame", r.stderr)] or [0]),
        "local_in_ptx": "ld.local" in ptx or "st.local" in ptx,
        "warnings": [line for line in r.stderr.splitlines() if "warning" in line.lower()],
        "wgmma": ptx.count("wgmma.mma_async"),
        "max_regs": 65536 // (bounds[0] * bounds[1]) if bounds and len(bounds) > 1 else 255,
    }


def _reports() -> None:
    """(run with the simulator off) one JSON line a kernel: the test kernels for each n."""
    import json

    from numba import types

    from pycalm.kernels import wgmma_matmul

    for n in (32, 64, 128, 256):
        sig = (types.int32[:, ::1], types.int32[:, ::1], types.float32[:, ::1], types.int64)
        print(json.dumps(ptxas_report(_kernel(n), sig, f"wgmma n={n}")))
    for n in (24, 64):  # A from registers
        sig = (types.int32[:, ::1], types.int32[:, ::1], types.float32[:, ::1])
        print(json.dumps(ptxas_report(_ra_kernel(n), sig, f"wgmma ra n={n}")))
    panel_wg = _script("panel_wg")  # the panel on wgmma: q4 at 64 rows, its 16-warp block
    for mode, out in (("plain", types.float32), ("gate", types.float16)):
        sig = (
            types.float16[:, ::1],
            *[types.uint32[:, ::1]] * 4,
            out[:, ::1],
            types.float32[::1],
            types.int32[::1],
        )
        kernel = panel_wg.make_kernel("q4", panel_wg.MODES[mode], 8, 16, 3, 1, 1)
        print(json.dumps(ptxas_report(kernel, sig, f"panel_wg q4 {mode}")))
    probe = _script("wgmma_probe")
    sig = (types.int32[::1], types.int32[::1], types.float32[:, :, ::1], *[types.int64] * 4)
    print(json.dumps(ptxas_report(probe.probe_kernel, sig, "wgmma probe")))
    import test_tma  # Hopper's TMA: a box alone, and boxes into wgmma

    sig = (types.uint64[::1], types.int32[::1], types.int64, types.int64)
    print(json.dumps(ptxas_report(test_tma._box_kernel, sig, "tma box")))
    sig = (types.uint64[::1], types.uint64[::1], types.float32[:, ::1])
    print(json.dumps(ptxas_report(test_tma._tma_wgmma_kernel, sig, "tma wgmma")))
    attention = _script("prefill_attention")
    sig = (types.float32[:, ::1], types.uint64[:, ::1], types.uint64[:, ::1], types.int32[::1],
           types.float16[:, ::1], types.int32)  # fmt: skip
    for head_dim, group in ((128, 4), (64, 8)):  # Llama-3-8B's, TinyLlama's
        for kv_dtype in ("fp16", "fp8"):
            for double in (False, True):
                kernel = attention.wg_kernel(head_dim, group, kv_dtype, 64, double)
                label = f"attention wg{2 if double else ''} d{head_dim} {kv_dtype}"
                print(json.dumps(ptxas_report(kernel, sig, label)))
    script = _script("matmul")
    weights = {
        "fp16": (types.float16[:, ::1],),
        "fp8": (types.uint8[:, ::1],),
        "gf4": (types.uint32[:, ::1],),
        "q8": (types.int8[:, ::1], types.float32[::1]),
        "q4": (types.uint32[:, ::1], types.float16[:, :, ::1]),
    }
    for version, shape in gpu_versions(script).items():
        for dtype in script.WGMMA_DTYPES:
            for mode in ("plain", "residual", "gate"):
                out = types.float16 if mode == "gate" else types.float32
                split = (types.float32[::1], types.int32[::1]) if shape[3] else ()  # part, tiles_done
                sig = (types.float16[:, ::1], *weights[dtype], *weights[dtype], out[:, ::1], *split)
                kernel = wgmma_matmul.wgmma_kernel(*shape, mode, dtype)
                print(json.dumps(ptxas_report(kernel, sig, f"matmul {version} {dtype} {mode}")))
    for version, shape in tma_versions(script).items():  # fed by TMA, fp16 W
        for mode in ("plain", "residual", "gate"):
            out = types.float16 if mode == "gate" else types.float32
            sig = (types.uint64[::1], types.uint64[::1], types.uint64[::1], types.int32, out[:, ::1])
            kernel = wgmma_matmul.tma_kernel(
                *shape, mode
            )  # (the package's, as the script's versions launch it)
            print(json.dumps(ptxas_report(kernel, sig, f"matmul {version} fp16 {mode}")))
    for version, shape in decode_versions(script).items():  # X by TMA, W decoded by the producer
        for dtype in QUANTIZED_DTYPES:
            for mode in ("plain", "residual", "gate"):
                out = types.float16 if mode == "gate" else types.float32
                w = (
                    weights[dtype] if shape[2] != "tma" else (types.uint64[::1], *weights[dtype][1:])
                )  # (a map)
                sig = (types.uint64[::1], *w, *w, types.int32, out[:, ::1])
                kernel = script.decode_kernel(*shape, mode, dtype)
                print(json.dumps(ptxas_report(kernel, sig, f"matmul {version} {dtype} {mode}")))


def gpu_versions(script: object) -> dict:
    """The wgmma versions the GPU runs (not the simulator's small tile)."""
    return {v: shape for v, shape in script.WGMMA_VERSIONS.items() if v not in script.SIM_VERSIONS}


def tma_versions(script: object) -> dict:
    """The TMA versions the GPU runs."""
    return {v: shape for v, shape in script.TMA_VERSIONS.items() if v not in script.SIM_VERSIONS}


def decode_versions(script: object) -> dict:
    """The decode versions the GPU runs."""
    return {v: shape for v, shape in script.DECODE_VERSIONS.items() if v not in script.SIM_VERSIONS}


QUANTIZED_DTYPES = ("fp8", "gf4", "q8", "q4")
# bytes a thread that ptxas spills, at most, where it spills at all: the decode version d1's q8 gate
# (the consumers' epilogue with its row scales, at the 168 registers of 384 threads; d2, the same
# consumers, spills none)
KNOWN_SPILLS = {"matmul d1 q8 gate": 4}


def _script(name: str) -> object:
    """scripts/kernels/NAME.py as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "kernels" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wgmma_compiles_for_sm90a() -> None:
    """The intrinsics, the probe of scripts/kernels/wgmma_probe.py, panel_wg.py's q4 kernels, test_tma's TMA kernels, the
    wgmma, TMA and decode versions of scripts/kernels/matmul.py and the wg attention of
    scripts/kernels/prefill_attention.py, through numba's real compiler and ptxas for sm_90a: the wgmma a loop step takes, no spill, no
    ptxas warning (a serialized wgmma is one)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "NUMBA_ENABLE_CUDASIM": "0",
        # (and what the caller's path held: the GPU machine's numpy wheel, in front of its own)
        "PYTHONPATH": os.pathsep.join(
            [str(tests), str(tests.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    r = subprocess.run([sys.executable, "-c", "import test_warpgroup; test_warpgroup._reports()"],
                       capture_output=True, text=True, env=env, timeout=1800)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    reports = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    script = _script("matmul")
    assert len(reports) == 19 + 3 * len(gpu_versions(script)) * len(script.WGMMA_DTYPES) + 3 * len(
        tma_versions(script)
    ) + 3 * len(decode_versions(script)) * len(QUANTIZED_DTYPES)
    for rep in reports:
        assert rep["rc"] == 0 and rep["regs"] > 0, rep
        # the probe: one; TMA's box: none; the attention: 2 (head_dim / 16 + 64 / 16) a tile of
        # keys; else a K step's 4
        attention = re.match(r"attention wg2? d(\d+)", rep["label"])
        wgmmas = {"wgmma probe": 1, "tma box": 0}.get(rep["label"], K // 16)
        if rep["label"].startswith("panel_wg"):
            wgmmas = 16  # q4: 8 k16 tiles a step, the loop unrolled by its two ring slots
        if attention:
            wgmmas = 2 * (int(attention[1]) + 64) // 16
        spill = KNOWN_SPILLS.get(rep["label"], 0)
        assert rep["wgmma"] == wgmmas and rep["spills"] <= spill and rep["stack"] <= 2 * spill, (
            rep
        )  # acc in registers
        assert not rep["local_in_ptx"], rep
        assert not rep["warnings"], rep
        assert rep["regs"] <= rep["max_regs"], rep  # what the launch bounds allow


# (rs: two splits of K under the simulator, three on the GPU: K whole too)
@pytest.mark.parametrize(
    ("version", "cases"), [("ws", 15), ("rs", 45 if GPU else 30), ("ts", 3), ("ds", 12), ("dt", 12)]
)
def test_matmul_script_checks_its_wgmma_version(version: str, cases: int) -> None:
    """scripts/kernels/matmul.py's wgmma versions run their own check against the reference (under
    the simulator: the 128 x 64 tile, and the rows versions' 64 x 64 tile with K split in two and
    in four, at a shape with partial tiles and a K tail)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "kernels" / "matmul.py"
    r = subprocess.run([sys.executable, str(script), "--wgmma", version, "--check"], capture_output=True, text=True,
                       env=dict(os.environ), timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # 3 modes x 5 formats (x 2 splits: rows; TMA: fp16 alone; decode: all but fp16)
    assert r.stdout.count(" ok") == cases and "FAIL" not in r.stdout, r.stdout


def test_panel_wg_script_checks_itself() -> None:
    """scripts/kernels/panel_wg.py (the panel's products on wgmma, A from registers, X staged by
    4-byte cp.async) against the reference in every format and mode: under the simulator one
    warpgroup with K split in two; on the GPU four shapes up to the 8B's widths."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "kernels" / "panel_wg.py"
    r = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True,
                       env=dict(os.environ), timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.count(" ok") == (4 if GPU else 1) * 5 * 3 and "FAIL" not in r.stdout, r.stdout


def test_wgmma_probe_finds_where_a_model_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/kernels/wgmma_probe.py: each probed A slot's rows and B slots agree with the model
    (under the simulator, the twin's reads; on the GPU, the hardware's), and a model of the other
    layout is caught on the slots where the two differ."""
    probe = _script("wgmma_probe")
    read = sorted(probe.model(32, 16, 1024, SWIZZLE_128B)[0])
    slots = np.array([*read[::97], 5, 700, 3001])  # slots the model reads, and others
    assert probe.probe("128B", 1, slots) == (0, len(read[::97]))
    assert probe.probe("none", 1, slots)[0] == 0
    monkeypatch.setitem(probe.LAYOUTS, "wrong", (SWIZZLE_NONE, 128, 1024, 32))  # the kernel's reads
    true_model = probe.model
    monkeypatch.setattr(
        probe, "model", lambda offset, lbo, sbo, swizzle: true_model(offset, 16, 1024, SWIZZLE_128B)
    )
    bad, _ = probe.probe("wrong", 1, slots)
    assert bad > 0
