"""The HTTP server (python -m pycalm.serve) as a user runs it: a real process on a free local
port with the CPU engine and the real SmolLM2 (fp16, conftest), driven by OpenAI's own Python
client, httpx for what the client hides (raw SSE, a disconnect), and the README's examples.

Greedy texts are checked against the CLI's and the Python API's for the same prompt.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from test_cli import REPO, _env

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, seconds: float = 120) -> None:
    """Return once the server process answers /health with 200; its log in the failure when it
    exits first or the time runs out."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:  # not listening yet
            pass
        time.sleep(0.05)
    raise AssertionError(f"no answer from {url}/health in {seconds} s:\n{log.read_text()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def cpu_server(
    model: Path, log: Path, context: int, *args: str, alias: str = "m", seconds: float = 60
) -> Iterator[str]:
    """python -m pycalm.serve MODEL on the CPU engine (context `context`, `alias` beside the
    model's name, any further `args`) on a free local port, its output in `log`; yields its URL
    once it answers /health, and stops it after."""
    port = _free_port()
    cmd = [sys.executable, "-m", "pycalm.serve", str(model), "--port", str(port), "--device", "cpu"]
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [*cmd, "-c", str(context), "--alias", alias, *args],
            stdout=err,
            stderr=subprocess.STDOUT,
            env=_env(),
            cwd=REPO,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, seconds)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(smollm2_fp16, tmp_path_factory):
    """The server's base URL once the model is loaded; before that, the loading answers are
    checked (the model loads after the server listens, so they are seen first)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pycalm.serve",
                str(smollm2_fp16),
                "--port",
                str(port),
                "--device",
                "cpu",
                "-c",
                "512",
                "--alias",
                "smollm2",  # the README's name
                "--alias",
                "m",
            ],
            stdout=err,
            stderr=subprocess.STDOUT,
            env=_env(),
            cwd=REPO,
        )
    url = f"http://127.0.0.1:{port}"
    seen = []  # (health status, chat status, chat body) while loading
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                health = httpx.get(f"{url}/health", timeout=5)
                chat = httpx.post(
                    f"{url}/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1}, timeout=60
                )
            except httpx.TransportError:  # not listening yet
                time.sleep(0.05)
                continue
            seen.append((health.status_code, chat.status_code, chat.json()))
            if health.status_code == 200:
                break
            time.sleep(0.05)
        assert seen and seen[-1][0] == 200, log.read_text()
        yield {"url": url, "loading": seen, "log": log}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _cli(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pycalm.generate", *args, "--device", "cpu", "-c", "512"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server["url"] + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(pycalm_\w+) (\S+)$", text, re.M)}


# ---------------------------------------------------------------------------------------------


def test_loading_answers_503(server):
    health, chat, body = server["loading"][0]
    assert health == 503 and chat == 503, server["loading"]
    assert body["error"]["type"] == "unavailable_error" and body["error"]["message"]


def test_models_health_metrics(server, client):
    ids = [m.id for m in client.models.list()]
    assert len(ids) == 1 and ids[0].endswith(".pycalm")
    assert httpx.get(server["url"] + "/health").json() == {"status": "ok"}
    before = _metrics(server)
    client.completions.create(model=ids[0], prompt=PROMPT, max_tokens=2, temperature=0)
    after = _metrics(server)
    assert after["pycalm_generation_tokens_total"] == before["pycalm_generation_tokens_total"] + 2
    assert after["pycalm_prompt_tokens_total"] == before["pycalm_prompt_tokens_total"] + 5
    assert after["pycalm_queue_length"] == 0 and after["pycalm_model_loaded"] == 1
    assert after["pycalm_decode_tokens_per_second"] > 0


def test_completion_greedy_equals_cli_and_api(server, client, smollm2_fp16):
    out = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0)
    text = out.choices[0].text
    assert _cli(str(smollm2_fp16), "-i", PROMPT, "-n", "6", "-t", "0") == text + "\n"
    import pycalm

    llm = pycalm.load(smollm2_fp16, device="cpu", context=512, verbose=False)
    assert llm.generate(PROMPT, max_tokens=6, temperature=0) == text
    assert text.startswith(" Paris.")
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 6)
    # streamed: the same text, piece by piece
    pieces = [
        c.choices[0].text
        for c in client.completions.create(prompt=PROMPT, model="m", max_tokens=6, temperature=0, stream=True)
    ]
    assert "".join(pieces) == text and len([p for p in pieces if p]) >= 3


def test_chat_greedy_equals_cli(server, client, smollm2_fp16):
    out = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=24, temperature=0)
    reply = out.choices[0].message.content
    assert reply == "The capital of France is Paris."  # transformers' greedy reply
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.role == "assistant"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pycalm.generate",
            str(smollm2_fp16),
            "-y",
            "",
            "-n",
            "24",
            "-t",
            "0",
            "--device",
            "cpu",
        ],
        input=QUESTION[0]["content"] + "\n",
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=300,
    )
    assert proc.stdout == reply + "\n", proc.stderr
    # streamed, with usage in a last chunk
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=QUESTION,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_stop_strings(server, client):
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0, stop=["."])
    assert out.choices[0].text == " Paris" and out.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="m", messages=QUESTION, max_tokens=24, temperature=0, stop=["France", "Paris"], stream=True
    )
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The capital of "
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_prefix_reuse_second_turn(server, client):
    first = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=24, temperature=0)
    reply = first.choices[0].message.content
    messages = [
        *QUESTION,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And of Germany?"},
    ]
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0)
    # the first turn's prompt and reply (but its EOS) were in the cache: only the new turn is fed
    cached = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens == cached
    assert second.usage.prompt_tokens - cached < 20
    assert "Berlin" in second.choices[0].message.content
    assert f"{second.usage.prompt_tokens} prompt tokens ({cached} reused" in server["log"].read_text()


def test_bad_requests(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=QUESTION, temperature="hot")
    err = e.value.response.json()["error"]
    assert (
        err["type"] == "invalid_request_error"
        and err["param"] == "temperature"
        and "number" in err["message"]
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt=PROMPT, n=9)
    assert e.value.response.json()["error"]["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="word " * 600, max_tokens=4)
    assert e.value.response.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[{"role": "robot", "content": "hi"}])
    r = httpx.post(server["url"] + "/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_model_is_404_and_aliases_answer(server, client):
    """A `model` other than the one served (or an --alias of it) gets OpenAI's 404,
    model_not_found, streaming or not; the served name and each alias answer."""
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=1, stream=stream)
        err = e.value.response.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-4o" in err["message"]
    served = client.models.list().data[0].id
    for name in (served, "smollm2", "m"):
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=1, temperature=0)
        assert out.choices[0].text and out.model == served


def test_api_key(smollm2_fp16, tmp_path):
    """--api-key: every endpoint but /health asks for the key (401, invalid_api_key, through the
    openai client); with it, requests are served."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pycalm.serve", str(smollm2_fp16), "--port", str(port), "--device", "cpu"]
    with open(tmp_path / "server.log", "w") as err:
        proc = subprocess.Popen(
            [*cmd, "-c", "64", "--api-key", "sesame"],
            stdout=err,
            stderr=subprocess.STDOUT,
            env=_env(),
            cwd=REPO,
        )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:  # no key needed
                    break
            except httpx.TransportError:  # not listening yet
                pass
            time.sleep(0.05)
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="open", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.completions.create(model="m", prompt=PROMPT, max_tokens=1)
        assert e.value.response.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        assert httpx.get(f"{url}/metrics", timeout=5).status_code == 401
        right = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0, timeout=60)
        served = right.models.list().data[0].id
        out = right.completions.create(model=served, prompt=PROMPT, max_tokens=1, temperature=0)
        assert out.choices[0].text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _gone(server) -> int:
    """How many requests the server has logged as abandoned by their client."""
    return server["log"].read_text().count("the client went away; the request stops")


