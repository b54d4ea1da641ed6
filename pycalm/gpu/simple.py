"""The engine on the simple kernels (EngineOptions(kernels="simple")): pycalm.kernels.simple.

GpuEngine keeps everything else: the weights, the KV cache, the device state, the graphs. Here
are the token step (forward), the prompt pass (Prefill: T rows at once, the matrix products as
tensor-core matmuls) and the sampled generation, each a plain launch a line, like llama2.c's
forward(). The fast step fuses the norm, RoPE, the residual adds and the gate into the matrix
products around them; here each is a launch of its own, between buffers of their own.

Per-token values come from the device, as in the fast step: the token from state[STATE_TOKEN]
(a view of the state is the embedding's token list), the position from state[STATE_POS], so the
step can be captured as a CUDA graph and replayed. The graphs' edges are plain: the simple
kernels do not wait for programmatic launches (pycalm.kernels.common.dependent_start).

Sampling: at temperature 0 the step ends with the argmax kernel, as the fast step ends with
its sampler. Above it, with penalties or a logit bias, or under a constraint (whose mask is applied there too), generate_sampled copies each step's logits to the host and draws the
token there with pycalm.cpu.sampler.Sampler (sample_ref, the specification), whose i-th coin is
the i-th draw of default_rng(seed), the coin the fast engine's sampling kernel reads for the
i-th sampled token: the same tokens for the same logits, one host round trip a token.

Mixtral (experts) and batch-invariant decoding are the fast engine's only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pycalm.cpu.reference import TokenLogprobs, logprobs_ref, mask_logits_ref
from pycalm.cpu.sampler import Sampler, SamplingParams
from pycalm.errors import PycalmError
from pycalm.gpu.memory import out_of_memory_as_error, require_gpu_memory
from pycalm.gpu.prefill import LOGITS_BYTES, Prefill
from pycalm.model.config import ModelConfig

SCORES_BYTES = 256 << 20  # the prompt pass's attention scores, (rows, n_heads, seq_len) float32, at most


def unsupported(cfg: ModelConfig, batch_invariant: bool) -> str | None:
    """Why the simple kernels cannot run this engine, or None when they can."""
    if cfg.n_experts:
        return "a mixture of experts (the simple kernels have no router)"
    if batch_invariant:
        return "batch-invariant decoding (it runs on the fast multi-token forward)"
    return None


@dataclass
class Activations:
    """The buffers between the launches, for `rows` tokens: (1, n) for the token step, all
    float32; for the prompt's rows, float16 where a tensor-core matmul reads them."""

    x: object  # (rows, dim) float32, the residual stream
    xb: object  # (rows, dim) rmsnorm(x) * norm weights
    qkv: object  # (rows, q_dim + 2 kv_dim) float32, Wqkv xb
    q: object  # (rows, q_dim) float32, the queries with bias and RoPE
    att: object  # (rows, q_dim) attention's output
    y: object  # (rows, dim) float32, Wo att or W2 h: what is added to x
    a: object  # (rows, hidden_dim) float32, W1 xb
    b: object  # (rows, hidden_dim) float32, W3 xb
    h: object  # (rows, hidden_dim) silu(a) * b
    scores: object  # (rows, n_heads, seq_len) float32, attention's scores and probabilities
    logits: object  # (logit_rows, vocab_size) float32 (the prompt's rows), or None (the step)

    @classmethod
    def allocate(
        cls, cfg: ModelConfig, rows: int, seq_len: int, logit_rows: int, stream: object
    ) -> Activations:
        from numba import cuda

        half = np.float16 if logit_rows else np.float32  # the prompt's matmuls read fp16

        def empty(shape: tuple[int, ...], dtype: type = np.float32) -> object:
            return cuda.device_array(shape, dtype, stream=stream)

        return cls(
            x=empty((rows, cfg.dim)), xb=empty((rows, cfg.dim), half), qkv=empty((rows, cfg.qkv_dim)),
            q=empty((rows, cfg.q_dim)), att=empty((rows, cfg.q_dim), half), y=empty((rows, cfg.dim)),
            a=empty((rows, cfg.hidden_dim)), b=empty((rows, cfg.hidden_dim)),
            h=empty((rows, cfg.hidden_dim), half), scores=empty((rows, cfg.n_heads, seq_len)),
            logits=empty((logit_rows, cfg.vocab_size)) if logit_rows else None,
        )  # fmt: skip

    @staticmethod
    def nbytes(cfg: ModelConfig, rows: int, seq_len: int, logit_rows: int) -> int:
        """The bytes allocate() takes."""
        half = 2 if logit_rows else 4
        per_row = 4 * (2 * cfg.dim + cfg.qkv_dim + cfg.q_dim + 2 * cfg.hidden_dim + cfg.n_heads * seq_len)
        per_row += half * (cfg.dim + cfg.q_dim + cfg.hidden_dim)
        return rows * per_row + 4 * logit_rows * cfg.vocab_size


