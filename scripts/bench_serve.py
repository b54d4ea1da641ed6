"""The server under load (--streams), and the server's streamed tok/s against the CLI's.

--streams 1,8,32,64,128: many users at once through the real HTTP server (make_app and
uvicorn, the --parallel N worker) on a model of a shape with random weights
on the GPU (bench.py's RandomDeviceModel, no EOS, a tokenizer of made-up words; the server a
process of its own, as a deployment's, the clients asyncio tasks here), every stream a
closed loop of --requests streamed /v1/completions requests: a prompt of --prompt distinct
random token ids, exactly --new tokens out (sampled at --temperature, 0.8; 0: greedy, as the
token step's tok/s and vLLM's benchmark). Each row: aggregate
output tok/s (completion tokens / the wall time from the first request to the last answer),
time to first token and time per output token after it (p50 and p99 over the requests, client
side), the server's steps, the share of the wall time outside the engine's pass (scheduler,
sampling bookkeeping, detokenizing, waiting for the GIL; the hand-out of a step's tokens that
overlaps the next pass counts as outside too), and the share in which the GPU has no pass to
run (its busy time from CUDA events around each step).

    python scripts/bench_serve.py --streams 1,8,32,64,128 --shape llama3-8b --dtype fp16

--stand-in BASE,ROW (ms) puts a stand-in in the GPU's place, to measure the host's side on a
machine without one: each step sleeps BASE + ROW x its rows on the worker thread (the GIL
released, as in a wait for the GPU) and draws random tokens; the server, the scheduler, the
sampling bookkeeping and the HTTP side are the real ones. The default, 8.1,0.056, is the H200's
fp16 8B step (bench_batched.py: 64 rows 11.7 ms, 64 rows and a 192-row chunk 22.4 ms).
--stand-in R:MS,R:MS,... instead charges a step its rows' power-of-two bucket, as the GPU
engine's graphs do (docs/BENCHMARKS.md has a table); --batch-size N passes the server's.
--profile FILE writes the worker thread's cProfile (pstats) there each time the batch empties.

    python scripts/bench_serve.py --streams 64 --stand-in 8.1,0.056 --profile /tmp/worker.prof

Without --streams:

A random-weight model of SmolLM2-135M's shape (tests/tiny_models.make_gguf, converted to fp16;
its 64-token vocabulary, no EOS so every run makes all its tokens) is written to a temporary
folder. Then, greedy from the same prompt, N tokens each:
  - the CLI (python -m pycalm.generate -i), its decode tok/s from the timing line; run twice,
    the first compiling the kernels into the cache folder the rest then loads them from;
  - the server (python -m pycalm.serve), one warm-up request, then streamed /v1/completions
    requests read by an httpx client: tok/s from the first streamed piece to the last, as the
    client sees them, and the server's own log line.

    python scripts/bench_serve.py                     # the GPU, 1000 tokens, 3 server runs
    python scripts/bench_serve.py --device cpu --layers 2 --tokens 40   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))

from tiny_models import make_gguf  # noqa: E402

from pycalm.convert.main import convert  # noqa: E402
from pycalm.gpu.batched import BatchedGpuEngine  # noqa: E402  (the stand-in takes its buckets)
from pycalm.kernels.sample import HostRows  # noqa: E402
from pycalm.model.loader import ModelWriter, open_model  # noqa: E402

PROMPT = "the cat"


def make_model(folder: Path, layers: int, context: int) -> Path:
    """SmolLM2-135M's shape with random weights and no EOS (every run makes all its tokens)."""
    src = make_gguf(folder, qtype="F16", dim=576, hidden_dim=1536, n_layers=layers, n_heads=9, n_kv_heads=3)
    first = convert(src.path, folder / "random.pycalm", "fp16", progress=False)
    m = open_model(first)
    cfg = m.config.replace(eos_ids=(), max_seq_len=context)
    out = folder / "random-noeos.pycalm"
    with ModelWriter(out, cfg, m.tokenizer_kind, m.tokenizer_blob, m.chat_template) as w:
        for spec in w.pending():
            w.write(spec.name, m.tensor(spec.name))
    return out


