"""What a user waits for, on the GPU: time to the first token from a cold and a warm kernel cache,
the weights' upload rate, and the decode rate inside generate beside the graph-replay figure.

    python scripts/bench_startup.py tokenizer OUT.npz         # here: SmolLM2's tokenizer and config
    python scripts/bench_startup.py run --tokenizer OUT.npz   # on the GPU machine: everything below
    python scripts/bench_startup.py table                     # on the GPU machine: the first-call table

- SmolLM2 through the CLI: a pycalm file of SmolLM2's shape and tokenizer with random fp16
  weights is written, then `python -m pycalm.generate FILE -i PROMPT -n 64 -t 0 --device gpu
  --cache-dir DIR` runs in fresh processes: once with an empty DIR (cold: every kernel
  compiles), then twice more (warm: every kernel from the cache). Time to first token is from
  the process's start to the first byte on its stdout (the interpreter's start included); the
  CLI's own timing line is printed too.
- The Llama-3-8B shape (gf4 by default; --big-dtype), random weights written to a file on the GPU
  machine: in fresh processes, cold and warm, the engine's ready time (the weights uploaded from
  the file, the kernels compiled or loaded, a run's token steps captured: GpuEngine.prepare) and
  the time to its first token, with the upload's GB/s.
- Every measured process keeps Python's bytecode as an installed package does (child_env); the
  first run writes it.
- Decode: for each shape and format of --decode, generate's tok/s over 256 new tokens after a
  one-token prompt (positions 0..255), with the default lookahead and with a host round trip a
  token (decode_lookahead=1), beside graph replays of the same positions (scripts/bench.py's
  time_replays, the figure the decode benchmark reports).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

PROMPT = "The capital of France is"


# ---------------------------------------------------------------------------------------------
# model files with random weights


def save_tokenizer(out: Path, gguf: str | None) -> None:
    """SmolLM2's config, tokenizer and chat template in one small file (from the GGUF, fetched and
    converted once when none is given)."""
    from pycalm.app.models import resolve_model
    from pycalm.model.loader import open_model
    from pycalm.paths import cache_dir

    m = open_model(resolve_model(gguf, "gf4", cache_dir(), print))
    np.savez(
        out,
        config=m.config.to_json(),
        kind=m.tokenizer_kind,
        template=m.chat_template,
        blob=np.frombuffer(m.tokenizer_blob, np.uint8),
    )


def write_random_model(out: Path, config: object, kind: str, blob: bytes, template: str) -> float:
    """A pycalm file for `config` with random finite weights (norms 1, biases 0, RoPE frequencies
    right), written in 64 MiB chunks cut from one random pool; -> seconds."""
    from bench import _FP8_BITS, _FP8_MASK, _FP16_BITS, _FP16_MASK, _GF4_BITS, _GF4_MASK

    from pycalm.model.loader import ModelWriter

    t0 = time.perf_counter()
    mask, bits = {
        "fp16": (_FP16_MASK, _FP16_BITS),
        "fp8": (_FP8_MASK, _FP8_BITS),
        "gf4": (_GF4_MASK, _GF4_BITS),
    }[config.weight_dtype]
    pool = np.random.default_rng(0).integers(0, 2**32, 16 << 20, dtype=np.uint32) & np.uint32(
        mask
    ) | np.uint32(bits)
    pool_bytes = pool.view(np.uint8)
    with ModelWriter(out, config, kind, blob, template) as w:
        for spec in w.pending():
            if spec.dtype == np.float32:
                if spec.name == "rope_freqs":
                    i = np.arange(spec.shape[0], dtype=np.float64)
                    w.write(spec.name, (config.rope_theta ** (-2 * i / config.rotary_dim)).astype(np.float32))
                else:  # norms 1, biases and the router 0
                    one = 1.0 if spec.name.endswith("norm") else 0.0
                    w.write(spec.name, np.full(spec.shape, one, np.float32))
                continue
            row_bytes = spec.shape[-1] * spec.dtype.itemsize
            rows = int(np.prod(spec.shape[:-1]))
            per_chunk = max(1, len(pool_bytes) // row_bytes)
            for r in range(0, rows, per_chunk):
                n = min(per_chunk, rows - r)
                w.write(spec.name, pool_bytes[: n * row_bytes].view(spec.dtype).reshape(n, spec.shape[-1]))
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# fresh processes


def child_env() -> dict[str, str]:
    """The measured processes' environment: this repository on the path, and Python's bytecode
    kept (in PYTHONPYCACHEPREFIX, else a folder of the temporary directory) as an installed
    package keeps it, whatever PYTHONDONTWRITEBYTECODE says here (the GPU machine sets it, and
    every process would compile the sources of pycalm, numpy and numba-cuda again: 0.74 s)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env.setdefault("PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / "pycalm-bench-pyc"))
    return env


def cli_first_token(model: Path, cache: Path, steps: int = 64) -> dict:
    """Run the CLI in a fresh process: seconds from its start to the first byte of its stdout,
    to its end, and its timing line."""
    cmd = [sys.executable, "-m", "pycalm.generate", str(model), "-i", PROMPT, "-n", str(steps), "-t", "0"]
    cmd += ["--device", "gpu", "--cache-dir", str(cache)]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=child_env())
    first = os.read(p.stdout.fileno(), 1)
    t_first = time.perf_counter() - t0
    rest, err = p.communicate()
    total = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(err.decode()[-3000:])
    return dict(first_token_s=t_first, total_s=total, timing=err.decode().strip().splitlines()[-1],
                text=(first + rest).decode(errors="replace")[:60])  # fmt: skip


