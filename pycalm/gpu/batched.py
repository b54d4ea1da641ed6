"""The GPU engine's batched forward: many sequences' rows in one pass over a paged KV cache, with
pycalm.cpu.batched.BatchedCpuEngine's interface, so that continuous batching
(pycalm.app.batching, the server's --parallel N) runs on either engine.

    engine = BatchedGpuEngine(gpu_engine, n_blocks, block_size)
    logits = engine.step(tokens, positions, seq_of_row, block_table, sample_rows)
    chosen, kept = engine.step_tokens(tokens, positions, seq_of_row, block_table, sample_rows,
                                      samplings, coins, keep)

A step feeds R rows (pycalm.batch.scheduler.Plan.arrays): row r is token tokens[r] at position
positions[r] of sequence seq_of_row[r], whose block table is block_table[seq_of_row[r]]; the
rows of one sequence are consecutive (a decode row, or a chunk of a prompt). The step's arrays
go to the device (a few KB) at fixed places, padded to a power of two of rows (padding rows are
sequence -1: they write no cache row and attend to nothing), and the pass replays as the CUDA
graph of its (rows, sampled rows, attention span) buckets, captured at its first use (eager
where the engine takes no graphs, and for Mixtral), with plain edges: the token step's
programmatic ones (pycalm.gpu.graph) make the graph alone 2% faster at one row (5.91 / 6.04 ms,
Llama-3-8B fp16, H100) and no faster at 64, and the batched step's GPU tests have passed with
plain edges only. The pass is pycalm.gpu.prefill's
forward_rows with pages: every weight read once for all R rows (the rows pass's products:
skinny's for a few rows, matmul's tiles above), qkv_pages writing each row's key and value into
its pool row, and pycalm.kernels.attention over the pages taking each row over its own
sequence's positions up to its own (split over the keys, fewer splits the more rows; the span,
the power of two above the step's last position, fixes the grid); a step of one sequence's
prompt chunk alone (one user's prompt: more than SPLIT_ATTENTION_ROWS rows) takes the prefill
attention's tensor-core tiles over that sequence's pages instead (pycalm.kernels.prefill_attention
with its block table, the live rows in the state's STATE_ROWS), as the engine's own prefill does
over its cache. take_rows gathers the sampled rows, the final RMSNorm and the classifier run on them, and
their logits (len(sample_rows), vocab_size) float32 come back to the host, where each request's
own sampler draws (its seed, penalties and constraint, as on the CPU engine).

A step of one sampled row (one sequence decoding alone, or a one-token prompt) runs the engine's
token step instead (GpuEngine.layers_step: the matvecs, qkv_rope writing the key and value into
the row's pool row, the same attention kernel over the pages), with row 0's token and position
in a state of its own in the step's buffer: one user alone decodes at the token step's speed,
where the rows pass of one row costs 1.1 to 1.4 token steps (its products read fp16 activations,
and RMSNorm and the QKV epilogue are launches of their own). Its logits are the token step's bits.

Running ahead. enqueue_tokens enqueues a step sampled on the device and returns at once; collect
waits for its tokens. The next step can be enqueued first: its decode rows name, in prev, the
sampled row of the step before whose token they feed, and the pass begins with feed_tokens,
which copies those tokens from where the sampler left them (pycalm.kernels.rows). The host then
plans and reads while the GPU always has a pass queued (pycalm.app.batching).

step_tokens samples on the device instead: pycalm.kernels.sample's sample_rows draws each
sampled row's token with that row's own options (temperature, top-k, top-p, min-p) and coin, in
the same captured graph, so one int32 a row comes back (through a pinned buffer), and the
logits of only the rows `keep` names (a request with penalties, a constraint or logprobs, which
the host samples or reads). At 64 sequences of a 128,256-token vocabulary this leaves 256 bytes
to copy instead of 33 MB.

The pool: a KVCache a layer, (n_blocks * block_size, kv_dim) rows in the engine's KV dtype
(fp16, or fp8 e5m2 above 4,096 positions), beside the engine's own one-sequence cache. Given
min_blocks, it takes as many of the n_blocks as the GPU's free memory holds beside a reserve
(RESERVE), and at least min_blocks (BatchRunner: a full context for every sequence where that
fits, else what fits, at least one full context; the scheduler preempts when blocks run out). Key t of
a sequence lives in pool row table[t // block_size] * block_size + t % block_size
(pycalm.batch.blocks hands the blocks out). A row's logits are the multi-token forward's: they
differ from the token step's by about 1e-3 relative (fp16 products), so batch-invariant serving
stays on the CPU engine for now (refused here).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from pycalm.cpu.sampler import SamplingParams
from pycalm.errors import PycalmError
from pycalm.gpu.graph import GraphStep
from pycalm.gpu.memory import gpu_memory_info, out_of_memory_as_error, require_gpu_memory
from pycalm.kernels.attention import KVCache, attention_chunk_len, attention_scratch, attention_span
from pycalm.kernels.common import STATE_POS, STATE_ROWS, STATE_TOKEN
from pycalm.kernels.sample import HostRows, RowSampling

# the GPU memory a pool sized to fit leaves free: this share of the GPU's, and at least
# RESERVE_MIN bytes (the CUDA graphs of the row buckets, kernel modules loaded later)
RESERVE = 0.05
RESERVE_MIN = 1 << 30


class BatchedGpuEngine:
    """A GpuEngine's weights and row buffers, a paged KV pool, and `step`: see the module
    docstring."""

    @staticmethod
    def refusal(engine: object) -> str | None:
        """Why a GpuEngine cannot batch (one line), or None where it can."""
        if engine.batch_invariant:
            return "--parallel with --batch-invariant runs on the CPU engine only (--device cpu)"
        if not engine.multi_token or engine.simple:
            return "--parallel on the GPU needs the multi-token forward (not --kernels simple)"
        return None

    def __init__(self, engine: object, n_blocks: int, block_size: int, min_blocks: int | None = None) -> None:
        """A pool of n_blocks blocks of block_size positions; with min_blocks, of as many of the
        n_blocks as fit the GPU's free memory (less a reserve, RESERVE), and at least min_blocks."""
        from numba import cuda

        if why := self.refusal(engine):
            raise PycalmError(why)
        if block_size < 1 or block_size & (block_size - 1):
            raise PycalmError(f"block size {block_size} is not a power of two")
        self.engine = engine
        self.config = cfg = engine.config
        self.block_size = block_size
        self.prefill = engine._prefill_step()
        self.max_rows = self.prefill.buffers.x.shape[0]  # rows a step holds at most
        s = engine.stream
        # the step's arrays at fixed places, so that a captured pass replays with new contents,
        # all in one int32 buffer that one copy a step fills from its pinned twin (R = max_rows):
        #   [0, 5R)        (5, R) tokens, positions, seq_of_row (< 0: padding), sample_rows, prev
        #                  (>= 0: the row feeds the token the step before sampled in its sampled
        #                  row prev, still on the device: enqueue_tokens)
        #   [5R, 10R)      step_tokens' (R,) temperature, top_k, top_p, min_p, coins (float32
        #                  bits but top_k): each sampled row's options and uniform [0, 1) coin
        #   [10R, 10R + 4) a token step's state: row 0's token and position (STATE_TOKEN,
        #                  STATE_POS), 0 (STATE_FEED_END), and the step's rows (STATE_ROWS: the
        #                  prefill attention's live rows in a pass of one sequence's chunk)
        #   [10R + 4, ..)  (R, max_blocks) the block table, a sequence a row
        R = self.max_rows
        self.max_blocks = -(-engine.seq_len // block_size)  # blocks a sequence holds at most
        self.head = 10 * R + 4  # the words before the block table
        # two pinned twins, by turns: a step's arrays are written while the copy of the last
        # step's may still wait in the stream (enqueue_tokens), and so are two of chosen's
        self.hosts = [cuda.pinned_array(self.head + R * self.max_blocks, np.int32) for _ in range(2)]
        for h in self.hosts:
            h[:] = 0  # (pinned memory comes uninitialised; zero options are greedy rows)
        self.blob = cuda.device_array(self.head + R * self.max_blocks, np.int32, stream=s)
        self.args = self.blob[: 5 * R].reshape(5, R)
        self.tokens, self.positions, self.seq_of_row, self.sample_rows, self.prev = (
            self.args[i] for i in range(5)
        )
        f32 = [self.blob[i * R : (i + 1) * R].view(np.float32) for i in range(5, 10)]
        self.row_sampling = RowSampling(f32[0], self.blob[6 * R : 7 * R], f32[2], f32[3])
        self.host_rows = HostRows()  # a step's rows' options, a request's checked at its first step
        self.coins = f32[4]
        self.state = self.blob[10 * R : 10 * R + 4]  # (4,) the one-row step's state, and STATE_ROWS
        self.table = self.blob[self.head :].reshape(R, self.max_blocks)
        self.picked = cuda.device_array((R, cfg.dim), np.float32, stream=s)  # (max_rows, dim)
        self.chosen = cuda.device_array(R, np.int32, stream=s)  # (max_rows,) each sampled row's token
        self.chosen_hosts = [cuda.pinned_array(R, np.int32) for _ in range(2)]  # (max_rows,) by turns
        self.turn = 0  # which twin the next step writes
        # the paged attention's partials: launches of up to max_rows rows over the context
        self.chunk = attention_chunk_len(cfg.head_dim, engine.kv_dtype)
        self.scratch = attention_scratch(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, engine.kv_dtype,
                                         engine.seq_len, chunk=self.chunk, rows=R, paged=True, stream=s)  # fmt: skip
        # (rows bucket, sampled bucket, attention span, sampled on the device) -> its pass
        self.graphs: dict[tuple[int, int, int, bool], GraphStep] = {}
        self.marks = [(cuda.event(), cuda.event()) for _ in range(2)]  # around a step's work, by turns
        self.gpu_s = 0.0  # seconds the GPU spent on the steps (between the marks: not the host's gaps)
        self.captures = 0  # graphs captured: keys met for the first time
        # host seconds of those first steps (launched one kernel at a time, then captured)
        self.capture_s = 0.0
        # the pool, last: with min_blocks it takes the memory the rest leaves
        kv_np = np.float16 if engine.kv_dtype == "fp16" else np.uint8
        block_bytes = 2 * cfg.n_layers * block_size * cfg.kv_dim * np.dtype(kv_np).itemsize
        reserve = 0.0
        if min_blocks is not None:
            free, total = gpu_memory_info()
            reserve = max(RESERVE * total, RESERVE_MIN)
            if free - reserve < n_blocks * block_bytes:  # (the simulator's memory is infinite)
                n_blocks = max(int((free - reserve) // block_bytes), min(min_blocks, n_blocks))
        self.n_blocks = n_blocks
        rows = n_blocks * block_size
        what = f"the paged KV pool of {n_blocks:,} blocks of {block_size} positions"
        require_gpu_memory(what, n_blocks * block_bytes, reserve)
        with out_of_memory_as_error(what, n_blocks * block_bytes):
            # a layer's pool: (n_blocks * block_size, kv_dim) keys and values, fp16 or e5m2 bytes
            self.pools = [
                KVCache(
                    cuda.device_array((rows, cfg.kv_dim), kv_np, stream=s),
                    cuda.device_array((rows, cfg.kv_dim), kv_np, stream=s),
                    engine.kv_dtype,
                )
                for _ in range(cfg.n_layers)
            ]
        # where worker processes compile the engine's kernels (pycalm.gpu.precompile), the
        # batched steps' too, last: wait for them here, so that a server says it is ready with
        # them in the cache, and its first requests compile nothing
        engine._await_kernels("batch")

    def bucket(self, n: int) -> int:
        """The rows a step of n rows runs: the power of two at or above n (padding rows are
        sequence -1), at most max_rows."""
        return min(1 << max(0, n - 1).bit_length(), self.max_rows)

    def step(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        seq_of_row: np.ndarray,
        block_table: np.ndarray,
        sample_rows: np.ndarray,
        while_waiting: Callable[[], None] = lambda: None,
    ) -> np.ndarray:
        """Feed the rows (each (R,) int: token, position, index into block_table's (S,
        max_blocks) rows), writing their keys and values to the pool -> the logits
        (len(sample_rows), vocab_size) float32 of the rows sample_rows names. while_waiting()
        runs on the host once the pass is enqueued, while the GPU works."""
        s = self.engine.stream
        m = self._arrays(tokens, positions, seq_of_row, block_table, sample_rows)
        out = np.empty((m, self.config.vocab_size), np.float32)  # (n_sampled, vocab_size)
        self._run(m, sampled=False, copy=lambda logits, first, k: logits[:k].copy_to_host(
            out[first : first + k], stream=s))  # fmt: skip
        self._wait(while_waiting)
        return out

    def step_tokens(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        seq_of_row: np.ndarray,
        block_table: np.ndarray,
        sample_rows: np.ndarray,
        samplings: list[SamplingParams],
        coins: np.ndarray,
        keep: Sequence[int] = (),
        while_waiting: Callable[[], None] = lambda: None,
        prev: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """step, sampled on the device: sampled row i takes the options samplings[i] (no
        penalties or bias) and the uniform coin coins[i] -> (chosen (n_sampled,) int32, each
        sample_ref's pick of its row's logits; the logits (len(keep), vocab_size) float32 of the
        sampled rows that keep lists, in its order). while_waiting() as step's; prev as
        enqueue_tokens'."""
        kept = np.empty((len(keep), self.config.vocab_size), np.float32)  # (len(keep), vocab_size)
        s = self.engine.stream

        def copy(logits: object, first: int, k: int) -> None:
            for j, i in enumerate(keep):
                if first <= i < first + k:
                    logits[i - first].copy_to_host(kept[j], stream=s)

        ticket = self._enqueue_sampled(tokens, positions, seq_of_row, block_table, sample_rows, samplings,
                                       coins, prev, copy)  # fmt: skip
        while_waiting()
        return self.collect(ticket), kept

    def enqueue_tokens(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        seq_of_row: np.ndarray,
        block_table: np.ndarray,
        sample_rows: np.ndarray,
        samplings: list[SamplingParams],
        coins: np.ndarray,
        prev: np.ndarray | None = None,
    ) -> tuple[int, int]:
        """step_tokens without the wait: the pass is enqueued, and a ticket comes back at once;
        collect(ticket) waits for its tokens. So the next step can be enqueued before the host
        reads this one's tokens: where prev[r] >= 0, row r feeds the token that the step enqueued
        before drew in its sampled row prev[r] (on the device; tokens[r] is then not read). At
        most one step may be enqueued and not collected when the next one is enqueued (the pinned
        buffers go by turns of two)."""
        return self._enqueue_sampled(tokens, positions, seq_of_row, block_table, sample_rows, samplings, coins,
                                     prev, lambda logits, first, k: None)  # fmt: skip

    def collect(self, ticket: tuple[int, int]) -> np.ndarray:
        """Wait for an enqueued step -> its chosen (n_sampled,) int32 tokens. gpu_s counts the
        step's GPU time (the simulator's events time nothing)."""
        turn, m = ticket
        start, end = self.marks[turn]
        end.synchronize()
        self.gpu_s += max(0.0, start.elapsed_time(end)) / 1e3
        return self.chosen_hosts[turn][:m].copy()

    def _enqueue_sampled(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        seq_of_row: np.ndarray,
        block_table: np.ndarray,
        sample_rows: np.ndarray,
        samplings: list[SamplingParams],
        coins: np.ndarray,
        prev: np.ndarray | None,
        copy: Callable[[object, int, int], None],
    ) -> tuple[int, int]:
        """Enqueue a step sampled on the device (its options and coins into this turn's pinned
        twin, the arrays, the pass, chosen back) -> (turn, n_sampled): collect's ticket."""
        m = len(sample_rows)
        if len(samplings) != m or len(coins) != m:
            raise PycalmError(
                f"{m} sampled rows take {m} samplings and coins, got {len(samplings)} and {len(coins)}"
            )
        R, h, turn = self.max_rows, self.hosts[self.turn], self.turn
        for i, field in enumerate((*self.host_rows(samplings), np.asarray(coins, np.float32))):
            h[(5 + i) * R : (5 + i) * R + m] = field.view(np.int32)
            h[(5 + i) * R + m : (6 + i) * R] = 0  # the bucket's padding rows: greedy, coin 0
        s = self.engine.stream
        self._arrays(tokens, positions, seq_of_row, block_table, sample_rows, prev)
        self._run(m, sampled=True, copy=copy)
        self.chosen[:m].copy_to_host(self.chosen_hosts[turn][:m], stream=s)
        self.marks[turn][1].record(s)
        return turn, m

    def _wait(self, while_waiting: Callable[[], None]) -> None:
        """while_waiting() on the host while the GPU works, then the wait for the step's end;
        gpu_s counts the step's GPU time (the simulator's events time nothing)."""
        s = self.engine.stream
        start, end = self.marks[self.turn ^ 1]  # (_arrays handed the turn on)
        end.record(s)
        while_waiting()
        s.synchronize()
        self.gpu_s += max(0.0, start.elapsed_time(end)) / 1e3

    def _arrays(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        seq_of_row: np.ndarray,
        block_table: np.ndarray,
        sample_rows: np.ndarray,
        prev: np.ndarray | None = None,
    ) -> int:
        """Check a step's arrays and enqueue their copies to the device (padded as the module
        docstring says) in this turn's pinned twin, and hand the turn on -> the number of sampled
        rows. Sets self.rows (the rows bucket) and self.ahead (some row feeds a token on the
        device: prev)."""
        cfg, e, s = self.config, self.engine, self.engine.stream
        tokens = np.array(tokens, np.int32)  # (a copy: the rows fed from the device are zeroed)
        positions = np.asarray(positions, np.int32)
        seq_of_row = np.asarray(seq_of_row, np.int32)
        table = np.asarray(block_table, np.int32)
        sample_rows = np.asarray(sample_rows, np.int32)
        n, m = len(tokens), len(sample_rows)
        prev = np.full(n, -1, np.int32) if prev is None else np.asarray(prev, np.int32)
        if len(prev) != n or prev.max(initial=-1) >= self.max_rows:
            raise PycalmError(
                "a batched step's prev names a row per row, each a sampled row of the last step"
            )
        self.ahead = bool(np.any(prev >= 0))
        tokens[prev >= 0] = 0  # (read on the device)
        bad = tokens[(tokens < 0) | (tokens >= cfg.vocab_size)]
        if len(bad):
            raise PycalmError(f"token id {bad[0]} outside the vocabulary (0..{cfg.vocab_size - 1})")
        if not 0 < n <= self.max_rows or table.shape[0] > n or table.shape[1] > self.max_blocks:
            raise PycalmError(f"a batched step takes 1 to {self.max_rows} rows of at most as many sequences")
        if positions.min() < 0 or positions.max() >= min(table.shape[1] * self.block_size, e.seq_len):
            raise PycalmError("a row's position lies past its block table or the context")
        if table.size and (table.min() < 0 or table.max() >= self.n_blocks):
            raise PycalmError(f"a block table names a block outside the pool of {self.n_blocks}")
        if m and (sample_rows.min() < 0 or sample_rows.max() >= n):
            raise PycalmError("a sampled row lies outside the step")
        self.rows = self.bucket(n)
        self.span = attention_span(int(positions.max()), self.chunk, e.seq_len)  # the attention's grid
        R, S, h = self.max_rows, table.shape[0], self.hosts[self.turn]
        # the padded arrays: rows n.. are padding (sequence -1), sampled rows m.. take row 0
        a = h[: 5 * R].reshape(5, R)  # tokens, positions, seq_of_row, sample_rows, prev
        a[:, : self.rows] = 0
        a[0, :n], a[1, :n], a[2, :n], a[3, :m], a[4, :n] = tokens, positions, seq_of_row, sample_rows, prev
        a[2, n : self.rows] = -1
        a[4, n : self.rows] = -1
        h[10 * R + STATE_TOKEN], h[10 * R + STATE_POS] = tokens[0], positions[0]  # (the one-row step's)
        h[10 * R + STATE_ROWS] = n
        # one sequence's rows (its consecutive positions: a prompt chunk): the prefill attention's
        # tiles over its pages, where the pass is long enough for them
        self.one_sequence = table.shape[0] == 1 and n > 1
        wide = h[self.head : self.head + S * self.max_blocks].reshape(S, self.max_blocks)
        wide[:] = 0
        wide[:, : table.shape[1]] = table
        # one copy: the arrays, the options and coins (step_tokens wrote them), S table rows
        # (the pinned buffer is free again: every step ends in a synchronize)
        end = self.head + S * self.max_blocks
        self.marks[self.turn][0].record(s)  # the step's GPU work starts here (not the host's before it)
        self.blob[:end].copy_to_device(h[:end], stream=s)
        self.turn ^= 1
        return m

    def _run(self, m: int, sampled: bool, copy: Callable[[object, int, int], None]) -> None:
        """Enqueue the pass over self.rows rows, the classifier of the m sampled rows (and, when
        sampled, their tokens into self.chosen); copy(logits, first, k) enqueues what the host
        takes of logits rows first .. first + k - 1 (in blocks of the logits buffer's rows when
        more rows are sampled than it holds)."""
        e, rows = self.engine, self.rows
        picked = self.bucket(m) if m else 0
        # one sampled row: the token step's matvecs (each weight read once, as by the pass, at
        # its speed), else the rows pass
        one = rows == 1 and picked == 1
        logits = e.logits_buf.reshape(1, self.config.vocab_size) if one else self.prefill.buffers.logits
        if picked > logits.shape[0]:  # more sampled rows than a logits block: eager, in blocks
            if self.ahead:
                self._feed(rows)
            self._pass(rows)
            for first in range(0, m, logits.shape[0]):
                k = min(logits.shape[0], m - first)
                self._classify(first, k, sampled)
                copy(logits, first, k)
            return
        key = (rows, picked, self.span, sampled and picked > 0, self.ahead, self.one_sequence)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.launch()
        else:

            def record() -> None:
                if self.ahead:  # the rows' tokens that the last step drew, still on the device
                    self._feed(rows)
                if one:
                    self._token(sampled)
                    return
                self._pass(rows)
                if picked:  # (a step of prompt chunks alone samples nothing)
                    self._classify(0, picked, sampled)

            t0 = time.perf_counter()
            record()  # compiles the kernels; also this step's result
            if e.use_graph and not self.config.n_experts:
                self.graphs[key] = GraphStep(e.stream, record)
                self.captures += 1
                self.capture_s += time.perf_counter() - t0
        if m:
            copy(logits, 0, m)

    def _feed(self, rows: int) -> None:
        """Enqueue tokens[r] = chosen[prev[r]] for the rows whose prev is >= 0 (and the one-row
        step's state token: row 0's)."""
        from pycalm.kernels.rows import feed_tokens

        feed_tokens(self.tokens[:rows], self.prev[:rows], self.chosen, self.state, stream=self.engine.stream)

    def _pages(self, rows: int) -> object:
        """The first `rows` rows of the step as pycalm.kernels.rows.Pages over the pool."""
        from pycalm.kernels.rows import Pages

        state = self.state if self.one_sequence else None
        return Pages(self.positions[:rows], self.seq_of_row[:rows], self.table, self.block_size, self.span,
                     self.scratch, state)  # fmt: skip

    def _token(self, sampled: bool) -> None:
        """Enqueue the step of one sampled row as the engine's token step over the pool: logits_buf
        = its logits (and, when sampled, chosen[0] = its token)."""
        e = self.engine
        # logits_buf = the token state[STATE_TOKEN] at state[STATE_POS] through the layers, its
        # key and value into its pool row
        e.layers_step(self.span, state=self.state, caches=self.pools, pages=self._pages(1))
        if sampled:
            # chosen[0] = sample_ref(logits, the row's options, coins[0])
            self._sample(e.logits_buf.reshape(1, self.config.vocab_size), 0)

    def _pass(self, rows: int) -> None:
        """Enqueue the layers over the first `rows` rows of the step's arrays."""
        pages = self._pages(rows)
        # x = the layers over the rows, each live row's key and value into its pool row
        self.prefill.forward_rows(0, rows, tokens=self.tokens[:rows], pages=pages, pools=self.pools)

    def _classify(self, first: int, k: int, sampled: bool) -> None:
        """Enqueue logits[:k] = the classifier of the residual rows sample_rows[first .. first + k - 1]
        (and, when sampled, chosen[first .. first + k - 1] = their tokens)."""
        from pycalm.kernels.rows import rmsnorm_rows, take_rows

        cfg, e, s = self.config, self.engine, self.engine.stream
        b = self.prefill.buffers
        # picked = x[sample_rows]
        take_rows(b.x, self.sample_rows[first:], self.picked[:k], stream=s)
        # xb = rmsnorm(picked) * norm, fp16
        rmsnorm_rows(self.picked[:k], e.norm, cfg.norm_eps, b.xb[:k], stream=s)
        # logits = xb Wout^T
        self.prefill.products(k)(b.xb[:k], e.output, b.logits[:k], e.output_dtype, stream=s)
        if sampled:
            # chosen[first + i] = sample_ref(logits[i], the row's options, coins[first + i])
            self._sample(b.logits[:k], first)

    def walk(self) -> None:
        """Enqueue every kind of work a step can launch, once each, on whatever the step's
        arrays hold: the pass of each row bucket, over many sequences and over one sequence's
        chunk, fed from the step before; the one-row step; the classifier and the sampler of
        each bucket of sampled rows. For pycalm.gpu.precompile's walk, which records the launches
        (the kernels and their argument types) and runs none, so that its workers compile what
        serving launches before the first request, not at it."""
        e, logits_rows = self.engine, self.prefill.buffers.logits.shape[0]
        self.span = attention_span(e.seq_len - 1, self.chunk, e.seq_len)
        # the row counts bucket() gives: the powers of two below max_rows, and max_rows
        buckets = sorted({self.bucket(1 << i) for i in range(self.max_rows.bit_length() + 1)})
        for rows in buckets:
            for one_sequence in (False, True) if rows > 1 else (False,):
                self.one_sequence = one_sequence  # (the prefill attention's tiles over one sequence's pages)
                self._pass(rows)
        self._feed(self.max_rows)
        for sampled in (False, True):
            self._token(sampled)
            for k in (b for b in buckets if b <= logits_rows):
                self._classify(0, k, sampled)

    def _sample(self, logits: object, first: int) -> None:
        """Enqueue chosen[first + i] = sample_ref(logits[i], sampled row first + i's options, its
        coin) for the (k, vocab_size) logits of sampled rows first .. first + k - 1."""
        from pycalm.kernels.sample import sample_rows

        part = slice(first, first + logits.shape[0])
        options = RowSampling(*(a[part] for a in self.row_sampling))
        sample_rows(logits, options, self.coins[part], self.chosen[part], stream=self.engine.stream,
                    **self.prefill.sample_options)  # fmt: skip
