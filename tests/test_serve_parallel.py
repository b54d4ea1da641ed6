"""The server with --parallel N (continuous batching on the CPU engine, pycalm.app.batching) as a
user runs it: a real process on a tiny random model (tests/tiny_models.py), driven by OpenAI's
own client from many threads at once.

The server runs with --batch-invariant, under which a row's logits are the token step's bits
whatever its batchmates (pycalm.cpu.batched): every completion, greedy or seeded, streamed or
not, must then be the text the Python API gives for the same request alone. The soak (slow) sends
a few hundred short requests, some of whose clients go away mid-stream or time out, and checks
that the others are answered whole and that the pool is whole again at the end.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

import pycalm
from pycalm.cpu.sampler import SamplingParams

CONTEXT = 128
PARALLEL = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tiny_models import make_hf_llama

    from pycalm.convert.main import convert

    tmp = tmp_path_factory.mktemp("parallel")
    tiny = make_hf_llama(tmp, dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64)
    return convert(tiny.path, tmp / "tiny.pycalm", "fp16", progress=False)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    from test_serve import cpu_server

    log = tmp_path_factory.mktemp("parallel_serve") / "server.log"
    args = ("--parallel", str(PARALLEL), "--batch-invariant")
    with cpu_server(model, log, CONTEXT, *args) as url:
        yield url


@pytest.fixture(scope="module")
def llm(model):
    return pycalm.load(str(model), device="cpu", context=CONTEXT, batch_invariant=True)


def requests(n: int, seed: int) -> list[dict]:
    """n completion requests of random prompts (token ids) and lengths; a third sampled with a
    seed, half streamed, some with a stop string."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = [int(t) for t in rng.integers(3, 64, int(rng.integers(1, 24)))]
        r = {"prompt": prompt, "max_tokens": int(rng.integers(1, 20)), "stream": bool(i % 2)}
        r["temperature"], r["seed"] = (0.9, int(rng.integers(1000))) if i % 3 == 0 else (0.0, 0)
        if i % 5 == 0:
            r["stop"] = [f"w{int(rng.integers(3, 20))}"]
        out.append(r)
    return out


def alone(llm, r: dict) -> tuple[str, str]:
    """The Python API's text and finish reason for request r, served alone."""
    sampling = SamplingParams(temperature=r["temperature"], seed=r["seed"])
    gen = llm.start(r["prompt"], r["max_tokens"], sampling, r.get("stop"), prime=True)
    text = "".join(gen)
    return text, gen.finish_reason


def served(client: openai.OpenAI, r: dict) -> tuple[str, str]:
    """The server's text and finish reason for request r, through the openai client."""
    args = {k: v for k, v in r.items() if k != "stream"}
    if not r["stream"]:
        c = client.completions.create(model="m", **args).choices[0]
        return c.text, c.finish_reason
    text, finish = [], None
    for chunk in client.completions.create(model="m", stream=True, **args):
        for c in chunk.choices:
            text.append(c.text)
            finish = c.finish_reason or finish
    return "".join(text), finish


def metrics(url: str) -> dict[str, float]:
    body = httpx.get(f"{url}/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^pycalm_(\w+) (\S+)$", body, re.M)}