def cli_rate(model: Path, args: argparse.Namespace, cache: Path) -> tuple[float, str]:
    cmd = [
        sys.executable,
        "-m",
        "pycalm.generate",
        str(model),
        "-i",
        PROMPT,
        "-n",
        str(args.tokens),
        "-t",
        "0",
    ]
    cmd += ["--device", args.device, "-c", str(args.context), "--cache-dir", str(cache)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    return float(re.search(r"decode \d+ tokens, [0-9.]+ s, ([0-9.]+) tok/s", line).group(1)), line


def start_server(cmd: list[str], log: Path) -> subprocess.Popen:
    """The server process, its output into `log` (a pipe could fill and stop it)."""
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)


def wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    """Until /health answers 200 (the model loaded); the log if the server dies first."""
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def server_rates(model: Path, args: argparse.Namespace, cache: Path) -> tuple[list[float], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = cache / "server.log"
    cmd = [sys.executable, "-m", "pycalm.serve", str(model), "--port", str(port), "--device", args.device]
    cmd += ["-c", str(args.context), "--cache-dir", str(cache)]
    proc = start_server(cmd, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log)
        body = {"prompt": PROMPT, "max_tokens": args.tokens, "temperature": 0, "stream": True}
        body["stream_options"] = {"include_usage": True}
        rates = []
        for run in range(args.runs + 1):  # the first captures the token steps' graphs
            times, n = [], 0
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["text"]:
                        times.append(time.perf_counter())
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
            assert n == args.tokens, (n, args.tokens)
            # pieces are tokens here (one-character tokens, no stop strings); a piece may hold
            # several tokens when the client lags, so the rate counts tokens, not pieces
            if run:
                rates.append((n - 1) / (times[-1] - times[0]))
        return rates, log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class WordTokenizer:
    """What the server needs of a tokenizer, over vocab_size made-up words " w<id>"."""

    chat_template = ""

    def __init__(self, vocab_size: int) -> None:
        self.words = [f" w{i}".encode() for i in range(vocab_size)]

    def stream(self) -> object:
        from pycalm.model.tokenizer import StreamDecoder

        return StreamDecoder(self.words, False)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.words[i] for i in ids).decode()


class StandInEngine:
    """The GpuEngine's face that the server and BatchRunner see, and no GPU behind it."""

    device = "gpu"
    batch_invariant = False
    multi_token = True
    simple = False

    def __init__(self, config: object, seq_len: int) -> None:
        self.config, self.seq_len = config, seq_len


class StandInBatched:
    """pycalm.gpu.batched.BatchedGpuEngine's step_tokens, enqueue_tokens and collect without a
    GPU: a step takes base_ms + row_ms x its rows of a "GPU" that runs one step at a time (an
    enqueued step starts when the one before it ends; collect sleeps until it has ended) and
    draws each sampled row's token at random (the options still checked)."""

    cost = staticmethod(lambda rows, bucket: 8.1 + 0.056 * rows)  # ms a step (stand_in_cost)
    max_rows = 2048  # rows a pass takes at most (the engine's prefill buffers: a lone prompt's step)
    bucket = BatchedGpuEngine.bucket  # the rows a step of n rows runs: its graph's bucket

    @staticmethod
    def refusal(engine: object) -> None:  # it batches any engine
        return None

    def __init__(
        self, engine: StandInEngine, n_blocks: int, block_size: int, min_blocks: int | None = None
    ) -> None:
        self.n_blocks = n_blocks  # (no memory to fit: the blocks asked for)
        self.vocab = engine.config.vocab_size
        self.rng = np.random.default_rng(0)
        self.gpu_s = 0.0  # the steps' "GPU" seconds
        self.busy_until = 0.0  # when the last step enqueued ends
        self.host_rows = HostRows()  # the engine's encoding of the rows' options

    def enqueue_tokens(self, tokens, positions, seq_of_row, block_table, sample_rows, samplings, coins,  # noqa: ANN001, ANN201
                       prev=None):  # fmt: skip
        self.host_rows(samplings)  # (the options checked, as the engine's)
        gpu_s = self.cost(len(tokens), self.bucket(len(tokens))) / 1e3
        self.busy_until = max(time.perf_counter(), self.busy_until) + gpu_s
        self.gpu_s += gpu_s
        return self.busy_until, self.rng.integers(3, self.vocab, len(sample_rows)).astype(np.int32)

    def collect(self, ticket):  # noqa: ANN001, ANN201
        end, chosen = ticket
        time.sleep(max(0.0, end - time.perf_counter()))
        return chosen  # (n_sampled,)

    def step_tokens(self, tokens, positions, seq_of_row, block_table, sample_rows, samplings, coins, keep=(),  # noqa: ANN001, ANN201
                    while_waiting=lambda: None, prev=None):  # fmt: skip
        ticket = self.enqueue_tokens(
            tokens, positions, seq_of_row, block_table, sample_rows, samplings, coins
        )
        while_waiting()  # as the engine's, while the "GPU" works
        return self.collect(ticket), np.zeros((len(keep), self.vocab), np.float32)  # (len(keep), vocab_size)


