"""The multi-token forward: a prompt's tokens through the layers T rows at a time.

GpuEngine.prefill and GpuEngine.prefill_logits run it. forward_rows below is the token step of
pycalm.gpu.engine (GpuEngine.forward) for T tokens at once, one launch per line in the same order: the
weight matrix products become tensor-core matmuls of T rows (pycalm.kernels.matmul, each weight
read once a chunk instead of once a token), and the kernels between them take T rows
(pycalm.kernels.rows, pycalm.kernels.prefill_attention). Row t of a chunk is the token at
position pos0 + t; pos0 is state[STATE_POS] on the device, as in the token step, and the KV
cache rows pos0 .. pos0 + T - 1 are written on the way.

A prompt is cut into chunks of at most max_chunk rows; the activations of max_chunk rows are
allocated once, on the first prefill (an engine that only decodes allocates nothing). Every
chunk is plain launches on the engine's stream (about nine a layer, each milliseconds of work
at a chunk of 2048 rows on an 8B model, so the launch cost is hidden behind the GPU's work).

A pass of a few rows (GpuEngine.forward_rows, Prefill.rows: draft verification, short chat turns,
batch-invariant decoding) is captured as a CUDA graph for each row bucket (ROW_BUCKETS) and
replayed: the token ids come from a device buffer and the position from state, so nothing in
the graph changes from pass to pass. Its weight products are pycalm.kernels.skinny's up to
SKINNY_ROWS[format] rows (the gate launch: SKINNY_GATE_ROWS) and pycalm.kernels.panel's up to
PANEL_ROWS[format], and its attention
the token step's split-K kernel (pycalm.kernels.attention) up to SPLIT_ATTENTION_ROWS rows.
Where skinny's or the panel's products take every matrix, a pass folds each RMSNorm but its
first into the residual product before it (skinny.NormFold: wo writes the FFN norm's input, w2
the next layer's attention norm's, and the product after each scales its rows' sums); up to
SKINNY_ROWS the QKV epilogue runs in the QKV product's (skinny_qkv): a layer is then five
launches, as the token step's. A pass of n rows replays the
bucket of B >= n rows; rows n..B-1 are padding (token 0) that write cache rows past the last
real one, which the next pass rewrites before any row reads them (a row attends only to
positions up to its own).

The matmuls take fp16 activations (RMSNorm's, attention's and the gate's outputs are written in
fp16), where the token step's matvecs read float32 ones; the residual stream stays float32. The
logits of the two paths agree to about 1e-3 relative (tests/test_prefill.py).

Mixtral's FFN (n_experts > 0) routes each row to its top experts (pycalm.kernels.rows), groups
the rows by expert, and runs the experts' matmuls on those groups (pycalm.kernels.moe_rows: each
expert's weights read once a chunk, the rows gathered and scattered by index), then adds each
row's weighted expert outputs into the residual stream in a fixed order (the same logits on
every run).

Models it does not take (unsupported() says why) feed their prompts through the token step
instead (GpuEngine.prefill falls back to it): head sizes the prefill attention's k-steps
do not fit (a multiple of 16), and matmul widths that are not a multiple of 8.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pycalm.errors import PycalmError
from pycalm.gpu.graph import GraphStep
from pycalm.gpu.memory import out_of_memory_as_error, require_gpu_memory
from pycalm.kernels.rows import ExpertRows, Pages, RowRoutes
from pycalm.kernels.skinny import NormFold, slot_count
from pycalm.model.config import ModelConfig

LOGITS_BYTES = 64 << 20  # the float32 logits block of prefill_logits holds at most this much
# a matrix of each format takes pycalm.kernels.skinny's products in passes of at most
# SKINNY_ROWS[format] rows (each weight read once a pass at close to the token step's speed), in
# longer ones matmul's tiles, K split over blocks. At 64 rows the tiles win for every format: the
# 8B shape's 64-row pass, ms (`bench.py --rows 32,64 --rows-both`, H100, 2026-12-05), q4 17.33 on
# skinny's two A tiles against 12.68 on the split tile (32 rows: 8.40 against 12.46), fp8 and q8
# 16.36 and 16.84 on skinny's, where fp16's split tile takes 11.50; batch-invariant engines take
# skinny's for every pass
SKINNY_ROWS = {"fp16": 32, "fp8": 32, "gf4": 32, "q8": 32, "q4": 32}
# ... but the gate launch (w1 and w3) of q4 and gf4 takes the panel (below) from 17 rows. The
# 8B's products at 32 rows, us, skinny's against the panel's (`rows_matmul.py --panel "16,1,3,1,1"
# --rows 32 --dtypes q4,gf4`, H100, 2026-12-07): q4 qkv 18.7 / 16.2 (skinny's with the QKV
# epilogue in it, the panel's with qkv_rows' 5 us after it), wo 11.3 / 16.0, gate 70.6 / 51.9, w2
# 31.6 / 35.2; gf4 16.6 / 15.4, 10.2 / 15.9, 66.5 / 45.9, 27.6 / 30.0. The 32-row pass with every
# product on the panel took q4 5.79 ms against 6.64 on skinny, gf4 5.46 against 6.15 (`bench.py
# --rows 16,32`, the same machine); the gate alone on it is about 0.35 ms a pass less again, from
# those launches' times (not yet timed as a pass)
SKINNY_GATE_ROWS = {"gf4": 16, "q4": 16}
# longer passes of at most PANEL_ROWS[format] rows take pycalm.kernels.panel's products (skinny's
# weight stream, X staged in shared memory, K split over blocks) in place of the split tile, and
# then fold their RMSNorms (Prefill.folds). The 8B's 64-row pass, ms (`bench.py --rows 1,64`,
# H100, 2026-12-07, one machine): gf4 7.75 on the panel with its folds against 10.02 on the split
# tile, fp16 13.09 against 11.99; fp8 9.13 (9.95 on the split tile on another H100 that day); q8
# 9.07 with the folds (9.10 on the panel without them, another H100); q4 8.34 (10.03 before its
# (d, m) word was split where it is used: the same machine)
PANEL_ROWS = {"fp16": 0, "fp8": 64, "gf4": 64, "q8": 64, "q4": 64}
# passes of at most SPLIT_ATTENTION_ROWS rows take pycalm.kernels.attention's split-K attention
# (every row its own splits over the keys, spread over the SMs), longer ones prefill_attention's
# tiles (a block a kv head and 64 rows); batch-invariant engines take the split one for every
# pass, so that a row's attention is the same sums in every bucket
SPLIT_ATTENTION_ROWS = 16
# the row counts a rows pass is captured for: a pass of n rows replays the smallest that holds n
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# the most rows whose RMSNorms fold into skinny's or the panel's residual products (Prefill.folds)
FOLD_ROWS = ROW_BUCKETS[-1]


def unsupported(cfg: ModelConfig) -> str | None:
    """Why the multi-token forward cannot run a model of this config, or None when it can."""
    if cfg.head_dim % 16:
        return f"head_dim {cfg.head_dim} (the prefill attention takes a head in k-steps of 16)"
    for name in ("dim", "q_dim", "hidden_dim"):  # the matmuls' K: 16-byte rows of fp16
        if getattr(cfg, name) % 8:
            return f"{name} {getattr(cfg, name)} (the matmuls need K a multiple of 8)"
        if "q8" in (cfg.weight_dtype, *(d for _, d in cfg.tensor_dtypes)) and getattr(cfg, name) % 16:
            return f"{name} {getattr(cfg, name)} with q8 weights (their matmuls load 16 codes at once)"
    return None


@dataclass
class RowBuffers:
    """The activations of up to `rows` tokens, float32 where they are summed into, fp16 where a
    matmul reads them."""

    x: object  # (rows, dim) float32, the residual stream
    xb: object  # (rows, dim) float16, rmsnorm(x) * norm weights: the matmuls' input
    qkv: object  # (rows, q_dim + 2 kv_dim) float32, Wqkv xb
    q: object  # (rows, q_dim) float32, the queries with bias and RoPE
    att: object  # (rows, q_dim) float16, attention's output: wo's input
    h: object  # (rows, hidden_dim) float16, silu(W1 xb) * (W3 xb): w2's input; MoE: (rows k,
    # hidden_dim), slot t k + j for row t's j-th expert (k = n_experts_active)
    logits: object  # (logit_rows, vocab_size) float32, a block of rows of logits
    # the RMSNorms folded into the residual products of a pass of up to 64 rows (Prefill.folds):
    rms: object  # (2, 64) float32, each row's rsqrt(mean(x^2) + eps) at the attention norm, the FFN norm
    scale: object  # (64,) float32, the factor of each row's sums in the product after a fold
    slots: object  # (64, ceil(dim / 16)) float32, the folds' sums of squares a 16-column tile
    counter: object  # (1,) int32, the folds' count of blocks done (zero between launches)
    # MoE only (None otherwise):
    routes: RowRoutes | None = None  # .ids, .weights (rows, k): each row's experts
    group_count: object = None  # (n_experts,) int32: rows an expert got
    group_rows: object = None  # (n_experts * rows,) int32: the (n_experts, rows) lists of moe_group
    group_w: object = None  # (n_experts * rows,) float32: their routing weights
    y: object = None  # (rows k, dim) float32: each slot's h W2_e^T

    @classmethod
    def allocate(cls, cfg: ModelConfig, rows: int, logit_rows: int, stream: object) -> RowBuffers:
        from numba import cuda

        def empty(shape: int | tuple[int, int], dtype: type) -> object:
            return cuda.device_array(shape, dtype, stream=stream)

        slots = cfg.n_experts_active if cfg.n_experts else 1  # the FFN rows a token takes
        moe = {}
        if cfg.n_experts:
            moe = dict(
                routes=RowRoutes(empty((rows, slots), np.int32), empty((rows, slots), np.float32)),
                group_count=empty(cfg.n_experts, np.int32),
                group_rows=empty(cfg.n_experts * rows, np.int32),
                group_w=empty(cfg.n_experts * rows, np.float32),
                y=empty((rows * slots, cfg.dim), np.float32),
            )
        fold_rows = min(rows, FOLD_ROWS)
        return cls(
            x=empty((rows, cfg.dim), np.float32),
            xb=empty((rows, cfg.dim), np.float16),
            qkv=empty((rows, cfg.qkv_dim), np.float32),
            q=empty((rows, cfg.q_dim), np.float32),
            att=empty((rows, cfg.q_dim), np.float16),
            h=empty((rows * slots, cfg.hidden_dim), np.float16),
            logits=empty((logit_rows, cfg.vocab_size), np.float32),
            rms=empty((2, fold_rows), np.float32),
            scale=empty(fold_rows, np.float32),
            slots=empty((fold_rows, slot_count(cfg.dim)), np.float32),
            counter=cuda.to_device(np.zeros(1, np.int32), stream=stream),
            **moe,
        )

    @staticmethod
    def nbytes(cfg: ModelConfig, rows: int, logit_rows: int) -> int:
        """The bytes allocate() takes (tests/test_model.py checks the two agree), known before
        allocating so that what does not fit is one line (pycalm.gpu.engine.require_gpu_memory)."""
        slots = cfg.n_experts_active if cfg.n_experts else 1
        f32, f16, i32 = 4, 2, 4
        per_row = cfg.dim * (f32 + f16) + cfg.qkv_dim * f32 + cfg.q_dim * (f32 + f16)
        per_row += slots * cfg.hidden_dim * f16
        moe = 0
        if cfg.n_experts:  # routes, group counts, rows and weights, the experts' outputs
            moe = rows * slots * (i32 + f32) + cfg.n_experts * i32 + cfg.n_experts * rows * (i32 + f32)
            moe += rows * slots * cfg.dim * f32
        fold = min(rows, FOLD_ROWS) * (3 + slot_count(cfg.dim)) * f32 + i32  # rms, scale, slots; counter
        return rows * per_row + logit_rows * cfg.vocab_size * f32 + fold + moe

    def first(self, n: int) -> RowBuffers:
        """Views of the first n rows (the logits block stays whole)."""
        slots = self.h.shape[0] // self.x.shape[0]
        moe = {}
        if self.routes is not None:
            n_experts = self.group_count.shape[0]
            moe = dict(
                routes=RowRoutes(self.routes.ids[:n], self.routes.weights[:n]),
                group_count=self.group_count,
                group_rows=self.group_rows[: n_experts * n],
                group_w=self.group_w[: n_experts * n],
                y=self.y[: n * slots],
            )
        return RowBuffers(
            self.x[:n], self.xb[:n], self.qkv[:n], self.q[:n], self.att[:n], self.h[: n * slots], self.logits,
            self.rms[:, :n], self.scale[:n], self.slots[:n], self.counter, **moe,
        )  # fmt: skip

    def fold(self, w: object, after: int, eps: float) -> NormFold:
        """The next RMSNorm (weights w) folded into a residual product: the norm `after` (0 the
        attention's, 1 the FFN's) gives the scale xb is written at, the other's rms is written."""
        return NormFold(
            w, self.rms[after], self.xb, self.slots, self.counter, self.rms[1 - after], self.scale, eps
        )

    @property
    def experts(self) -> ExpertRows:
        """MoE: the rows grouped by expert, (n_experts, rows) views of the group buffers."""
        n_experts = self.group_count.shape[0]
        shape = (n_experts, self.group_rows.shape[0] // n_experts)
        return ExpertRows(self.group_count, self.group_rows.reshape(*shape), self.group_w.reshape(*shape))


class Prefill:
    """The multi-token forward of a GpuEngine (its weights, KV cache, state and stream), in
    chunks of at most max_chunk rows."""

    def __init__(self, engine: object, max_chunk: int) -> None:
        cfg: ModelConfig = engine.config
        reason = unsupported(cfg)
        if reason:
            raise PycalmError(f"the multi-token forward does not take {reason}")
        if max_chunk < 1:
            raise PycalmError(f"a prefill chunk takes at least one row, got {max_chunk}")
        from numba import config as numba_config
        from numba import cuda

        from pycalm.kernels import skinny

        self.engine = engine
        # the skinny products take every matrix of the model (its K a whole number of their loads)
        k_of = {"wo": cfg.q_dim, "w2": cfg.hidden_dim}  # the others' K is dim
        skinny_ok = skinny.fits(engine.output_dtype, cfg.dim) and all(
            skinny.fits(dt, k_of.get(name, cfg.dim)) for L in engine.layers for name, dt in L.dtypes.items()
        )
        # batch invariance: one kind of product for every pass, so every pass is at most MAX_ROWS
        self.invariant = engine.batch_invariant and skinny_ok
        if self.invariant:
            max_chunk = min(max_chunk, skinny.MAX_ROWS)
        self.skinny_rows = dict(SKINNY_ROWS)  # format -> the most rows a pass takes skinny's products for
        if self.invariant or not skinny_ok:
            self.skinny_rows = dict.fromkeys(SKINNY_ROWS, skinny.MAX_ROWS if self.invariant else 0)
        self.skinny_gate_rows = dict(self.skinny_rows)  # ... and its gate launch
        if not self.invariant and skinny_ok:
            self.skinny_gate_rows.update(SKINNY_GATE_ROWS)
        self.max_chunk = max_chunk
        # the split attention's rows (its group at most 32 query heads a kv head)
        split_ok = cfg.n_heads // cfg.n_kv_heads <= 32
        self.split_rows = (ROW_BUCKETS[-1] if self.invariant else SPLIT_ATTENTION_ROWS) if split_ok else 0
        rows = max(max_chunk, ROW_BUCKETS[-1])  # a prompt's chunk, or a rows pass of any bucket
        self.logit_rows = max(ROW_BUCKETS[-1], min(max_chunk, LOGITS_BYTES // (4 * cfg.vocab_size)))
        nbytes = RowBuffers.nbytes(cfg, rows, self.logit_rows)
        what = f"the prefill buffers of {rows:,} rows (EngineOptions.prefill_chunk)"
        require_gpu_memory(what, nbytes)
        with out_of_memory_as_error(what, nbytes):
            self.buffers = RowBuffers.allocate(cfg, rows, self.logit_rows, engine.stream)
        from pycalm.kernels.matmul import matmul_split_scratch
        from pycalm.kernels.panel import panel_scratch
        from pycalm.kernels.prefill_attention import prefill_attention_scratch

        # the tiled matmul's and the panel's split-K partials and counters (batch-invariant passes
        # take neither)
        self.split_scratch = None if self.invariant else matmul_split_scratch(engine.stream)
        self.panel_rows = (
            dict.fromkeys(PANEL_ROWS, 0) if self.invariant or not skinny_ok else dict(PANEL_ROWS)
        )
        self.panel_scratch = panel_scratch(engine.stream) if any(self.panel_rows.values()) else None
        # the prefill attention's partials where a pass's blocks are few (its keys split over
        # blocks; batch-invariant passes take the split attention, never the tiles)
        self.tiles_scratch = None if self.invariant else prefill_attention_scratch(cfg, engine.stream)
        self.att_scratch = None  # the split attention's partials and counters, split_rows rows
        if self.split_rows:
            from pycalm.kernels.attention import attention_scratch, part_shape

            chunk, kv = engine.att_scratch.chunk, engine.kv_dtype
            what = f"the split attention's scratch of {self.split_rows} rows"
            nbytes = 4 * math.prod(
                part_shape(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, engine.seq_len, chunk, self.split_rows)
            )
            require_gpu_memory(what, nbytes)
            with out_of_memory_as_error(what, nbytes):
                self.att_scratch = attention_scratch(
                    cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, kv, engine.seq_len,
                    chunk=chunk, rows=self.split_rows, stream=engine.stream,
                )  # fmt: skip
        # the split attention's positions a block: per span (attention_span of the pass's last
        # row, as the token step's), or fixed for the cache where a row's bits must not depend
        # on its pass (batch-invariant: every span then takes the same splits, fewer of them)
        self.fixed_split = None
        if self.split_rows and self.invariant:
            from pycalm.kernels.attention import split_len

            self.fixed_split = split_len(engine.seq_len, engine.att_scratch.chunk, cfg.n_kv_heads)
        self._views: dict[int, RowBuffers] = {}  # n rows -> views of the buffers
        from pycalm.kernels.sample import RowSampling
        from pycalm.kernels.sample_wide import WIDE_ROWS, WideScratch

        most = ROW_BUCKETS[-1]
        # a rows pass's inputs in one int32 block that one copy a pass fills from its pinned twin
        # (numba's copies of array slices cost tens of us of Python each: a pass of a small model
        # takes about a millisecond): (6, 64) the ids, then each row's sampling options
        # (temperature, top_k, top_p, min_p) and its uniform draw (float32 bits but top_k), for
        # pycalm.kernels.sample.sample_rows
        self._inputs_host = cuda.pinned_array((6, most), np.int32)  # (6, 64)
        self._inputs_host[:] = 0  # (pinned memory comes uninitialised; zero options are greedy rows)
        self._inputs = cuda.to_device(self._inputs_host, stream=engine.stream)  # (6, 64)
        floats = self._inputs.view(np.float32)  # (6, 64) the same words as float32
        self.rows_tokens = self._inputs[0]  # (64,) the pass's ids
        self.row_sampling = RowSampling(floats[1], self._inputs[2], floats[3], floats[4])  # (64,) each field
        self.row_coins = floats[5]  # (64,)
        self.row_sampled = cuda.to_device(np.zeros(most, np.int32), stream=engine.stream)  # (64,)
        self._sampled_host = cuda.pinned_array(most, np.int32)  # (64,) row_sampled's twin
        # (bucket, what the pass gives: "logits", "tokens" or "cache", attention span) -> its pass
        self._rows_graphs: dict[tuple[int, str, int | None], GraphStep] = {}
        self._inputs_copied = cuda.event()  # the last pass's inputs are on the GPU
        # sample_rows' options: the scratch of the walk over many blocks for up to WIDE_ROWS rows
        # without top-k or min-p (pycalm.kernels.sample_wide; more rows take a block each, which at
        # 64 rows is faster: 381 us against 428 on an H100, 2026-12-07), and under the simulator
        # (a Python thread a GPU thread) blocks of 64 threads
        self.sample_options = {
            "wide": WideScratch.allocate(WIDE_ROWS),
            **({"threads": 64} if numba_config.ENABLE_CUDASIM else {}),
        }

    def products(self, n_rows: int) -> object:
        """The weight-product launcher of a pass of n_rows rows (matmul's arguments): for each
        matrix, skinny_matmul up to skinny_rows of its format (the gate: skinny_gate_rows),
        panel_matmul up to panel_rows; on
        an H100 / H200 wgmma_matmul from its WGMMA_MIN_ROWS of the format (K a multiple of 64);
        else the tiled matmul."""
        from pycalm.kernels.panel import panel_matmul
        from pycalm.kernels.skinny import skinny_matmul
        from pycalm.kernels.wgmma_matmul import takes, wgmma_matmul

        def product(x: object, w: object, out: object, dtype: str, **kwargs: object) -> None:
            # (scale, fold: skinny's and the panel's)
            kwargs = {k: v for k, v in kwargs.items() if v is not None}
            skinny_rows = self.skinny_gate_rows if kwargs.get("mode") == "gate" else self.skinny_rows
            if n_rows <= skinny_rows[dtype]:
                launch = skinny_matmul
            elif n_rows <= self.panel_rows[dtype]:
                launch, kwargs = panel_matmul, {**kwargs, "scratch": self.panel_scratch}
            elif not self.invariant and takes(n_rows, x.shape[1], dtype):
                launch = wgmma_matmul
            else:
                launch = self.tiled
            launch(x, w, out, dtype, **kwargs)

        return product

    def folds(self, n_rows: int) -> bool:
        """Whether a pass of n_rows folds each RMSNorm but the first into the residual product
        before it (skinny.NormFold; the product after it scaled): where skinny's or the panel's
        products take every matrix of the pass, and the FFN is dense."""
        e = self.engine
        return (
            n_rows <= FOLD_ROWS
            and not e.config.n_experts
            and all(
                n_rows <= max(self.skinny_rows[dt], self.panel_rows[dt])
                for L in e.layers
                for dt in L.dtypes.values()
            )
        )

    def tiled(self, *args: object, **kwargs: object) -> None:
        """pycalm.kernels.matmul.matmul, K split over blocks where its tiles leave SMs idle."""
        from pycalm.kernels.matmul import matmul

        matmul(*args, **kwargs, scratch=self.split_scratch)

    # ---------------------------------------------------------------------------------------
    def forward_rows(
        self,
        pos0: int,
        n_rows: int,
        tokens: object = None,
        pages: Pages | None = None,
        pools: list | None = None,
        span: int | None = None,
    ) -> None:
        """Enqueue the layers for the n_rows tokens feed[pos0 .. pos0 + n_rows - 1] (or the
        device array `tokens` of n_rows ids: a captured pass reads its token from a fixed place);
        the kernels read pos0 from state[STATE_POS], which must hold it (run sets it). The KV
        cache rows pos0.. are written, and x holds each row's residual stream after the last
        layer (classify_rows takes it from there). span: the split attention's grid covers
        positions below it (attention; default the whole cache): right while the last row's
        position is below it (span_of). With pages (pycalm.kernels.rows.Pages) and pools (a
        paged KVCache a layer): rows of many sequences, each at its own position in its own
        pages (batched serving, pycalm.gpu.batched), pos0 unread."""
        from pycalm.kernels.attention import attention
        from pycalm.kernels.moe_rows import expert_matmul, moe_combine_rows
        from pycalm.kernels.prefill_attention import prefill_attention
        from pycalm.kernels.rows import (
            embed_rows,
            moe_group,
            moe_route_rows,
            qkv_pages,
            qkv_rows,
            rmsnorm_rows,
        )
        from pycalm.kernels.skinny import skinny_qkv

        e, b = self.engine, self._rows(n_rows)
        cfg, eps, s = e.config, e.config.norm_eps, e.stream
        matmul = self.products(n_rows)  # skinny_matmul for a few rows, else the tiled one
        fold = self.folds(n_rows)  # each RMSNorm but the first folded into the residual product before it
        experts = b.experts if cfg.n_experts else None  # MoE: the group lists of n_rows rows
        ids = e.feed[pos0 : pos0 + n_rows] if tokens is None else tokens
        # x[t] = the embedding row of the token at position pos0 + t
        embed_rows(e.tok_embeddings, ids, b.x, e.embed_dtype, stream=s)
        caches = e.kv_caches if pools is None else pools
        for i, (L, cache) in enumerate(zip(e.layers, caches, strict=True)):
            dt = L.dtypes  # each matrix's format
            scale = b.scale if fold and i else None  # past a fold: xb is x attn_norm at the FFN norm's rms
            if not fold or i == 0:
                # xb = rmsnorm(x) * attn_norm, fp16 (folding: rms[0] = each row's rsqrt, the scale wo writes at)
                rmsnorm_rows(b.x, L.attn_norm, eps, b.xb, stream=s, rms=b.rms[0] if fold else None)
            if pages is None and n_rows <= self.skinny_rows[dt["wqkv"]]:
                # q = rope(xb Wqkv^T + bq); cache rows pos0 + t = rope(k + bk), v + bv: the product's epilogue
                skinny_qkv(
                    b.xb, L.wqkv, dt["wqkv"], L, e.rope_freqs, e.state, b.q, cache, cfg, stream=s, scale=scale
                )
            else:
                # qkv = xb Wqkv^T
                matmul(b.xb, L.wqkv, b.qkv, dt["wqkv"], stream=s, scale=scale)
                if pages is None:
                    # q = rope(q + bq); cache rows pos0 + t = rope(k + bk), v + bv
                    qkv_rows(b.qkv, L, e.rope_freqs, e.state, b.q, cache, cfg, stream=s)
                else:  # rows of many sequences, each in its own pages
                    # q = rope(q + bq) at each row's position; its pool row = rope(k + bk), v + bv
                    qkv_pages(b.qkv, L, e.rope_freqs, pages, b.q, cache, cfg, stream=s)
            # att = softmax(q k^T / sqrt(head_dim)) v, each row over the positions up to its own (or the window)
            if pages is not None and pages.state is not None and n_rows > self.split_rows:
                # one sequence's chunk over its pages: the tiles
                prefill_attention(b.q, cache, pages.state, b.att, cfg, stream=s, table=pages.table[0],
                                  page_size=pages.page_size, scratch=self.tiles_scratch)  # fmt: skip
            elif pages is not None:  # each row over its own sequence's pages, split over the keys
                attention(
                    b.q, cache, e.state, b.att, cfg, pages.scratch, stream=s, span=pages.span, pages=pages
                )
            elif n_rows <= self.split_rows:  # split over the keys, every row its own splits
                attention(b.q, cache, e.state, b.att, cfg, self.att_scratch, stream=s, span=span,
                          split=self.fixed_split)  # fmt: skip
            else:  # a block a kv head and 64 rows, on the tensor cores (the keys split where blocks are few)
                prefill_attention(b.q, cache, e.state, b.att, cfg, stream=s, scratch=self.tiles_scratch)
            # x += att Wo^T (folding: xb = x ffn_norm at the attention norm's rms, rms[1] and scale)
            ffn_fold = b.fold(L.ffn_norm, 0, eps) if fold else None
            matmul(b.att, L.wo, b.x, dt["wo"], stream=s, mode="residual", fold=ffn_fold)
            if not fold:
                # xb = rmsnorm(x) * ffn_norm, fp16
                rmsnorm_rows(b.x, L.ffn_norm, eps, b.xb, stream=s)
            if cfg.n_experts:
                # routes = each row's top n_experts_active experts of Wg rmsnorm(x) * ffn_norm,
                # and the softmax of their logits
                moe_route_rows(L, b.x, b.routes, cfg, stream=s)
                # the rows grouped by expert
                moe_group(b.routes, experts, stream=s)
                # h[t k + j] = silu(xb[t] W1_e^T) * (xb[t] W3_e^T), e = ids[t, j], fp16
                expert_matmul(b.xb, L.w1, b.h, dt["w1"], experts, b.routes, stream=s, mode="gate", w3=L.w3)
                # y[t k + j] = h[t k + j] W2_e^T
                expert_matmul(b.h, L.w2, b.y, dt["w2"], experts, b.routes, stream=s)
                # x[t] += sum over j of weights[t, j] y[t k + j]
                moe_combine_rows(b.y, b.routes, b.x, stream=s)
            else:
                # h = silu(xb W1^T) * (xb W3^T), fp16 (folded: each row's sums times its scale)
                matmul(
                    b.xb, L.w1, b.h, dt["w1"], stream=s, mode="gate", w3=L.w3, scale=b.scale if fold else None
                )
                # x += h W2^T (folding: xb = x attn_norm of the next layer at the FFN norm's rms, rms[0] and
                # scale; the last layer's next norm is the classifier's, classify_rows's)
                attn_fold = (
                    b.fold(e.layers[i + 1].attn_norm, 1, eps) if fold and i + 1 < len(e.layers) else None
                )
                matmul(b.h, L.w2, b.x, dt["w2"], stream=s, mode="residual", fold=attn_fold)

    def span_of(self, pos0: int, n_rows: int) -> int | None:
        """The attention span of a pass of n_rows rows from pos0 (that of its last row's position,
        as the token step's: pycalm.kernels.attention.attention_span); None where the pass takes
        the prefill attention's tiles (no span) or has no split attention."""
        from pycalm.kernels.attention import attention_span

        if not self.split_rows or n_rows > self.split_rows:
            return None
        e = self.engine
        return attention_span(pos0 + n_rows - 1, e.att_scratch.chunk, e.seq_len)

    def token_logits(self, span: int | None = None) -> object:
        """Enqueue the one-row pass of the token state[STATE_TOKEN] at position state[STATE_POS]
        (a batch-invariant engine's token step: its logits are the bits every rows pass gives
        that token there; span: the step's), returning its logits, a (vocab_size,) float32
        device view."""
        from pycalm.kernels.common import STATE_TOKEN

        state = self.engine.state
        # (the token read from state)
        self.forward_rows(0, 1, tokens=state[STATE_TOKEN : STATE_TOKEN + 1], span=span)
        self.classify_rows(0, 1)
        return self.buffers.logits[0]

    def classify_rows(self, first: int, n_rows: int) -> None:
        """Enqueue logits[:n_rows] = Wout rmsnorm(x[first + i]) * norm for rows first .. first +
        n_rows - 1 of the last forward_rows (n_rows at most logit_rows)."""
        from pycalm.kernels.rows import rmsnorm_rows

        e, b = self.engine, self.buffers
        cfg, s, rows = e.config, e.stream, slice(first, first + n_rows)
        matmul = self.products(n_rows)
        # xb = rmsnorm(x) * norm, fp16
        rmsnorm_rows(b.x[rows], e.norm, cfg.norm_eps, b.xb[rows], stream=s)
        # logits = xb Wout^T
        matmul(b.xb[rows], e.output, b.logits[:n_rows], e.output_dtype, stream=s)

    # ---------------------------------------------------------------------------------------
    def run(self, ids: list[int], start_pos: int, logits: str = "none") -> Iterator[np.ndarray]:
        """Feed ids at positions start_pos.. chunk by chunk, caching their keys and values.
        logits: "none" (yields nothing), "last" (yields the last row's (1, vocab_size)), "all"
        (yields (rows, vocab_size) float32 blocks of every row's logits, in order), or
        "residual" (yields each chunk's residual stream after the last layer, (rows, dim)
        float32, in order: GpuEngine.embed norms and pools it on the host)."""
        e = self.engine
        end = start_pos + len(ids)
        if not ids or start_pos < 0 or end > e.seq_len:
            raise PycalmError(
                f"prefill of {len(ids)} tokens at position {start_pos} does not fit the context of {e.seq_len}"
            )
        if logits not in ("none", "last", "all", "residual"):
            raise PycalmError(f"prefill logits: none, last, all or residual, not {logits!r}")
        e.feed[start_pos:end].copy_to_device(np.asarray(ids, np.int32), stream=e.stream)
        for pos0 in range(start_pos, end, self.max_chunk):
            n = min(self.max_chunk, end - pos0)
            e._set_state(token=0, pos=pos0, feed_end=0)  # the kernels read pos0 from state
            self.forward_rows(pos0, n, span=self.span_of(pos0, n))
            if logits == "residual":  # x[:n], the chunk's rows after the last layer
                out = self.buffers.x[:n].copy_to_host(stream=e.stream)
                e.stream.synchronize()
                yield out
                continue
            if logits == "all":
                wanted = range(0, n)
            elif logits == "last" and pos0 + n == end:
                wanted = range(n - 1, n)
            else:
                continue
            for first in range(wanted.start, wanted.stop, self.logit_rows):
                count = min(self.logit_rows, wanted.stop - first)
                self.classify_rows(first, count)
                out = self.buffers.logits[:count].copy_to_host(stream=e.stream)
                e.stream.synchronize()
                yield out

    def rows(
        self,
        ids: list[int],
        pos0: int,
        samplings: list | None = None,
        coins: np.ndarray | None = None,
        tail: object = None,
        cache_only: bool = False,
    ) -> np.ndarray | None:
        """The n <= 64 tokens ids, then tail's (GpuEngine.forward_rows), at positions pos0..,
        their keys and values cached, in one replay of the captured pass of the smallest row
        bucket that holds n (the first pass of a bucket runs eagerly, compiling its kernels, and
        captures it; without graphs (the simulator), or where the bucket's padding rows would
        pass the end of the cache, plain launches of exactly n rows). Returns the logits (n,
        vocab_size) float32, or with `samplings` (a SamplingParams a row) and `coins` (n uniform
        draws) the (n,) int32 tokens each row samples on the GPU (sample_rows: the logits stay
        there). cache_only: the keys and values alone (a prompt's, a draft model's catch-up): no
        classifier, nothing back, and the host does not wait for the pass; returns None."""
        e = self.engine
        given = len(ids)  # the rows whose ids the host has; tail's follow them
        n = given + (0 if tail is None else len(tail.host))
        if not 1 <= n <= ROW_BUCKETS[-1] or pos0 < 0 or pos0 + n > e.seq_len:
            raise PycalmError(
                f"a rows pass takes 1 to {ROW_BUCKETS[-1]} tokens inside the context of {e.seq_len}; "
                f"got {n} at position {pos0}"
            )
        bucket = next(b for b in ROW_BUCKETS if b >= n)
        if not e.use_graph or pos0 + bucket > e.seq_len:
            bucket = n
        host = self._inputs_host  # (6, 64)
        self._inputs_copied.synchronize()  # the last pass's copy of it is done (cache_only passes end unwaited)
        host[0, :given] = ids
        host[0, given:bucket] = 0  # padding rows feed token 0 (tail's rows: theirs, copied below)
        if samplings is not None:
            from pycalm.kernels.sample import host_rows

            if len(samplings) != n or coins is None or len(coins) != n:
                raise PycalmError(f"a rows pass of {n} tokens samples with {n} settings and {n} coins")
            for i, field in enumerate((*host_rows(samplings), np.asarray(coins, np.float32))):
                host[1 + i, :n] = field.view(np.int32)  # (float32 fields as their bits)
        self._inputs.copy_to_device(host, stream=e.stream)
        self._inputs_copied.record(e.stream)
        if tail is not None:  # tail's ids, device to device once the steps that write them are done
            tail.event.wait(e.stream)
            self.rows_tokens[given:n].copy_to_device(tail.device, stream=e.stream)
        e._set_state(token=0, pos=pos0, feed_end=0)  # the kernels read pos0 from state

        gives = "cache" if cache_only else "logits" if samplings is None else "tokens"
        sampled = gives == "tokens"
        span = self.span_of(pos0, bucket)  # (a graph a bucket, result and span)

        def record() -> None:
            from pycalm.kernels.sample import RowSampling, sample_rows

            # (pos0 only names the rows)
            self.forward_rows(pos0, bucket, tokens=self.rows_tokens[:bucket], span=span)
            if gives == "cache":
                return
            self.classify_rows(0, bucket)
            if sampled:
                # sampled[r] = row r's token, drawn with its own options and coin (padding rows: whatever)
                params = RowSampling(*(a[:bucket] for a in self.row_sampling))
                sample_rows(self.buffers.logits[:bucket], params, self.row_coins[:bucket], self.row_sampled[:bucket],
                            stream=e.stream, **self.sample_options)  # fmt: skip

        graph = self._rows_graphs.get((bucket, gives, span))
        if graph is not None:
            graph.launch()
        else:
            record()  # compiles the kernels; also this pass's result
            if e.use_graph and bucket in ROW_BUCKETS and not e.config.n_experts:
                self._rows_graphs[(bucket, gives, span)] = GraphStep(
                    e.stream, record, programmatic=e.programmatic
                )
        if cache_only:
            return None
        if sampled:
            self.row_sampled.copy_to_host(self._sampled_host, stream=e.stream)
            e.stream.synchronize()
            return self._sampled_host[:n].copy()
        out = self.buffers.logits[:n].copy_to_host(stream=e.stream)
        e.stream.synchronize()
        return out

    def _rows(self, n: int) -> RowBuffers:
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = self.buffers.first(n)
        return views