_READY = r"""
import json, sys, time
t_start = float(sys.argv[3])
from pycalm.gpu import kernel_cache as cache
cache.set_root(sys.argv[2])
before = cache.cached_kernels()
from pycalm.gpu.engine import EngineOptions, GpuEngine
from pycalm.model.loader import open_model
from pycalm.cpu.sampler import SamplingParams
t_import = time.time()
model = open_model(sys.argv[1])
t0 = time.perf_counter()
engine = GpuEngine(model, seq_len=4096, options=EngineOptions(compile_while_loading=sys.argv[4] == "1"))
upload = time.perf_counter() - t0
greedy = SamplingParams(temperature=0.0)
t1 = time.perf_counter()
engine.prepare(greedy, range(15, 15 + 64))
prepare = time.perf_counter() - t1
t_ready = time.time()
tokens = engine.generate(list(range(1, 17)), 0, 64, greedy)
next(tokens)
t_first = time.time()
for _ in tokens:
    pass
print("READY" + json.dumps(dict(import_s=t_import - t_start, upload_s=upload, prepare_s=prepare,
    ready_s=t_ready - t_start, first_token_s=t_first - t_start, compiled=cache.cached_kernels() - before,
    file_bytes=model.path.stat().st_size)))
"""


def engine_ready(model: Path, cache: Path, overlap: bool = True) -> dict:
    """A fresh process: open the file, GpuEngine (the upload, and with overlap the token step's
    kernels compiled meanwhile), prepare, the first token."""
    p = subprocess.run(
        [sys.executable, "-c", _READY, str(model), str(cache), repr(time.time()), str(int(overlap))],
        capture_output=True, text=True, cwd=ROOT, env=child_env(),
    )  # fmt: skip
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("READY")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(p.stderr[-3000:])
    r = json.loads(lines[-1][5:])
    r["upload_gbs"] = r["file_bytes"] / r["upload_s"] / 1e9
    return r


