"""The HTTP server: python -m pycalm.serve [MODEL] [--host 127.0.0.1] [--port 8000].

An OpenAI-compatible API over one engine, on Starlette (ASGI) served by uvicorn:

  POST /v1/chat/completions   the model's chat template; streaming (server-sent events) or not;
                              tools (pycalm.app.tools)
  POST /v1/completions        a plain continuation of a prompt (text or token ids)
  POST /v1/embeddings         texts' vectors: the final hidden states pooled (mean or last
                              token: the request's "pooling", else --pooling), L2-normalised
  GET  /v1/models             the one model served
  GET  /health                503 while the model loads, 200 once it is ready
  GET  /metrics               Prometheus text: tokens, tok/s, queue length

Requests take max_tokens, temperature, top_p, stop, seed, stream (and top_k, min_p beyond
OpenAI's set), n (up to 8 choices, made one after another from one feed of the prompt, choice i
with seed + i; streamed, choice 0's chunks come first, then choice 1's, each with its index;
usage counts every choice's tokens), presence_penalty, frequency_penalty, logit_bias (OpenAI's)
and repetition_penalty (vLLM's; pycalm.cpu.reference.penalties_ref gives the rule), vLLM's
min_tokens (no EOS, and no stop string's end, before the reply has that many tokens) and
ignore_eos (an EOS does not end the reply), and logprobs (chat: `logprobs: true` and
`top_logprobs: k`; completions: `logprobs: k`; k up to 20): each token's log-probability
under the model before temperature and the k most likely tokens', in OpenAI's shapes, a
streamed chunk carrying its tokens';
structured output (pycalm.app.constrain): `response_format` {"type": "json_object"} or
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}, or pycalm's extension
fields `grammar` (a Lark grammar, llguidance's dialect) or `regex` (the text matches it whole);
the response's usage holds prompt_tokens, completion_tokens and, as OpenAI's
prompt_tokens_details.cached_tokens, the prompt tokens whose keys and values were already in the
KV cache (pycalm.app.api: the next turn of a chat feeds only its new tokens). Errors have OpenAI's
shape, {"error": {"message", "type", "param", "code"}}: 400 for a bad request, 503 while the
model loads.

One engine serves one request at a time: a worker thread loads the model (after the server
listens, so /health answers 503 first) and then runs the requests in arrival order from a
queue; each request's text pieces cross to the event loop through a deque (Job). A client
that disconnects mid-stream sets its request's cancel flag, which the worker reads after every
token: the generation stops there and the next request starts.

--parallel N > 1 replaces that worker with ParallelWorker: the jobs join one batch, up to N
sequences at once (pycalm.app.batching: continuous batching over a paged KV cache with prefix
caching), the same events going out the same way; a cancel flag takes its sequence out at the
next step, and --batch-size caps the rows of a step. /metrics adds the batch's gauges.
--parallel auto (the default) decides once the model is loaded: on the GPU engine, where it can
batch, up to AUTO_PARALLEL sequences over a pool of as many positions as the GPU's memory
holds; else (the CPU engine, speculative decoding, the GPU's --batch-invariant or simple
kernels) one request at a time.

Chats take OpenAI's `tools` and `tool_choice` (auto, none, required, or a named function: these
two by constrained decoding, pycalm.app.tools.tool_grammar), rendered by the model's chat template, and messages of role "tool" and assistant messages
with `tool_calls`. The calls the model makes are parsed out of its text into the message's
`tool_calls` (content None when there is no other text) with finish_reason "tool_calls";
streamed, the text goes out as content deltas until a call, and each call as one `tool_calls`
delta ({"index", "id", "type", "function": {"name", "arguments"}}) once it is complete.

Embeddings take OpenAI's fields: `input` (a string, a list of strings, a list of token ids, or a
list of such lists) and `encoding_format` ("float", or "base64": the float32 bytes, little-endian,
as the openai client asks for by default); their usage holds prompt_tokens and total_tokens. They
queue for the engine like completions; a client that goes away stops its request before the next
text.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hmac
import json
import math
import queue
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from pycalm.cpu.reference import POOLINGS
from pycalm.cpu.sampler import SamplingParams
from pycalm.errors import OneLineParser, PycalmError

# a streaming response sends at most one chunk of text this often (the pieces made meanwhile go
# out together): an event loop woken for every token would take the GIL from the worker thread
# that many more times, and the decode would slow down with it
STREAM_INTERVAL_S = 0.01

# -------------------------------------------------------------------------------------------
# requests: checked fields and OpenAI's error shape

CLIENT_GONE = "the client went away before the request started"
SHUTTING_DOWN = "the server is shutting down"
ABANDON_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


class BadRequest(Exception):
    """A request the server refuses: its status and OpenAI's error object."""

    def __init__(
        self, message: str, param: str | None = None, code: str | None = None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"'{name}' must be a number, not {type(value).__name__}", name)
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        bounds = f"{'above' if low_open else 'at least'} {low}" + (
            f" and at most {high}" if high < math.inf else ""
        )
        raise BadRequest(f"'{name}' must be {bounds}, not {value}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer, not {type(value).__name__}", name)
    if low is not None and value < low:
        raise BadRequest(f"'{name}' must be at least {low}, not {value}", name)
    return value


def _boolean(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false, not {type(value).__name__}", name)
    return value


def _unsupported(body: dict, name: str, off: tuple) -> None:
    """A field pycalm does not implement is accepted only at its 'off' values."""
    if name in body and body[name] not in off:
        raise BadRequest(f"'{name}' is not supported by this server", name, "unsupported_parameter")


@dataclass
class Request:
    """What a completion request asks for, checked."""

    max_tokens: int | None
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # the top logprobs each token lists; None: no logprobs
    n: int = 1  # choices, made one after another (choice i with seed + i)
    constraint: object | None = None  # pycalm.app.constrain.Constraint the tokens follow; None: free
    constraint_spec: dict | None = None  # what makes a fresh constraint for each later choice


def parse_logprobs(body: dict, chat: bool) -> int | None:
    """The top logprobs a token lists (None: logprobs off). Chat: `logprobs` true or false and
    `top_logprobs` 0 to 20; completions: `logprobs` 0 to 20."""
    from pycalm.cpu.reference import MAX_TOP_LOGPROBS

    if not chat:
        _unsupported(body, "top_logprobs", (None,))
        k = _integer(body, "logprobs", None)
    else:
        on = _boolean(body, "logprobs")
        k = _integer(body, "top_logprobs", None)
        if k is not None and not on:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        k = (k or 0) if on else None
    name = "logprobs" if not chat else "top_logprobs"
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"'{name}' must be from 0 to {MAX_TOP_LOGPROBS}, not {k}", name)
    return k


def constraint_spec(body: dict) -> dict:
    """The request's constraint options, as LLM.constraint takes them."""
    return {
        "response_format": body.get("response_format"),
        "grammar": body.get("grammar"),
        "regex": body.get("regex"),
    }