def wait_drained(url: str, seconds: float = 20) -> dict[str, float]:
    """/metrics once no sequence runs or waits and no block is held (the pool whole again)."""
    deadline = time.monotonic() + seconds
    while True:
        m = metrics(url)
        if m["batch_running"] == m["batch_waiting"] == m["kv_blocks_used"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def test_concurrent_requests_are_each_served_alone(server, llm):
    """32 requests at once, greedy and seeded, streamed and not: each text and finish reason is
    the Python API's for the request alone; then the pool is whole, the prefix cache used."""
    rs = requests(32, seed=1)
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    with ThreadPoolExecutor(len(rs)) as pool:
        got = list(pool.map(lambda r: served(client, r), rs))
    for r, g in zip(rs, got, strict=True):
        assert g == alone(llm, r), r
    m = wait_drained(server)
    assert m["kv_blocks_free"] + m["kv_blocks_cached"] > 0 and m["requests_total"] >= len(rs)
    # the requests did share steps (how many at once at the peak depends on how fast the 32
    # arrive against how fast the tiny model ends them; at most --parallel)
    assert 2 <= m["batch_running_peak"] <= PARALLEL
    # latency histograms: a first token a request, every later token an inter-token gap
    ttft, itl = m["time_to_first_token_seconds_count"], m["inter_token_latency_seconds_count"]
    assert ttft == len(rs) and ttft + itl == m["generation_tokens_total"]
    assert m["time_to_first_token_seconds_sum"] > 0 and m["inter_token_latency_seconds_sum"] > 0
    # every token came from a step; the engine's share of the steps' time is part of it
    assert 0 < m["batch_steps_total"] <= m["generation_tokens_total"]
    assert 0 < m["batch_engine_seconds_total"] < m["batch_step_seconds_total"]
    assert m["batch_gpu_seconds_total"] == 0  # (the CPU engine's: no GPU time, no graph)
    assert m["batch_graph_captures_total"] == 0 and m["batch_capture_seconds_total"] == 0
    body = httpx.get(f"{server}/metrics").text
    for name, count in (("time_to_first_token_seconds", ttft), ("inter_token_latency_seconds", itl)):
        buckets = [float(v) for v in re.findall(rf'^pycalm_{name}_bucket{{le="[^"]+"}} (\S+)$', body, re.M)]
        assert len(buckets) == 11 and buckets == sorted(buckets) and buckets[-1] == count
    # a longest prompt again: its full blocks (16 positions) come from the prefix cache
    again = {**max(rs, key=lambda r: len(r["prompt"])), "stream": False}
    assert len(again["prompt"]) > 16
    reply = client.completions.create(model="m", **{k: v for k, v in again.items() if k != "stream"})
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == alone(llm, again)
    assert reply.usage.prompt_tokens_details.cached_tokens == 16
    assert metrics(server)["prefix_cache_hit_rate"] > 0


def test_chat_and_choices_in_the_batch(server, llm):
    """A chat with n = 3 choices (each its own sequence, choice i with seed + i) beside a stream of
    completions: each choice is the Python API's chat reply with that seed."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "w5 w9 w11"}]
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(served, client, r) for r in requests(3, seed=2)]
        reply = client.chat.completions.create(
            model="m", messages=messages, n=3, max_tokens=12, temperature=0.8, seed=7
        )
        [f.result() for f in others]
    ids = llm.chat_ids(messages)
    for i, c in enumerate(reply.choices):
        gen = llm.start(ids, 12, SamplingParams(temperature=0.8, seed=7 + i), prime=False)
        assert (c.message.content, c.finish_reason) == ("".join(gen), gen.finish_reason)


def test_logprobs_in_the_batch(server, llm):
    """Completions with logprobs (k = 2) beside other requests: each token's logprob is the
    Python API's for the request alone."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    rs = [{**r, "stream": False} for r in requests(4, seed=6)]
    with ThreadPoolExecutor(8) as pool:
        others = [pool.submit(served, client, r) for r in requests(4, seed=7)]
        replies = list(pool.map(lambda r: client.completions.create(model="m", logprobs=2, **r), rs))
        [f.result() for f in others]
    for r, reply in zip(rs, replies, strict=True):
        sampling = SamplingParams(temperature=r["temperature"], seed=r["seed"])
        gen = llm.start(r["prompt"], r["max_tokens"], sampling, r.get("stop"), logprobs=2)
        assert reply.choices[0].text == "".join(gen)
        want = [lp.logprob for lp in gen.logprobs]
        got = reply.choices[0].logprobs.token_logprobs
        np.testing.assert_allclose(got[: len(want)], want, rtol=1e-6)


def test_parallel_options():
    from pycalm.app.serve import parse_args

    with pytest.raises(SystemExit):  # batch-invariant batching: the CPU engine's alone
        parse_args(["m", "--parallel", "2", "--device", "gpu", "--batch-invariant"])
    with pytest.raises(SystemExit):  # the batched pass is the fast kernels'
        parse_args(["m", "--parallel", "2", "--device", "gpu", "--kernels", "simple"])
    with pytest.raises(SystemExit):
        parse_args(["m", "--parallel", "0"])
    with pytest.raises(SystemExit):
        parse_args(["m", "--parallel", "many"])
    assert parse_args(["m"]).parallel is None  # auto, decided at load (below)
    assert parse_args(["m", "--parallel", "auto", "--device", "gpu", "--batch-invariant"]).parallel is None
    assert parse_args(["m", "--parallel", "8", "--device", "gpu"]).parallel == 8
    with pytest.raises(SystemExit):  # a step holds a row for each running request
        parse_args(["m", "--parallel", "8", "--batch-size", "4"])
    with pytest.raises(SystemExit):
        parse_args(["m", "-b", "0"])
    assert parse_args(["m", "-np", "8", "-b", "512"]).batch_size == 512
    # speculation: auto (n-gram on the GPU) for one request at a time; batching does not speculate
    assert parse_args(["m", "--parallel", "1"]).speculate == "auto"
    assert (
        parse_args(["m"]).speculate == "off"
        and parse_args(["m", "-np", "4", "--speculate", "auto"]).speculate == "off"
    )
    with pytest.raises(SystemExit):
        parse_args(["m", "-np", "4", "--speculate", "ngram"])


def test_batch_size_caps_a_step(llm):
    """--batch-size reaches the scheduler (whose plans keep to it: Scheduler.check); one below
    the sequences fails the loading in one line (--parallel auto's 64 is known only then)."""
    from pycalm.app.batching import BatchRunner
    from pycalm.app.serve import ParallelWorker
    from pycalm.errors import PycalmError

    worker = ParallelWorker(lambda: llm, lambda got, message: None, 4, 24)
    worker.prepare(llm)
    assert worker.runner.scheduler.token_budget == 24
    with pytest.raises(PycalmError, match="a batch of 3 rows a step is below 4 sequences"):
        BatchRunner(llm, 4, token_budget=3)


def test_parallel_auto_decides_at_load(llm, capfd):
    """--parallel auto: a GPU engine that batches gets AUTO_PARALLEL sequences; the CPU engine,
    and a GPU engine that cannot batch (here its batch-invariant mode), get one request at a time,
    with a line that says why, where --parallel N would fail the loading (the test above). The
    worker then serves as the one-at-a-time Worker does (tests/test_serve.py's servers run so:
    the CPU engine under the default --parallel)."""
    from types import SimpleNamespace

    from pycalm.app.serve import AUTO_PARALLEL, ParallelWorker, auto_parallel

    batching_gpu = SimpleNamespace(device="gpu", batch_invariant=False, multi_token=True, simple=False)
    invariant_gpu = SimpleNamespace(device="gpu", batch_invariant=True)
    assert auto_parallel(batching_gpu) == (AUTO_PARALLEL, "")
    assert auto_parallel(llm.engine)[0] == 1
    assert auto_parallel(invariant_gpu) == (
        1,
        "batching with --batch-invariant runs on the CPU engine only (--device cpu)",
    )
    for target in (llm, SimpleNamespace(engine=invariant_gpu)):
        loaded = []
        worker = ParallelWorker(
            lambda t=target: t, lambda got, message, out=loaded: out.append((got, message)), None
        )
        worker.start()
        worker.jobs.put(None)  # the queue's end: the one-at-a-time loop returns
        worker.join(timeout=30)
        assert not worker.is_alive()
        assert loaded == [(target, "")] and worker.runner is None and worker.parallel == 1
    err = capfd.readouterr().err
    assert err.count("pycalm: --parallel auto: one request at a time (") == 2


@pytest.mark.slow
def test_soak(server, llm):
    """300 short requests from 16 threads: a tenth of the streams dropped after their first
    chunk, a tenth of the others given up by a client timeout; every other one is answered whole
    (the first 40 checked against the Python API), the server still answers after, and the pool
    is whole at the end."""
    rs = requests(300, seed=3)
    rng = np.random.default_rng(4)
    fate = rng.choice(["whole", "drop", "timeout"], len(rs), p=[0.8, 0.1, 0.1])
    answered, gone = [], 0
    lock = threading.Lock()

    def one(i: int) -> None:
        nonlocal gone
        r = rs[i]
        if fate[i] == "drop" and r["stream"]:  # read one chunk, then close the connection
            body = {**r, "model": "m"}
            with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as resp:
                next(resp.iter_lines())
            with lock:
                gone += 1
            return
        timeout = 0.02 if fate[i] == "timeout" else 60
        client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=timeout)
        try:
            got = served(client, r)
        except (openai.APITimeoutError, openai.APIConnectionError):
            assert fate[i] == "timeout"
            with lock:
                gone += 1
            return
        with lock:
            answered.append((i, got))

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(len(rs))))
    assert len(answered) + gone == len(rs) and len(answered) >= 0.7 * len(rs)
    for i, got in sorted(answered)[:40]:
        assert got == alone(llm, rs[i]), rs[i]
    m = wait_drained(server)
    assert m["kv_blocks_used"] == 0 and m["kv_blocks_free"] + m["kv_blocks_cached"] > 0
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    assert served(client, rs[0]) == alone(llm, rs[0])