_FIRST_CALL = r"""
import json, sys, time
sys.path.insert(0, "scripts")
from pycalm.gpu import kernel_cache as cache
cache.set_root(sys.argv[3])
before = cache.cached_kernels()
from bench import RandomDeviceModel, config_for
from pycalm.gpu.engine import EngineOptions, GpuEngine
from pycalm.cpu.sampler import SamplingParams
options = EngineOptions(parallel_compile=json.loads(sys.argv[4]))
t0 = time.perf_counter()
engine = GpuEngine(RandomDeviceModel(config_for(sys.argv[1], sys.argv[2], 4096)), seq_len=4096, kv_dtype="fp16",
                   options=options)
engine_s = time.perf_counter() - t0
greedy = SamplingParams(temperature=0.0)
prompt = [1 + (7 * i) % 30000 for i in range(2000)]
calls = []
for _ in range(2):
    t0 = time.perf_counter()
    tokens = engine.generate(prompt, 0, 64, greedy)
    next(tokens)
    first = time.perf_counter() - t0
    n = sum(1 for _ in tokens)
    calls.append(dict(first_token_s=first, rest_tok_s=n / (time.perf_counter() - t0 - first)))
p = engine.precompile and engine.precompile.finish()  # the workers' own figures
workers = p and dict(processes=p.processes, compiled=len(p.compiled), wait_s=p.wait_s, failures=p.failures,
                     slowest=p.slowest, kernels=sorted(p.compiled, key=lambda c: -c[1]))
print("CALLS" + json.dumps(dict(calls=calls, compiled=cache.cached_kernels() - before, engine_s=engine_s,
                                workers=workers)))
"""


def first_calls(shape: str, dtype: str, cache: Path, parallel_compile: int | None = None) -> dict:
    """The issue's table, like for like: a fresh process builds a GpuEngine on random device
    weights and calls generate twice with a 2,000-token prompt and 64 new tokens; seconds from
    each call to its first token (the first call pays for compiling or loading the kernels and
    capturing the graphs). parallel_compile: EngineOptions' (0: no worker processes; with them,
    a cold cache is filled while GpuEngine() makes the weights, so the first call is counted from
    the engine's construction too, engine_s)."""
    p = subprocess.run(
        [sys.executable, "-c", _FIRST_CALL, shape, dtype, str(cache), json.dumps(parallel_compile)],
        capture_output=True, text=True,
        cwd=ROOT, env=child_env(),
    )  # fmt: skip
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("CALLS")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(lines[-1][5:])