def parse_constraint(body: dict, llm: object) -> object | None:
    """The request's constraint (None: none): OpenAI's response_format ({"type": "text"},
    "json_object" or "json_schema"), or pycalm's extension fields `grammar` (a Lark grammar) or
    `regex`; another response_format type, or a schema, grammar or regex that does not compile,
    is a BadRequest."""
    fmt = body.get("response_format")
    if fmt is not None and (
        not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema")
    ):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise BadRequest(
            f"response_format type must be text, json_object or json_schema, not {kind!r}", "response_format"
        )
    for name in ("grammar", "regex"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise BadRequest(f"'{name}' must be a string", name)
    try:
        return llm.constraint(**constraint_spec(body))
    except PycalmError as e:
        param = next((n for n in ("grammar", "regex") if body.get(n) is not None), "response_format")
        raise BadRequest(str(e), param) from None


def parse_common(body: dict) -> Request:
    """The fields both endpoints share; BadRequest names the first bad one."""
    if not isinstance(body.get("model", ""), str):
        raise BadRequest("'model' must be a string", "model")
    from pycalm.app.api import MAX_CHOICES

    n = _integer(body, "n", 1, 1)
    if n > MAX_CHOICES:
        raise BadRequest(f"'n' must be at most {MAX_CHOICES}, not {n}", "n")
    presence = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    repetition = _number(body, "repetition_penalty", 1.0, 0.0, math.inf, low_open=True)
    _unsupported(body, "best_of", (None, 1))
    max_tokens = _integer(body, "max_tokens", None, 1)
    max_tokens = _integer(body, "max_completion_tokens", max_tokens, 1)
    min_tokens = _integer(body, "min_tokens", 0, 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise BadRequest(
            f"'min_tokens' must be at most max_tokens ({max_tokens}), not {min_tokens}", "min_tokens"
        )
    ignore_eos = _boolean(body, "ignore_eos")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = _integer(body, "top_k", 0, 0)
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    seed = _integer(body, "seed", None)
    if seed is None:
        seed = time.time_ns() % (2**31)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of them", "stop")
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    include_usage = _boolean(options or {}, "include_usage")
    sampling = SamplingParams(
        temperature, top_k, top_p, min_p, seed % (2**63), presence, frequency, repetition,
        min_tokens=min_tokens, ignore_eos=ignore_eos,
    )  # fmt: skip
    return Request(max_tokens, sampling, stop, stream, include_usage, n=n)


def parse_logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, {"token id": bias from -100 to 100} (at most 300 entries), as sorted
    (id, bias) pairs; BadRequest names the first bad entry."""
    from pycalm.cpu.reference import MAX_LOGIT_BIAS

    given = body.get("logit_bias")
    if given is None:
        return ()
    if not isinstance(given, dict):
        raise BadRequest("'logit_bias' must be an object of token ids to biases", "logit_bias")
    if len(given) > MAX_LOGIT_BIAS:
        raise BadRequest(
            f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens, not {len(given)}", "logit_bias"
        )
    out = []
    for key, bias in given.items():
        token = int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else None
        if token is None or not 0 <= token < vocab_size:
            raise BadRequest(
                f"'logit_bias': {key!r} is not a token id of this model (0 to {vocab_size - 1})", "logit_bias"
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise BadRequest(
                f"'logit_bias': the bias of token {token} must be a number from -100 to 100", "logit_bias"
            )
        out.append((token, float(bias)))
    return tuple(sorted(out))


def parse_messages(body: dict) -> list[dict[str, Any]]:
    """The chat's messages as [{"role", "content"}] with text content ("developer" is "system");
    an assistant's tool_calls and a tool result's tool_call_id kept (pycalm.app.tools)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(f"messages[{i}]: role must be system, user, assistant or tool", "messages")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):  # content parts: text only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise BadRequest(f"messages[{i}]: only text content parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}]: content must be a string", "messages")
        message = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if role == "tool" and m.get("tool_call_id") is not None:
            message["tool_call_id"] = str(m["tool_call_id"])
        out.append(message)
    return out


def _tool_calls(calls: object, i: int) -> list[dict]:
    """An assistant message's tool_calls, checked: [{"id", "type", "function": {"name",
    "arguments"}}] with the arguments as JSON text (or an object)."""
    ok = isinstance(calls, list) and all(
        isinstance(c, dict)
        and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", "{}"), str | dict)
        for c in calls
    )
    if not ok:
        raise BadRequest(
            f"messages[{i}].tool_calls must be a list of {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
            "messages",
        )
    return [
        {
            "id": str(c.get("id", "")),
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": c["function"].get("arguments", "{}")},
        }
        for c in calls
    ]


def parse_tools(body: dict) -> tuple[list[dict] | None, str]:
    """The chat's tools (None: none offered) and tool_choice (auto, none, required or a name)."""
    from pycalm.app.tools import check_tool_choice, check_tools

    tools = body.get("tools") or None
    try:
        tools = None if tools is None else check_tools(tools)
    except PycalmError as e:
        raise BadRequest(str(e), "tools") from None
    try:
        choice = check_tool_choice(body.get("tool_choice"), tools)
    except PycalmError as e:
        raise BadRequest(str(e), "tool_choice") from None
    return tools, choice


def parse_prompt(body: dict) -> str | list[int]:
    """The completion's prompt: text, or token ids (a list of one of either is taken too)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    raise BadRequest("'prompt' must be a string or a list of token ids (one prompt a request)", "prompt")


def parse_embedding_input(
    body: dict, vocab_size: int, tokenize: Callable[[str], list[int]]
) -> list[list[int]]:
    """The token ids of each of an embeddings request's texts (strings encoded with the BOS)."""
    given = body.get("input")
    message = "'input' must be a non-empty string, a list of them, or token ids (a list, or a list of lists)"
    if isinstance(given, str) or (isinstance(given, list) and given and all(_is_id(t) for t in given)):
        given = [given]
    if not isinstance(given, list) or not given:
        raise BadRequest(message, "input")
    texts = []
    for i, item in enumerate(given):
        if isinstance(item, str):
            if not item:
                raise BadRequest(f"input[{i}] is an empty string", "input")
            texts.append(tokenize(item))
        elif isinstance(item, list) and item and all(_is_id(t) for t in item):
            if any(not 0 <= t < vocab_size for t in item):
                raise BadRequest(f"input[{i}]: a token id is outside the vocabulary", "input")
            texts.append(list(item))
        else:
            raise BadRequest(message, "input")
    return texts


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Embedding:
    """What an embeddings request asks the worker for: the texts' ids and the pooling."""

    texts: list[list[int]]
    pooling: str


# -------------------------------------------------------------------------------------------
# the worker: one engine, one request at a time


@dataclass
class Job:
    """One request on its way through the worker: its prompt, and the events it sends back.

    The worker appends events to a deque and wakes the event loop only when no wake-up is on its
    way already, so pieces made while the loop is busy go out together, at one wake-up."""

    ids: list[int]
    max_tokens: int
    request: Request
    prime: bool  # decode as the prompt's continuation (completions) or as a reply (chat)
    loop: asyncio.AbstractEventLoop
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    # a completion's: ("start", i), ("text", (i, str)), ("logprobs", (i, [TokenLogprobs])),
    # ("calls", (i, [call])) and ("finish", (i, Generation)) a choice i, then ("done",
    # [Generation]) or ("error", str)
    events: deque = field(default_factory=deque)
    cancel: threading.Event = field(default_factory=threading.Event)
    woken: bool = False  # a wake-up is on its way to the loop
    embedding: Embedding | None = None  # an embeddings request (ids, max_tokens, request unused)
    tool_parser: object | None = None  # a chat that offers tools: parses the calls (pycalm.app.tools)

    def emit(self, kind: str, value: object) -> None:  # on the worker thread
        if self.post(kind, value):
            self.loop.call_soon_threadsafe(self.ready.set)

    def post(self, kind: str, value: object) -> bool:  # on the worker thread
        """Append an event -> whether the loop must be woken for it (the caller wakes it:
        ParallelWorker wakes a step's jobs together, one call_soon_threadsafe a step)."""
        self.events.append((kind, value))
        if self.woken:
            return False
        self.woken = True
        return True

    async def drain(self, not_before: float = 0.0) -> list[tuple[str, object]]:  # on the event loop
        """The events so far, once there is one, and not before the loop's time `not_before`
        (those made meanwhile come too)."""
        await self.ready.wait()
        if (wait := not_before - self.loop.time()) > 0:  # (no timer where the time has passed)
            await asyncio.sleep(wait)
        self.ready.clear()
        self.woken = False  # before taking the events: one appended from here on wakes again
        return [self.events.popleft() for _ in range(len(self.events))]


def _set_ready(jobs: list[Job]) -> None:  # on the event loop
    for job in jobs:
        job.ready.set()


class Waker(threading.Thread):
    """Wakes the event loop for ParallelWorker's jobs from a thread of its own. The wake-up's
    system call (call_soon_threadsafe's write) lets go of the GIL, and the event loop, which it
    wakes, takes it: made on the worker thread right before the worker waits for the GPU, the
    worker would wait for the loop to hand the GIL back first, often for the loop's whole turn
    of formatting and sending. The worker hands the jobs over here instead (no system call of
    its own, the GIL kept) and goes on to wait; this thread makes the call once it has the GIL."""

    def __init__(self) -> None:
        super().__init__(name="pycalm-waker", daemon=True)
        self.queue: queue.SimpleQueue[list[Job] | None] = queue.SimpleQueue()

    def run(self) -> None:
        ending = False  # the None that ends it came (after every list handed over before it)
        while not ending and (first := self.queue.get()) is not None:
            jobs = list(first)
            while not ending and not self.queue.empty():  # those handed over meanwhile, at one wake-up
                more = self.queue.get()
                ending = more is None
                jobs += more or []
            with contextlib.suppress(RuntimeError):  # (a loop closed: no one waits on its jobs)
                jobs[0].loop.call_soon_threadsafe(_set_ready, jobs)


@dataclass
class Metrics:
    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    busy_s: float = 0.0  # seconds the engine spent on requests
    last_decode_tok_s: float = 0.0
    last_prompt_tok_s: float = 0.0
    running: int = 0


class Worker(threading.Thread):
    """Loads the model, then runs the queued jobs in arrival order, one at a time. All engine
    work (and so every GPU call) happens on this thread."""

    def __init__(self, load: Callable[[], object], on_loaded: Callable[[object | None, str], None]) -> None:
        super().__init__(name="pycalm-worker", daemon=True)
        self.load = load
        self.on_loaded = on_loaded  # (llm, "") once loaded, (None, message) when loading fails
        self.llm: object | None = None
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.metrics = Metrics()
        self.current: Job | None = None  # the job on the engine
        self.stopping = False  # the server is shutting down: no job starts any more

    def run(self) -> None:
        try:
            llm = self.load()
            self.prepare(llm)
        except (PycalmError, OSError) as e:
            self.on_loaded(None, str(e))
            return
        except Exception as e:  # a bug: shown whole, and the server still ends
            traceback.print_exc()
            self.on_loaded(None, f"loading failed: {e}")
            return
        self.llm = llm
        self.on_loaded(llm, "")
        self.serve()

    def prepare(self, llm: object) -> None:
        """What serving needs beyond the model, made before the server says it is ready: a failure
        here fails the loading (one line, and the server exits), not the requests."""

    def serve(self) -> None:
        """The queued jobs in arrival order, one at a time, until the None that ends the queue."""
        while (job := self.jobs.get()) is not None:
            self.current = job  # before reading `stopping`: shutdown() reads them the other way round
            if self.stopping:
                job.emit("error", SHUTTING_DOWN)
            elif not job.cancel.is_set():  # a client that left while queued costs nothing
                self.run_job(job)
            else:  # but its handler still gets an end, so that it returns and is not left waiting
                job.emit("error", CLIENT_GONE)
            self.current = None

    def shutdown(self) -> None:
        """The server is stopping (on the event loop): the running job stops at its next token
        and answers with what it has; the queued ones answer with an error at once."""
        self.stopping = True
        if (job := self.current) is not None:
            job.cancel.set()
        with self.jobs.mutex:
            queued = [j for j in self.jobs.queue if j is not None]
        for job in queued:
            job.cancel.set()
            job.emit("error", SHUTTING_DOWN)

    @contextmanager
    def on_engine(self, job: Job) -> Iterator[Metrics]:
        """The frame of a job on the engine: the metrics' running flag and busy time, and an error
        becomes the job's ("error", message) (a bug ends this request, not the server)."""
        m = self.metrics
        m.running = 1
        t0 = time.perf_counter()
        try:
            yield m
        except PycalmError as e:
            job.emit("error", str(e))
        except Exception as e:  # a bug ends this request, not the server
            traceback.print_exc()
            job.emit("error", f"internal error: {e}")
        finally:
            m.busy_s += time.perf_counter() - t0
            m.running = 0

    def run_job(self, job: Job) -> None:
        """The request's choices, one after another (choice i with seed + i; the later ones find
        the prompt in the cache): ("start", i), its ("logprobs", (i, [TokenLogprobs])) and
        ("text", (i, piece)) events, ("finish", (i, Generation)); then ("done", [Generation])."""
        if job.embedding is not None:
            return self.run_embedding(job)
        with self.on_engine(job) as m:
            r, gens = job.request, []
            for i in range(r.n):
                gen = self.run_choice(job, i, replace(r.sampling, seed=r.sampling.seed + i))
                gens.append(gen)
                if gen.completion_tokens > 1:
                    m.last_decode_tok_s = gen.decode_tok_s
                if job.cancel.is_set():
                    break
            m.requests += 1
            m.prompt_tokens += gens[0].prompt_tokens
            m.reused_tokens += gens[0].reused_tokens
            m.generated_tokens += sum(g.completion_tokens for g in gens)
            if gens[0].prompt_s > 0:
                m.last_prompt_tok_s = (gens[0].prompt_tokens - gens[0].reused_tokens) / gens[0].prompt_s
            job.emit("done", gens)

    def run_choice(self, job: Job, i: int, sampling: SamplingParams) -> object:
        """Choice i of the job, its events sent as it is made; returns its finished Generation."""
        r = job.request
        # a constraint follows one output: the request's for choice 0, a fresh one for the others
        constraint = (
            r.constraint if i == 0 or r.constraint is None else self.llm.constraint(**r.constraint_spec)
        )
        gen = self.llm.start(
            job.ids,
            job.max_tokens,
            sampling,
            r.stop,
            job.prime,
            job.cancel.is_set,
            logprobs=r.logprobs,
            constraint=constraint,
            tool_parser=job.tool_parser,
        )
        sent = calls = 0  # the tokens whose logprobs were emitted, the tool calls emitted

        def emit_calls() -> None:  # the calls completed, after the text before them
            nonlocal calls
            if gen.tool_calls is not None and len(gen.tool_calls) > calls:
                job.emit("calls", (i, gen.tool_calls[calls:]))
                calls = len(gen.tool_calls)

        def emit_logprobs() -> None:  # the new tokens' logprobs, ahead of their text
            nonlocal sent
            if gen.logprobs is not None and len(gen.logprobs) > sent:
                job.emit("logprobs", (i, gen.logprobs[sent:]))
                sent = len(gen.logprobs)

        job.emit("start", i)
        for piece in gen:
            emit_logprobs()
            if piece:
                job.emit("text", (i, piece))
            emit_calls()
        emit_logprobs()
        emit_calls()
        job.emit("finish", (i, gen))
        return gen

    def run_embedding(self, job: Job) -> None:
        """The texts' embeddings, one text after another; a cancelled job stops before the next
        text. Sends ("done", (n, dim) float32) or ("error", message)."""
        e = job.embedding
        with self.on_engine(job) as m:
            vectors = self.llm.embed_ids(e.texts, e.pooling, cancelled=job.cancel.is_set)
            if vectors is None:  # the client went away (or the server stops): no one reads it
                job.emit("error", SHUTTING_DOWN if self.stopping else "the request was cancelled")
                return
            m.requests += 1
            m.prompt_tokens += sum(len(ids) for ids in e.texts)
            job.emit("done", vectors)

    def metrics_text(self) -> str:
        """The counters in Prometheus' text format."""
        m = self.metrics
        rows = [  # (name, type, help, value)
            ("requests_total", "counter", "Requests completed.", m.requests),
            ("prompt_tokens_total", "counter", "Prompt tokens.", m.prompt_tokens),
            ("prompt_tokens_reused_total", "counter", "Prompt tokens from the cache.", m.reused_tokens),
            ("generation_tokens_total", "counter", "Tokens generated.", m.generated_tokens),
            ("busy_seconds_total", "counter", "Seconds the engine spent on requests.", m.busy_s),
            ("decode_tokens_per_second", "gauge", "Decode tok/s, last request.", m.last_decode_tok_s),
            ("prompt_tokens_per_second", "gauge", "Fed prompt tok/s, last request.", m.last_prompt_tok_s),
            ("queue_length", "gauge", "Requests waiting for the engine.", self.jobs.qsize()),
            ("requests_running", "gauge", "Requests on the engine (0 or 1).", m.running),
            ("model_loaded", "gauge", "1 once the model is loaded.", int(self.llm is not None)),
        ]
        out = []
        for name, kind, about, value in rows:
            out += [f"# HELP pycalm_{name} {about}", f"# TYPE pycalm_{name} {kind}"]
            out.append(f"pycalm_{name} {value:g}")
        return "\n".join(out) + "\n"


AUTO_PARALLEL = 64  # --parallel auto on the GPU: sequences a step at most (the row buckets
# measured, up to 64); the pool takes the memory there is, and admission waits for its blocks


def auto_parallel(engine: object) -> tuple[int, str]:
    """--parallel auto for a loaded engine -> (sequences, why): AUTO_PARALLEL on a GPU engine
    that batches, else 1 and the reason."""
    from pycalm.app.batching import batch_refusal

    if engine.device != "gpu":
        return 1, "the CPU engine serves one request at a time unless --parallel N says otherwise"
    if why := batch_refusal(engine):
        return 1, why.replace("--parallel", "batching", 1)
    return AUTO_PARALLEL, ""


class ParallelWorker(Worker):
    """--parallel N: the engine (CPU or GPU) runs up to N requests at once through continuous
    batching (pycalm.app.batching.BatchRunner). Each turn of the loop takes the jobs queued
    meanwhile (a choice of a job is a sequence of the batch; embeddings run between steps), then
    runs one step; it waits on the queue only when nothing runs. The runner hands a step's text
    out while the GPU runs the next pass, and the event loop is woken as the worker next waits for
    the GPU (the runner's on_events, through the Waker), so that it formats and sends the text
    while the worker waits, not while it plans and enqueues the next step. A job ends ("done")
    when its last choice has finished; a cancelled job (a client gone, or the shutdown) leaves
    the batch at the next step with what it has. parallel None (--parallel auto): auto_parallel
    decides at load; where it says 1, the worker serves as Worker does, one job at a time."""

    def __init__(
        self,
        load: Callable[[], object],
        on_loaded: Callable[[object | None, str], None],
        parallel: int | None,
        batch_size: int | None = None,
    ) -> None:
        super().__init__(load, on_loaded)
        self.parallel = parallel
        self.batch_size = batch_size  # rows a step feeds at most (None: BatchRunner's default)
        self.auto = parallel is None
        self.runner: object | None = None  # the BatchRunner, once the model is loaded
        self.active: dict[int, tuple[Job, list]] = {}  # id(job) -> (job, its Generations by choice)
        self.peak = 0  # the most sequences a step has run
        self.to_wake: list[Job] = []  # jobs with events since the last wake-up
        self.waker = Waker()  # wakes the loop for the runner's events, while the worker waits

    def prepare(self, llm: object) -> None:
        """The batch runner and its KV pool: an engine that cannot batch (--parallel N), or a pool
        that does not fit, fails the loading. --parallel auto decides here (auto_parallel)."""
        if self.auto:
            self.parallel, why = auto_parallel(llm.engine)
            if self.parallel == 1:
                print(f"pycalm: --parallel auto: one request at a time ({why})", file=sys.stderr, flush=True)
                return
        self.runner = r = self.new_runner(llm)
        positions = r.blocks.n_blocks * r.blocks.block_size
        print(f"pycalm: --parallel {self.parallel}{' (auto)' if self.auto else ''}: a KV pool of {positions:,} "
              f"positions ({positions / llm.seq_len:.1f} full contexts)", file=sys.stderr, flush=True)  # fmt: skip

    def new_runner(self, llm: object) -> object:
        """A BatchRunner of up to self.parallel sequences that wakes the event loop after each
        hand-out of tokens (while the GPU runs the next step)."""
        from pycalm.app.batching import BatchRunner

        runner = BatchRunner(llm, self.parallel, token_budget=self.batch_size)
        runner.on_events = self.wake_waiting
        return runner

    def serve(self) -> None:
        if self.runner is None:  # --parallel auto chose one request at a time
            return Worker.serve(self)
        self.waker.start()
        ending = False  # (self.runner, not a local: a failed step replaces it)
        while not ending or not self.runner.idle():
            try:
                job = self.jobs.get(block=self.runner.idle() and not ending)
            except queue.Empty:
                job = False  # nothing new: step the batch
            while job is not False:
                if job is None:
                    ending = True
                else:
                    self.start_job(job)
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    job = False
            if not self.runner.idle():
                self.step()
            if self.runner.inflight is None:  # (else the runner wakes it at its wait for that step)
                self.wake()
        self.waker.queue.put(None)

    def start_job(self, job: Job) -> None:
        """A queued job joins the batch (its choices as sequences), or answers at once."""
        if self.stopping:
            return job.emit("error", SHUTTING_DOWN)
        if job.cancel.is_set():
            return job.emit("error", CLIENT_GONE)
        if job.embedding is not None:
            return self.run_embedding(job)
        r, gens = job.request, [None] * job.request.n

        def emit(kind: str, value: object) -> None:
            if job.post(kind, value):  # woken after the step, with the step's other jobs
                self.to_wake.append(job)
            if kind == "finish":
                i, gen = value
                gens[i] = gen
                if all(g is not None for g in gens):
                    self.end_job(job, gens)

        self.active[id(job)] = (job, gens)
        try:
            for i in range(r.n):
                constraint = (
                    r.constraint
                    if i == 0 or r.constraint is None
                    else self.llm.constraint(**r.constraint_spec)
                )
                self.runner.add(
                    job.ids,
                    job.max_tokens,
                    replace(r.sampling, seed=r.sampling.seed + i),
                    emit,
                    i,
                    r.stop,
                    job.prime,
                    job.cancel.is_set,
                    r.logprobs,
                    constraint,
                    job.tool_parser,
                )
        except PycalmError as e:
            job.cancel.set()  # the choices queued already leave at the next step
            self.active.pop(id(job), None)
            job.emit("error", str(e))

    def wake(self) -> None:
        """Wake the event loop once for every job that has new events (a call_soon_threadsafe
        a job would cost a system call each, on the worker thread, 64 a step at 64 sequences)."""
        if self.to_wake:
            jobs, self.to_wake = self.to_wake, []
            jobs[0].loop.call_soon_threadsafe(_set_ready, jobs)

    def wake_waiting(self) -> None:
        """wake(), by the Waker: the runner's on_events, called as the worker is about to wait."""
        if self.to_wake:
            jobs, self.to_wake = self.to_wake, []
            self.waker.queue.put(jobs)

    def end_job(self, job: Job, gens: list) -> None:
        """Every choice of the job has finished: its counts, and ("done", gens)."""
        if self.active.pop(id(job), None) is None:  # it failed already
            return
        m = self.metrics
        m.requests += 1
        m.prompt_tokens += gens[0].prompt_tokens
        m.reused_tokens += gens[0].reused_tokens
        m.generated_tokens += sum(g.completion_tokens for g in gens)
        if gens[0].completion_tokens > 1:
            m.last_decode_tok_s = gens[0].decode_tok_s
        job.emit("done", gens)

    def step(self) -> None:
        """One step of the batch; a bug ends the requests in it (an error each), not the server."""
        m = self.metrics
        t0 = time.perf_counter()
        failed = None
        try:
            self.runner.step()
        except Exception as e:
            traceback.print_exc()
            failed = f"internal error: {e}"
        m.busy_s += time.perf_counter() - t0
        if failed is not None:
            for job, _ in list(self.active.values()):
                job.cancel.set()
                job.emit("error", failed)
            self.active.clear()
            self.runner = None  # the old pool freed (its state is unknown) before a fresh one is made
            self.runner = self.new_runner(self.llm)
        m.running = len(self.runner.scheduler.running)
        self.peak = max(self.peak, m.running)

    def shutdown(self) -> None:
        """The server is stopping (on the event loop): the running jobs stop at the next step and
        answer with what they have; the queued ones answer with an error at once."""
        super().shutdown()
        for job, _ in list(self.active.values()):
            job.cancel.set()

    def metrics_text(self) -> str:
        """The counters, and the batch's: running and waiting sequences, KV blocks, prefix hits."""
        out = super().metrics_text()
        r = self.runner  # read once: a failed step replaces it (None meanwhile)
        if r is None:
            return out
        rows = [
            ("batch_running", "gauge", "Sequences in the batch.", "running"),
            ("batch_running_peak", "gauge", "The most sequences a step has run.", "peak"),
            ("batch_waiting", "gauge", "Sequences waiting for a place in the batch.", "waiting"),
            ("batch_preemptions_total", "counter", "Sequences preempted for blocks.", "preemptions"),
            ("kv_blocks_used", "gauge", "KV blocks held by sequences.", "kv_blocks_used"),
            ("kv_blocks_free", "gauge", "KV blocks holding nothing.", "kv_blocks_free"),
            ("kv_blocks_cached", "gauge", "KV blocks holding a reusable prefix.", "kv_blocks_cached"),
            (
                "prefix_cache_hit_rate",
                "gauge",
                "Share of prompt tokens from the prefix cache.",
                "prefix_hit_rate",
            ),
            ("batch_steps_total", "counter", "Batched passes run.", "steps"),
            ("batch_step_seconds_total", "counter", "Seconds in the batch's steps.", "step_s"),
            (
                "batch_engine_seconds_total",
                "counter",
                "Seconds of those in the engine's pass (the rest: scheduling, sampling, text).",
                "engine_s",
            ),
            (
                "batch_gpu_seconds_total",
                "counter",
                "Seconds the GPU spent on the batch's passes (CUDA events; 0 on the CPU engine).",
                "gpu_s",
            ),
            (
                "batch_graph_captures_total",
                "counter",
                "CUDA graphs captured (a step's rows, sampled rows and attention span met first).",
                "captures",
            ),
            (
                "batch_capture_seconds_total",
                "counter",
                "Host seconds of those steps (launched a kernel at a time, then captured).",
                "capture_s",
            ),
        ]
        values = {**r.metrics(), "peak": self.peak}
        lines = []
        for name, kind, about, key in rows:
            lines += [f"# HELP pycalm_{name} {about}", f"# TYPE pycalm_{name} {kind}"]
            lines.append(f"pycalm_{name} {values[key]:g}")
        return (
            out
            + "\n".join(lines)
            + "\n"
            + r.ttft.text(
                "pycalm_time_to_first_token_seconds", "From a request's arrival to its first token."
            )
            + r.itl.text("pycalm_inter_token_latency_seconds", "Between two tokens of a request.")
        )


class Chunks:
    """A streamed reply's chunks as server-sent events, `data: {JSON}\n\n`, byte for byte those
    of json.dumps of the whole chunk ({id, created, model, object, choices[, usage]}). A piece of
    text alone (a choice's text, no logprobs, tool calls or finish: a stream's usual chunk) is the
    JSON around it, made once for the request, spliced around json.dumps of the text."""

    def __init__(self, head: dict, obj: str, chat: bool) -> None:
        self.head = {**head, "object": obj}  # the fields fixed for the request
        before = json.dumps({**self.head, "choices": [{"index": 0}]})  # '{..., "choices": [{"index": 0}]}'
        self.before = "data: " + before[: -len("0}]}")]  # up to a choice's index
        self.between = ', "delta": {"content": ' if chat else ', "text": '  # from the index to the text
        self.after = ("}" if chat else ', "logprobs": null') + ', "finish_reason": null}]}\n\n'

    def chunk(self, choices: list[dict], **extra: object) -> str:
        """The chunk of these choices, then `extra`'s fields (usage)."""
        return f"data: {json.dumps({**self.head, 'choices': choices, **extra})}\n\n"

    def text(self, index: int, text: str) -> str:
        """chunk() of choice `index`'s piece `text` alone: completions' {"index", "text",
        "logprobs": null, "finish_reason": null}, chat's {"index", "delta": {"content"},
        "finish_reason": null}."""
        return f"{self.before}{index}{self.between}{json.dumps(text)}{self.after}"


# -------------------------------------------------------------------------------------------
# the app


def make_app(
    worker: Worker,
    model_name: str,
    on_startup: Callable[[], None] | None = None,
    aliases: tuple[str, ...] = (),
    api_key: str | None = None,
    pooling: str = "mean",
) -> object:
    """The Starlette app over `worker` (started by on_startup or by the caller). A request's
    `model`, where given, must be model_name or one of `aliases` (else OpenAI's 404,
    model_not_found); with `api_key`, every endpoint but /health asks for
    `Authorization: Bearer <api_key>` (else 401, invalid_api_key). pooling: the embeddings'
    pooling where a request gives none ("mean" or "last")."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    created = int(time.time())

    served = {model_name, *aliases}  # the names a request's `model` may take

    def fail(e: BadRequest) -> JSONResponse:
        kind = "invalid_request_error" if e.status < 500 else "unavailable_error"
        return JSONResponse(error_body(str(e), kind, e.param, e.code), status_code=e.status)

    def authorized(request: HttpRequest) -> bool:
        if api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())

    def refused() -> JSONResponse:
        return fail(
            BadRequest("a valid API key is needed: Authorization: Bearer KEY", None, "invalid_api_key", 401)
        )

    async def read_body(request: HttpRequest) -> dict:
        if worker.llm is None:
            raise BadRequest("the model is loading; try again shortly", None, "model_loading", 503)
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    def submit(ids: list[int], r: Request, prime: bool, tool_parser: object | None = None) -> Job:
        llm = worker.llm
        if len(ids) >= llm.seq_len:
            raise BadRequest(
                f"the prompt is {len(ids)} tokens; the context holds {llm.seq_len} (prompt and reply)",
                "messages" if not prime else "prompt",
                "context_length_exceeded",
            )
        room = llm.seq_len - len(ids)
        max_tokens = room if r.max_tokens is None else min(r.max_tokens, room)
        job = Job(ids, max_tokens, r, prime, asyncio.get_running_loop(), tool_parser=tool_parser)
        worker.jobs.put(job)
        return job

    def usage(gens: list) -> dict:
        """The prompt once (and its cached tokens, the first choice's), every choice's tokens."""
        completion = sum(g.completion_tokens for g in gens)
        return {
            "prompt_tokens": gens[0].prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": gens[0].prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": gens[0].reused_tokens},
        }

    def log(path: str, gens: list) -> None:
        for i, gen in enumerate(gens):
            rate = f"{gen.decode_tok_s:.1f} tok/s" if gen.completion_tokens > 1 else "-"
            which = f" choice {i}:" if len(gens) > 1 else ""
            print(
                f"pycalm: {path}:{which} {gen.prompt_tokens} prompt tokens ({gen.reused_tokens} reused from the cache) "
                f"+ {gen.completion_tokens} generated, {rate}, finish {gen.finish_reason}",
                file=sys.stderr,
                flush=True,
            )

    async def events(job: Job, path: str) -> AsyncIterator[tuple[str, object]]:
        """The job's events in order; a choice's consecutive text pieces (and their tokens'
        logprobs, and the tool calls completed) of one wake-up come as one ("text", (i, text,
        [TokenLogprobs], [call])). Leaving early (a client gone) cancels the job, which the
        worker sees at its next token, and says so in a line."""
        ended = False  # the job's last event was taken
        not_before = 0.0  # the loop's time the next text may go out (STREAM_INTERVAL_S after the last)
        try:
            while True:
                batch = await job.drain(not_before)
                merged: list[tuple[str, object]] = []
                for kind, value in batch:
                    if kind in ("text", "logprobs", "calls"):
                        i, item = value
                        if not merged or merged[-1][0] != "text" or merged[-1][1][0] != i:
                            merged.append(("text", (i, "", [], [])))
                        _, text, lps, calls = merged[-1][1]
                        if kind == "text":
                            text += item
                        elif kind == "logprobs":
                            lps = lps + item
                        else:
                            calls = calls + item
                        merged[-1] = ("text", (i, text, lps, calls))
                    else:
                        merged.append((kind, value))
                for kind, value in merged:
                    if kind in ("done", "error"):
                        ended = True
                    yield kind, value
                    if ended:
                        return
                if any(kind == "text" for kind, _ in merged):
                    not_before = job.loop.time() + STREAM_INTERVAL_S
        finally:
            if not ended and not job.cancel.is_set():
                print(f"pycalm: {path}: the client went away; the request stops", file=sys.stderr, flush=True)
            job.cancel.set()

    async def abandoned(request: HttpRequest, job: Job, path: str) -> None:
        """A non-streaming request whose client goes away: the job is cancelled (the worker stops
        at its next token) and a line says so. (A stream sees its client go when a write fails.)"""
        while not job.cancel.is_set():
            if await request.is_disconnected():
                job.cancel.set()
                print(f"pycalm: {path}: the client went away; the request stops", file=sys.stderr, flush=True)
                return
            await asyncio.sleep(ABANDON_POLL_S)

    def check_model(body: dict) -> None:
        """A request's `model`, where given, is the served one (else OpenAI's 404)."""
        if not isinstance(body.get("model", ""), str):
            raise BadRequest("'model' must be a string", "model")
        if body.get("model") and body["model"] not in served:
            raise BadRequest(
                f"the model '{body['model']}' does not exist: this server serves '{model_name}'",
                "model",
                "model_not_found",
                404,
            )

    async def run(request: HttpRequest, chat: bool) -> object:
        path = request.url.path
        if not authorized(request):
            return refused()
        try:
            body = await read_body(request)
            r = parse_common(body)
            check_model(body)
            r.logprobs = parse_logprobs(body, chat)
            bias = parse_logit_bias(body, worker.llm.config.vocab_size)
            r.sampling = replace(r.sampling, logit_bias=bias)
            r.constraint = parse_constraint(body, worker.llm)
            r.constraint_spec = constraint_spec(body)
            _unsupported(body, "echo", (None, False))
            parser = None
            if chat:
                from pycalm.app.tools import ToolCallParser

                tools, choice = parse_tools(body)
                offered = tools if choice != "none" else None
                ids = worker.llm.chat_ids(parse_messages(body), offered)
                if offered:
                    if r.n > 1:
                        raise BadRequest("n > 1 does not go with tools (one choice a chat with tools)", "n")
                    parser = ToolCallParser(frozenset(t["function"]["name"] for t in offered))
                if choice not in ("auto", "none"):  # the calls forced, in the model's own form
                    if r.constraint is not None:
                        raise BadRequest(
                            "tool_choice required or named goes with no response_format, grammar or regex",
                            "tool_choice",
                        )
                    r.constraint = worker.llm.tool_constraint(tools, choice)
            else:
                _unsupported(body, "tools", (None, []))
                _unsupported(body, "suffix", (None, ""))
                prompt = parse_prompt(body)
                ids = worker.llm.tokenize(prompt) if isinstance(prompt, str) else prompt
                if any(not 0 <= t < worker.llm.config.vocab_size for t in ids):
                    raise BadRequest("a token id is outside the vocabulary", "prompt")
            job = submit(ids, r, prime=not chat, tool_parser=parser)
        except BadRequest as e:
            return fail(e)
        except PycalmError as e:  # e.g. the chat template rejects the conversation
            return fail(BadRequest(str(e)))
        name = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": name, "created": int(time.time()), "model": model_name}

        tokenizer = worker.llm.tokenizer
        offsets = [0] * r.n  # completions: where the next token's text begins in each choice

        def entry(token: int, logprob: float) -> tuple[str, float, bytes]:
            raw = tokenizer.token_bytes(token)  # -inf (a masked token) as OpenAI's -9999
            return raw.decode("utf-8", errors="replace"), max(logprob, -9999.0), raw

        def logprobs_of(index: int, lps: list | None) -> dict | None:
            """OpenAI's logprobs object of these tokens of choice `index`: chat's content list, or
            completions' tokens / token_logprobs / top_logprobs / text_offset."""
            if r.logprobs is None:
                return None
            lps = lps or []
            if chat:
                content = []
                for lp in lps:
                    text, logprob, raw = entry(lp.token, lp.logprob)
                    top = [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
                    content.append({
                        "token": text, "logprob": logprob, "bytes": list(raw),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for t, v, b in top],
                    })  # fmt: skip
                return {"content": content}
            out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for lp in lps:
                text, logprob, _ = entry(lp.token, lp.logprob)
                out["tokens"].append(text)
                out["token_logprobs"].append(logprob)
                top = (entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True))
                out["top_logprobs"].append({t: v for t, v, _ in top})
                out["text_offset"].append(offsets[index])
                offsets[index] += len(text)
            return out

        def choice(
            index: int,
            text: str | None,
            finish: str | None,
            lps: list | None = None,
            calls: list | None = None,
        ) -> dict:
            logprobs = logprobs_of(index, lps)
            if not chat:
                return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            if r.stream:
                delta = {} if not text and (calls or text is None) else {"content": text}
                if calls:  # each call whole, at its index among the reply's calls
                    delta["tool_calls"] = [{"index": k, **c} for k, c in calls]
                out = {"index": index, "delta": delta, "finish_reason": finish}
                return out if logprobs is None or not lps else {**out, "logprobs": logprobs}
            from pycalm.app.tools import reply_message

            message = reply_message(text, [c for _, c in calls or []])
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}

        if not r.stream:
            # a list a choice
            pieces, lps, calls = [[] for _ in range(r.n)], [[] for _ in range(r.n)], [[] for _ in range(r.n)]
            watch = asyncio.get_running_loop().create_task(abandoned(request, job, path))
            try:
                async for kind, value in events(job, path):
                    if kind == "text":
                        i, text, items, made = value
                        pieces[i].append(text)
                        lps[i] += items
                        calls[i] += made
                    elif kind == "error":
                        status = 503 if value == SHUTTING_DOWN else 500
                        return JSONResponse(error_body(value, "server_error"), status_code=status)
                    elif kind == "done":
                        log(path, value)
                        obj = "chat.completion" if chat else "text_completion"
                        choices = [
                            choice(
                                i, "".join(pieces[i]), gen.finish_reason, lps[i], list(enumerate(calls[i]))
                            )
                            for i, gen in enumerate(value)
                        ]
                        out = {**head, "object": obj, "choices": choices}
                        return JSONResponse({**out, "usage": usage(value)})
            finally:
                watch.cancel()

        async def sse() -> AsyncIterator[str]:
            chunks = Chunks(head, "chat.completion.chunk" if chat else "text_completion", chat)
            chunk = chunks.chunk
            n_calls = [0] * r.n  # each choice's tool calls sent
            async for kind, value in events(job, path):
                if kind == "start" and chat:  # a choice begins: its role
                    role = {"role": "assistant", "content": ""}
                    yield chunk([{"index": value, "delta": role, "finish_reason": None}])
                elif kind == "text":
                    i, text, items, made = value
                    if r.logprobs is None and not made:  # the text alone (choice()'s, spliced)
                        yield chunks.text(i, text)
                        continue
                    calls = list(enumerate(made, n_calls[i]))
                    n_calls[i] += len(made)
                    yield chunk([choice(i, text, None, items, calls)])
                elif kind == "finish":
                    i, gen = value
                    yield chunk([choice(i, None, gen.finish_reason)])
                elif kind == "error":
                    yield f"data: {json.dumps(error_body(value, 'server_error'))}\n\n"
                elif kind == "done":
                    log(path, value)
                    if r.include_usage:
                        yield chunk([], usage=usage(value))
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def chat_completions(request: HttpRequest) -> object:
        return await run(request, chat=True)

    async def completions(request: HttpRequest) -> object:
        return await run(request, chat=False)

    async def embeddings(request: HttpRequest) -> JSONResponse:
        """POST /v1/embeddings: every text's vector, through the worker's queue like a completion
        (a client that goes away cancels the request before its next text)."""
        path = request.url.path
        if not authorized(request):
            return refused()
        try:
            body = await read_body(request)
            check_model(body)
            _unsupported(body, "dimensions", (None,))
            fmt = body.get("encoding_format") or "float"
            if fmt not in ("float", "base64"):
                raise BadRequest("'encoding_format' must be float or base64", "encoding_format")
            chosen = body.get("pooling") or pooling
            if chosen not in POOLINGS:
                raise BadRequest(f"'pooling' must be {' or '.join(POOLINGS)}, not {chosen!r}", "pooling")
            llm = worker.llm
            texts = parse_embedding_input(body, llm.config.vocab_size, llm.tokenize)
            for i, ids in enumerate(texts):
                if len(ids) > llm.seq_len:
                    raise BadRequest(
                        f"input[{i}] is {len(ids)} tokens; the context holds {llm.seq_len}",
                        "input",
                        "context_length_exceeded",
                    )
        except BadRequest as e:
            return fail(e)
        except PycalmError as e:
            return fail(BadRequest(str(e)))
        job = Job([], 0, None, False, asyncio.get_running_loop(), embedding=Embedding(texts, chosen))
        worker.jobs.put(job)
        watch = asyncio.get_running_loop().create_task(abandoned(request, job, path))
        try:
            async for kind, value in events(job, path):
                if kind == "error":
                    status = 503 if value == SHUTTING_DOWN else 500
                    return JSONResponse(error_body(value, "server_error"), status_code=status)
                if kind == "done":
                    break
        finally:
            watch.cancel()
        n_tokens = sum(len(ids) for ids in texts)
        print(
            f"pycalm: {path}: {len(texts)} texts, {n_tokens} tokens, {chosen} pooling",
            file=sys.stderr,
            flush=True,
        )
        data = []
        for i, vector in enumerate(value):
            if fmt == "base64":  # the float32 bytes, little-endian
                vector = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
            else:
                vector = vector.tolist()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        usage = {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
        return JSONResponse({"object": "list", "data": data, "model": model_name, "usage": usage})

    async def models(request: HttpRequest) -> JSONResponse:
        if not authorized(request):
            return refused()
        entry = {"id": model_name, "object": "model", "created": created, "owned_by": "pycalm"}
        return JSONResponse({"object": "list", "data": [entry]})

    async def health(request: HttpRequest) -> JSONResponse:
        if worker.llm is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(request: HttpRequest) -> PlainTextResponse:
        if not authorized(request):
            return refused()
        return PlainTextResponse(worker.metrics_text(), media_type="text/plain; version=0.0.4")

    @asynccontextmanager
    async def lifespan(app: object) -> AsyncIterator[None]:
        if on_startup is not None:
            on_startup()
        yield
        worker.jobs.put(None)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


# -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> Any:
    from pycalm.app.batching import TOKEN_BUDGET
    from pycalm.app.fetch import DEFAULT_MODEL, KNOWN_MODELS
    from pycalm.model.config import WEIGHT_DTYPES

    ap = OneLineParser(
        prog="python -m pycalm.serve",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions).",
    )
    ap.add_argument(
        "model",
        nargs="?",
        help=f"pycalm file, HF folder, .gguf, ORG/NAME[:TAG] on the Hugging Face Hub, or one of "
        f"{', '.join(KNOWN_MODELS)} (default {DEFAULT_MODEL})",
    )
    ap.add_argument("--model", dest="model_option", metavar="MODEL", help="the same, as an option")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    ap.add_argument(
        "-c", "--context", "--ctx-size", type=int, default=4096, help="context to allocate (default 4096)"
    )
    ap.add_argument("--kv", choices=("auto", "fp16", "fp8"), default="auto", help="KV cache dtype")
    ap.add_argument(
        "--device", choices=("auto", "gpu", "cpu"), default="auto", help="auto: the GPU when present"
    )
    ap.add_argument(
        "--dtype",
        choices=WEIGHT_DTYPES,
        default="fp16",
        help="weight format when converting (default fp16; q8, q4: smaller and faster)",
    )
    ap.add_argument("--cache-dir", help="where fetched and converted models are kept")
    ap.add_argument(
        "--threads", type=int, default=None, metavar="N", help="CPU engine: BLAS threads (default 1)"
    )
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="every token through one path (GPU: the multi-token forward, slower decode; CPU: the token"
        " step, slower prompts), so a request gives the same tokens however much of its prompt was cached",
    )
    ap.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another name a request's 'model' may give (repeatable); any other name gets a 404",
    )
    ap.add_argument(
        "--api-key",
        metavar="KEY",
        help="every endpoint but /health asks for 'Authorization: Bearer KEY' (default: none asked)",
    )
    ap.add_argument(
        "--kernels",
        choices=("fast", "simple"),
        default="fast",
        help="GPU engine: the fast kernels, or the simple ones a learner reads first (slower)",
    )
    ap.add_argument(
        "--pooling",
        choices=POOLINGS,
        default=POOLINGS[0],
        help="/v1/embeddings: pool the hidden states by their mean or the last token's (default mean;"
        " a request's 'pooling' overrides it)",
    )
    ap.add_argument(
        "--speculate",
        choices=("auto", "off", "ngram", "draft"),
        default=None,
        help="speculative decoding (ngram: drafts looked up in the prompt and the reply so far; draft: from"
        " --draft-model); the replies are plain decoding's (default: with --parallel 1, auto, ngram for"
        " greedy requests on the GPU; else off; draft when --draft-model is given)",
    )
    ap.add_argument("--draft-model", metavar="MODEL", help="the draft model of --speculate draft")
    ap.add_argument(
        "--parallel",
        "-np",
        type=parallel_count,
        default=None,
        metavar="N",
        help="run up to N requests at once by continuous batching, over a KV pool of N full contexts"
        " or, on the GPU, as many positions as its free memory holds; 1: one at a time (default auto:"
        f" up to {AUTO_PARALLEL} on the GPU where it can batch, else 1)",
    )
    ap.add_argument(
        "--batch-size",
        "-b",
        type=int,
        default=None,
        metavar="N",
        help="--parallel: rows a step feeds at most, every running request's next token and then"
        f" chunks of prompts (default {TOKEN_BUDGET}, or N of --parallel N where that is larger)",
    )
    ap.add_argument(
        "--draft-k", type=int, default=None, metavar="N", help="drafts a pass (default: adaptive)"
    )
    args = ap.parse_args(argv)
    if args.model and args.model_option:
        ap.error("give MODEL once (as an argument or with --model)")
    args.model = args.model or args.model_option
    if args.speculate is None:
        args.speculate = "draft" if args.draft_model else "auto"
    if (args.speculate == "draft") != bool(args.draft_model):
        ap.error("--speculate draft and --draft-model go together")
    if args.draft_k is not None and not 1 <= args.draft_k <= 63:
        ap.error(f"--draft-k {args.draft_k}: must be 1 to 63")
    if args.context < 2 or not 0 <= args.port < 65536:
        ap.error("out-of-range value: need context >= 2 and 0 <= port < 65536")
    if args.batch_size is not None and args.batch_size < 1:
        ap.error(f"--batch-size {args.batch_size}: must be 1 or more")
    if args.parallel is None:  # auto: decided once the model is loaded (auto_parallel)
        pass
    elif args.parallel < 1:
        ap.error(f"--parallel {args.parallel}: must be 1 or more")
    elif args.batch_size is not None and args.batch_size < args.parallel:
        ap.error(
            f"--batch-size {args.batch_size}: below --parallel {args.parallel} (a row for each request's next token)"
        )
    elif args.parallel > 1 and args.device == "gpu" and args.batch_invariant:
        ap.error("--parallel > 1 with --batch-invariant runs on the CPU engine only (--device cpu)")
    elif args.parallel > 1 and args.device == "gpu" and args.kernels == "simple":
        ap.error("--parallel > 1 on the GPU needs the fast kernels (not --kernels simple)")
    elif args.parallel > 1 and args.speculate in ("ngram", "draft"):
        ap.error("--parallel > 1 does not go with --speculate yet")
    if args.speculate == "auto" and args.parallel != 1:  # continuous batching does not speculate yet
        args.speculate = "off"
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads {args.threads}: must be 1 or more")
    return args