def test_shutdown_with_sequences_running_and_waiting(tmp_path):
    """SIGINT with two sequences in the batch and one waiting for a place: every stream ends (what
    it has, then [DONE]) and the process exits at once, with no traceback. (The model's context
    is 4,096 positions, so that the two run for seconds: at 256 they ended within a quarter of a
    second, and a loaded machine's polls of /metrics could miss that state.)"""
    import signal
    import subprocess
    import sys

    from test_cli import REPO, _env
    from test_serve import _free_port, wait_healthy
    from tiny_models import make_hf_llama

    from pycalm.convert.main import convert

    tiny = make_hf_llama(tmp_path, n_layers=2, vocab_size=64, max_positions=4096)
    model = convert(tiny.path, tmp_path / "long.pycalm", "fp16", progress=False)

    port, log = _free_port(), tmp_path / "server.log"
    cmd = [sys.executable, "-m", "pycalm.serve", str(model), "--port", str(port), "--device", "cpu"]
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [*cmd, "-c", "4096", "--parallel", "2"],
            stdout=err,
            stderr=subprocess.STDOUT,
            env=_env(),
            cwd=REPO,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, 60)
        ends: list[str] = []

        def stream(seed: int) -> None:  # no EOS (the model's two biased away): it runs until stopped
            bias = {"2": -100, "3": -100}
            body = {"prompt": [1, 5, seed], "max_tokens": 4000, "stream": True, "logit_bias": bias}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
                ends.append(list(resp.iter_lines())[-2])

        threads = [threading.Thread(target=stream, args=(s,)) for s in (7, 8, 9)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while (m := metrics(url))["batch_running"] != 2 or m["batch_waiting"] != 1:
            assert time.monotonic() < deadline, f"two running and one waiting never seen: {m}"
            time.sleep(0.02)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0 and time.monotonic() - t0 < 10
        for t in threads:
            t.join(timeout=30)
        assert ends == ["data: [DONE]"] * 3
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_generate_takes_a_list_of_prompts(llm, monkeypatch):
    """LLM.generate over a list of prompts: one batch (the runner's steps), each output the one
    the prompt gives alone, greedy, seeded and with logprobs; streaming a list is refused."""
    from pycalm.app.batching import BatchRunner
    from pycalm.errors import PycalmError

    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(3, 64, n)] for n in (3, 17, 1, 9)]
    steps = []
    step = BatchRunner.step
    monkeypatch.setattr(BatchRunner, "step", lambda self: steps.append(len(self.streams)) or step(self))
    for options in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 3}):
        got = llm.generate(prompts, max_tokens=8, **options)
        assert max(steps) == len(prompts)  # the four ran in the same steps
        steps.clear()
        assert got == [llm.generate(p, max_tokens=8, **options) for p in prompts]
    gens = llm.generate(prompts, max_tokens=4, temperature=0.0, logprobs=2)
    for p, g in zip(prompts, gens, strict=True):
        alone = llm.generate(p, max_tokens=4, temperature=0.0, logprobs=2)
        assert g.text == alone.text and [x.logprob for x in g.logprobs] == [x.logprob for x in alone.logprobs]
    with pytest.raises(PycalmError, match="list of prompts"):
        llm.generate(prompts, stream=True)