def stand_in_cost(spec: str) -> Callable[[int, int], float]:
    """--stand-in's step time, ms, for a step of n rows run as the graph of `bucket` rows:
    "BASE,ROW" -> BASE + ROW n; "R:MS,R:MS,..." -> the bucket's ms (the GPU engine runs the
    bucket's graph, padding rows and all), linear between the listed ones (the last one's beyond).
    Raises ValueError on a malformed spec."""
    if ":" not in spec:
        base, row = (float(v) for v in spec.split(","))
        return lambda n, bucket: base + row * n
    table = sorted((int(r), float(ms)) for r, ms in (p.split(":") for p in spec.split(",")))
    rows, ms = [r for r, _ in table], [m for _, m in table]
    return lambda n, bucket: float(np.interp(bucket, rows, ms))


def stand_in_llm(shape: str, dtype: str, context: int, stand_in: str) -> object:
    """An LLM over a StandInEngine of the shape (no EOS, WordTokenizer), its batched pass StandInBatched."""
    from bench import config_for

    import pycalm.gpu.batched
    from pycalm.app.api import LLM

    StandInBatched.cost = staticmethod(stand_in_cost(stand_in))
    pycalm.gpu.batched.BatchedGpuEngine = StandInBatched  # what BatchRunner builds on a "gpu" engine
    cfg = config_for(shape, dtype, context).replace(eos_ids=())
    return LLM(StandInEngine(cfg, context), WordTokenizer(cfg.vocab_size), name="random")


def random_llm(shape: str, dtype: str, context: int) -> object:
    """An LLM over a GpuEngine of the shape, random weights, no EOS, WordTokenizer."""
    from bench import RandomDeviceModel, config_for

    from pycalm.app.api import LLM
    from pycalm.gpu.engine import GpuEngine

    cfg = config_for(shape, dtype, context).replace(eos_ids=())
    engine = GpuEngine(RandomDeviceModel(cfg), seq_len=context, kv_dtype="fp16")
    return LLM(engine, WordTokenizer(cfg.vocab_size), name="random")


async def one_request(client: httpx.AsyncClient, body: dict) -> tuple[int, float, float]:
    """A streamed completion -> (completion tokens, seconds to the first text, seconds from it to the last)."""
    t0 = time.perf_counter()
    first = last = 0.0
    n = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # the server's own message, not a KeyError
                raise RuntimeError(f"the server answered an error: {chunk['error']}")
            if chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    return n, first - t0, last - first


async def load(url: str, streams: int, args: argparse.Namespace, vocab: int, seed: int) -> dict:
    """`streams` closed loops of args.requests requests each -> the row's figures."""
    rng = random.Random(seed)
    out: list[tuple[int, float, float]] = []

    async def loop(client: httpx.AsyncClient) -> None:
        for _ in range(args.requests):
            body = {
                "prompt": [rng.randrange(3, vocab) for _ in range(args.prompt)],
                "max_tokens": args.new,
                "ignore_eos": True,  # exactly max_tokens out, as vLLM's benchmark asks
                "temperature": args.temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            out.append(await one_request(client, body))

    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(loop(client) for _ in range(streams)))
        wall = time.perf_counter() - t0
    tokens = sum(n for n, _, _ in out)
    assert all(n == args.new for n, _, _ in out), [n for n, _, _ in out]
    ttft = sorted(f for _, f, _ in out)
    tpot = sorted(d / (n - 1) for n, _, d in out)

    def pct(v: list[float], q: float) -> float:
        return v[min(len(v) - 1, int(q * len(v)))] * 1e3

    return dict(
        tok_s=tokens / wall,
        ttft=(pct(ttft, 0.5), pct(ttft, 0.99)),
        tpot=(pct(tpot, 0.5), pct(tpot, 0.99)),
        wall=wall,
    )


