"""Continuous batching on either engine: the runner that drives the scheduler and the batched
forward, and hands each request's text to its consumer (the server's --parallel N).

    runner = BatchRunner(llm, max_seqs=8)
    stream = runner.add(ids, max_tokens, sampling, emit, ...)   # from the runner's thread
    while not runner.idle():
        runner.step()

A step: the streams whose consumer went away are cancelled; pycalm.batch.Scheduler plans the
step (a decode row for every running sequence, prompt chunks in the rest of the token budget);
pycalm.cpu.batched.BatchedCpuEngine (pycalm.gpu.batched.BatchedGpuEngine on the GPU) runs the
plan as one pass over the paged KV pool; each sampling row's token is drawn with its own
request's Sampler (its temperature, top-k, top-p, penalties and seed: the j-th token of a
request takes the j-th coin of its seed, as plain decoding does, whatever its batchmates and
however often it is preempted). On the GPU a row without penalties or a constraint is drawn
there, in the pass's graph, with its request's options and next coin (BatchedGpuEngine.step_tokens),
and only the logits the host needs come back (penalties, a constraint, logprobs); a request's
min_tokens is a constraint (pycalm.cpu.sampler.MinTokens: no EOS yet), so its rows are drawn
on the host until it has that many tokens. The CPU engine's rows all go through Sampler.sample.
Scheduler.finish_step records the tokens; then each token goes through its request's
detokenizer, stop strings (pycalm.app.generation.StopText), constraint and tool-call parser as
LLM.start's generation does, and the text reaches the consumer through `emit`, the same events
the server's one-at-a-time worker sends: ("start", i), ("logprobs", (i, [TokenLogprobs])),
("text", (i, piece)), ("calls", (i, [call])) and ("finish", (i, Generation)).

That hand-out of a step's tokens runs while the next step's pass runs on the GPU (the engine's
while_waiting), and then `on_events()` (the server: wake its event loop, which formats and sends
the text while the GPU works): the host's work and the pass overlap. With a step run ahead
(below) in flight, on_events() comes when the host next waits for the GPU (_collect): the event
loop, which takes the GIL, then runs while the host waits, not while it plans and enqueues the
next step. A stop string seen there ends its request one step late: that step's row for it is
computed, and its token dropped. A step with nothing to run hands out at once.

On the GPU a step whose every sampled row is drawn there, with no logits for the host, runs
ahead: it is enqueued (BatchedGpuEngine.enqueue_tokens), then the step before it is collected,
its tokens recorded (Scheduler.resolve) and handed out, and the new step assumed
(Scheduler.assume: its tokens PENDING); the step after it is planned and enqueued before this
one's tokens are read, its decode rows feeding them on the device. So the GPU always has a pass
queued while the host plans, records and hands out. A request that draws an EOS there has one
more row computed in the step enqueued meanwhile, its token dropped. A step with a row the host
draws or reads waits for its own tokens, as above.

A request ends on an EOS ("stop"; not under ignore_eos), a stop string (from its min_tokens-th
token on) or a finished constraint ("stop", or "tool_calls" after tool calls), at max_tokens
("length"), or when `cancelled()` turns true (finish_reason None); its blocks are freed at once
(a stop string's at the next step), the full ones staying in the prefix cache.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pycalm.app.generation import Generation, StopText
from pycalm.batch.blocks import BLOCK_SIZE, BlockManager
from pycalm.batch.scheduler import FINISHED, PENDING, Request, Scheduler
from pycalm.cpu.batched import BatchedCpuEngine
from pycalm.cpu.reference import logprobs_ref, mask_logits_ref
from pycalm.cpu.sampler import MinTokens, Sampler, SamplingParams
from pycalm.errors import PycalmError

# the buckets' upper bounds, seconds: time to first token (the prompt fed, from a request's
# arrival at the runner) and the time between two tokens of a request
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0, 2.5)
GREEDY = SamplingParams()  # a device row's options where the host samples that row
TOKEN_BUDGET = 256  # rows a step feeds at most: the decode rows, then prompt chunks; a larger
# step makes the running sequences wait longer for their next token while a prompt is fed


class Histogram:
    """A Prometheus histogram: counts of observations at or below each bound, their sum."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # (bounds + 1,) the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value
        self.sum += value

    def text(self, name: str, about: str) -> str:
        """The histogram in Prometheus' text format, cumulative buckets up to le="+Inf"."""
        lines = [f"# HELP {name} {about}", f"# TYPE {name} histogram"]
        total = 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            total += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {total}')
        return "\n".join([*lines, f"{name}_sum {self.sum:g}", f"{name}_count {total}"]) + "\n"