def test_a_batch_that_cannot_be_made_fails_the_loading():
    """The batch runner is made while the model loads: an engine that cannot batch (here the GPU's
    batch-invariant mode) fails the loading with its one line, and the worker ends (the server
    then exits), where a dead worker thread once left every request waiting."""
    from types import SimpleNamespace

    from pycalm.app.serve import ParallelWorker

    llm = SimpleNamespace(engine=SimpleNamespace(device="gpu", batch_invariant=True))
    loaded = []
    worker = ParallelWorker(lambda: llm, lambda llm, message: loaded.append((llm, message)), 4)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert loaded == [(None, "--parallel with --batch-invariant runs on the CPU engine only (--device cpu)")]


def test_a_failed_step_answers_its_requests_and_the_batch_goes_on(llm, monkeypatch):
    """A step that raises (a bug) ends the requests in it with an error each and a fresh pool;
    the next request is served whole, and the idle worker waits without using the CPU."""
    import asyncio

    from pycalm.app import batching
    from pycalm.app.serve import Job, ParallelWorker, Request

    loaded = []
    worker = ParallelWorker(lambda: llm, lambda llm, message: loaded.append(message), 4)
    worker.start()
    step = batching.BatchRunner.step
    failing = [True]

    def step_once_failing(self: object) -> None:
        if failing.pop() if failing else False:
            raise RuntimeError("a bug in the step")
        step(self)

    monkeypatch.setattr(batching.BatchRunner, "step", step_once_failing)

    async def ask(prompt: list[int]) -> list[tuple[str, object]]:
        sampling = SamplingParams(temperature=0.0)
        request = Request(6, sampling, [], stream=False, include_usage=False)
        job = Job(prompt, 6, request, True, asyncio.get_running_loop())
        worker.jobs.put(job)
        events = []
        while not events or events[-1][0] not in ("done", "error"):
            events += await asyncio.wait_for(job.drain(), 60)
        return events

    try:
        first = asyncio.run(ask([1, 5, 9]))
        assert first[-1] == ("error", "internal error: a bug in the step")
        second = asyncio.run(ask([1, 5, 9]))
        assert second[-1][0] == "done"
        want = alone(llm, {"prompt": [1, 5, 9], "max_tokens": 6, "temperature": 0.0, "seed": 0})
        assert second[-1][1][0].text == want[0]
        # idle: the worker blocks on its queue (it once spun, asking the failed runner, which
        # never empties, whether the batch was idle)
        time.sleep(0.2)
        before = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - before < 0.3
    finally:
        worker.jobs.put(None)
        worker.join(timeout=30)
    assert loaded == [""] and not worker.is_alive()