def forward(e: object) -> None:
    """Enqueue one token step on e.stream (e: the GpuEngine): the token state[STATE_TOKEN] at
    position state[STATE_POS] in, the next token and position out."""
    from pycalm.kernels.common import STATE_TOKEN
    from pycalm.kernels.finite import check_finite
    from pycalm.kernels.simple.argmax import argmax
    from pycalm.kernels.simple.attention import attention
    from pycalm.kernels.simple.elementwise import residual_add, silu_gate
    from pycalm.kernels.simple.embed import embed
    from pycalm.kernels.simple.matvec import matvec
    from pycalm.kernels.simple.rmsnorm import rmsnorm
    from pycalm.kernels.simple.rope_kv import rope_kv
    from pycalm.kernels.step import advance

    cfg, eps, s, b, state = e.config, e.config.norm_eps, e.stream, e.simple_step, e.state
    # x = the embedding row of the token
    embed(e.tok_embeddings, state[STATE_TOKEN : STATE_TOKEN + 1], b.x, e.embed_dtype, stream=s)
    for L, cache in zip(e.layers, e.kv_caches, strict=True):
        dt = L.dtypes  # each matrix's format
        # xb = rmsnorm(x) * attn_norm
        rmsnorm(b.x, L.attn_norm, eps, b.xb, stream=s)
        # qkv = Wqkv xb
        matvec(L.wqkv, b.xb[0], b.qkv[0], dt["wqkv"], stream=s)
        # q = rope(q + bq); cache row pos: k = rope(k + bk), v = v + bv
        rope_kv(b.qkv, L.bqkv, e.rope_freqs, state, b.q, cache, cfg.head_dim, stream=s)
        # att = softmax(q k^T / sqrt(head_dim)) v over positions 0..pos (or the window)
        attention(b.q, cache, state, b.scores, b.att, cfg, stream=s)
        # x += Wo att
        matvec(L.wo, b.att[0], b.y[0], dt["wo"], stream=s)
        residual_add(b.x, b.y, stream=s)
        # xb = rmsnorm(x) * ffn_norm
        rmsnorm(b.x, L.ffn_norm, eps, b.xb, stream=s)
        # h = silu(W1 xb) * (W3 xb)
        matvec(L.w1, b.xb[0], b.a[0], dt["w1"], stream=s)
        matvec(L.w3, b.xb[0], b.b[0], dt["w3"], stream=s)
        silu_gate(b.a, b.b, b.h, stream=s)
        # x += W2 h
        matvec(L.w2, b.h[0], b.y[0], dt["w2"], stream=s)
        residual_add(b.x, b.y, stream=s)
    # logits = Wout rmsnorm(x) * norm
    rmsnorm(b.x, e.norm, eps, b.xb, stream=s)
    matvec(e.output, b.xb[0], e.logits_buf, e.output_dtype, stream=s)
    if e.finite_flag is not None:
        # debug: flag = the first position whose logits hold a NaN or an infinity
        check_finite(e.logits_buf, state, e.finite_flag, stream=s)
    # token = argmax(logits)
    argmax(e.logits_buf, state, stream=s)
    # pos += 1; while prefilling, token = the prompt's next token instead
    advance(state, e.feed, stream=s)