@dataclass
class InFlight:
    """A step enqueued ahead of the host: the engine's ticket, the scheduler's slots of its
    PENDING tokens, for each slot its sampled row, its streams (a sampled row each) and each
    request's sampled row (request id -> row)."""

    ticket: object
    slots: list
    rows_of_slots: list[int]
    streams: list
    order: dict[int, int]


@dataclass(eq=False)
class Stream:
    """One request's consumer side: its sampler, its text on its way out, its Generation."""

    request: Request
    index: int  # the choice's index in its job (the events' i)
    emit: Callable[[str, object], None]
    sampler: Sampler
    options: SamplingParams  # the sampler's options without seed or penalties (a device row's)
    decoder: Any  # the tokenizer's streaming decoder
    text: StopText
    gen: Generation
    cancelled: Callable[[], bool]
    logprobs: int | None = None
    # pycalm.app.constrain.Constraint, a MinTokens (over one, or none) while it bans EOS, or None
    constraint: Any = None
    tool_parser: Any = None  # pycalm.app.tools.ToolCallParser, or None
    t0: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    t_last: float = 0.0  # when the last token was made
    done: bool = False


def batch_refusal(engine: object) -> str | None:
    """Why `engine` has no batched forward (one line), or None where it has: the CPU engine
    always, the GPU engine as pycalm.gpu.batched.BatchedGpuEngine.refusal says."""
    if hasattr(engine, "drafter"):  # pycalm.app.speculative's engine (it forwards the rest)
        return "--parallel: not with speculative decoding"
    if engine.device == "gpu":
        from pycalm.gpu.batched import BatchedGpuEngine

        return BatchedGpuEngine.refusal(engine)
    return None