def test_a_stop_string_ends_its_request_a_step_late_and_the_batch_empties(llm):
    """A step's tokens are handed out while the next pass runs (pycalm.app.batching), so a stop
    string seen in the next-to-last token ends its request after the scheduler has planned, and
    ended at max_tokens, the last one: the text is the request's alone, the dropped token's stream
    leaves, the runner empties and the pool is whole again."""
    from pycalm.app.batching import BatchRunner

    def text(prompt: list[int], n: int, stop: list[str] | None = None) -> tuple[str, str]:
        return alone(llm, {"prompt": prompt, "max_tokens": n, "temperature": 0.0, "seed": 0, "stop": stop})

    for last in range(3, 64):  # a prompt whose 5th greedy word is not among the 4 before it
        prompt = [1, 5, last]
        word = text(prompt, 5)[0][len(text(prompt, 4)[0]) :].strip()
        if word and word not in text(prompt, 4)[0]:
            break
    want = text(prompt, 6, [word])
    assert want[1] == "stop"
    runner = BatchRunner(llm, 2)
    got = {"text": "", "finish": None}

    def emit(kind: str, value: object) -> None:
        if kind == "text":
            got["text"] += value[1]
        elif kind == "finish":
            got["finish"] = value[1].finish_reason

    runner.add(prompt, 6, SamplingParams(temperature=0.0), emit, stop=[word])
    steps = 0
    while not runner.idle():
        runner.step()
        steps += 1
        assert steps < 20, "the runner never empties"
    assert (got["text"], got["finish"]) == want
    assert runner.scheduler.metrics()["kv_blocks_used"] == 0


