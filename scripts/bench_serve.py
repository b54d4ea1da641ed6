"""The server's streamed tok/s against the CLI's, on the same model and engine.

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
import json
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from tiny_models import make_gguf  # noqa: E402

from pycalm.convert.main import convert  # noqa: E402
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


def server_rates(model: Path, args: argparse.Namespace, cache: Path) -> tuple[list[float], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = cache / "server.log"
    cmd = [sys.executable, "-m", "pycalm.serve", str(model), "--port", str(port), "--device", args.device]
    cmd += ["-c", str(args.context), "--cache-dir", str(cache)]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="gpu")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
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