def serve_random(args: argparse.Namespace) -> None:
    """The server process of --streams: --parallel N over random_llm, on port args.serve."""
    import uvicorn

    from pycalm.app.serve import ParallelWorker, Worker, make_app

    def on_loaded(llm: object | None, message: str) -> None:
        if llm is None:  # the parent sees the server gone (wait_ready), with this line in its log
            print(f"error: {message}", file=sys.stderr, flush=True)
            os._exit(1)

    def llm() -> object:
        if args.stand_in:
            return stand_in_llm(args.shape, args.dtype, args.context, args.stand_in)
        return random_llm(args.shape, args.dtype, args.context)

    worker = (
        Worker(llm, on_loaded)
        if args.plain
        else ParallelWorker(llm, on_loaded, args.parallel, args.batch_size)
    )
    if args.profile:  # the worker thread's profile, written each time the batch empties
        import cProfile

        profile = cProfile.Profile()
        serve, step, wake = worker.serve, worker.step, worker.wake
        stepped = [False]  # a step ran since the last write

        def profiled_serve() -> None:
            profile.enable()
            serve()

        def profiled_step() -> None:
            stepped[0] = True
            step()

        def profiled_wake() -> None:  # (uvicorn's exit re-raises SIGTERM: no end to write at)
            wake()
            if stepped[0] and worker.runner.idle():
                stepped[0] = False
                profile.dump_stats(args.profile + ".part")  # stops the profile: on again below
                os.replace(args.profile + ".part", args.profile)
                profile.enable()

        worker.serve, worker.step, worker.wake = profiled_serve, profiled_step, profiled_wake
    app = make_app(worker, "random", on_startup=worker.start)
    uvicorn.run(app, host="127.0.0.1", port=args.serve, log_level="warning")


def server_counts(url: str) -> dict[str, float]:
    """/metrics' values by name."""
    text = httpx.get(url + "/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^pycalm_(\w+) (\S+)$", text, re.M)}