def table(args: argparse.Namespace) -> None:
    """First and second call of generate (2,000-token prompt) in fresh processes, with an empty
    and then a filled kernel cache, for each shape:dtype of --cells."""
    work = Path(tempfile.mkdtemp(prefix="pycalm-table-"))
    results = []
    for cell in args.cells.split(","):
        shape, dtype = cell.split(":")
        cache = work / f"cache-{shape}-{dtype}"
        for label in ("cold", "warm"):
            r = dict(
                shape=shape,
                dtype=dtype,
                cache=label,
                **first_calls(shape, dtype, cache, args.parallel_compile),
            )
            results.append(r)
            first, second = r["calls"]
            w = r["workers"]
            by = "" if w is None else (
                f", {w['compiled']} by {w['processes']} worker processes, waited for {w['wait_s']:.2f} s,"
                f" slowest kernel {w['slowest'][1] if w['slowest'] else 0:.1f} s{', FAILED' if w['failures'] else ''}"
            )  # fmt: skip
            print(
                f"{shape} {dtype} {label} cache: GpuEngine() {r['engine_s']:.2f} s, first call"
                f" {first['first_token_s']:.2f} s to the first token, second call {second['first_token_s']:.3f} s"
                f" ({r['compiled']} kernels compiled{by})",
                flush=True,
            )
            if w and w["kernels"]:  # the workers' slowest compiles (seconds, 8 compiling at once)
                slow = ", ".join(f"{k.split(' ')[0].rsplit('.', 1)[-1]} {t:.1f}" for k, t in w["kernels"][:6])
                print(f"  slowest compiles: {slow}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


# ---------------------------------------------------------------------------------------------
# decode: generate against graph replays


def decode_cell(shape: str, dtype: str, tokens: int = 256) -> dict:
    import functools

    from bench import RandomDeviceModel, config_for, time_replays

    from pycalm.cpu.sampler import SamplingParams
    from pycalm.gpu.engine import EngineOptions, GpuEngine

    greedy = SamplingParams(temperature=0.0)
    out = dict(shape=shape, dtype=dtype)
    for name, lookahead in (("generate", EngineOptions().decode_lookahead), ("round_trip", 1)):
        engine = GpuEngine(
            RandomDeviceModel(config_for(shape, dtype, 4096)), seq_len=4096, kv_dtype="fp16",
            options=EngineOptions(decode_lookahead=lookahead),
        )  # fmt: skip
        engine.prepare(greedy, range(tokens))
        for _ in engine.generate([1], 0, 16, greedy):  # warm-up
            pass
        rates = []
        for _ in range(3):
            stamps = [time.perf_counter() for _ in engine.generate([1], 0, tokens, greedy)]
            rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
        out[name] = float(np.median(rates))
        if name == "generate":
            step = functools.partial(engine.graph, greedy)
            time_replays(engine, step, 0, 16)
            out["replay"] = float(np.median([1 / time_replays(engine, step, 0, tokens) for _ in range(3)]))
        del engine
        gc.collect()  # the captured graphs' closures hold the engine in a cycle: free its weights now
    out["generate_vs_replay"] = out["generate"] / out["replay"]
    return out


# ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> None:
    from pycalm.gpu import kernel_cache as kernel_cache
    from pycalm.model.config import ModelConfig

    work = Path(tempfile.mkdtemp(prefix="pycalm-startup-"))
    kernel_cache.set_root(work / "decode-cache")  # the decode cells' own cache (this process)
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    tk = np.load(args.tokenizer)  # SmolLM2's tokenizer, for the big file too (its ids are never decoded)
    kind, blob, template = str(tk["kind"]), tk["blob"].tobytes(), str(tk["template"])
    if args.smollm2:
        smol_cfg = dataclasses.replace(ModelConfig.from_json(str(tk["config"])), weight_dtype="fp16")
        smol = work / "smollm2-random-fp16.pycalm"
        write_s = write_random_model(smol, smol_cfg, kind, blob, template)
        print(
            f"SmolLM2 shape, random fp16: {smol.stat().st_size / 1e6:.0f} MB written in {write_s:.1f} s",
            flush=True,
        )
        cache = work / "smol-cache"
        runs = [cli_first_token(smol, cache) for _ in range(3)]  # cold, warm, warm
        results["smollm2_cli"] = runs
        for label, r in zip(("cold", "warm", "warm"), runs, strict=True):
            print(
                f"  {label}: first token {r['first_token_s']:.2f} s, exit {r['total_s']:.2f} s | {r['timing']}",
                flush=True,
            )
    if args.big:
        from bench import config_for

        big_cfg = config_for(args.big, args.big_dtype, 8192)
        big = work / f"{args.big}-{args.big_dtype}.pycalm"
        write_s = write_random_model(big, big_cfg, kind, blob, "")
        print(
            f"{args.big} {args.big_dtype}: {big.stat().st_size / 1e9:.2f} GB written in {write_s:.1f} s",
            flush=True,
        )
        runs = []  # cold, warm: compiling while the weights load, then after
        for overlap in (True, False):
            cache = work / f"big-cache-{int(overlap)}"
            runs += [dict(engine_ready(big, cache, overlap), overlap=overlap) for _ in range(2)]
        results["big_ready"] = runs
        labels = ("cold, compile while loading", "warm, compile while loading", "cold, after", "warm, after")
        for label, r in zip(labels, runs, strict=True):
            print(
                f"  {label}: import {r['import_s']:.2f} s, GpuEngine() {r['upload_s']:.2f} s"
                f" ({r['upload_gbs']:.1f} GB/s of file{', kernels included' if r['overlap'] else ''}),"
                f" prepare {r['prepare_s']:.2f} s ({r['compiled']} kernels compiled), ready {r['ready_s']:.2f} s,"
                f" first token {r['first_token_s']:.2f} s",
                flush=True,
            )
        big.unlink()
    for cell in filter(None, args.decode.split(",")):
        shape, dtype = cell.split(":")
        r = decode_cell(shape, dtype)
        results.setdefault("decode", []).append(r)
        print(
            f"{shape} {dtype}: generate {r['generate']:.1f} tok/s, round trip {r['round_trip']:.1f},"
            f" replay {r['replay']:.1f} (generate / replay {r['generate_vs_replay']:.3f})",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def read_only_s(path: Path, readers: int, piece: int) -> float:
    """Seconds for `readers` threads to read the file in pieces of `piece` bytes (interleaved)
    into pageable host buffers: what the page cache gives, with no GPU."""
    from concurrent.futures import ThreadPoolExecutor

    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    bufs = [np.empty(piece, np.uint8) for _ in range(readers)]

    def read(i: int) -> None:
        buf = memoryview(bufs[i])
        for off in range(i * piece, size, readers * piece):
            os.preadv(fd, [buf[: min(piece, size - off)]], off)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        list(pool.map(read, range(readers)))
    t = time.perf_counter() - t0
    os.close(fd)
    return t


def upload_sweep(args: argparse.Namespace) -> None:
    """The upload's GB/s from a page-cached file by reader threads, beside the same threads
    reading the same pieces into pageable host memory only (the page cache's own rate)."""
    from bench import config_for
    from numba import cuda

    from pycalm.model import loader

    tk = np.load(args.tokenizer)
    path = Path(tempfile.mkdtemp(prefix="pycalm-upload-")) / "big.pycalm"
    cfg = config_for(args.shape, args.dtype, 8192)
    write_s = write_random_model(path, cfg, str(tk["kind"]), tk["blob"].tobytes(), "")
    size = path.stat().st_size
    print(f"{args.shape} {args.dtype}: {size / 1e9:.2f} GB written in {write_s:.1f} s", flush=True)
    model = loader.open_model(path)
    names = [n for n in model.names() if n != "tokenizer"]
    stream = cuda.stream()
    upload_tensors = loader.upload_tensors
    upload_tensors(model, names[:4], stream=stream)  # CUDA context and pinned memory warm
    for readers in map(int, args.readers.split(",")):
        loader.READERS = readers
        t0 = time.perf_counter()
        out = upload_tensors(model, names, stream=stream)
        t = time.perf_counter() - t0
        del out
        t_read = read_only_s(path, readers, loader.STAGING_BYTES)
        print(
            f"  readers {readers}: upload {size / t / 1e9:.1f} GB/s, read only {size / t_read / 1e9:.1f} GB/s",
            flush=True,
        )
    path.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenizer", help="save SmolLM2's config, tokenizer and template (needs the GGUF)")
    t.add_argument("out")
    t.add_argument("--gguf", help="SmolLM2's GGUF (default: fetched into pycalm's cache)")
    r = sub.add_parser("run", help="the measurements (GPU)")
    r.add_argument("--tokenizer", required=True, help="the file the tokenizer command wrote")
    r.add_argument("--no-smollm2", dest="smollm2", action="store_false", help="skip the SmolLM2 CLI runs")
    r.add_argument("--big", default="llama3-8b", help="a shape of scripts/bench.py ('' to skip)")
    r.add_argument("--big-dtype", default="gf4")
    r.add_argument("--decode", default="tinyllama-1.1b:fp16,llama3-8b:fp16,llama3-8b:gf4")
    r.add_argument("--json", help="write every figure here")
    f = sub.add_parser(
        "table", help="first and second generate call, 2,000-token prompt, cold and warm (GPU)"
    )
    f.add_argument("--cells", default="tinyllama-1.1b:fp16,llama3-8b:fp16,llama3-8b:gf4")
    f.add_argument("--json", help="write every figure here")
    f.add_argument(
        "--parallel-compile", type=int, default=None,
        help="EngineOptions.parallel_compile: worker processes for a cold cache (0: none; default: the engine's)",
    )  # fmt: skip
    u = sub.add_parser("upload", help="the upload's GB/s by reader threads (GPU)")
    u.add_argument("--tokenizer", required=True)
    u.add_argument("--shape", default="llama3-8b")
    u.add_argument("--dtype", default="fp16")
    u.add_argument("--readers", default="1,2,4,8,16")
    args = ap.parse_args()
    if args.cmd == "tokenizer":
        save_tokenizer(Path(args.out), args.gguf)
    elif args.cmd == "upload":
        upload_sweep(args)
    elif args.cmd == "table":
        table(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