class BatchRunner:
    """Scheduler + BatchedCpuEngine (or pycalm.gpu.batched.BatchedGpuEngine) + each request's
    sampler and text: see the module docstring. Every method runs on one thread (the server's
    worker)."""

    def __init__(
        self,
        llm: Any,
        max_seqs: int,
        n_blocks: int | None = None,
        block_size: int = BLOCK_SIZE,
        token_budget: int | None = None,
    ) -> None:
        engine = llm.engine
        if why := batch_refusal(engine):
            raise PycalmError(why)
        self.llm = llm
        self.seq_len = llm.seq_len
        blocks_a_seq = -(-self.seq_len // block_size)
        most = n_blocks or max_seqs * blocks_a_seq  # by default, a full context for every sequence
        if engine.device == "gpu":  # the rows pass over a paged pool on the device
            from pycalm.gpu.batched import BatchedGpuEngine

            # (by default, where those do not fit the GPU's memory, as many blocks as fit, at
            # least one full context: preemption handles the rest)
            self.engine = BatchedGpuEngine(engine, most, block_size, None if n_blocks else blocks_a_seq)
            self.threads = contextlib.nullcontext
            self.device_sampling = True  # plain rows sampled on the device (step_tokens)
            self.ahead = hasattr(self.engine, "enqueue_tokens")  # steps run ahead of the host
        else:  # (its pool's pages are mapped as they are first written)
            self.engine = BatchedCpuEngine(engine.ref, most, block_size, engine.batch_invariant)
            self.threads = engine._threads  # BLAS at the CPU engine's thread count around each pass
            self.device_sampling = self.ahead = False
        self.blocks = BlockManager(self.engine.n_blocks, block_size)
        # (a step without decode rows feeds up to the engine's rows a pass: one user's prompt in
        # as few passes as the engine allows)
        budget = token_budget or max(max_seqs, TOKEN_BUDGET)
        if budget < max_seqs:
            raise PycalmError(f"a batch of {budget} rows a step is below {max_seqs} sequences (a row each)")
        self.scheduler = Scheduler(self.blocks, max_seqs, budget, getattr(self.engine, "max_rows", None))
        self.eos = frozenset(llm.config.eos_ids)
        self.streams: dict[int, Stream] = {}
        self.ttft = Histogram(TTFT_BUCKETS)  # seconds from a request's arrival to its first token
        self.itl = Histogram(ITL_BUCKETS)  # seconds between a request's tokens
        self.next_id = 0
        self.pending: list[tuple] = []  # the last step's (stream, token, logits, time, end) to hand out
        self.inflight: InFlight | None = None  # the step enqueued ahead, its tokens not read yet
        self.on_events: Callable[[], None] = lambda: None  # after a hand-out (the server's wake-up)
        self.steps = 0  # passes run
        self.step_s = 0.0  # seconds in step() (the pass, and the host's work around it)
        self.engine_s = 0.0  # seconds of those in the engine's step (its arrays, the pass, the copy
        # back), not counting the hand-out that runs inside it
        self.hand_out_s = 0.0  # seconds in hand_out

    def idle(self) -> bool:
        """No request waiting or running (and no step in flight)."""
        return not self.streams and self.inflight is None

    def add(
        self,
        ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        emit: Callable[[str, object], None],
        index: int = 0,
        stop: list[str] | None = None,
        prime: bool = True,
        cancelled: Callable[[], bool] | None = None,
        logprobs: int | None = None,
        constraint: object | None = None,
        tool_parser: object | None = None,
    ) -> Stream:
        """Queue a generation of up to max_tokens tokens after prompt `ids` (prime: its text
        continues the prompt's, as LLM.start's); emits ("start", index) now and the rest as the
        steps make it. Raises PycalmError for a prompt and max_tokens that do not fit the context."""
        if not ids or len(ids) + max_tokens > self.seq_len + 1 or max_tokens < 1:
            raise PycalmError(
                f"a prompt of {len(ids)} tokens and {max_tokens} new ones do not fit the context of {self.seq_len}"
            )
        decoder = self.llm.tokenizer.stream()
        if prime:  # the continuation's first space is kept
            for t in ids:
                decoder.push(t)
            decoder.flush()
        request = Request(self.next_id, list(ids), max_tokens, sampling.end_ids(self.eos))
        self.next_id += 1
        stream = Stream(
            request,
            index,
            emit,
            Sampler.for_request(sampling, list(ids), self.llm.config.vocab_size),
            sampling.unseeded(),
            decoder,
            StopText(list(stop or []), sampling.min_tokens),
            Generation(
                prompt_tokens=len(ids),
                logprobs=None if logprobs is None else [],
                tool_calls=None if tool_parser is None else [],
            ),
            cancelled or (lambda: False),
            logprobs,
            MinTokens.over(constraint, sampling, self.llm.config.eos_ids, self.llm.config.vocab_size),
            tool_parser,
        )
        self.scheduler.submit(request)
        self.streams[request.id] = stream
        emit("start", index)
        return stream

    def step(self) -> None:
        """One step: cancellations, the plan, the pass, each row's token sampled and handed out."""
        for s in list(self.streams.values()):  # consumers gone: their rows leave at this schedule
            if s.cancelled():
                self._finish(s, None)
        plan = self.scheduler.schedule()
        for r in plan.finished:  # cancelled in schedule(): their streams have finished already
            self.streams.pop(r.id, None)
        if not plan.chunks:  # nothing to overlap the last step's hand-out with
            self._collect()
            self.hand_out()
            return
        t0 = time.perf_counter()
        self._step(plan)
        self.steps += 1
        self.step_s += time.perf_counter() - t0

    def _step(self, plan: object) -> None:
        """The pass of a plan, its tokens sampled and handed out (or, run ahead, assumed: the
        module docstring)."""
        a = plan.arrays()
        seqs = [c.seq for c in plan.chunks if c.sample]  # a sampled row's request id
        rows = [self.streams[q] for q in seqs]  # a stream a sampled row
        if self.device_sampling:  # the GPU draws the plain rows' tokens; the host the rest
            on_host, keep, options, coins = [], [], [], []  # (n_sampled,) each but keep
            for i, s in enumerate(rows):
                h = s.constraint is not None or s.sampler.penalties is not None
                on_host.append(h)
                if h or s.logprobs is not None:
                    keep.append(i)
                options.append(GREEDY if h else s.options)
                coins.append(0.0 if h else s.sampler.next_coin())
            prev = self._prev(plan, a)
            t0, handed = time.perf_counter(), self.hand_out_s
            step = (
                a["tokens"],
                a["positions"],
                a["seq_of_row"],
                a["block_table"],
                a["sample_rows"],
                options,
                coins,
            )
            if self.ahead and not keep:  # nothing for the host to draw or read: run ahead
                ticket = self.engine.enqueue_tokens(*step, prev=prev)
                self.engine_s += time.perf_counter() - t0
                self._collect()  # the step before: its tokens read (resolve) ...
                slots, _ = self.scheduler.assume(plan)  # ... before this one's positions are computed
                order = {q: j for j, q in enumerate(seqs)}
                self.inflight = InFlight(ticket, slots, [order[r.id] for r, _ in slots], rows, order)
                self.hand_out()  # (while this step runs)
                return
            chosen, kept = self.engine.step_tokens(*step, keep, while_waiting=self._collect_and_hand_out,
                                                   prev=prev)  # fmt: skip
            self.engine_s += time.perf_counter() - t0 - (self.hand_out_s - handed)
            logits = [None] * len(rows)  # a row's logits where the host took them
            for i, row in zip(keep, kept, strict=True):
                logits[i] = row
        else:
            self.hand_out()  # (the CPU engine's pass holds the host: nothing overlaps)
            t0 = time.perf_counter()
            with self.threads():
                logits = self.engine.step(
                    a["tokens"], a["positions"], a["seq_of_row"], a["block_table"], a["sample_rows"]
                )  # (n_sampled, vocab_size)
            self.engine_s += time.perf_counter() - t0
            on_host, chosen = [True] * len(rows), None
        now = time.perf_counter()
        sampled, made = {}, []  # request id -> token; (stream, token, logits) to hand out
        for i, (s, row) in enumerate(zip(rows, logits, strict=True)):
            if on_host[i]:
                if s.constraint is not None:  # the ids the constraint does not allow to -inf
                    mask = np.zeros(-(-self.llm.config.vocab_size // 32), np.uint32)  # (ceil(vocab / 32),)
                    s.constraint.fill_mask(mask)
                    row = mask_logits_ref(row, mask)
                token = s.sampler.sample(row)
                if s.constraint is not None:
                    s.constraint.accept(token)
                    if isinstance(s.constraint, MinTokens) and not s.constraint.banning:
                        s.constraint = s.constraint.inner  # EOS allowed: a device row again, if plain
            else:
                token = int(chosen[i])
            sampled[s.request.id] = token
            made.append((s, token, row))
        ended = {r.id: r.finish_reason for r in self.scheduler.finish_step(plan, sampled)}
        self.pending = [(s, token, row, now, ended.get(s.request.id)) for s, token, row in made]

    def _prev(self, plan: object, a: dict[str, np.ndarray]) -> np.ndarray | None:
        """Each row's sampled row of the step in flight whose token it feeds (PENDING tokens),
        else -1; None where no row feeds one."""
        ahead = np.flatnonzero(a["tokens"] == PENDING)
        if not len(ahead):
            return None
        prev = np.full(len(a["tokens"]), -1, np.int32)  # (R,)
        order, chunks = self.inflight.order, plan.chunks
        prev[ahead] = [order[chunks[i].seq] for i in a["seq_of_row"][ahead].tolist()]
        return prev

    def _collect(self) -> None:
        """Wait for the step in flight, if any: its tokens into the scheduler (resolve) and to the
        streams (the hand-out list)."""
        if self.inflight is None:
            return
        f, self.inflight = self.inflight, None
        self.on_events()  # the last hand-out's events, while the host waits (the module docstring)
        t0 = time.perf_counter()
        chosen = self.engine.collect(f.ticket)
        now = time.perf_counter()
        self.engine_s += now - t0
        tokens = chosen[f.rows_of_slots].tolist()  # (a slot's token: ints)
        self.scheduler.resolve(f.slots, tokens)
        made = []
        for (r, i), j, token in zip(f.slots, f.rows_of_slots, tokens, strict=True):
            end = r.finish_reason if r.state == FINISHED and i == len(r.output) - 1 else None
            made.append((f.streams[j], token, None, now, end))
        self.pending += made

    def _collect_and_hand_out(self) -> None:
        """While a step that waits for its own tokens runs: the step in flight before it
        collected, and handed out."""
        self._collect()
        self.hand_out()

    def hand_out(self) -> None:
        """The last step's tokens to their streams (a stream that finished meanwhile, on a stop
        string or a cancellation, drops its token), then on_events(): at once, or with a step in
        flight, at the next wait for it (_collect)."""
        t0 = time.perf_counter()
        pending, self.pending = self.pending, []
        for s, token, row, now, ended in pending:
            if not s.done:
                self._hand_out(s, token, row, now, ended)
            elif ended is not None:  # finished here and ended by the scheduler: no cancel pops it
                self.streams.pop(s.request.id, None)
        if self.inflight is None:
            self.on_events()
        self.hand_out_s += time.perf_counter() - t0

    def _hand_out(self, s: Stream, token: int, logits: np.ndarray, now: float, ended: str | None) -> None:
        """A request's new token: its text (stop strings, tool calls) to the consumer; the
        stream finishes on an EOS, a stop string, a finished constraint or max_tokens (`ended`:
        the scheduler's reason when it ended the request)."""
        gen = s.gen
        if gen.completion_tokens == 0:
            s.t_first = now
            gen.prompt_s = now - s.t0
            self.ttft.observe(now - s.t0)
        else:
            self.itl.observe(now - s.t_last)
        s.t_last = now
        gen.decode_s = now - s.t_first
        gen.completion_tokens += 1
        if token in s.request.stop_tokens:  # an EOS (none under ignore_eos)
            return self._finish(s, "stop")
        if gen.logprobs is not None:
            item = logprobs_ref(logits, token, s.logprobs)
            gen.logprobs.append(item)
            s.emit("logprobs", (s.index, [item]))
        if piece := s.text.push("" if token in self.eos else s.decoder.push(token)):
            self._text(s, piece)
        if s.text.stopped or (s.constraint is not None and s.constraint.finished):
            self._finish(s, "stop")
        elif ended is not None:
            self._finish(s, ended)

    def _text(self, s: Stream, piece: str) -> None:
        """Text on its way out: through the tool parser when there is one."""
        if s.tool_parser is None:  # (the piece as it is, without _pieces' generator: the usual case)
            if piece:
                s.gen.text += piece
                s.emit("text", (s.index, piece))
            return
        for out in self._pieces(s, piece):
            if out:
                s.gen.text += out
                s.emit("text", (s.index, out))

    def _pieces(self, s: Stream, piece: str, last: bool = False) -> Iterator[str]:
        if s.tool_parser is None:
            yield piece
            return
        events = s.tool_parser.push(piece) + (s.tool_parser.finish() if last else [])
        for kind, value in events:
            if kind == "call":
                s.gen.tool_calls.append(value)
                s.emit("calls", (s.index, [value]))
            elif value:
                yield value

    def _finish(self, s: Stream, reason: str | None) -> None:
        """End a stream: the held-back text out (unless cancelled), its finish event; its request
        leaves the scheduler (at once, or at the next schedule() when it is still running)."""
        if s.done:
            return
        s.done = True
        gen = s.gen
        if reason is not None:
            piece = s.text.finish(s.decoder.flush)
            for out in self._pieces(s, piece, last=True):
                if out:
                    gen.text += out
                    s.emit("text", (s.index, out))
            if s.text.stopped:
                reason = "stop"
            if gen.tool_calls and reason == "stop":
                reason = "tool_calls"
        gen.finish_reason = reason
        gen.reused_tokens = s.request.cached_tokens
        if s.request.id in self.scheduler.requests:
            self.scheduler.cancel(s.request.id, reason or "cancelled")
        else:
            self.streams.pop(s.request.id, None)
        s.emit("finish", (s.index, gen))

    def metrics(self) -> dict[str, float]:
        """The scheduler's and the pool's counts (Scheduler.metrics), and the steps' time: in
        step(), in the engine's call (the hand-out it overlaps not counted), and on the GPU; the
        GPU engine's graph captures and the host's seconds in those steps."""
        return {
            **self.scheduler.metrics(),
            "steps": self.steps,
            "step_s": self.step_s,
            "engine_s": self.engine_s,
            "gpu_s": getattr(self.engine, "gpu_s", 0.0),  # the GPU engine's (CUDA events)
            "captures": getattr(self.engine, "captures", 0),  # the GPU engine's graphs captured
            "capture_s": getattr(self.engine, "capture_s", 0.0),
        }
