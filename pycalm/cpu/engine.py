"""The engines behind `pycalm.generate`, one interface for the CPU reference and the GPU.

    engine.generate(ids, start_pos, max_new, sampling) -> iterator of new token ids
    engine.generate(..., logprobs=k) -> iterator of their TokenLogprobs (pycalm.cpu.reference)
    engine.generate(..., constraint=c) -> only tokens that c (pycalm.app.constrain.Constraint) allows
    engine.logits(token, pos) -> (vocab_size,) float32
    engine.prefill_logits(ids, start_pos) -> iterator of (rows, vocab_size) float32 blocks
    engine.forward_rows(ids, pos) -> (rows, vocab_size) float32, 1 to 64 tokens in one pass
    engine.forward_rows(ids, pos, samplings, coins) -> (rows,) int32, each row's sampled token
    engine.embed(ids, pooling, normalize) -> (dim,) float32, the text's embedding

`generate` feeds `ids` at positions start_pos.. (the KV cache keeps what came before, so a chat
goes on turn after turn), then samples up to `max_new` tokens, stopping after an EOS id. With a
constraint, each step's logits are masked to the ids it allows before sampling, the token moves
it on, and generation also stops once it is finished (nothing but EOS may follow).

The CPU engine feeds a prompt (all of it but its last token) through the reference's multi-token
forward (ReferenceEngine.forward_rows) in chunks of `prefill_chunk` rows, as the GPU's prefill
does: each weight matrix is multiplied by a chunk of rows at once (a matrix product in BLAS,
instead of one matrix-vector product a token), and `-x` perplexity takes every row's logits
from it (prefill_logits). Decoding goes one token step at a time (ReferenceEngine.forward).

NumPy's BLAS runs `threads` threads (threadpoolctl sets it around each step of this engine, and
leaves the process's setting as it was between them). The default is DEFAULT_THREADS: one.
BLAS threads spin while they wait for work, so on a machine whose cores are busy with other
work, more threads than idle cores make every product wait for a descheduled thread (SmolLM2
on a 2-core machine shared with other work: decode at 9.5 tok/s on one thread, 0.9 to 3.8 on
two; -x at 180 to 210 tok/s on one, 30 to 57 on two). Give a machine's idle cores with --threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager

import numpy as np
from threadpoolctl import ThreadpoolController

from pycalm.cpu.reference import (
    ReferenceEngine,
    TokenLogprobs,
    check_constraint,
    check_logprobs,
    check_pooling,
    embed_pool_ref,
    logprobs_ref,
    mask_logits_ref,
    sample_ref,
)
from pycalm.cpu.sampler import MinTokens, Sampler, SamplingParams
from pycalm.errors import PycalmError

PREFILL_CHUNK = 512  # rows a pass of the multi-token forward takes at most; the attention's
# scores of a kv head are (group, chunk, positions) float32: 25 MB for SmolLM2's groups of 3
# heads at 4,096 positions
LOGITS_BYTES = 32 << 20  # a block of prefill_logits holds at most this much float32 (170 rows
# of SmolLM2's 49,152 logits): glibc reuses freed blocks up to 32 MB (its largest mmap
# threshold), where a larger one is mapped afresh each time and every page faults in anew
ROWS_MOST = 64  # tokens forward_rows takes at most, as the GPU's captured rows pass
DEFAULT_THREADS = 1  # BLAS threads when none are asked for (the module docstring says why)


def check_threads(threads: int | None) -> int:
    """The BLAS thread count for `threads` (None: DEFAULT_THREADS); a one-line error below 1."""
    if threads is None:
        return DEFAULT_THREADS
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise PycalmError(f"threads must be a whole number, 1 or more, not {threads!r}")
    return threads


class CpuEngine:
    """The NumPy reference engine with the CPU sampler."""

    device = "cpu"

    def __init__(
        self,
        model: object,
        seq_len: int,
        kv_dtype: str = "fp16",
        threads: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        batch_invariant: bool = False,
    ) -> None:
        if prefill_chunk < 1:
            raise PycalmError(f"a prefill chunk takes at least one row, got {prefill_chunk}")
        self.threads = check_threads(threads)
        self.ref = ReferenceEngine(model, seq_len=seq_len, kv_dtype=kv_dtype)
        self.config = model.config
        self.seq_len = self.ref.seq_len
        self.prefill_chunk = prefill_chunk
        # generate feeds the prompt a token step a token, as it decodes: the tokens do not depend
        # on how a prompt is split between the cache and the call (a product of many rows may
        # sum in another order than one of a row; the fp16 KV cache can round that apart)
        self.batch_invariant = batch_invariant
        # the BLAS libraries NumPy loaded, found once (the search is the slow part of a limit)
        self._blas = ThreadpoolController()

    def _threads(self) -> AbstractContextManager:
        """BLAS at self.threads threads for the duration of a with block, restored after it."""
        return self._blas.limit(limits=self.threads, user_api="blas")

    def logits(self, token: int, pos: int) -> np.ndarray:
        with self._threads():
            return self.ref.forward(token, pos)

    def _check_fits(self, ids: list[int], start_pos: int) -> None:
        if not ids:
            raise PycalmError("nothing to feed: the prompt encodes to no tokens")
        if start_pos < 0 or start_pos + len(ids) > self.seq_len:
            raise PycalmError(
                f"prompt of {len(ids)} tokens at position {start_pos} does not fit the context of {self.seq_len} tokens"
            )

    def _chunks(self, ids: list[int], start_pos: int) -> Iterator[np.ndarray]:
        """Feed ids at positions start_pos.. through the multi-token forward, a chunk of at most
        prefill_chunk rows a pass, caching their keys and values; yields each chunk's residual
        stream after the last layer, (rows, dim) float32. The chunks' sizes are within one of
        each other (600 rows: 300 and 300, not 512 and 88): a product of few rows runs at a
        fraction of the speed of one of many (SmolLM2's layers on one thread: 3.7 ms a row at 39
        rows, 1.45 at 148, 1.3 at 512)."""
        self._check_fits(ids, start_pos)
        tokens = np.asarray(ids, np.int64)  # (T,)
        for rows in np.array_split(np.arange(len(ids)), -(-len(ids) // self.prefill_chunk)):
            with self._threads():
                x = self.ref.forward_rows(tokens[rows], start_pos + int(rows[0]))  # (len(rows), dim)
            yield x

    def prefill(self, ids: list[int], start_pos: int) -> None:
        """Feed ids at positions start_pos.. in chunks of rows, caching their keys and values
        (batch_invariant: a token step a token, as decoding feeds them)."""
        if self.batch_invariant:
            self._check_fits(ids, start_pos)
            for i, token in enumerate(ids):
                self.logits(token, start_pos + i)
            return
        for _ in self._chunks(ids, start_pos):
            pass

    def forward_rows(
        self,
        ids: list[int],
        pos: int,
        samplings: list[SamplingParams] | None = None,
        coins: np.ndarray | None = None,
    ) -> np.ndarray:
        """The n = len(ids) tokens (1 to ROWS_MOST) at positions pos .. pos + n - 1, their keys
        and values cached, as GpuEngine.forward_rows takes them: every row's logits (n,
        vocab_size) float32, or with samplings (a SamplingParams a row) and coins (a uniform draw
        a row) the (n,) int32 tokens sample_ref picks for each row. One pass of the multi-token
        forward; batch_invariant: a token step a row, so that a row's logits are the bits that
        decoding gives its token (the speculative loop's output is then plain decoding's)."""
        if not 1 <= len(ids) <= ROWS_MOST:
            raise PycalmError(f"a rows pass takes 1 to {ROWS_MOST} tokens, not {len(ids)}")
        self._check_fits(ids, pos)
        if self.batch_invariant:
            logits = np.stack([self.logits(t, pos + i) for i, t in enumerate(ids)])  # (n, vocab_size)
        else:
            with self._threads():
                logits = self.ref.classify_rows(self.ref.forward_rows(np.asarray(ids, np.int64), pos))
        if samplings is None:
            return logits
        if len(samplings) != len(ids) or coins is None or len(coins) != len(ids):
            raise PycalmError(f"a rows pass of {len(ids)} tokens samples with {len(ids)} settings and coins")
        return np.array(
            [sample_ref(row, s.temperature, s.top_k, s.top_p, s.min_p, float(c))
             for row, s, c in zip(logits, samplings, coins, strict=True)],
            np.int32,
        )  # fmt: skip

    def set_next(self, token: int, pos: int) -> None:
        """Where the next token step starts (GpuEngine.set_next): the CPU engine keeps no state."""

    def prefill_logits(self, ids: list[int], start_pos: int) -> Iterator[np.ndarray]:
        """prefill, yielding the logits of every row as (rows, vocab_size) float32 blocks in
        order, each at most LOGITS_BYTES, a chunk's blocks within a row of each other in size."""
        most = max(1, LOGITS_BYTES // (4 * self.config.vocab_size))  # rows a block holds at most
        for x in self._chunks(ids, start_pos):
            for rows in np.array_split(x, -(-len(x) // most)):
                with self._threads():
                    out = self.ref.classify_rows(rows)  # (rows, vocab_size)
                yield out

    def embed(self, ids: list[int], pooling: str = "mean", normalize: bool = True) -> np.ndarray:
        """The embedding (dim,) float32 of the text `ids`, fed alone from position 0 through the
        multi-token forward (its keys and values overwrite cache rows 0 .. len(ids) - 1): the
        final RMSNorm of every row, pooled and L2-normalised (pycalm.cpu.reference.embed_pool_ref)."""
        check_pooling(pooling)
        rows = []  # each chunk's hidden rows, (rows, dim) float32
        for x in self._chunks(ids, 0):
            with self._threads():
                rows.append(self.ref.hidden_rows(x))
        return embed_pool_ref(np.concatenate(rows), pooling, normalize)

    def generate(
        self,
        ids: list[int],
        start_pos: int,
        max_new: int,
        sampling: SamplingParams,
        logprobs: int | None = None,
        prefix: list[int] | None = None,
        constraint: object | None = None,
    ) -> Iterator[int] | Iterator[TokenLogprobs]:
        """Feed ids at positions start_pos.., then sample up to max_new tokens, yielding each
        token id; with logprobs = k (0 to MAX_TOP_LOGPROBS), each token's TokenLogprobs instead
        (logprobs_ref over the step's logits, before any penalty, masked where a constraint is
        given). prefix: the tokens at positions 0 .. start_pos - 1 (cached), which with ids make
        the prompt that sampling's repetition_penalty counts as seen. constraint
        (pycalm.app.constrain.Constraint): each step samples among the ids it allows
        (mask_logits_ref), and generation ends once it is finished. sampling.min_tokens: no EOS
        among the first min_tokens tokens (MinTokens, a constraint over the given one);
        sampling.ignore_eos: an EOS does not end the generation."""
        check_logprobs(logprobs)
        check_constraint(constraint, self.config.vocab_size)
        constraint = MinTokens.over(constraint, sampling, self.config.eos_ids, self.config.vocab_size)
        self._check_fits(ids, start_pos)
        sampler = Sampler.for_request(sampling, [*(prefix or []), *ids], self.config.vocab_size)
        eos = sampling.end_ids(self.config.eos_ids)
        if len(ids) > 1:  # the prompt but its last token: only the cache matters
            self.prefill(ids[:-1], start_pos)
        pos, token = start_pos + len(ids) - 1, ids[-1]
        if constraint is not None:
            mask = np.zeros(-(-self.config.vocab_size // 32), np.uint32)  # (ceil(vocab_size / 32),)
        for _ in range(max_new):  # token steps, the first one feeding the prompt's last token
            if pos >= self.seq_len:
                return
            logits = self.logits(token, pos)  # (vocab_size,)
            if constraint is not None:  # the ids the constraint does not allow to -inf
                constraint.fill_mask(mask)
                logits = mask_logits_ref(logits, mask)
            token = sampler.sample(logits)
            if constraint is not None:
                constraint.accept(token)
            pos += 1
            yield token if logprobs is None else logprobs_ref(logits, token, logprobs)
            if token in eos or (constraint is not None and constraint.finished):
                return