class SimplePrefill(Prefill):
    """The prompt pass on the simple kernels, T rows at a time: the token step's launches with
    a matmul (pycalm.kernels.simple.matmul) for each matvec; the rows' activations are rounded to
    fp16 where a matmul reads them. Prefill.run cuts the prompt into chunks and reads logits."""

    split_rows = 0  # no split attention (span_of: no span): the simple attention reads every position

    def __init__(self, engine: object, max_chunk: int) -> None:
        cfg: ModelConfig = engine.config
        self.engine = engine
        # the attention scores of a chunk of rows fit SCORES_BYTES
        self.max_chunk = max(1, min(max_chunk, SCORES_BYTES // (4 * cfg.n_heads * engine.seq_len)))
        self.logit_rows = max(1, min(self.max_chunk, LOGITS_BYTES // (4 * cfg.vocab_size)))
        nbytes = Activations.nbytes(cfg, self.max_chunk, engine.seq_len, self.logit_rows)
        what = f"the simple prompt pass's buffers of {self.max_chunk:,} rows"
        require_gpu_memory(what, nbytes)
        with out_of_memory_as_error(what, nbytes):
            self.buffers = Activations.allocate(
                cfg, self.max_chunk, engine.seq_len, self.logit_rows, engine.stream
            )

    def forward_rows(self, pos0: int, n_rows: int, tokens: object = None, span: int | None = None) -> None:
        """Enqueue the layers for the tokens feed[pos0 .. pos0 + n_rows - 1] (or the device
        array `tokens`); pos0 is read from state[STATE_POS]. Writes the cache rows and x. (span:
        unread; the simple attention reads every position up to each row's.)"""
        from pycalm.kernels.simple.attention import attention
        from pycalm.kernels.simple.elementwise import residual_add, silu_gate
        from pycalm.kernels.simple.embed import embed
        from pycalm.kernels.simple.matmul import matmul
        from pycalm.kernels.simple.rmsnorm import rmsnorm
        from pycalm.kernels.simple.rope_kv import rope_kv

        e, n = self.engine, n_rows
        cfg, eps, s, B = e.config, e.config.norm_eps, e.stream, self.buffers
        x, xb, qkv, q, att, y, a, b, h = (B.x[:n], B.xb[:n], B.qkv[:n], B.q[:n], B.att[:n], B.y[:n], B.a[:n],
                                          B.b[:n], B.h[:n])  # fmt: skip
        ids = e.feed[pos0 : pos0 + n] if tokens is None else tokens
        # x[t] = the embedding row of the token at position pos0 + t
        embed(e.tok_embeddings, ids, x, e.embed_dtype, stream=s)
        for L, cache in zip(e.layers, e.kv_caches, strict=True):
            dt = L.dtypes
            # xb = rmsnorm(x) * attn_norm, fp16
            rmsnorm(x, L.attn_norm, eps, xb, stream=s)
            # qkv = xb Wqkv^T
            matmul(xb, L.wqkv, qkv, dt["wqkv"], stream=s)
            # q = rope(q + bq); cache rows pos0 + t: k = rope(k + bk), v = v + bv
            rope_kv(qkv, L.bqkv, e.rope_freqs, e.state, q, cache, cfg.head_dim, stream=s)
            # att[t] = softmax(q k^T / sqrt(head_dim)) v over positions 0 .. pos0 + t, fp16
            attention(q, cache, e.state, B.scores, att, cfg, stream=s)
            # x += att Wo^T
            matmul(att, L.wo, y, dt["wo"], stream=s)
            residual_add(x, y, stream=s)
            # xb = rmsnorm(x) * ffn_norm, fp16
            rmsnorm(x, L.ffn_norm, eps, xb, stream=s)
            # h = silu(xb W1^T) * (xb W3^T), fp16
            matmul(xb, L.w1, a, dt["w1"], stream=s)
            matmul(xb, L.w3, b, dt["w3"], stream=s)
            silu_gate(a, b, h, stream=s)
            # x += h W2^T
            matmul(h, L.w2, y, dt["w2"], stream=s)
            residual_add(x, y, stream=s)

    def classify_rows(self, first: int, n_rows: int) -> None:
        """Enqueue logits[:n_rows] = Wout rmsnorm(x[first + i]) * norm for rows first .. first +
        n_rows - 1 of the last forward_rows."""
        from pycalm.kernels.simple.matmul import matmul
        from pycalm.kernels.simple.rmsnorm import rmsnorm

        e, B, rows = self.engine, self.buffers, slice(first, first + n_rows)
        # xb = rmsnorm(x) * norm, fp16
        rmsnorm(B.x[rows], e.norm, e.config.norm_eps, B.xb[rows], stream=e.stream)
        # logits = xb Wout^T
        matmul(B.xb[rows], e.output, B.logits[:n_rows], e.output_dtype, stream=e.stream)


def generate_sampled(
    e: object,
    ids: list[int],
    start_pos: int,
    max_new: int,
    sampling: SamplingParams,
    logprobs: int | None = None,
    prompt: list[int] | None = None,
    constraint: object | None = None,
) -> Iterator[int] | Iterator[TokenLogprobs]:
    """GpuEngine.generate at temperature > 0, with penalties or under a constraint (e: the
    engine, the arguments checked): the prompt but its last token through the prompt pass, then
    one greedy token step a position, its logits read back and the token drawn on the host (see
    the module docstring), the penalties and the bias applied there (Sampler.for_request over
    `prompt`, the whole prompt). The state is left as generate leaves it: the last token taken,
    at the position after it. With logprobs = k, each token's TokenLogprobs from the same
    logits on the host (logprobs_ref, the model's: before the penalties). With a constraint
    (pycalm.app.constrain.Constraint), the logits are masked on the host first
    (mask_logits_ref: the plain path's spec), and generation ends once it is finished."""
    if sampling.temperature <= 0 and not sampling.penalized and constraint is None:
        raise PycalmError(
            "generate_sampled draws at a temperature above 0, with penalties or under a constraint"
        )
    sampler = Sampler.for_request(sampling, prompt if prompt is not None else ids, e.config.vocab_size)
    end, eos = start_pos + len(ids), sampling.end_ids(e.config.eos_ids)
    if len(ids) > 1:
        e.prefill(ids[:-1], start_pos)
    token, taken = ids[-1], 0
    try:
        for pos in range(end - 1, min(end - 1 + max_new, e.seq_len)):
            logits = e.logits(token, pos)  # a greedy step; its logits on the host
            if constraint is not None:  # the ids the constraint does not allow to -inf
                constraint.fill_mask(e._mask_host)
                logits = mask_logits_ref(logits, e._mask_host)
            token = sampler.sample(logits)
            if constraint is not None:
                constraint.accept(token)
            taken += 1
            yield token if logprobs is None else logprobs_ref(logits, token, logprobs)
            if token in eos or (constraint is not None and constraint.finished):
                return
    finally:
        if taken:  # the step left its own argmax in the state
            e._set_state(token, end - 1 + taken, end)
