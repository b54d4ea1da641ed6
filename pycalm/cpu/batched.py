"""The CPU engine's batched forward: many sequences' rows in one pass over a paged KV cache.

    engine = BatchedCpuEngine(ReferenceEngine(model, seq_len), n_blocks, block_size)
    logits = engine.step(tokens, positions, seq_of_row, block_table, sample_rows)

A step feeds R rows (pycalm.batch.scheduler.Plan.arrays): row r is token tokens[r] at position
positions[r] of sequence seq_of_row[r], whose block table is block_table[seq_of_row[r]]. The
rows of one sequence are consecutive and at consecutive positions (a decode row, or a chunk of a
prompt). Keys and values live in a pool per layer, (n_blocks * block_size, kv_dim) float32
rounded through the KV dtype (kv_round), as the reference engine's cache holds them; key t of a
sequence is pool row table[t // block_size] * block_size + t % block_size (pycalm.batch.blocks).

Each layer runs in forward order over all R rows at once, with the multi-token forward's
functions of pycalm.cpu.reference (embed_rows_ref, rmsnorm_rows_ref, matmul_ref, qkv_rows_ref a
chunk at its start position, batch_attention_ref over the pool, matmul_residual_ref, the FFN
and the classifier): one product a weight matrix for every row of the step, as
ReferenceEngine.forward_rows runs a prompt. A row's logits are then the token step's
(ReferenceEngine.forward) up to float32 rounding: a product of many rows may sum in another order
than a matrix-vector product (the fp16 KV rounding can carry such a difference into later rows).

batch_invariant: every row instead goes through the token step's functions, one row after
another (the rows of a chunk in position order, so each reads its predecessors' keys), so that a
row's logits are the bits CpuEngine's token step gives, whatever else the step holds: the
server's --batch-invariant, under which a request's tokens do not depend on its batchmates.
"""

from __future__ import annotations

import numpy as np

from pycalm.cpu.reference import (
    ReferenceEngine,
    attention_ref,
    batch_attention_ref,
    embed_ref,
    embed_rows_ref,
    ffn_gate_ref,
    kv_round,
    matmul_ref,
    matmul_residual_ref,
    matvec_ref,
    matvec_residual_ref,
    moe_ffn_gate_ref,
    moe_matvec_residual_ref,
    moe_route_ref,
    qkv_ref,
    qkv_rows_ref,
    rmsnorm_ref,
    rmsnorm_rows_ref,
)
from pycalm.errors import PycalmError