def parallel_count(value: str) -> int | None:
    """--parallel's value: a whole number, or "auto" (None)."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number or auto") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        print("error: the server needs starlette and uvicorn: pip install starlette uvicorn", file=sys.stderr)
        return 1
    from pycalm.app.api import load, model_name

    failed: list[str] = []
    tasks: list[asyncio.Task] = []  # held, so the task is not collected while it runs
    name = model_name(args.model)

    def load_model() -> object:
        options = dict(
            device=args.device,
            dtype=args.dtype,
            context=args.context,
            kv=args.kv,
            batch_invariant=args.batch_invariant,
            kernels=args.kernels,
            threads=args.threads,
            speculate=args.speculate,
            draft_model=args.draft_model,
            draft_k=args.draft_k,
        )
        return load(args.model, cache_dir=args.cache_dir, **options)

    def on_loaded(llm: object | None, message: str) -> None:
        if llm is None:
            print(f"error: {message}", file=sys.stderr, flush=True)
            failed.append(message)
            server.should_exit = True
        else:
            print(f"pycalm: {name} ready ({llm.device}, context {llm.seq_len})", file=sys.stderr, flush=True)

    def start_loading() -> None:
        async def when_listening() -> None:
            while not server.started and not server.should_exit:
                await asyncio.sleep(0.01)
            print(f"pycalm: listening on http://{args.host}:{args.port}; loading {name}", file=sys.stderr)
            worker.start()

        tasks.append(asyncio.get_running_loop().create_task(when_listening()))

    if args.parallel is None or args.parallel > 1:  # (auto: ParallelWorker decides at load)
        worker = ParallelWorker(load_model, on_loaded, args.parallel, args.batch_size)
    else:
        worker = Worker(load_model, on_loaded)
    app = make_app(
        worker,
        name,
        on_startup=start_loading,
        aliases=tuple(args.alias),
        api_key=args.api_key,
        pooling=args.pooling,
    )
    # uvicorn's own lines only for warnings and errors: pycalm logs one line a request
    config = dict(log_level="warning", access_log=False, timeout_graceful_shutdown=3)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:  # Ctrl-C, SIGTERM
            worker.shutdown()  # the requests answer now, so the graceful shutdown takes no wait
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, **config))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises Ctrl-C again once it has shut down
        pass
    return 1 if failed or not server.started else 0


if __name__ == "__main__":
    sys.exit(main())