class DeviceSamplingCpu:
    """The CPU engine's batched pass behind BatchedGpuEngine's face: each row "on the device"
    (sample_ref with its options and coin, as pycalm.kernels.sample draws it), and steps that run
    ahead: a row whose prev is >= 0 feeds the token the step before drew in that sampled row."""

    def __init__(self, inner: object) -> None:
        self.inner, self.n_blocks, self.last = inner, inner.n_blocks, None
        self.calls = {"enqueue_tokens": 0, "step_tokens": 0, "fed ahead": 0}

    def enqueue_tokens(self, tokens, positions, seq_of_row, table, sample_rows, samplings, coins, prev=None):  # noqa: ANN001, ANN201
        from pycalm.cpu.reference import feed_tokens_ref, sample_ref

        self.calls["enqueue_tokens"] += 1
        tokens = np.asarray(tokens, np.int32)
        if prev is not None:
            self.calls["fed ahead"] += int(np.sum(prev >= 0))
            tokens = feed_tokens_ref(tokens, np.asarray(prev), self.last)
        assert np.all(tokens >= 0), "a row feeds a token nobody drew"
        self.logits = logits = self.inner.step(
            tokens, positions, seq_of_row, table, sample_rows
        )  # (n_sampled, vocab)
        self.last = np.array(
            [sample_ref(w, o.temperature, o.top_k, o.top_p, o.min_p, c) for w, o, c in zip(logits, samplings, coins, strict=True)],
            np.int32,
        )  # fmt: skip
        return self.last

    def collect(self, ticket: np.ndarray) -> np.ndarray:
        return ticket

    def step_tokens(self, tokens, positions, seq_of_row, table, sample_rows, samplings, coins, keep=(),  # noqa: ANN001, ANN201
                    while_waiting=lambda: None, prev=None):  # fmt: skip
        """A step that waits for its own tokens (a row the host reads): the logits of keep too."""
        self.calls["step_tokens"] += 1
        chosen = self.enqueue_tokens(
            tokens, positions, seq_of_row, table, sample_rows, samplings, coins, prev
        )
        while_waiting()
        return chosen, self.logits[list(keep)]


def test_the_runner_runs_ahead_of_a_device_that_samples(llm):
    """BatchRunner over an engine that draws every row on the device runs each step ahead of the
    host's reading of the last one (pycalm.app.batching): greedy and seeded requests, some with a
    stop string, some ending on an EOS, each give the text and finish reason the API gives alone;
    the decode rows fed the device's tokens; the pool is whole at the end."""
    from pycalm.app.batching import BatchRunner

    runner = BatchRunner(llm, 4, token_budget=24)
    engine = DeviceSamplingCpu(runner.engine)
    runner.engine, runner.device_sampling, runner.ahead = engine, True, True
    rs = requests(12, seed=5)
    got = [{"text": "", "finish": None} for _ in rs]

    def emitter(i: int) -> object:
        def emit(kind: str, value: object) -> None:
            if kind == "text":
                got[i]["text"] += value[1]
            elif kind == "finish":
                got[i]["finish"] = value[1].finish_reason

        return emit

    for i, r in enumerate(rs):
        sampling = SamplingParams(temperature=r["temperature"], seed=r["seed"])
        runner.add(r["prompt"], r["max_tokens"], sampling, emitter(i), stop=r.get("stop"))
    steps = 0
    while not runner.idle():
        runner.step()
        steps += 1
        assert steps < 400, "the runner never empties"
    assert [(g["text"], g["finish"]) for g in got] == [alone(llm, r) for r in rs]
    assert {"stop", "length"} <= {g["finish"] for g in got}
    assert engine.calls["fed ahead"] > 0 and engine.calls["step_tokens"] == 0
    assert runner.blocks.whole() and runner.inflight is None