class BatchedCpuEngine:
    """The reference's weights, a paged KV pool, and `step`: see the module docstring."""

    def __init__(
        self, ref: ReferenceEngine, n_blocks: int, block_size: int, batch_invariant: bool = False
    ) -> None:
        cfg = ref.config
        self.ref = ref
        self.config = cfg
        self.n_blocks = n_blocks
        self.block_size = block_size
        self.batch_invariant = batch_invariant
        # the pools: (n_layers, n_blocks * block_size, kv_dim) float32, values rounded through the
        # KV dtype; np.zeros maps pages lazily, so blocks never used cost no memory
        shape = (cfg.n_layers, n_blocks * block_size, cfg.kv_dim)
        self.key_pool = np.zeros(shape, np.float32)
        self.value_pool = np.zeros(shape, np.float32)

    def pool_rows(self, table: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The pool rows (n,) int64 of a sequence's positions (n,) through its table (max_blocks,)."""
        bs = self.block_size
        return table[positions // bs].astype(np.int64) * bs + positions % bs

    def step(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        seq_of_row: np.ndarray,
        block_table: np.ndarray,
        sample_rows: np.ndarray,
    ) -> np.ndarray:
        """Feed the rows (each (R,) int: token, position, index into block_table's (S, max_blocks)
        rows), writing their keys and values to the pool -> the logits (len(sample_rows),
        vocab_size) float32 of the rows sample_rows names."""
        cfg = self.config
        tokens = np.asarray(tokens, np.int64)
        positions = np.asarray(positions, np.int64)
        bad = tokens[(tokens < 0) | (tokens >= cfg.vocab_size)]
        if len(bad):
            raise PycalmError(f"token id {bad[0]} outside the vocabulary (0..{cfg.vocab_size - 1})")
        if len(positions) and (
            positions.min() < 0 or positions.max() >= block_table.shape[1] * self.block_size
        ):
            raise PycalmError("a row's position lies past its block table")
        if self.batch_invariant:
            return self._step_rows_alone(tokens, positions, seq_of_row, block_table, sample_rows)
        x = self._layers(tokens, positions, seq_of_row, block_table)  # (R, dim) residual stream
        return self.ref.classify_rows(x[np.asarray(sample_rows, np.int64)])

    def _layers(
        self, tokens: np.ndarray, positions: np.ndarray, seq_of_row: np.ndarray, block_table: np.ndarray
    ) -> np.ndarray:
        """Every row through the layers as matrix products -> the residual stream (R, dim) float32."""
        ref, cfg, dt = self.ref, self.config, "fp32"  # weights come decoded from ref._w
        w = ref._w
        # the chunks: runs of rows of one sequence, (start row, end row, first position)
        starts = np.flatnonzero(np.diff(seq_of_row, prepend=-1)) if len(tokens) else np.empty(0, np.int64)
        chunks = [
            (int(a), int(b), int(positions[a]))
            for a, b in zip(starts, [*starts[1:], len(tokens)], strict=True)
        ]
        # (R,) pool row of each row's key and value
        rows = np.concatenate(
            [self.pool_rows(block_table[seq_of_row[a]], positions[a:b]) for a, b, _ in chunks]
        )

        x = embed_rows_ref(ref.tok_embeddings, tokens, cfg.dtype_of("tok_embeddings"))  # (R, dim) residual
        for layer in range(cfg.n_layers):
            p = f"layers.{layer}."
            # attention block: q, k, v of every row, each chunk rotated from its first position
            xb = rmsnorm_rows_ref(x, w(p + "attn_norm"), cfg.norm_eps, fp16=False)  # (R, dim)
            bqkv = w(p + "bqkv") if cfg.qkv_bias else None
            qkv = matmul_ref(xb, w(p + "wqkv"), dt)  # (R, q_dim + 2 kv_dim)
            q = np.empty((len(tokens), cfg.n_heads * cfg.head_dim), np.float32)  # (R, q_dim)
            for a, b, pos0 in chunks:
                q[a:b], k, v = qkv_rows_ref(
                    qkv[a:b], bqkv, pos0, ref.rope_freqs, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
                )
                self.key_pool[layer, rows[a:b]] = kv_round(k, ref.kv_dtype)
                self.value_pool[layer, rows[a:b]] = kv_round(v, ref.kv_dtype)
            att = batch_attention_ref(
                q,
                self.key_pool[layer],
                self.value_pool[layer],
                block_table,
                seq_of_row,
                positions,
                self.block_size,
                cfg.n_heads,
                cfg.n_kv_heads,
                cfg.head_dim,
                cfg.sliding_window,
            )  # (R, q_dim)
            x = matmul_residual_ref(att, w(p + "wo"), dt, x)
            # x += the feed-forward block of rmsnorm(x)
            x = ref.ffn_rows(x, p)
        return x

    def _step_rows_alone(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        seq_of_row: np.ndarray,
        block_table: np.ndarray,
        sample_rows: np.ndarray,
    ) -> np.ndarray:
        """batch_invariant: each row as ReferenceEngine.forward runs a token, over the pool."""
        sampled = {int(r): i for i, r in enumerate(sample_rows)}
        out = np.empty((len(sampled), self.config.vocab_size), np.float32)  # (n_sampled, vocab_size)
        for r, (token, pos, s) in enumerate(zip(tokens, positions, seq_of_row, strict=True)):
            logits = self._token_step(int(token), int(pos), block_table[s])
            if r in sampled:
                out[sampled[r]] = logits
        return out

    def _token_step(self, token: int, pos: int, table: np.ndarray) -> np.ndarray:
        """ReferenceEngine.forward(token, pos) with the sequence's keys and values in the pool
        through `table` (max_blocks,): the same functions in the same order -> (vocab_size,)."""
        ref, cfg, dt = self.ref, self.config, "fp32"
        w = ref._w
        rows = self.pool_rows(table, np.arange(pos + 1))  # (pos + 1,) this sequence's pool rows

        x = embed_ref(ref.tok_embeddings, token, cfg.dtype_of("tok_embeddings"))  # (dim,) residual
        for layer in range(cfg.n_layers):
            p = f"layers.{layer}."
            # attention block
            xb = rmsnorm_ref(x, w(p + "attn_norm"), cfg.norm_eps)
            bqkv = w(p + "bqkv") if cfg.qkv_bias else None
            q, k, v = qkv_ref(
                w(p + "wqkv"), bqkv, xb, dt, pos, ref.rope_freqs, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
            )
            self.key_pool[layer, rows[-1]] = kv_round(k, ref.kv_dtype)
            self.value_pool[layer, rows[-1]] = kv_round(v, ref.kv_dtype)
            att = attention_ref(
                q,
                self.key_pool[layer, rows],
                self.value_pool[layer, rows],
                pos + 1,
                cfg.n_heads,
                cfg.n_kv_heads,
                cfg.head_dim,
                cfg.sliding_window,
            )
            x = matvec_residual_ref(w(p + "wo"), att, dt, x)
            # feed-forward block
            xb = rmsnorm_ref(x, w(p + "ffn_norm"), cfg.norm_eps)
            if cfg.n_experts:
                ids, weights = moe_route_ref(w(p + "moe_gate"), xb, cfg.n_experts_active)
                h = moe_ffn_gate_ref(w(p + "w1"), w(p + "w3"), xb, dt, ids, weights)
                x = moe_matvec_residual_ref(w(p + "w2"), h, dt, ids, x)
            else:
                h = ffn_gate_ref(w(p + "w1"), w(p + "w3"), xb, dt)
                x = matvec_residual_ref(w(p + "w2"), h, dt, x)
        x = rmsnorm_ref(x, ref.norm, cfg.norm_eps)
        return matvec_ref(ref.output, x, dt)  # the classifier