def streams_main(args: argparse.Namespace) -> None:
    counts = [int(v) for v in args.streams.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--serve", str(port), "--parallel", str(max(counts))]
    cmd += ["--shape", args.shape, "--dtype", args.dtype, "--context", str(args.context)]
    cmd += ["--stand-in", args.stand_in] if args.stand_in else []
    cmd += ["--batch-size", str(args.batch_size)] if args.batch_size else []
    cmd += ["--profile", args.profile] if args.profile else []
    cmd += ["--plain"] if args.plain else []
    log = Path(tempfile.mkdtemp()) / "server.log"
    server = start_server(cmd, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(server, url, log)
        vocab = args.vocab
        served_by = (
            "one request at a time (--parallel 1's worker)"
            if args.plain
            else f"--parallel {max(counts)}" + (f" --batch-size {args.batch_size}" if args.batch_size else "")
        )
        print(f"{args.shape} {args.dtype}, the server a process of its own with {served_by}, "
              f"prompts of {args.prompt} tokens, {args.new} out, {args.requests} requests a stream, "
              f"temperature {args.temperature:g}")  # fmt: skip
        print(
            "| streams | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | steps, ms each | outside the pass | GPU idle |"
        )
        print("|---|---|---|---|---|---|---|")
        # a warm-up with every row bucket the runs will meet (each graph is captured once)
        warm = argparse.Namespace(**{**vars(args), "requests": 1, "new": 4})
        for n in sorted({1, *counts}):
            asyncio.run(load(url, n, warm, vocab, seed=n))
        for i, n in enumerate(counts):
            before = server_counts(url)
            row = asyncio.run(load(url, n, args, vocab, seed=1000 + i))
            after = server_counts(url)
            if args.plain:  # (no batch counters: the one-at-a-time worker)
                print(f"| {n} | {row['tok_s']:,.0f} | {row['ttft'][0]:.0f} / {row['ttft'][1]:.0f} | "
                      f"{row['tpot'][0]:.2f} / {row['tpot'][1]:.2f} | - | - | - |", flush=True)  # fmt: skip
                continue
            steps = after["batch_steps_total"] - before["batch_steps_total"]
            step_s = after["batch_step_seconds_total"] - before["batch_step_seconds_total"]
            engine_s = after["batch_engine_seconds_total"] - before["batch_engine_seconds_total"]
            gpu_s = after["batch_gpu_seconds_total"] - before["batch_gpu_seconds_total"]
            captures = after["batch_graph_captures_total"] - before["batch_graph_captures_total"]
            capture_s = after["batch_capture_seconds_total"] - before["batch_capture_seconds_total"]
            print(
                f"| {n} | {row['tok_s']:,.0f} | {row['ttft'][0]:.0f} / {row['ttft'][1]:.0f} | "
                f"{row['tpot'][0]:.2f} / {row['tpot'][1]:.2f} | {steps:.0f}, {row['wall'] / steps * 1e3:.2f} "
                f"(in step() {step_s / row['wall']:.0%}; {captures:.0f} graphs captured, {capture_s:.2f} s) | {1 - engine_s / row['wall']:.1%} | "
                f"{1 - gpu_s / row['wall']:.1%} |",
                flush=True,
            )
    except Exception:
        print("server log, last lines:\n" + "".join(f"  {x}\n" for x in log.read_text().splitlines()[-30:]))
        raise
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="gpu")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--streams", help="the load test: concurrent streams, e.g. 1,8,32,64,128")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens a request (--streams)")
    ap.add_argument("--new", type=int, default=256, help="output tokens a request (--streams)")
    ap.add_argument("--requests", type=int, default=3, help="requests a stream (--streams)")
    ap.add_argument(
        "--temperature", type=float, default=0.8, help="the requests' temperature, 0: greedy (--streams)"
    )
    ap.add_argument("--vocab", type=int, default=128256, help="the shape's vocabulary (--streams)")
    ap.add_argument(
        "--stand-in",
        metavar="BASE,ROW|R:MS,...",
        help="no GPU: a step sleeps BASE + ROW x rows ms, or its rows' power-of-two bucket's ms from the"
        " table R:MS,... (--streams)",
    )
    ap.add_argument(
        "--batch-size", type=int, help="the server's --batch-size: rows a step at most (--streams)"
    )
    ap.add_argument(
        "--profile",
        metavar="FILE",
        help="the server worker's cProfile (pstats), written when the batch empties (--streams)",
    )
    ap.add_argument(
        "--plain", action="store_true", help="the server's one-at-a-time worker, not the batch (--streams 1)"
    )
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server process of --streams: its port
    ap.add_argument("--parallel", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plain and args.stand_in:
        ap.error("--plain runs the engine's own decode loop, which the stand-in does not have")
    if args.serve:
        return serve_random(args)
    if args.streams:
        return streams_main(args)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        model = make_model(folder, args.layers, args.context)
        print(f"model: {model.stat().st_size / 1e6:.0f} MB in {time.perf_counter() - t0:.1f} s", flush=True)
        cli = []
        for _ in range(2):
            rate, line = cli_rate(model, args, folder)
            cli.append(rate)
            print(f"cli: {line}", flush=True)
        served, log = server_rates(model, args, folder)
        print("server log:\n" + "".join(f"  {x}\n" for x in log.strip().splitlines()), end="")
        best_cli, best_served = max(cli), max(served)
        print(f"cli decode tok/s: {', '.join(f'{r:.1f}' for r in cli)}")
        print(f"server streamed tok/s (client side): {', '.join(f'{r:.1f}' for r in served)}")
        print(
            f"best: server {best_served:.1f} / cli {best_cli:.1f} = {best_served / best_cli:.3f}; "
            f"median {statistics.median(served):.1f} / {statistics.median(cli):.1f}"
        )


if __name__ == "__main__":
    main()
