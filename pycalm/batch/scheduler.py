"""The continuous-batching scheduler: which sequences a step advances, and by how many tokens, as
pure logic over a BlockManager (no engine calls, no device).

A step alternates strictly: `schedule()` returns a Plan, an engine runs the plan as one pass and
samples a token for each sequence the plan marks, and `finish_step(plan, sampled)` records them.

schedule():
  1. Cancellations (`cancel`, from any thread: a flag read here) take effect: a waiting request
     leaves the queue, a running one frees its blocks.
  2. Decode rows. Every running sequence that has fed all its known tokens but the last sampled
     one gets one row, oldest first; its new position may need a block. When none is left, the
     NEWEST running sequence is preempted: its blocks are freed (its computed full blocks stay in
     the prefix cache, so the recompute often finds them) and it goes back to the head of the
     waiting queue with its prompt and output, to be fed again as one longer prompt. The oldest
     sequence thus always advances; a request that could never fit alone is refused at `submit`.
  3. Prompt chunks (chunked prefill). The rest of the token budget goes to running sequences that
     still have prompt to feed, oldest first, then to waiting requests in arrival order (a step
     without decode rows, which no sequence waits on for its next token, takes the larger
     prefill budget: one user's prompt is fed in as few passes as the engine allows): the head
     is admitted when its blocks fit beside one spare block per running sequence (a watermark:
     each may cross a block boundary next step, and an admission that forces a preemption at
     once wastes its prefill), while fewer than max_seqs run, and the budget has a token left. A
     head that does not fit blocks the queue (strict FIFO: no later request overtakes it), so a
     request waits at the head only until the running sequences ahead of it finish.

finish_step(): every planned sequence's fed positions become computed (full blocks get their
keys); a sampled token is appended to the request's output. The scheduler stops a request on its
stop tokens (EOS) and at max_tokens (finish reasons "stop" and "length"); stop STRINGS need the
detokenizer, so the caller detects them and calls `cancel(id, "stop")`.

Running ahead. An engine that samples on the device can take the next step before the host has
read this one's tokens: the next step's decode rows read them where the device left them. Then
`assume(plan)` stands in for finish_step: the fed positions become computed, each sampled token
enters the output as PENDING, and a request that reaches max_tokens ends ("length"), whatever its
token. `schedule()` plans the next step as usual (a PENDING token is fed as the device's), and
`resolve(slots, sampled)`, once the tokens are read, writes them in place and ends the requests
whose token is a stop token ("stop"). Such a request has one row in the step planned meanwhile:
its key and value land past its end, and its token is dropped. The order is: schedule the next
step, run it, resolve this one, assume the next (a full block gets its key from its tokens when
assume marks it computed, so they must be known by then). A preempted request is admitted again
only once its tokens are known (its recompute feeds them).

The waiting queue stays in arrival order (preempted requests are older than every waiting one),
and the running list in admission order, so "newest" is the running list's last.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from pycalm.batch.blocks import BlockManager, OutOfBlocks
from pycalm.errors import PycalmError

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
PENDING = -1  # a sampled token the device holds and the host has not read yet (assume, resolve)


@dataclass(eq=False)
class Request:
    """One generation: its prompt, its limits, and its state as the scheduler moves it."""

    id: int
    prompt: list[int]
    max_tokens: int
    stop_tokens: frozenset[int] = frozenset()  # token ids that end it (EOS), kept in the output
    output: list[int] = field(default_factory=list)
    state: str = WAITING
    finish_reason: str | None = None  # "stop", "length" or "cancelled" (or the caller's reason)
    computed: int = 0  # positions whose keys and values are written (while running)
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied at first admission
    preemptions: int = 0
    arrival: int = -1  # submit order, set by submit
    cancel_reason: str | None = None  # set by cancel(): applied at the next schedule()

    @property
    def tokens(self) -> list[int]:
        """Prompt then output: what a recompute feeds (a new list)."""
        return self.prompt + self.output

    @property
    def n_tokens(self) -> int:
        """len(tokens), without the list."""
        return len(self.prompt) + len(self.output)

    @property
    def last_token(self) -> int:
        """tokens[-1], without the list."""
        return self.output[-1] if self.output else self.prompt[-1]


@dataclass
class Chunk:
    """A sequence's rows in one step: tokens fed at positions start, start + 1, ...; `sample`
    when the last row's logits give the sequence's next token (a prompt chunk that does not
    reach the prompt's end samples nothing). `table` is its block table."""

    seq: int  # request id
    start: int
    tokens: list[int]
    sample: bool
    table: list[int]  # the manager's own list: read it before the next schedule()

    @property
    def prompt(self) -> bool:
        """A prompt chunk (several rows, or a row that is not the one decode row)."""
        return len(self.tokens) > 1 or not self.sample


class TableRows:
    """The block tables of a scheduler's plans as rows of one array kept from step to step, from
    which Plan.arrays gathers a plan's block_table. A chunk's table is the manager's own list: it
    only grows while its sequence holds its blocks, and an allocation makes a new one. So a row
    is written whole for a table it has not seen (a new list) and extended for a longer one: a
    step copies the blocks added since the step before, not every table."""

    def __init__(self) -> None:
        self.rows = np.zeros((16, 16), np.int32)  # (slots, widest table so far): past a table, 0
        self.slots: dict[int, tuple[int, list[int], int]] = {}  # seq -> (its row, its table, blocks written)
        self.free = list(range(len(self.rows)))  # rows no sequence has

    def block_table(self, chunks: list[Chunk], width: int) -> np.ndarray:
        """(len(chunks), width) int32: chunk i's table, padded with block 0."""
        most = max(width, max((len(c.table) for c in chunks), default=0))
        if most > (wide := self.rows.shape[1]):  # a wider table: every row widened with 0s
            self.rows = np.pad(self.rows, ((0, 0), (0, max(most, 2 * wide) - wide)))
        slots, index = self.slots, []  # (S,) each chunk's row
        for c in chunks:
            n, e = len(c.table), slots.get(c.seq)
            if e is not None and e[1] is c.table and e[2] == n:  # (most steps: nothing new)
                index.append(e[0])
                continue
            if e is not None and e[1] is c.table and e[2] < n:  # grown: the new blocks
                self.rows[e[0], e[2] : n] = c.table[e[2] :]
                row = e[0]
            else:  # a table not seen: the whole row
                row = e[0] if e is not None else self._row(chunks)
                self.rows[row] = 0
                self.rows[row, :n] = c.table
            slots[c.seq] = (row, c.table, n)
            index.append(row)
        return self.rows[index, :width]  # (S, width) (a copy)

    def _row(self, chunks: list[Chunk]) -> int:
        """A row for a new sequence: a free one, else the rows of sequences not in `chunks` (they
        ended, or wait) freed, else twice the rows."""
        if not self.free:
            planned = {c.seq for c in chunks}
            for seq in [q for q in self.slots if q not in planned]:
                self.free.append(self.slots.pop(seq)[0])
        if not self.free:
            n = len(self.rows)
            self.rows = np.concatenate([self.rows, np.zeros_like(self.rows)])
            self.free = list(range(n, 2 * n))
        return self.free.pop()


@dataclass
class Plan:
    """One step: decode chunks (one row each) first, then prompt chunks; `finished` lists the
    requests that ended while planning (cancelled). `table_rows`: where the scheduler keeps its
    tables' rows (TableRows), else None."""

    chunks: list[Chunk]
    finished: list[Request] = field(default_factory=list)
    table_rows: TableRows | None = None

    @property
    def n_rows(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)

    def arrays(self, max_blocks: int | None = None) -> dict[str, np.ndarray]:
        """The plan as the arrays a pass reads: row r feeds tokens[r] at positions[r] of chunk
        seq_of_row[r], whose block table is block_table[seq_of_row[r]] (padded with block 0,
        which no row reads); sample_rows are the rows whose logits are sampled, in chunk order."""
        chunks, n_seqs = self.chunks, len(self.chunks)
        lens = np.fromiter((len(c.tokens) for c in chunks), np.int32, n_seqs)  # (S,) rows a chunk
        n_rows = int(lens.sum())
        width = max_blocks or max((len(c.table) for c in chunks), default=0)
        last = np.cumsum(lens, dtype=np.int32) - 1  # (S,) each chunk's last row
        # (R,) tokens in chunk order; (R,) each row's chunk; (R,) start + the row's place in its chunk
        tokens = np.fromiter((t for c in chunks for t in c.tokens), np.int32, n_rows)
        seq_of_row = np.repeat(np.arange(n_seqs, dtype=np.int32), lens)
        starts = np.fromiter((c.start for c in chunks), np.int32, n_seqs)  # (S,)
        positions = np.arange(n_rows, dtype=np.int32) + np.repeat(starts - (last + 1 - lens), lens)
        if self.table_rows is not None:
            block_table = self.table_rows.block_table(chunks, width)  # (S, max_blocks)
        else:
            block_table = np.zeros((n_seqs, width), np.int32)  # (S, max_blocks)
            for i, c in enumerate(chunks):
                block_table[i, : len(c.table)] = c.table
        sample_rows = last[np.fromiter((c.sample for c in chunks), bool, n_seqs)]
        return {
            "tokens": tokens,
            "positions": positions,
            "seq_of_row": seq_of_row,
            "block_table": block_table,
            "sample_rows": sample_rows,  # (n_sampled,)
        }


class Scheduler:
    """Continuous batching over a BlockManager: see the module docstring."""

    def __init__(
        self, blocks: BlockManager, max_seqs: int, token_budget: int, prefill_budget: int | None = None
    ) -> None:
        if token_budget < max_seqs:  # every running sequence's decode row fits, and a prefill token
            raise ValueError(f"token budget {token_budget} is below max_seqs {max_seqs}")
        self.blocks = blocks
        self.max_seqs = max_seqs
        self.token_budget = token_budget
        self.prefill_budget = max(token_budget, prefill_budget or 0)  # rows of a step without decode rows
        self.waiting: deque[Request] = deque()  # arrival order
        self.running: list[Request] = []  # admission order: the last is the newest
        self.requests: dict[int, Request] = {}  # every request not finished, by id
        self.preemptions = 0
        self.arrivals = 0  # requests submitted so far
        self.cancelled: set[int] = set()  # ids cancel() marked since the last schedule()
        self.table_rows = TableRows()  # the plans' block tables, kept from step to step

    def submit(self, request: Request) -> None:
        """Queue a request. Refuses one that could not fit in the pool even alone."""
        if request.id in self.requests:
            raise ValueError(f"request {request.id} is already queued")
        if not request.prompt or request.max_tokens < 1:
            raise PycalmError("a request needs a prompt and max_tokens of at least 1")
        positions = len(request.prompt) + request.max_tokens - 1  # the last token is sampled, never fed
        if self.blocks.blocks_for(positions) > self.blocks.n_blocks:
            raise PycalmError(
                f"a prompt of {len(request.prompt)} tokens and {request.max_tokens} new ones need "
                f"{self.blocks.blocks_for(positions)} KV blocks; the pool has {self.blocks.n_blocks}"
            )
        request.arrival = self.arrivals
        self.arrivals += 1
        self.requests[request.id] = request
        self.waiting.append(request)

    def cancel(self, request_id: int, reason: str = "cancelled") -> None:
        """End a request at the next schedule() (a client gone, a stop string seen)."""
        if (r := self.requests.get(request_id)) is not None:
            r.cancel_reason = reason
            self.cancelled.add(request_id)

    def idle(self) -> bool:
        """No request waiting or running."""
        return not self.requests

    # -- planning ------------------------------------------------------------------------------

    def schedule(self) -> Plan:
        """The next step's plan (see the module docstring)."""
        plan = Plan([], table_rows=self.table_rows)
        for r in [self.requests[i] for i in sorted(self.cancelled) if i in self.requests]:  # 1. cancellations
            if r.state == RUNNING:
                self.running.remove(r)
                self.blocks.free_seq(r.id)
            else:
                self.waiting.remove(r)
            self._end(r, r.cancel_reason or "cancelled")
            plan.finished.append(r)
        self.cancelled.clear()

        budget = self.token_budget
        seqs, chunks = self.blocks.seqs, plan.chunks  # (the manager's SeqBlocks by id; the plan's)
        i = 0
        while i < len(self.running):  # 2. decode rows, oldest first
            r = self.running[i]
            if r.n_tokens - r.computed == 1:  # a sampled token, or a prompt's last one, to feed
                s = seqs[r.id]
                if len(s.tokens) < r.n_tokens and not self._grow(r):
                    break  # r itself was the newest and is preempted
                chunks.append(Chunk(r.id, r.computed, [r.last_token], True, s.table))
                budget -= 1
            i += 1

        if not chunks:  # no sequence waits on this step for a token: the prefill budget
            budget = self.prefill_budget
        for r in self.running:  # 3. prompt chunks of admitted sequences, oldest first
            if budget <= 0:
                break
            todo = r.n_tokens - r.computed
            if todo > 1:
                chunks.append(self._chunk(r, min(todo, budget)))
                budget -= len(chunks[-1].tokens)
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:  # admissions, FIFO
            r = self.waiting[0]
            if r.output and r.output[-1] == PENDING:  # preempted with a token not read yet
                break
            if not self.blocks.can_allocate(r.tokens, reserve=len(self.running)):
                break
            self.waiting.popleft()
            cached = self.blocks.allocate(r.id, r.tokens)
            if r.preemptions == 0:
                r.cached_tokens = cached
            r.state, r.computed = RUNNING, cached
            self.running.append(r)
            plan.chunks.append(self._chunk(r, min(len(r.tokens) - cached, budget)))
            budget -= len(plan.chunks[-1].tokens)
        return plan

    def _chunk(self, r: Request, n: int) -> Chunk:
        """r's next n tokens to feed; it samples when they reach r's last known token."""
        end = r.computed + n
        return Chunk(
            r.id, r.computed, r.tokens[r.computed : end], end == len(r.tokens), self.blocks.table(r.id)
        )

    def _grow(self, r: Request) -> bool:
        """Give r a slot for its last sampled token, preempting the newest running sequences
        until one is free. False when r itself had to be preempted."""
        while True:
            try:
                self.blocks.append(r.id, r.last_token)
                return True
            except OutOfBlocks:
                newest = self.running[-1]
                self._preempt(newest)
                if newest is r:
                    return False

    def _preempt(self, r: Request) -> None:
        """Free r's blocks and put it back at the head of the waiting queue, to be recomputed."""
        self.running.remove(r)
        self.blocks.free_seq(r.id)
        r.state, r.computed = WAITING, 0
        r.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(r)

    # -- results -------------------------------------------------------------------------------

    def finish_step(self, plan: Plan, sampled: Mapping[int, int]) -> list[Request]:
        """Record a step: each planned sequence's fed rows are computed, and `sampled` maps each
        sampling chunk's request id to its new token. Returns the requests that ended (stop token
        or max_tokens); their blocks are freed, full ones staying in the prefix cache. A request
        that ended since the plan (a step before it, run ahead, resolved on its stop token) has
        its row dropped. This is assume and resolve at once."""
        slots, done = self.assume(plan)
        return done + self.resolve(slots, [sampled[r.id] for r, _ in slots])

    def assume(self, plan: Plan) -> tuple[list[tuple[Request, int]], list[Request]]:
        """Record a step whose sampled tokens the host has not read (see "Running ahead" above)
        -> ((request, index of its PENDING token in its output) for each sampling chunk, in plan
        order; the requests that ended at max_tokens)."""
        slots, done = [], []
        for c in plan.chunks:
            r = self.requests.get(c.seq)
            if r is None:  # ended since the plan (resolve: a stop token): its row is dropped
                continue
            r.computed = c.start + len(c.tokens)
            self.blocks.computed(r.id, r.computed)
            if not c.sample:
                continue
            r.output.append(PENDING)
            slots.append((r, len(r.output) - 1))
            if len(r.output) >= r.max_tokens:
                self.running.remove(r)
                self.blocks.free_seq(r.id)
                self._end(r, "length")
                done.append(r)
        return slots, done

    def resolve(self, slots: list[tuple[Request, int]], sampled: list[int]) -> list[Request]:
        """The tokens of an assumed step, read at last: each in its place (the request's output,
        and its slot's token where it still holds blocks) -> the requests that end on them (a
        stop token: "stop"). A request that ended meanwhile (max_tokens, a cancellation) takes
        its token and ends no further (one that ended at max_tokens on a stop token: its reason
        becomes "stop")."""
        done = []
        for (r, i), token in zip(slots, sampled, strict=True):
            r.output[i] = token
            if r.state == FINISHED:  # a stop token as the last of max_tokens: "stop", as finish_step says
                if r.finish_reason == "length" and i == len(r.output) - 1 and token in r.stop_tokens:
                    r.finish_reason = "stop"
                continue
            if (s := self.blocks.seqs.get(r.id)) is not None and len(r.prompt) + i < len(s.tokens):
                s.tokens[len(r.prompt) + i] = token  # (the next step's slot: not computed yet)
            if token in r.stop_tokens:
                if r.state == RUNNING:
                    self.running.remove(r)
                    self.blocks.free_seq(r.id)
                else:
                    self.waiting.remove(r)
                self._end(r, "stop")
                done.append(r)
        return done

    def _end(self, r: Request, reason: str) -> None:
        r.state, r.finish_reason = FINISHED, reason
        del self.requests[r.id]

    # -- metrics and invariants ----------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """What /metrics shows of the scheduler and its pool."""
        b = self.blocks
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "preemptions": self.preemptions,
            "kv_blocks_used": b.used,
            "kv_blocks_free": b.free,
            "kv_blocks_cached": b.cached,
            "prefix_hit_rate": b.hit_rate,
        }

    def check(self, plan: Plan | None = None) -> None:
        """Assert the scheduler's invariants and its pool's (tests call it each step)."""
        self.blocks.check()
        assert len(self.running) <= self.max_seqs
        assert {r.id for r in self.running} == set(self.blocks.seqs), "running set and block owners differ"
        assert {r.id for r in self.running} | {r.id for r in self.waiting} == set(self.requests)
        order = [r.arrival for r in self.waiting]
        assert order == sorted(order), "the waiting queue left arrival order"
        assert all(r.arrival < self.waiting[0].arrival for r in self.running) if self.waiting else True
        for r in self.running:
            s = self.blocks.seqs[r.id]
            assert r.computed == s.computed and s.tokens == r.tokens[: len(s.tokens)]
            assert len(r.tokens) - len(s.tokens) <= 1
        if plan is not None:
            decoding = any(not c.prompt for c in plan.chunks)
            assert plan.n_rows <= (self.token_budget if decoding else self.prefill_budget)
            assert len({c.seq for c in plan.chunks}) == len(plan.chunks), "a sequence twice in a plan"
            for c in plan.chunks:
                assert c.start + len(c.tokens) <= len(self.blocks.seqs[c.seq].tokens), "a row without a slot"