def test_disconnect_mid_stream_frees_the_engine(server, client):
    before, gone = _metrics(server), _gone(server)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data: ")]
        assert got and json.loads(got[0][6:])["choices"][0]["text"] is not None
    # the client is gone: the next request is answered without waiting for 400 tokens
    t0 = time.monotonic()
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0)
    assert out.choices[0].text == " Paris."
    after = _metrics(server)
    generated = after["pycalm_generation_tokens_total"] - before["pycalm_generation_tokens_total"]
    assert generated < 100, generated  # the abandoned stream stopped early (2 of them are the next request's)
    assert time.monotonic() - t0 < 60
    assert _gone(server) == gone + 1  # and said so


def test_abandoned_request_frees_the_engine(server, client):
    """A non-streaming request whose client gives up (a 2 s read timeout) stops at its next
    token: the next request does not wait for 400 tokens, and the server logs the abandon."""
    before, gone = _metrics(server), _gone(server)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["url"] + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=2))
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0)
    assert out.choices[0].text == " Paris."
    after = _metrics(server)
    generated = after["pycalm_generation_tokens_total"] - before["pycalm_generation_tokens_total"]
    assert generated < 400, generated  # the abandoned request stopped before its 400 tokens
    assert _gone(server) == gone + 1


def test_shutdown_with_requests_running_and_queued(smollm2_fp16, tmp_path):
    """SIGINT with one request on the engine and one queued: the running one answers with what
    it has, the queued one with a 503, and the process ends at once, with no traceback."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "pycalm.serve", str(smollm2_fp16), "--port", str(port), "--device", "cpu"]
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [*cmd, "-c", "512"], stdout=err, stderr=subprocess.STDOUT, env=_env(), cwd=REPO
        )
    try:
        wait_healthy(proc, url, log, 120)
        answers: dict[str, httpx.Response] = {}

        def post(key: str) -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0}
            answers[key] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        threads = [threading.Thread(target=post, args=(k,)) for k in ("running", "queued")]
        threads[0].start()
        while _metrics({"url": url})["pycalm_requests_running"] != 1:
            time.sleep(0.02)
        threads[1].start()
        while _metrics({"url": url})["pycalm_queue_length"] != 1:
            time.sleep(0.02)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
        took = time.monotonic() - t0
        for thread in threads:
            thread.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 0 and "Traceback" not in text, text
    assert answers["running"].status_code == 200, answers["running"].text
    assert answers["running"].json()["usage"]["completion_tokens"] < 400
    assert answers["queued"].status_code == 503
    assert answers["queued"].json()["error"]["message"] == "the server is shutting down"
    # a token step and the process's exit, not the 3 s graceful-shutdown limit or 400 tokens
    assert took < 3, took


def test_two_concurrent_clients(server, client):
    prompts = [PROMPT, "The capital of Germany is"]
    expected = [
        client.completions.create(model="m", prompt=p, max_tokens=8, temperature=0).choices[0].text
        for p in prompts
    ]
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        stream = client.completions.create(
            model="m", prompt=prompts[i], max_tokens=8, temperature=0, stream=True
        )
        results[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == {0: expected[0], 1: expected[1]}


def test_requests_queue_in_arrival_order(server, client):
    """One request at a time: the second and third wait (queue_length) while the first runs,
    and start in the order they came, each after the one before it ended."""
    spans: dict[int, tuple[float, float]] = {}  # request -> (first piece, last piece) times

    def ask(i: int) -> None:
        times = []
        n = 40 if i == 0 else 4  # the first runs long enough for the others to queue behind it
        stream = client.completions.create(model="m", prompt=PROMPT, max_tokens=n, temperature=0, stream=True)
        for c in stream:
            if c.choices[0].text:
                times.append(time.monotonic())
        spans[i] = (times[0], times[-1])

    first = threading.Thread(target=ask, args=(0,))
    first.start()
    deadline = time.monotonic() + 60
    while _metrics(server)["pycalm_requests_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    rest = []
    for i in (1, 2):
        rest.append(threading.Thread(target=ask, args=(i,)))
        rest[-1].start()
        while _metrics(server)["pycalm_queue_length"] < i and time.monotonic() < deadline:
            time.sleep(0.01)
    queued = _metrics(server)["pycalm_queue_length"]
    for t in [first, *rest]:
        t.join(timeout=120)
    assert queued == 2  # both wait while the first runs
    assert spans[0][1] < spans[1][0] and spans[1][1] < spans[2][0], spans


def test_readme_examples(server):
    """The README's curl and openai examples, as written but for the port."""
    readme = (REPO / "README.md").read_text()
    port = server["url"].rsplit(":", 1)[1]
    example = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "OpenAI(" in b)
    proc = subprocess.run(
        [sys.executable, "-c", example.replace(":8000", f":{port}")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "Paris" in proc.stdout, proc.stderr
    curl = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "curl" in b)
    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine (the openai example ran)")
    proc = subprocess.run(
        ["bash", "-c", curl.replace(":8000", f":{port}")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["choices"][0]["message"]["content"] == "The capital of France is Paris."


def test_pycalm_command():
    out = subprocess.run(
        [sys.executable, "-m", "pycalm", "--version"], capture_output=True, text=True, env=_env(), cwd=REPO
    )
    assert out.returncode == 0 and re.fullmatch(r"pycalm \d+\.\d+\.\d+\n", out.stdout)
    out = subprocess.run(
        [sys.executable, "-m", "pycalm", "serve", "--help"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
    )
    assert out.returncode == 0 and "--port" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "pycalm", "bake"], capture_output=True, text=True, env=_env(), cwd=REPO
    )
    assert out.returncode == 2 and out.stderr.startswith("error: unknown command")


def test_a_model_that_fails_to_load_ends_the_server(tmp_path):
    bad = tmp_path / "missing.pycalm"
    cmd = [sys.executable, "-m", "pycalm.serve", str(bad), "--port", str(_free_port()), "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"error: model not found: {bad}"


def test_a_job_abandoned_while_queued_still_ends():
    """The worker skips a job whose client left while it was queued, and still ends it with an
    error event, so that the request's handler returns instead of waiting forever; the job
    queued after it runs."""
    import asyncio

    from pycalm.app.serve import CLIENT_GONE, Job, Worker

    ran = []

    class Stub:  # stands in for the LLM: the worker only calls it through run_job
        pass

    async def main() -> list:
        loop = asyncio.get_running_loop()
        loaded = threading.Event()
        worker = Worker(lambda: Stub(), lambda llm, msg: loaded.set())
        worker.run_job = lambda job: (ran.append(job), job.emit("done", None))
        gone = Job([1], 1, None, False, loop)
        gone.cancel.set()  # the client left before the job started
        kept = Job([1], 1, None, False, loop)
        worker.start()
        worker.jobs.put(gone)
        worker.jobs.put(kept)
        worker.jobs.put(None)
        first = await asyncio.wait_for(gone.drain(), 5)
        second = await asyncio.wait_for(kept.drain(), 5)
        worker.join(5)
        return [first, second]

    first, second = asyncio.run(main())
    assert first == [("error", CLIENT_GONE)]
    assert second == [("done", None)] and len(ran) == 1


def test_chunks_are_json_dumps_of_the_whole_chunk():
    """Chunks' events are byte for byte `data: {json.dumps(chunk)}\n\n` of the whole chunk (the
    request's fields, then choices, then usage), for completions and chat: a piece of text alone
    spliced into the JSON made once (unicode, quotes, backslashes, newlines and control
    characters, an empty piece, a lone surrogate), and the chunks of logprobs, tool calls, a
    finish and the usage through chunk()."""
    from pycalm.app.serve import Chunks

    head = {"id": "cmpl-0123456789abcdef01234567", "created": 1765000000, "model": 'my "model" é/1'}
    texts = [
        "",
        " Paris",
        'say "hi"\\n',
        "a\nb\r\n\tc\x00\x1f\x7f",
        "héllo 世界 🎉 \u2028",
        "\ud800",
        "\ufffd",
    ]
    for chat, obj in ((False, "text_completion"), (True, "chat.completion.chunk")):
        chunks = Chunks(head, obj, chat)

        def whole(choices: list[dict], obj: str = obj, **extra: object) -> str:
            return f"data: {json.dumps({**head, 'object': obj, 'choices': choices, **extra})}\n\n"

        for index in (0, 3, 12):
            for text in texts:
                if chat:
                    choice = {"index": index, "delta": {"content": text}, "finish_reason": None}
                else:
                    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
                assert chunks.text(index, text) == whole([choice])
        lps = {
            "tokens": [" Par", "is"],
            "token_logprobs": [-0.5, -9999.0],
            "top_logprobs": [{" Par": -0.5}, {}],
        }
        call = {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": "f", "arguments": '{"a": "ü"}'},
        }
        others = [
            [{"index": 1, "text": " Par", "logprobs": lps, "finish_reason": None}],
            [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}],
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            [{"index": 2, "delta": {}, "finish_reason": "stop"}],
            [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
        ]
        for choices in others:
            assert chunks.chunk(choices) == whole(choices)
        usage = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
        assert chunks.chunk([], usage=usage) == whole([], usage=usage)
