"""The GPU engine: weights and buffers on the device, and the token step as CUDA graphs.

forward() below is the whole token step, one kernel launch per line in data-flow order, like
llama2.c's forward(). It is run once eagerly (which compiles every kernel), then captured into
CUDA graphs on the engine's stream, one for each attention span: the positions that attention's
grid covers, a power-of-two multiple of its chunk (at 4096 positions of cache and chunks of
256: 5 graphs; a single graph over the whole cache would launch 16 blocks a head where a short
context has one live). Every later token, prompt tokens included, is one replay of the graph
for its position. On compute capability 9.0 and up the graphs' edges are programmatic: each
kernel launches, and issues its first weight loads, while the one before it finishes
(pycalm.graph). Nothing per token is a launch argument: the token, the position and the
prompt live in device memory (`state`, `feed`), and the step ends by advancing them itself.
The host only reads back the token ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pycalm.config import ModelConfig, kv_dtype_for
from pycalm.errors import PycalmError
from pycalm.graph import GraphStep
from pycalm.kernels.attention import attention_span
from pycalm.sampler import SamplingParams


def gpu_unavailable_reason() -> str | None:
    """None when a CUDA GPU can run the kernels, else why not (one line)."""
    from numba import config

    if config.ENABLE_CUDASIM:
        return "the CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1)"
    try:
        from numba import cuda

        if not cuda.is_available():
            return "no CUDA GPU found"
    except Exception as e:  # noqa: BLE001 - any driver failure means: no usable GPU
        return f"no usable CUDA GPU ({type(e).__name__})"
    return None


@dataclass
class LayerWeights:
    attn_norm: object  # (dim,) float32
    wqkv: object  # (q_dim + 2 kv_dim, dim) stored
    bqkv: object | None  # (q_dim + 2 kv_dim,) float32, Qwen2 only
    wo: object  # (dim, q_dim) stored
    ffn_norm: object  # (dim,) float32
    w1: object  # (hidden_dim, dim) stored; MoE: (n_experts, hidden_dim, dim)
    w3: object  # (hidden_dim, dim) stored; MoE: (n_experts, hidden_dim, dim)
    w2: object  # (dim, hidden_dim) stored; MoE: (n_experts, dim, hidden_dim)
    moe_gate: object | None = None  # (n_experts, dim) float32, the router; MoE only


class EagerStep:
    """The token step as plain launches (the CUDA simulator's stand-in for a graph)."""

    def __init__(self, record: object) -> None:
        self.launch = record


class GpuEngine:
    """forward(token, pos) on the GPU; generate() streams token ids from graph replays."""

    device = "gpu"

    def __init__(
        self,
        model: object,
        seq_len: int,
        kv_dtype: str = "auto",
        use_graph: bool | None = None,
        programmatic: bool | None = None,
        attention_chunk: int | None = None,
    ) -> None:
        from numba import config, cuda

        from pycalm.kernels.attention import attention_scratch
        from pycalm.kernels.sample import argmax_scratch_shape
        from pycalm.kernels.step import STATE_SIZE

        cfg: ModelConfig = model.config
        self.config = cfg
        self.seq_len = min(seq_len, cfg.max_seq_len)
        self.kv_dtype = kv_dtype_for(kv_dtype, self.seq_len)
        self.stream = cuda.stream()
        # the CUDA simulator cannot capture graphs: there the step runs its launches eagerly
        self.use_graph = not config.ENABLE_CUDASIM if use_graph is None else use_graph
        # graph edges as programmatic dependencies (pycalm.graph), by default where the GPU has
        # them (compute capability 9.0 and up): each kernel launches and loads its first weights
        # while the one before it finishes (pycalm.kernels.common.dependent_start)
        if programmatic is None:
            programmatic = self.use_graph and cuda.get_current_device().compute_capability >= (9, 0)
        self.programmatic = programmatic

        # weights: a model that makes its own device arrays (the benchmark's random weights)
        # offers device_tensor(name); a model file is uploaded tensor by tensor
        def dev(name: str) -> object:
            if hasattr(model, "device_tensor"):
                return model.device_tensor(name)
            return cuda.to_device(np.ascontiguousarray(model.tensor(name)), stream=self.stream)

        self.tok_embeddings = dev("tok_embeddings")  # (vocab_size, dim) stored
        self.rope_freqs = dev("rope_freqs")  # (rotary_dim // 2,) float32
        self.layers = [
            LayerWeights(
                attn_norm=dev(f"layers.{i}.attn_norm"),
                wqkv=dev(f"layers.{i}.wqkv"),
                bqkv=dev(f"layers.{i}.bqkv") if cfg.qkv_bias else None,
                wo=dev(f"layers.{i}.wo"),
                ffn_norm=dev(f"layers.{i}.ffn_norm"),
                w1=dev(f"layers.{i}.w1"),
                w3=dev(f"layers.{i}.w3"),
                w2=dev(f"layers.{i}.w2"),
                moe_gate=dev(f"layers.{i}.moe_gate") if cfg.n_experts else None,
            )
            for i in range(cfg.n_layers)
        ]
        self.norm = dev("norm")  # (dim,) float32
        self.output = (
            self.tok_embeddings if cfg.tied_embeddings else dev("output")
        )  # (vocab_size, dim) stored

        # activations, float32
        f32 = np.float32
        self.x = cuda.device_array(cfg.dim, f32, stream=self.stream)  # (dim,) residual stream
        self.q = cuda.device_array(cfg.q_dim, f32, stream=self.stream)  # (n_heads * head_dim,) query
        self.att = cuda.device_array(
            cfg.q_dim, f32, stream=self.stream
        )  # (n_heads * head_dim,) attention out
        # (hidden_dim,) gated FFN; MoE: (k * hidden_dim,), one part a chosen expert (a slot)
        self.k = cfg.n_experts_active if cfg.n_experts else 1
        self.h = cuda.device_array(self.k * cfg.hidden_dim, f32, stream=self.stream)
        # MoE: the current layer's chosen experts, in descending router logit order, and their
        # routing weights: written by the routing kernel, read by the expert matvecs
        moe = cfg.n_experts > 0
        self.route_ids = cuda.device_array(self.k, np.int32, stream=self.stream) if moe else None  # (k,)
        self.route_w = cuda.device_array(self.k, f32, stream=self.stream) if moe else None  # (k,)
        self.logits_buf = cuda.device_array(cfg.vocab_size, f32, stream=self.stream)  # (vocab_size,)
        # KV cache: per layer (seq_len, kv_dim), float16 or fp8 e5m2 bytes
        kv_np = np.float16 if self.kv_dtype == "fp16" else np.uint8
        self.key_cache = [
            cuda.to_device(np.zeros((self.seq_len, cfg.kv_dim), kv_np), stream=self.stream)
            for _ in range(cfg.n_layers)
        ]
        self.value_cache = [
            cuda.to_device(np.zeros((self.seq_len, cfg.kv_dim), kv_np), stream=self.stream)
            for _ in range(cfg.n_layers)
        ]
        # per-chunk partial attention and per-head chunk counters, shared by the layers;
        # attention_chunk: positions an attention block takes (default the longest that fits;
        # the tests take short ones so that a few steps cross several spans)
        self.att_scratch = attention_scratch(
            cfg.n_heads, cfg.head_dim, self.kv_dtype, self.seq_len, chunk=attention_chunk, stream=self.stream
        )
        # (2, blocks) int32: per-block (value bits, id) of the many-block argmax; under the
        # simulator (a Python thread per CUDA thread) two small blocks instead of 128 large ones
        self.argmax_scratch = cuda.device_array(
            (2, 2) if config.ENABLE_CUDASIM else argmax_scratch_shape(), np.int32, stream=self.stream
        )
        self._threads = {"threads": 64} if config.ENABLE_CUDASIM else {}  # argmax / sample block size
        # per-token values on the device (see pycalm.kernels.step)
        self.state = cuda.to_device(
            np.zeros(STATE_SIZE, np.int32), stream=self.stream
        )  # token, pos, feed_end
        self.feed = cuda.to_device(
            np.zeros(self.seq_len, np.int32), stream=self.stream
        )  # (seq_len,) prompt by position
        self.tokens = cuda.to_device(
            np.zeros(self.seq_len, np.int32), stream=self.stream
        )  # (seq_len,) token at each pos
        self.coins = cuda.to_device(
            np.zeros(self.seq_len, np.float32), stream=self.stream
        )  # (seq_len,) uniform draws
        self._state_host = cuda.pinned_array(STATE_SIZE, np.int32)
        self._graphs: dict[tuple[SamplingParams, int], GraphStep | EagerStep] = {}
        self.stream.synchronize()

    # ---------------------------------------------------------------------------------------
    def forward(self, sampling: SamplingParams, span: int | None = None) -> int:
        """Enqueue one token step on self.stream for positions below span (default: seq_len,
        see pycalm.kernels.attention.attention_span); returns the bytes it moves."""
        from pycalm.kernels.attention import attention
        from pycalm.kernels.embed import embed
        from pycalm.kernels.matvec import ffn_gate, matvec, matvec_residual
        from pycalm.kernels.moe import moe_ffn_gate, moe_matvec_residual, moe_route
        from pycalm.kernels.qkv import qkv_rope
        from pycalm.kernels.sample import argmax, sample
        from pycalm.kernels.step import advance

        cfg, dt, kv, s = self.config, self.config.weight_dtype, self.kv_dtype, self.stream
        eps = cfg.norm_eps
        n = 0
        # x = embedding row of state[token]
        n += embed(self.tok_embeddings, self.state, self.x, dt, stream=s)
        for i, L in enumerate(self.layers):
            kc, vc = self.key_cache[i], self.value_cache[i]
            # q, k, v = Wqkv rmsnorm(x) (+ b); rotate q, k; k, v -> cache row pos
            n += qkv_rope(
                L.wqkv,
                L.bqkv,
                self.x,
                L.attn_norm,
                eps,
                self.rope_freqs,
                self.state,
                self.q,
                kc,
                vc,
                dt,
                kv,
                cfg.n_heads,
                cfg.n_kv_heads,
                cfg.head_dim,
                stream=s,
            )
            # att = softmax(q k^T / sqrt(head_dim)) v over positions 0..pos (or the window)
            n += attention(
                self.q,
                kc,
                vc,
                self.state,
                self.att,
                cfg.n_heads,
                cfg.n_kv_heads,
                cfg.head_dim,
                kv,
                cfg.sliding_window,
                self.att_scratch,
                stream=s,
                span=span,
            )
            # x += Wo att
            n += matvec_residual(L.wo, self.att, self.x, dt, stream=s)
            if cfg.n_experts:
                # route_ids, route_w = the top k of Wg rmsnorm(x), and the softmax over their logits
                n += moe_route(
                    L.moe_gate, self.x, L.ffn_norm, eps, self.k, self.route_ids, self.route_w, stream=s
                )
                # h[slot] = route_w[slot] * silu(W1_e rmsnorm(x)) * W3_e rmsnorm(x), e = route_ids[slot]
                n += moe_ffn_gate(
                    L.w1, L.w3, self.x, self.h, dt, self.route_ids, self.route_w, self.k,
                    stream=s, norm_w=L.ffn_norm, eps=eps,
                )  # fmt: skip
                # x += sum over the slots of W2_e h[slot]
                n += moe_matvec_residual(L.w2, self.h, self.x, dt, self.route_ids, self.k, stream=s)
            else:
                # h = silu(W1 rmsnorm(x)) * W3 rmsnorm(x)
                n += ffn_gate(L.w1, L.w3, self.x, self.h, dt, stream=s, norm_w=L.ffn_norm, eps=eps)
                # x += W2 h
                n += matvec_residual(L.w2, self.h, self.x, dt, stream=s)
        # logits = Wout rmsnorm(x)
        n += matvec(self.output, self.x, self.logits_buf, dt, stream=s, norm_w=self.norm, eps=eps)
        # state[token] = the next token, chosen on the device
        if sampling.temperature == 0:
            n += argmax(self.logits_buf, self.state, stream=s, scratch=self.argmax_scratch, **self._threads)
        else:
            n += sample(
                self.logits_buf,
                self.state,
                self.coins,
                sampling.temperature,
                sampling.top_k,
                sampling.top_p,
                sampling.min_p,
                stream=s,
                **self._threads,
            )
        # feed the prompt's next token instead while prefilling; pos += 1
        n += advance(self.state, self.feed, self.tokens, stream=s)
        return n

    def span(self, pos: int) -> int:
        """The attention span of the step at pos: its grid holds the live chunks at most twice."""
        return attention_span(pos, self.att_scratch.chunk, self.seq_len)

    def graph(self, sampling: SamplingParams, pos: int = 0) -> GraphStep | EagerStep:
        """The token step for these sampling settings at pos: one for each span (see span()),
        captured on first use, then replayed. Capturing changes no state, except that a new
        sampling setting's first step runs once eagerly at the span's last position."""
        key = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, 0)
        span = self.span(pos)
        g = self._graphs.get((key, span))
        if g is None:
            if not self.use_graph:
                g = EagerStep(lambda: self.forward(key, span))
            else:
                if not any(k == key for k, _ in self._graphs):
                    # run once eagerly so every kernel is compiled and loaded; that writes one
                    # garbage KV row at the span's last position, rewritten before it is ever
                    # read, and moves the state, which whoever replays the step sets
                    self._set_state(token=0, pos=span - 1, feed_end=0)
                    self.forward(key, span)
                    self.stream.synchronize()
                g = GraphStep(self.stream, lambda: self.forward(key, span), programmatic=self.programmatic)
            self._graphs[(key, span)] = g
        return g

    def _set_state(self, token: int, pos: int, feed_end: int) -> None:
        host = np.zeros(self._state_host.shape[0], np.int32)
        host[:3] = (token, pos, feed_end)
        self.state.copy_to_device(host, stream=self.stream)

    # ---------------------------------------------------------------------------------------
    def logits(self, token: int, pos: int) -> np.ndarray:
        """Logits (vocab_size,) float32 for `token` at `pos`, caching its keys and values."""
        if not 0 <= pos < self.seq_len:
            raise PycalmError(f"position {pos} is past the context length {self.seq_len}")
        g = self.graph(SamplingParams(), pos)
        self._set_state(token, pos, 0)
        g.launch()
        out = self.logits_buf.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return out

    def generate(
        self, ids: list[int], start_pos: int, max_new: int, sampling: SamplingParams
    ) -> Iterator[int]:
        if not ids:
            raise PycalmError("nothing to feed: the prompt encodes to no tokens")
        end = start_pos + len(ids)
        if end > self.seq_len:
            raise PycalmError(
                f"prompt of {len(ids)} tokens at position {start_pos} does not fit the context of {self.seq_len} tokens"
            )
        last = min(end - 1 + max_new, self.seq_len) - 1  # the last step's position
        # every step this call runs, captured before the state is set
        steps = [self.graph(sampling, p) for p in range(start_pos, last + 1)]
        feed = np.asarray(ids, np.int32)
        self.feed[start_pos:end].copy_to_device(feed, stream=self.stream)
        if sampling.temperature > 0:
            # the i-th sampled token uses the i-th draw of the seeded generator, as the CPU
            # Sampler does; the step at position p reads coins[p]
            coins = np.zeros(self.seq_len, np.float32)
            coins[end - 1 :] = np.random.default_rng(sampling.seed).random(self.seq_len - end + 1)
            self.coins.copy_to_device(coins, stream=self.stream)
        self._set_state(int(ids[0]), start_pos, end)
        for i in range(len(ids) - 1):  # prefill: positions start_pos .. end-2, tokens from feed
            steps[i].launch()
        eos = set(self.config.eos_ids)
        for i in range(len(ids) - 1, len(ids) - 1 + min(max_new, self.seq_len - end + 1)):
            steps[i].launch()  # position start_pos + i
            self.state.copy_to_host(self._state_host, stream=self.stream)
            self.stream.synchronize()
            token = int(self._state_host[0])
            yield token
            if token in eos:
                return