def test_a_step_that_waits_after_one_run_ahead(llm):
    """A request whose logits the host reads (logprobs) makes its steps wait for their own
    tokens, right after steps that ran ahead: the step in flight is read meanwhile, and a request
    that ends there on its EOS, though planned into the waiting step, leaves cleanly. Every text,
    finish reason and logprob is the API's alone."""
    from pycalm.app.batching import BatchRunner

    runner = BatchRunner(llm, 4, token_budget=24)
    engine = DeviceSamplingCpu(runner.engine)
    runner.engine, runner.device_sampling, runner.ahead = engine, True, True
    rs = requests(12, seed=5)  # two of them end on an EOS (the test above)
    late = {"prompt": [7, 9, 11], "max_tokens": 30, "temperature": 0.0, "seed": 0}  # arrives at step 3
    got = [{"text": "", "finish": None, "logprobs": []} for _ in range(len(rs) + 1)]

    def emitter(i: int) -> object:
        def emit(kind: str, value: object) -> None:
            if kind == "text":
                got[i]["text"] += value[1]
            elif kind == "logprobs":
                got[i]["logprobs"] += [x.logprob for x in value[1]]
            elif kind == "finish":
                got[i]["finish"] = value[1].finish_reason

        return emit

    for i, r in enumerate(rs):
        runner.add(r["prompt"], r["max_tokens"], SamplingParams(temperature=r["temperature"], seed=r["seed"]),
                   emitter(i), stop=r.get("stop"))  # fmt: skip
    steps = 0
    while not runner.idle():
        if steps == 3:
            runner.add(late["prompt"], late["max_tokens"], SamplingParams(), emitter(len(rs)), logprobs=1)
        runner.step()
        steps += 1
        assert steps < 400, "the runner never empties"
    assert [(g["text"], g["finish"]) for g in got] == [alone(llm, r) for r in [*rs, late]]
    gen = llm.start(late["prompt"], late["max_tokens"], SamplingParams(), None, prime=True, logprobs=1)
    "".join(gen)
    np.testing.assert_allclose(got[-1]["logprobs"], [x.logprob for x in gen.logprobs], rtol=1e-6)
    assert engine.calls["step_tokens"] > 0 and engine.calls["fed ahead"] > 0
    assert runner.blocks.whole() and runner.inflight is None


def test_the_waker_wakes_every_job_handed_over_before_it_ends():
    """serve.Waker: the jobs handed over between two of its wake-ups are woken together, and
    those handed over before the None that ends it are woken too (a job left unwoken would
    leave its client waiting)."""
    from pycalm.app.serve import Waker

    woken: list[str] = []
    calls: list[list[str]] = []

    class Loop:
        def call_soon_threadsafe(self, fn, jobs):  # noqa: ANN001, ANN202 - asyncio's signature
            calls.append([j.name for j in jobs])
            fn(jobs)

    class Ready:
        def __init__(self, name: str) -> None:
            self.name = name

        def set(self) -> None:
            woken.append(self.name)

    class FakeJob:
        def __init__(self, name: str) -> None:
            self.name, self.loop, self.ready = name, Loop(), Ready(name)

    waker = Waker()
    waker.queue.put([FakeJob("a")])  # handed over before it runs: one wake-up for all three
    waker.queue.put([FakeJob("b"), FakeJob("c")])
    waker.queue.put(None)
    waker.start()
    waker.join(timeout=10)
    assert not waker.is_alive()
    assert calls == [["a", "b", "c"]] and woken == ["a", "b", "c"]
    # running: each hand-over woken as it comes, the last one before the None too
    waker, woken[:], calls[:] = Waker(), [], []
    waker.start()
    waker.queue.put([FakeJob("d")])
    deadline = time.monotonic() + 10
    while not woken and time.monotonic() < deadline:
        time.sleep(0.01)
    waker.queue.put([FakeJob("e")])
    waker.queue.put(None)
    waker.join(timeout=10)
    assert woken == ["d", "e"] and not waker.is_alive()
