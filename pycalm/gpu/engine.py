"""The GPU engine: weights and buffers on the device, and the token step as CUDA graphs.

forward() below is the whole token step, one kernel launch per line in data-flow order, like
llama2.c's forward(). It is run once eagerly (which compiles every kernel), then captured into
CUDA graphs on the engine's stream, one for each attention span: the positions that attention's
grid covers, a power-of-two multiple of its chunk (at 4096 positions of cache and chunks of
256: 5 graphs; a single graph over the whole cache would launch 16 blocks a head where a short
context has one live). Every later token, prompt tokens included, is one replay of the graph
for its position. On compute capability 9.0 and up the graphs' edges are programmatic: each
kernel launches, and issues its first weight loads, while the one before it finishes
(pycalm.gpu.graph). Nothing per token is a launch argument: the token, the position and the
prompt live in device memory (`state`, `feed`), and the step ends by advancing them itself.
The host only reads back the token ids (and, when a caller asks for logprobs, a step variant's
few words of pycalm.kernels.logprobs).

With EngineOptions(kernels="simple") the step and the prompt pass run the plain kernels of
pycalm/kernels/simple/ instead, wired by pycalm.gpu.simple.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from pycalm.cpu.reference import TokenLogprobs, check_constraint, check_logprobs
from pycalm.cpu.sampler import MinTokens, SamplingParams
from pycalm.errors import PycalmError
from pycalm.gpu.graph import GraphStep
from pycalm.gpu.memory import out_of_memory_as_error, require_gpu_memory
from pycalm.gpu.prefill import ROW_BUCKETS
from pycalm.kernels.attention import KVCache, attention_span, split_len
from pycalm.kernels.common import STATE_FEED_END, STATE_POS, STATE_SIZE, STATE_TOKEN
from pycalm.model.config import ModelConfig, kv_dtype_for
from pycalm.model.formats import QUANTIZED, Quantized, bits_per_weight


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


FINITE_CHECK_EVERY = 64  # with check_finite: tokens between two reads of the flag


def _stored_bytes(rows: int, cols: int, dtype: str, group: int = 32) -> int:
    """Bytes of a (rows, cols) matrix as pycalm.model.formats stores it, scales included (q4: groups
    of `group` columns)."""
    return round(rows * cols * bits_per_weight(dtype, cols, group) / 8)


def step_bytes(cfg: ModelConfig, kv_dtype: str, pos: int, chunk: int) -> dict[str, int]:
    """The bytes a greedy token step at position pos moves to and from GPU memory, by launch
    role in forward's order, summed over the layers (the total is the sum of the values):
    every weight a launch reads (one embedding row; MoE: the n_experts_active chosen experts
    and the float32 router), the KV cache that attention reads at pos (the window with a
    sliding window) and the row that qkv_rope writes, attention's partials when the context
    spans several splits (pycalm.kernels.attention.split_len, the shortest of `chunk`
    positions), and the float32 activations each launch reads and writes. The benchmark divides it by the step's time (GB/s)."""
    from pycalm.kernels.argmax import ARGMAX_BLOCKS

    f32, dim = 4, cfg.dim

    def stored(name: str, rows: int, cols: int) -> int:  # matrix `name` in its own format
        return _stored_bytes(rows, cols, cfg.dtype_of(name), cfg.group_of(name))

    kv_elem = 1 if kv_dtype == "fp8" else 2
    n_attended = min(pos + 1, cfg.sliding_window) if cfg.sliding_window else pos + 1
    span = chunk  # the engine's span at pos (attention_span), uncapped
    while span <= pos:
        span *= 2
    live_chunks = -(-n_attended // split_len(span, chunk, cfg.n_kv_heads))  # the live splits
    slots = cfg.n_experts_active if cfg.n_experts else 1  # the FFN matrices a token reads
    route = 2 * slots * f32  # MoE: the chosen experts' ids and weights
    bias = cfg.qkv_dim * f32 if cfg.qkv_bias else 0
    layers = [{
        # wqkv, bias, attn_norm, rope_freqs and x read; q and the cache row written
        "qkv_rope": stored(f"layers.{i}.wqkv", cfg.qkv_dim, dim) + bias + 2 * dim * f32 + cfg.rotary_dim // 2 * f32
        + cfg.q_dim * f32 + 2 * cfg.kv_dim * kv_elem,
        # K and V rows read, q read, out written; the partials written and read by the combine
        "attention": 2 * n_attended * cfg.kv_dim * kv_elem + 2 * cfg.q_dim * f32
        + (2 * live_chunks * cfg.n_heads * (cfg.head_dim + 2) * f32 if live_chunks > 1 else 0),
        # wo and att read, x read and written
        "wo+res": stored(f"layers.{i}.wo", dim, cfg.q_dim) + cfg.q_dim * f32 + 2 * dim * f32,
        # MoE: the router (n_experts, dim) float32, x and ffn_norm read, the route written
        "moe_route": cfg.n_experts * dim * f32 + 2 * dim * f32 + route,
        # w1, w3, x and ffn_norm read, h written (MoE: the route read too)
        "ffn_gate": slots * (stored(f"layers.{i}.w1", cfg.hidden_dim, dim) + stored(f"layers.{i}.w3", cfg.hidden_dim, dim))
        + 2 * dim * f32 + slots * cfg.hidden_dim * f32 + (route if cfg.n_experts else 0),
        # w2 and h read, x read and written (MoE: the route read too)
        "w2+res": slots * stored(f"layers.{i}.w2", dim, cfg.hidden_dim) + slots * cfg.hidden_dim * f32 + 2 * dim * f32
        + (route if cfg.n_experts else 0),
    } for i in range(cfg.n_layers)]  # fmt: skip
    roles = [role for role in layers[0] if cfg.n_experts or role != "moe_route"]
    out = "tok_embeddings" if cfg.tied_embeddings else "output"
    return {
        "embed": stored("tok_embeddings", 1, dim) + dim * f32,  # one row read, x written
        **{role: sum(layer[role] for layer in layers) for role in roles},
        # Wout, x and norm read, the logits written
        "classifier": stored(out, cfg.vocab_size, dim) + 2 * dim * f32 + cfg.vocab_size * f32,
        # the logits read, each block's (value, id) written and read, the token written
        "argmax": cfg.vocab_size * f32 + 2 * 2 * ARGMAX_BLOCKS * 4 + 4,
        "advance": 5 * 4,  # pos and feed end read, the prompt's next token read; token, pos written
    }


@dataclass
class LayerWeights:
    """One layer's weights on the device, as pycalm.model.formats stores them: a q8 / q4 matrix is a
    pycalm.model.formats.Quantized of its codes and scales, and `dtypes` says each matrix's format."""

    attn_norm: object  # (dim,) float32
    wqkv: object  # (q_dim + 2 kv_dim, dim) stored
    bqkv: object | None  # (q_dim + 2 kv_dim,) float32, Qwen2 only
    wo: object  # (dim, q_dim) stored
    ffn_norm: object  # (dim,) float32
    w1: object  # (hidden_dim, dim) stored; MoE: (n_experts, hidden_dim, dim)
    w3: object  # (hidden_dim, dim) stored; MoE: (n_experts, hidden_dim, dim)
    w2: object  # (dim, hidden_dim) stored; MoE: (n_experts, dim, hidden_dim)
    dtypes: dict[str, str]  # "wqkv", "wo", "w1", "w3", "w2" -> its format (ModelConfig.dtype_of)
    moe_gate: object | None = None  # (n_experts, dim) float32, the router; MoE only


@dataclass(frozen=True)
class EngineOptions:
    """Switches for tests and benchmarks; the defaults are what the CLI runs."""

    # capture the step as CUDA graphs (None: yes, except under the CUDA simulator, which cannot)
    use_graph: bool | None = None
    # graph edges as programmatic dependencies (pycalm.gpu.graph; None: where the GPU has them,
    # compute capability 9.0 and up): each kernel launches and loads its first weights while the
    # one before it finishes (pycalm.kernels.common.dependent_start)
    programmatic: bool | None = None
    # positions an attention block takes (None: the longest that fits; the tests take short ones
    # so that a few steps cross several spans)
    attention_chunk: int | None = None
    # token steps generate() enqueues ahead of the one whose token the host waits for (1: a host
    # round trip a token; more hides the host's work between tokens behind the GPU's)
    decode_lookahead: int = 4
    # rows a multi-token pass (pycalm.gpu.prefill) takes at most: 2048 prefills a 2,048-token prompt
    # of Llama-3-8B 22% faster than 512 (BENCHMARKS.md at b282afd); its buffers take about 270 MB
    # there. The tests take a few rows, so that a short prompt spans several chunks.
    prefill_chunk: int = 2048
    # compile the token step's kernels (or load them from the kernel cache) while a model file's
    # weights are copied to the device (pycalm.model.loader.start_upload), not after; graphs only. Off:
    # measured no faster (numba's compiler and cache loader hold the GIL; BENCHMARKS.md at b282afd)
    compile_while_loading: bool = False
    # worker processes that compile the kernels into an empty kernel cache while the weights load
    # (pycalm.gpu.precompile; None: as many as the cores allow, at most 8; 0: off, this process
    # compiles them one after another on first use)
    parallel_compile: int | None = None
    # debug: check every token step's logits for NaN and infinity on the device
    # (pycalm.kernels.finite; the CLI's --check-finite), read every FINITE_CHECK_EVERY tokens;
    # the first failing position is a PycalmError
    check_finite: bool = False
    # every token through the multi-token forward, the sampled ones too (the rows pass's captured
    # one-row graph; prompts in passes of up to 64 rows, all of them on pycalm.kernels.skinny's
    # products; the CLI's --batch-invariant): a row's logits do not depend on the rows that share its pass, so
    # the tokens do not depend on how the prompt is cut into chunks or which prefix was cached,
    # and feeding the prompt one token at a time gives the same tokens. Off: the sampled tokens
    # go through the token step (its float32 activations and its own summation order), whose
    # logits differ from the multi-token forward's by about 1e-3 relative, so the two can part
    # where the two best logits are that close
    batch_invariant: bool = False
    # which kernels run the engine: "fast" (pycalm/kernels/*.py), or "simple", the plain kernels
    # a learner reads first (pycalm/kernels/simple/, wired by pycalm.gpu.simple; the CLI's
    # --kernels): the same tokens, slower; no Mixtral, no batch_invariant
    kernels: str = "fast"


@dataclass
class DeviceTokens:
    """Tokens that a GpuEngine's enqueued steps write (greedy_tokens): `device` (n,) int32 on the
    GPU (a slice of the engine's feed) and `host` (n,) its pinned copy hold them once `event`
    has passed; valid until the engine's steps or prompts reach those positions again.
    fed_last: a step after them caches the last one's keys and values too."""

    device: object
    host: np.ndarray
    event: object
    fed_last: bool = False


class EagerStep:
    """The token step as plain launches (the CUDA simulator's stand-in for a graph)."""

    def __init__(self, record: object) -> None:
        self.launch = record


class GpuEngine:
    """The model on the GPU: forward() enqueues a token step, graph() captures it for a span
    of positions; logits() and generate() (token ids streamed from graph replays) serve callers.
    options: switches for tests and benchmarks (EngineOptions)."""

    device = "gpu"

    def __init__(
        self, model: object, seq_len: int, kv_dtype: str = "auto", *, options: EngineOptions = EngineOptions()
    ) -> None:
        from numba import config, cuda

        cfg: ModelConfig = model.config
        from pycalm.gpu import simple
        from pycalm.gpu.prefill import unsupported

        if options.kernels not in ("fast", "simple"):
            raise PycalmError(f"kernels must be fast or simple, not {options.kernels!r}")
        self.simple = options.kernels == "simple"
        why = simple.unsupported(cfg, options.batch_invariant) if self.simple else None
        if why:
            raise PycalmError(f"the simple kernels do not take {why}")
        if options.batch_invariant and unsupported(cfg):
            raise PycalmError(
                f"batch-invariant decoding runs every token through the multi-token forward, which does not take {unsupported(cfg)}"
            )
        self.batch_invariant = options.batch_invariant
        self.config = cfg
        self.seq_len = min(seq_len, cfg.max_seq_len)
        self.kv_dtype = kv_dtype_for(kv_dtype, self.seq_len)
        from pycalm.gpu import precompile

        # a kernel cache without this engine's kernels: worker processes compile them into it
        # while the weights load here (pycalm.gpu.precompile; None: none started); graph(), prepare()
        # and the first prefill wait for the kernels they launch (_await_kernels)
        self.precompile = None if self.simple else precompile.start(cfg, self.seq_len, self.kv_dtype, options)
        self.stream = cuda.stream()
        s = self.stream
        self.use_graph = not config.ENABLE_CUDASIM if options.use_graph is None else options.use_graph
        programmatic = options.programmatic
        if programmatic is None:
            programmatic = self.use_graph and cuda.get_current_device().compute_capability >= (9, 0)
        self.programmatic = programmatic and not self.simple  # (simple kernels: plain edges)

        # weights: a model that makes its own device arrays (the benchmark's random weights)
        # offers device_tensor(name); a model file's tensors are read into device arrays
        # through pinned staging buffers, the whole file in one pass, by a thread on a stream of
        # its own (pycalm.model.loader.start_upload): the arrays exist now, their bytes arrive while
        # the rest of __init__ runs
        upload = None
        if hasattr(model, "device_tensor"):
            dev = model.device_tensor
        else:
            from pycalm.model.loader import start_upload

            names = [n for n in model.names() if n != "tokenizer"]
            weight_bytes = sum(model._entries[n].end - model._entries[n].begin for n in names)
            require_gpu_memory(f"the weights of {model.path.name}", weight_bytes)
            with out_of_memory_as_error(f"the weights of {model.path.name}", weight_bytes):
                upload = start_upload(model, names, stream=cuda.stream())
            dev = upload.arrays.__getitem__

        def matrix(name: str) -> object:  # a q8 / q4 matrix: its codes and its scales
            quantized = cfg.dtype_of(name) in QUANTIZED
            return Quantized(dev(name), dev(name + ".scales")) if quantized else dev(name)

        self.tok_embeddings = matrix("tok_embeddings")  # (vocab_size, dim) stored
        self.embed_dtype = cfg.dtype_of("tok_embeddings")
        self.rope_freqs = dev("rope_freqs")  # (rotary_dim // 2,) float32
        self.layers = [
            LayerWeights(
                attn_norm=dev(f"layers.{i}.attn_norm"),
                wqkv=matrix(f"layers.{i}.wqkv"),
                bqkv=dev(f"layers.{i}.bqkv") if cfg.qkv_bias else None,
                wo=matrix(f"layers.{i}.wo"),
                ffn_norm=dev(f"layers.{i}.ffn_norm"),
                w1=matrix(f"layers.{i}.w1"),
                w3=matrix(f"layers.{i}.w3"),
                w2=matrix(f"layers.{i}.w2"),
                dtypes={m: cfg.dtype_of(f"layers.{i}.{m}") for m in ("wqkv", "wo", "w1", "w3", "w2")},
                moe_gate=dev(f"layers.{i}.moe_gate") if cfg.n_experts else None,
            )
            for i in range(cfg.n_layers)
        ]
        if any(L.dtypes["w1"] != L.dtypes["w3"] for L in self.layers):
            raise PycalmError("w1 and w3 of a layer must share a format (one launch reads both)")
        self.norm = dev("norm")  # (dim,) float32
        # (vocab_size, dim) stored: the classifier, or the embedding table when they are tied
        self.output = self.tok_embeddings if cfg.tied_embeddings else matrix("output")
        self.output_dtype = cfg.dtype_of("tok_embeddings" if cfg.tied_embeddings else "output")

        # the KV cache (the bulk of what __init__ allocates) and the per-position buffers fit, or
        # one line says what did not
        kv_bytes = 2 * cfg.n_layers * self.seq_len * cfg.kv_dim * (2 if self.kv_dtype == "fp16" else 1)
        kv_what = f"a KV cache of {self.seq_len:,} positions ({self.kv_dtype}, {cfg.n_layers} layers)"
        require_gpu_memory(kv_what, kv_bytes + 8 * self.seq_len)  # and each position's feed and draw
        with out_of_memory_as_error(kv_what, kv_bytes):
            self._allocate(cfg, options)
        if upload is not None:
            if self.use_graph and options.compile_while_loading:
                # the greedy token step, once, on the weights as they stand mid-copy: it compiles
                # (or loads from the kernel cache) every kernel of the step while the file's bytes
                # arrive; its output, one KV row at the last position and the state, is garbage
                # that generate() rewrites before reading (as graph()'s eager run)
                self._await_kernels("step")
                self._set_state(token=0, pos=self.seq_len - 1, feed_end=0)
                self.forward(SamplingParams(temperature=0.0), self.span(self.seq_len - 1))
            upload.wait()
        s.synchronize()

    def _allocate(self, cfg: ModelConfig, options: EngineOptions) -> None:
        """The activations, the KV cache, the scratch and the per-token state on the device."""
        from numba import config, cuda

        from pycalm.kernels.argmax import argmax_scratch_shape
        from pycalm.kernels.attention import attention_scratch
        from pycalm.kernels.sample_wide import WideScratch

        s = self.stream

        # activations, float32
        def zeros(shape: int | tuple[int, ...], dtype: type = np.float32) -> object:
            return cuda.to_device(np.zeros(shape, dtype), stream=s)

        slots = cfg.n_experts_active if cfg.n_experts else 1  # MoE: one FFN part a chosen expert
        self.x = zeros(cfg.dim)  # (dim,) the residual stream
        self.q = zeros(cfg.q_dim)  # (n_heads * head_dim,) the query
        self.att = zeros(cfg.q_dim)  # (n_heads * head_dim,) attention's output
        self.h = zeros(slots * cfg.hidden_dim)  # (slots * hidden_dim,) the gated FFN, a part a slot
        self.logits_buf = zeros(cfg.vocab_size)  # (vocab_size,)
        # MoE: the current layer's chosen experts, in descending router logit order, and their
        # routing weights (n_experts_active,): written by moe_route, read by the expert matvecs
        self.route = None
        if cfg.n_experts:
            from pycalm.kernels.moe import Route

            self.route = Route(zeros(slots, np.int32), zeros(slots))
        # KV cache, one a layer: (seq_len, kv_dim) keys and values, float16 or fp8 e5m2 bytes
        kv_np = np.float16 if self.kv_dtype == "fp16" else np.uint8
        self.kv_caches = [
            KVCache(
                zeros((self.seq_len, cfg.kv_dim), kv_np),
                zeros((self.seq_len, cfg.kv_dim), kv_np),
                self.kv_dtype,
            )
            for _ in range(cfg.n_layers)
        ]
        # per-chunk partial attention and per-head chunk counters, shared by the layers
        self.att_scratch = attention_scratch(
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            self.kv_dtype,
            self.seq_len,
            chunk=options.attention_chunk,
            stream=s,
        )
        # (2, blocks) int32: per-block (value bits, id) of the many-block argmax; under the
        # simulator (a Python thread per CUDA thread) two small blocks instead of 128 large ones
        self.argmax_scratch = zeros((2, 2) if config.ENABLE_CUDASIM else argmax_scratch_shape(), np.int32)
        # sample's launch options: the argmax scratch, the scratch of the walk over many blocks
        # (no top-k or min-p: pycalm.kernels.sample_wide), and under the simulator 64-thread blocks
        self._sample_options = {
            "scratch": self.argmax_scratch,
            "wide": WideScratch.allocate(1),
            **({"threads": 64} if config.ENABLE_CUDASIM else {}),
        }
        # per-token values on the device (pycalm.kernels.common: STATE_TOKEN, STATE_POS, STATE_FEED_END)
        self.state = zeros(STATE_SIZE, np.int32)  # (STATE_SIZE,) token, pos, feed end
        # (seq_len + 1,) the token at each position: the prompt's, then each step's pick (advance;
        # the last step's pick, after the context, in the extra slot)
        self.feed = zeros(self.seq_len + 1, np.int32)
        self.coins = zeros(self.seq_len)  # (seq_len,) the uniform draw the step at each position uses
        # a request's penalties and logit bias: the generated tokens' counts, the prompt's flags,
        # the bias, the values and the penalized logits (pycalm.kernels.penalty; 17 bytes a token
        # of the vocabulary), read only by the steps of requests that have any
        from pycalm.kernels.penalty import PenaltyBuffers

        self.penalty = PenaltyBuffers.allocate(cfg.vocab_size, s)
        # the decode loop's ring (generate): slot i % decode_lookahead holds the token of the i-th
        # sampling step, and its event passes once that token is there
        self._tokens_host = cuda.pinned_array(options.decode_lookahead, np.int32)  # (decode_lookahead,)
        self._token_events = [cuda.event() for _ in range(options.decode_lookahead)]
        # with logprobs: the step's logsumexp, its token's logit and the top K (pycalm.kernels.logprobs),
        # (OUT_SIZE,) int32 on the device, and their copies in the ring, a row a slot
        from pycalm.kernels.logprobs import OUT_SIZE

        self.logprobs_out = zeros(OUT_SIZE, np.int32)  # (OUT_SIZE,)
        self._logprobs_host = cuda.pinned_array((options.decode_lookahead, OUT_SIZE), np.int32)
        # greedy_tokens' tokens (a draft model's), on the device for another engine's rows pass to
        # copy, and their pinned copy for the host to read once the event has passed
        self._drafted_host = cuda.pinned_array(ROW_BUCKETS[-1], np.int32)  # (64,)
        self._drafted_event = cuda.event()
        # constrained decoding (pycalm.app.constrain): the allowed ids of the next token, a bit an
        # id, computed on the host into the pinned buffer while the GPU runs the step's forward,
        # then copied to the device for the step's masked sampling (pycalm.kernels.mask)
        words = -(-cfg.vocab_size // 32)
        self.mask_dev = zeros(words, np.uint32)  # (ceil(vocab_size / 32),)
        self._mask_host = cuda.pinned_array(words, np.uint32)  # (ceil(vocab_size / 32),)
        # (sampling settings, with logprobs, with penalties), span -> the captured step; and the two parts of a
        # constrained step: (("logits",), span) -> the forward, (("masked", settings, with
        # logprobs), 0) -> the masked sampling and advance
        self._graphs: dict[tuple[tuple, int], GraphStep | EagerStep] = {}
        from pycalm.gpu.prefill import unsupported

        self.prefill_chunk = options.prefill_chunk
        # the multi-token forward takes the prompts (else the token step: odd head sizes; the
        # simple kernels' prompt pass takes any)
        self.multi_token = unsupported(cfg) is None or self.simple
        # the simple token step's activations (pycalm.gpu.simple; None: the fast kernels run)
        self.simple_step = None
        if self.simple:
            from pycalm.gpu.simple import Activations

            self.simple_step = Activations.allocate(cfg, 1, self.seq_len, 0, s)
        self._prefill = None  # pycalm.gpu.prefill.Prefill, made (with its buffers) on first use
        self._norm_host = None  # (dim,) float32: the final norm's weights on the host (embed)
        # (FLAG_SIZE,) int32: zeros, or the first position whose logits were not finite
        # (pycalm.kernels.finite); None: the check is off
        from pycalm.kernels.finite import FLAG_SIZE

        self.finite_flag = zeros(FLAG_SIZE, np.int32) if options.check_finite else None

    # ---------------------------------------------------------------------------------------
    def forward(
        self,
        sampling: SamplingParams,
        span: int | None = None,
        logprobs: bool = False,
        penalties: bool = False,
    ) -> None:
        """Enqueue one token step on self.stream for positions below span (default: seq_len,
        see pycalm.kernels.attention.attention_span): the token state[STATE_TOKEN] at position
        state[STATE_POS] in, the next token and position out. logprobs: the step also writes
        logprobs_out from its logits and the sampled token (pycalm.kernels.logprobs). penalties:
        the sampler reads the logits with self.penalty's penalties and bias applied
        (pycalm.kernels.penalty; the simple kernels draw those on the host instead)."""
        from pycalm.kernels import logprobs as lp

        if self.simple:  # the simple kernels (pycalm.gpu.simple; sampling > 0 draws on the host)
            from pycalm.gpu import simple

            simple.forward(self)
            if logprobs:  # after advance, which keeps a sampled token (only prompt steps take feed's)
                lp.logprobs(self.logits_buf, self.state, self.logprobs_out, stream=self.stream)
            return None
        self.forward_logits(span)
        self.sample_step(sampling, logprobs, penalties=penalties)

    def forward_logits(self, span: int | None = None) -> None:
        """The first part of forward: the token state[STATE_TOKEN] at position state[STATE_POS]
        through the layers to step_logits() (the finite check included); the state is unchanged."""
        from pycalm.kernels.finite import check_finite

        if self.batch_invariant:
            # logits = the one-row pass of the multi-token forward (pycalm.gpu.prefill): the
            # same bits as any rows pass gives the token at this position
            self._prefill_step().token_logits(span)
        else:
            self.layers_step(span)
        if self.finite_flag is not None:
            # debug: flag = the first position whose logits hold a NaN or an infinity
            check_finite(self.step_logits(), self.state, self.finite_flag, stream=self.stream)

    def step_logits(self) -> object:
        """The (vocab_size,) float32 device array a token step's logits are in: logits_buf, or
        (batch_invariant) the multi-token forward's first logits row."""
        return self._prefill_step().buffers.logits[0] if self.batch_invariant else self.logits_buf

    def layers_step(
        self, span: int | None, state: object = None, caches: list | None = None, pages: object = None
    ) -> None:
        """Enqueue the token step's layers and classifier: logits_buf = the logits of the token
        state[STATE_TOKEN] at position state[STATE_POS], its keys and values cached. state and
        caches default to the engine's; pages (pycalm.kernels.rows.Pages of one row, its
        attention scratch): caches are paged pools (pycalm.gpu.batched), read and written
        through the block table of the row's sequence."""
        from pycalm.kernels.attention import attention
        from pycalm.kernels.embed import embed
        from pycalm.kernels.matvec import ffn_gate, matvec, matvec_residual
        from pycalm.kernels.moe import moe_ffn_gate, moe_matvec_residual, moe_route
        from pycalm.kernels.qkv import qkv_rope

        cfg, eps, s = self.config, self.config.norm_eps, self.stream
        x, q, att, h, route = self.x, self.q, self.att, self.h, self.route
        state = self.state if state is None else state
        caches = self.kv_caches if caches is None else caches
        scratch = self.att_scratch if pages is None else pages.scratch
        # x = the embedding row of the token
        embed(self.tok_embeddings, state, x, self.embed_dtype, stream=s)
        for L, cache in zip(self.layers, caches, strict=True):
            # q, k, v = Wqkv rmsnorm(x) (+ bqkv); q and k rotated by pos; cache row pos = k, v
            qkv_rope(L, x, self.rope_freqs, state, q, cache, cfg, stream=s, pages=pages)
            # att = softmax(q k^T / sqrt(head_dim)) v over positions 0..pos (or the window)
            attention(q, cache, state, att, cfg, scratch, stream=s, span=span, pages=pages)
            # x += Wo att
            matvec_residual(L.wo, att, x, L.dtypes["wo"], stream=s)
            if cfg.n_experts:
                # route = the top n_experts_active experts of Wg rmsnorm(x), softmax of their logits
                moe_route(L, x, route, cfg, stream=s)
                # h[slot] = weight[slot] * silu(W1_e rmsnorm(x)) * W3_e rmsnorm(x), e = ids[slot]
                moe_ffn_gate(L, x, h, route, cfg, stream=s)
                # x += sum over the slots of W2_e h[slot]
                moe_matvec_residual(L, h, x, route, cfg, stream=s)
            else:
                # h = silu(W1 rmsnorm(x)) * W3 rmsnorm(x)
                ffn_gate(L.w1, L.w3, x, h, L.dtypes["w1"], stream=s, norm_w=L.ffn_norm, eps=eps)
                # x += W2 h
                matvec_residual(L.w2, h, x, L.dtypes["w2"], stream=s)
        # logits = Wout rmsnorm(x)
        matvec(self.output, x, self.logits_buf, self.output_dtype, stream=s, norm_w=self.norm, eps=eps)

    def sample_step(
        self, sampling: SamplingParams, logprobs: bool = False, masked: bool = False, penalties: bool = False
    ) -> None:
        """The second part of forward: the token from step_logits() into state[STATE_TOKEN]
        (logprobs: logprobs_out too), then the next position. masked: the ids that mask_dev
        does not allow are set to -inf first (constrained decoding, pycalm.kernels.mask).
        penalties: the sampler reads the logits with self.penalty's penalties and bias applied
        (pycalm.kernels.penalty)."""
        from pycalm.kernels import logprobs as lp
        from pycalm.kernels.mask import mask_logits
        from pycalm.kernels.penalty import penalize
        from pycalm.kernels.sample import sample
        from pycalm.kernels.step import advance

        s, state, logits = self.stream, self.state, self.step_logits()
        if masked:
            # logits[i] = -inf where bit i of the constraint's mask is clear
            mask_logits(logits, self.mask_dev, stream=s)
        # penalties: drawn = the logits less the penalties of the tokens seen, plus the bias
        drawn = penalize(logits, state, self.penalty, stream=s) if penalties else logits
        # token = argmax(drawn) at temperature 0, else the draw coins[pos] picks (sample_ref)
        sample(drawn, state, self.coins, sampling, stream=s, **self._sample_options)
        if logprobs:
            # logprobs_out = logsumexp(logits), logits[token], the top K ids and logits
            lp.logprobs(logits, state, self.logprobs_out, stream=s)
        # pos += 1; while prefilling, token = the prompt's next token instead
        advance(state, self.feed, stream=s)

    def span(self, pos: int) -> int:
        """The attention span of the step at pos: its grid holds the live chunks at most twice
        (the simple kernels: the whole cache, one graph)."""
        if self.simple:  # (its attention reads every position)
            return self.seq_len
        return attention_span(pos, self.att_scratch.chunk, self.seq_len)

    def graph(self, sampling: SamplingParams, pos: int = 0, logprobs: bool = False) -> GraphStep | EagerStep:
        """The token step for these sampling settings at pos (logprobs: the variant that also
        writes logprobs_out): one for each span (see span()), captured on first use, then
        replayed; a request with penalties or a bias has steps of its own, which read their
        values from self.penalty (any values: one set of graphs). Capturing changes no state,
        except that a new setting's first step runs once eagerly at the span's last position
        (with penalties, it counts a token in self.penalty, which generate resets after)."""
        params, penalties = sampling.unseeded(), sampling.penalized
        key = (params, logprobs, penalties)
        span = self.span(pos)
        g = self._graphs.get((key, span))
        if g is None:
            if not self.use_graph:
                g = EagerStep(lambda: self.forward(params, span, logprobs, penalties))
            else:
                if not any(k == key for k, _ in self._graphs):
                    groups = ("prefill",) if self.batch_invariant else ()  # its step is a rows pass
                    drawn = ("sample",) if params.temperature > 0 or penalties else ()
                    self._await_kernels("step", *groups, *drawn)
                    # run once eagerly so every kernel is compiled and loaded; that writes one
                    # garbage KV row at the span's last position, rewritten before it is ever
                    # read, and moves the state, which whoever replays the step sets
                    self._set_state(token=0, pos=span - 1, feed_end=0)
                    self.forward(params, span, logprobs, penalties)
                    self.stream.synchronize()
                g = GraphStep(
                    self.stream,
                    lambda: self.forward(params, span, logprobs, penalties),
                    programmatic=self.programmatic,
                )
            self._graphs[(key, span)] = g
        return g

    def _captured(
        self, key: tuple[tuple, int], record: Callable[[], None], pos: int, groups: tuple
    ) -> object:
        """The step part that record() enqueues, under key in the graph table: captured on first
        use (after one eager run at pos, which compiles its kernels, waited for in `groups` of
        the kernel cache's workers; that run writes a garbage KV row at pos, rewritten before it
        is read, and moves the state, which whoever replays the part sets), then replayed."""
        g = self._graphs.get(key)
        if g is None:
            if not self.use_graph:
                g = EagerStep(record)
            else:
                self._await_kernels(*groups)
                self._set_state(token=0, pos=pos, feed_end=0)
                record()
                self.stream.synchronize()
                g = GraphStep(self.stream, record, programmatic=self.programmatic)
            self._graphs[key] = g
        return g

    def logits_step(self, pos: int) -> GraphStep | EagerStep:
        """Constrained decoding's first part of the step at pos: forward_logits for pos's span."""
        span = self.span(pos)
        return self._captured((("logits",), span), lambda: self.forward_logits(span), span - 1, ("step",))

    def masked_sample_step(self, sampling: SamplingParams, logprobs: bool = False) -> GraphStep | EagerStep:
        """Constrained decoding's second part of a step: sample_step(masked=True) for these
        settings (logprobs: the variant that also writes logprobs_out; with penalties or a bias,
        the variant that applies them)."""
        params, penalties = sampling.unseeded(), sampling.penalized
        groups = ("step", "sample") if params.temperature > 0 or penalties else ("step",)

        def record() -> None:
            self.sample_step(params, logprobs, masked=True, penalties=penalties)

        return self._captured((("masked", params, logprobs, penalties), 0), record, 0, groups)

    def prepare(self, sampling: SamplingParams, positions: range, rows: tuple[int, ...] = ()) -> None:
        """Compile (or load from the kernel cache, pycalm.gpu.kernel_cache) and capture the token
        steps of these positions now rather than in generate's first call, so a caller can tell
        the two costs apart (and, where worker processes fill the kernel cache, waits for the
        multi-token forward's kernels too). Changes no state but what graph() does. rows: also
        the rows passes (forward_rows) of these row counts at every attention span the positions
        reach, greedy-sampled and keys-and-values-only (a speculative engine's checks, a draft
        model's catch-ups); those write cache rows, so call it before a prompt."""
        for pos in sorted({self.span(p) - 1 for p in positions}):  # one position a span
            self.graph(sampling, pos)
        if self.multi_token:
            self._await_kernels("prefill")
        if not rows or not self.multi_token or self.simple or not self.use_graph or self.config.n_experts:
            return
        prefill, seen = self._prefill_step(), set()
        greedy = SamplingParams()
        for n in sorted({next(b for b in ROW_BUCKETS if b >= m) for m in rows}):
            for pos in positions:
                if pos + n > self.seq_len:
                    continue
                key = (n, prefill.span_of(pos, n))
                if key in seen:
                    continue
                seen.add(key)
                self.forward_rows([0] * n, pos, [greedy] * n, np.zeros(n))  # captures the pass
                self.forward_rows([0] * n, pos, cache_only=True)

    def _await_kernels(self, *groups: str) -> None:
        """Where worker processes compile this engine's kernels (pycalm.gpu.precompile): wait until
        those of `groups` are in the kernel cache (or the workers gave up: then they compile here)."""
        if self.precompile is not None:
            self.precompile.wait_for(groups)

    def set_next(self, token: int, pos: int) -> None:
        """The state after a caller that ran passes of its own (forward_rows, prefill): the next
        token step feeds `token` at `pos`, as generate leaves it after sampling `token`."""
        self._set_state(int(token), int(pos), 0)

    def _set_state(self, token: int, pos: int, feed_end: int) -> None:
        host = np.zeros(STATE_SIZE, np.int32)
        host[STATE_TOKEN], host[STATE_POS], host[STATE_FEED_END] = token, pos, feed_end
        self.state.copy_to_device(host, stream=self.stream)

    # ---------------------------------------------------------------------------------------
    def prefill(self, ids: list[int], start_pos: int) -> None:
        """Feed ids at positions start_pos.. through the multi-token forward (pycalm.gpu.prefill),
        caching their keys and values: up to 64 of them (a dense model, graphs on) in one replay
        of its captured rows pass (forward_rows), more in its chunks; where it does not take the
        model (odd head sizes: pycalm.gpu.prefill.unsupported), through the token step, one token
        at a time. The state is left for the caller to set."""
        if not self.multi_token:  # token steps (greedy, the sampled tokens unused), tokens from feed
            for step in self._greedy_steps(ids, start_pos, start_pos + len(ids) - 1):
                step.launch()
            return
        if self.use_graph and not self.simple and not self.config.n_experts and len(ids) <= ROW_BUCKETS[-1]:
            # a short prompt (a chat turn, a draft model's catch-up): one replay of the captured
            # rows pass, whose kernels are the multi-token forward's; from Python, the forward's
            # 200-odd plain launches took 38 ms for one token on the H100 (Qwen2.5-0.5B), 40x
            # the pass. Its keys and values alone: no classifier, and the host goes on (what
            # follows on the stream waits for it). Mixtral's rows pass is not captured (its
            # expert groups): it keeps the forward
            self.forward_rows(ids, start_pos, cache_only=True)
            return
        for _ in self._prefill_step().run(ids, start_pos):
            pass

    def forward_rows(
        self,
        ids: list[int],
        pos: int,
        samplings: list[SamplingParams] | None = None,
        coins: np.ndarray | None = None,
        tail: DeviceTokens | None = None,
        cache_only: bool = False,
    ) -> np.ndarray | None:
        """The n tokens (1 to 64) ids, then tail's, at positions pos .. pos + n - 1 in one pass
        (each weight read once), their keys and values cached: the captured rows pass of
        pycalm.gpu.prefill (a graph for each row bucket). tail: tokens another engine's steps
        write on the GPU (greedy_tokens: a draft model's), copied into the pass's inputs there
        once they are written (the host never waits for them). Returns every row's logits (n,
        vocab_size) float32, or with samplings (a SamplingParams a row) and coins (a uniform
        draw a row) the (n,) int32 tokens each row samples on the GPU; cache_only: the keys and
        values alone, enqueued (no classifier, nothing back, the host does not wait), None.
        The state is left for the caller to set."""
        if self.simple:
            raise PycalmError("forward_rows runs the fast kernels (not --kernels simple)")
        return self._prefill_step().rows(ids, pos, samplings, coins, tail, cache_only)

    def prefill_logits(self, ids: list[int], start_pos: int) -> Iterator[np.ndarray]:
        """prefill, yielding the logits of every row as (rows, vocab_size) float32 blocks in order
        (a block holds at most pycalm.gpu.prefill.LOGITS_BYTES; without the multi-token forward, a
        row a block from the token step)."""
        if not self.multi_token:
            for i, token in enumerate(ids):
                yield self.logits(token, start_pos + i)[None]
            return
        yield from self._prefill_step().run(ids, start_pos, logits="all")

    def embed(self, ids: list[int], pooling: str = "mean", normalize: bool = True) -> np.ndarray:
        """The embedding (dim,) float32 of the text `ids`, fed alone from position 0 (its keys and
        values overwrite cache rows 0 .. len(ids) - 1): each row's residual stream after the last
        layer comes to the host (the multi-token forward's chunks; without it, a token step a
        position), where the final RMSNorm, the pooling and the L2 norm are the reference's
        (pycalm.cpu.reference.embed_pool_ref: a few thousand rows of dim floats, no kernel of
        its own). The state is left for the caller to set."""
        from pycalm.cpu.reference import check_pooling, embed_pool_ref, rmsnorm_rows_ref

        check_pooling(pooling)
        if not ids or len(ids) > self.seq_len:
            raise PycalmError(f"a text to embed takes 1 to {self.seq_len} tokens, not {len(ids)}")
        if self.multi_token:
            x = np.concatenate(list(self._prefill_step().run(ids, 0, logits="residual")))  # (T, dim)
        else:  # token steps (their sampled tokens unused), x read back after each
            x = np.empty((len(ids), self.config.dim), np.float32)  # (T, dim)
            for pos, token in enumerate(ids):
                g = self.graph(SamplingParams(), pos)
                self._set_state(int(token), pos, 0)
                g.launch()
                x[pos] = self.x.copy_to_host(stream=self.stream)
            self.stream.synchronize()
        if self._norm_host is None:
            self._norm_host = self.norm.copy_to_host(stream=self.stream)  # (dim,) float32
            self.stream.synchronize()
        hidden = rmsnorm_rows_ref(x, self._norm_host, self.config.norm_eps, fp16=False)  # (T, dim)
        return embed_pool_ref(hidden, pooling, normalize)

    def _prefill_step(self) -> object:
        if self._prefill is None:
            from pycalm.gpu.prefill import Prefill
            from pycalm.gpu.simple import SimplePrefill

            self._await_kernels("prefill")
            self._prefill = (SimplePrefill if self.simple else Prefill)(self, self.prefill_chunk)
        return self._prefill

    def logits(self, token: int, pos: int) -> np.ndarray:
        """Logits (vocab_size,) float32 for `token` at `pos`, caching its keys and values."""
        if not 0 <= pos < self.seq_len:
            raise PycalmError(f"position {pos} is past the context length {self.seq_len}")
        g = self.graph(SamplingParams(), pos)
        self._set_state(token, pos, 0)
        g.launch()
        out = self.logits_buf.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        self.raise_if_not_finite(pos)
        return out

    def raise_if_not_finite(self, first_pos: int) -> None:
        """With check_finite: a PycalmError naming the first position (and the step counted
        from first_pos) whose logits held a NaN or an infinity, once the stream has passed it."""
        if self.finite_flag is None:
            return
        from pycalm.kernels.finite import FLAG_FAILED, FLAG_INDEX, FLAG_POS

        flag = self.finite_flag.copy_to_host(stream=self.stream)  # waits for the steps enqueued
        if flag[FLAG_FAILED]:
            pos, step = int(flag[FLAG_POS]), int(flag[FLAG_POS]) - first_pos + 1
            when = f"step {step} of this call" if step > 0 else "a prompt token's step"
            raise PycalmError(
                f"non-finite logits (NaN or infinity) at position {pos}, {when} "
                f"(logit {int(flag[FLAG_INDEX])}): the first failing token step"
            )

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
        (its log-probability and the top k, computed in the token step from its logits:
        pycalm.kernels.logprobs). prefix: the tokens at positions 0 .. start_pos - 1 (cached),
        which with ids make the prompt that sampling's repetition_penalty counts as seen.
        constraint (pycalm.app.constrain.Constraint): each token is sampled among the ids it
        allows (_decode_constrained), and generation ends once it is finished.
        sampling.min_tokens: no EOS among the first min_tokens tokens (MinTokens, a constraint
        over the given one: the whole generation takes the constrained steps, a host round trip
        a token); sampling.ignore_eos: an EOS does not end the generation."""
        check_logprobs(logprobs)
        check_constraint(constraint, self.config.vocab_size)
        constraint = MinTokens.over(constraint, sampling, self.config.eos_ids, self.config.vocab_size)
        eos = sampling.end_ids(self.config.eos_ids)  # the tokens that end it
        if not ids:
            raise PycalmError("nothing to feed: the prompt encodes to no tokens")
        end = start_pos + len(ids)
        if end > self.seq_len:
            raise PycalmError(
                f"prompt of {len(ids)} tokens at position {start_pos} does not fit the context of {self.seq_len} tokens"
            )
        prompt = [*(prefix or []), *ids]  # repetition_penalty's seen tokens
        host = sampling.temperature > 0 or sampling.penalized or constraint is not None
        if self.simple and host:  # drawn on the host
            from pycalm.gpu.simple import generate_sampled

            yield from generate_sampled(self, ids, start_pos, max_new, sampling, logprobs, prompt, constraint)
            return
        last = min(end - 1 + max_new, self.seq_len) - 1  # the last step's position
        # the prompt but its last token goes through the multi-token forward (pycalm.gpu.prefill)
        # where it takes the model, else through token steps: the first token step's position.
        # One token before the last goes by a token step too (a draft model's catch-up after a
        # pass that kept every draft): a rows pass of one row costs 1.4-1.8 token steps
        first = end - 1 if self.multi_token and len(ids) > 2 else start_pos
        # every token step this call runs, captured before the state is set (with a constraint:
        # the prompt's token steps, and the sampled positions' steps in two parts)
        if constraint is None:
            steps = [self.graph(sampling, p, logprobs is not None) for p in range(first, last + 1)]
        else:
            steps = [self.graph(sampling, p) for p in range(first, end - 1)]
            forwards = [self.logits_step(p) for p in range(end - 1, last + 1)]
            masked = self.masked_sample_step(sampling, logprobs is not None)
        if first > start_pos:
            self.prefill(ids[:-1], start_pos)
        if end - 1 > first:  # the steps after the first take positions first + 1 .. end - 1 from feed
            self.feed[first + 1 : end].copy_to_device(
                np.asarray(ids[first + 1 - start_pos :], np.int32), stream=self.stream
            )
        if sampling.temperature > 0:
            # the i-th sampled token uses the i-th draw of the seeded generator, as the CPU
            # Sampler does; the step at position p reads coins[p]
            coins = np.zeros(self.seq_len, np.float32)
            rng = np.random.default_rng(sampling.seed)
            rng.random(sampling.first_coin)  # (a speculative loop's stretch starts that far in)
            coins[end - 1 :] = rng.random(self.seq_len - end + 1)
            self.coins.copy_to_device(coins, stream=self.stream)
        if sampling.penalized:  # no token counted yet; the prompt, the bias, the values
            self.penalty.reset(sampling, prompt, self.stream)
        self._set_state(int(ids[first - start_pos]), first, end)
        for i in range(end - 1 - first):  # token steps: positions start_pos .. end-2, tokens from feed
            steps[i].launch()
        if constraint is not None:
            yield from self._decode_constrained(forwards, masked, end - 1, constraint, eos, logprobs)
            return
        # the sampling steps, positions end - 1 .., each yielding the token it samples
        sampled = steps[end - 1 - first : end - 1 - first + min(max_new, self.seq_len - end + 1)]
        yield from self._decode(sampled, end - 1, end, eos, logprobs)

    def greedy_tokens(self, ids: list[int], start_pos: int, n: int, feed_last: bool = False) -> DeviceTokens:
        """Enqueue generate(ids, start_pos, n, SamplingParams())'s token steps (ids fed at
        start_pos.., then n greedy tokens, 1 to 64), without its host round trips: each sampling
        step's advance writes its token into feed at its position, so the n tokens are a slice
        of feed, copied into their pinned copy after the last step, and an event is recorded.
        Nothing waits for them: a draft model's tokens go into the target's rows pass on the GPU (forward_rows' tail). No EOS stops
        them. feed_last (where the context has room): one more step, after the event, feeds
        the n-th token, so that its keys and values are cached while what waits for the event
        runs (the target's pass: a draft model whose drafts are all kept then drafts on at
        once). The state is left for the caller to set."""
        end = start_pos + len(ids)
        if not ids or not 1 <= n <= ROW_BUCKETS[-1] or start_pos < 0 or end - 1 + n > self.seq_len:
            raise PycalmError(
                f"greedy_tokens feeds 1 or more tokens and samples 1 to {ROW_BUCKETS[-1]} inside the "
                f"context of {self.seq_len}; got {len(ids)} at position {start_pos}, {n} to sample"
            )
        s = self.stream
        feed_last = feed_last and end - 1 + n < self.seq_len
        steps = self._greedy_steps(ids, start_pos, end - 2 + n + feed_last)
        for step in steps[: len(steps) - feed_last]:
            step.launch()
        drafted = self.feed[end : end + n]  # (n,) the tokens of positions end .. end + n - 1
        drafted.copy_to_host(self._drafted_host[:n], stream=s)
        self._drafted_event.record(s)
        if feed_last:  # token n at position end - 1 + n: its keys and values (its own token unused)
            steps[-1].launch()
        return DeviceTokens(drafted, self._drafted_host[:n], self._drafted_event, feed_last)

    def _greedy_steps(self, ids: list[int], start_pos: int, last: int) -> list[GraphStep | EagerStep]:
        """The greedy token steps of positions start_pos .. last, captured first (a span's graph
        looked up once), with ids fed: the steps before position start_pos + len(ids) - 1 take
        the next token from feed, and the state is set to the first. The caller launches them."""
        greedy, by_span, steps = SamplingParams(), {}, []
        for p in range(start_pos, last + 1):
            span = self.span(p)
            if span not in by_span:
                by_span[span] = self.graph(greedy, p)
            steps.append(by_span[span])
        end = start_pos + len(ids)
        if len(ids) > 1:  # positions start_pos + 1 .. end - 1 from feed
            self.feed[start_pos + 1 : end].copy_to_device(np.asarray(ids[1:], np.int32), stream=self.stream)
        self._set_state(int(ids[0]), start_pos, end)
        return steps

    def _decode_constrained(
        self,
        forwards: list[GraphStep | EagerStep],
        masked: GraphStep | EagerStep,
        pos: int,
        constraint: object,
        eos: frozenset[int],
        logprobs: int | None = None,
    ) -> Iterator[int] | Iterator[TokenLogprobs]:
        """Run the constrained token steps at positions pos, pos + 1, ..., yielding the token
        each samples (with logprobs = k: its TokenLogprobs) up to one of `eos`. The mask of step
        i + 1 depends on token i, so the loop runs one step ahead: as soon as step i's masked sampling is
        enqueued, so is step i + 1's forward (forwards[i + 1], which reads the token from the
        state on the device); then the host waits for token i, moves the constraint on by it and
        computes step i + 1's mask into a pinned buffer while the GPU runs that forward, copies
        it to mask_dev and enqueues step i + 1's masked sampling (masked: the mask kernel, the
        sampler, advance). The host's mask work overlaps the forward; the GPU waits only where
        it takes longer. When the caller stops, the one forward enqueued past the last token
        taken has written the KV row of a later position (rewritten before it is read) and left
        the state alone: the state is what the last taken step left."""
        from pycalm.kernels.logprobs import token_logprobs

        s, ring, event, lp_ring = self.stream, self._tokens_host, self._token_events[0], self._logprobs_host
        token_dev = self.state[STATE_TOKEN : STATE_TOKEN + 1]
        if not forwards:
            return
        forwards[0].launch()  # step 0's logits
        for i in range(len(forwards)):
            # the allowed ids of token i, into the pinned buffer (token i - 1's copy has passed:
            # the mask copy before it in the stream has too), then to the device
            constraint.fill_mask(self._mask_host)
            self.mask_dev.copy_to_device(self._mask_host, stream=s)
            # token i = sample(logits with the disallowed ids at -inf); pos += 1
            masked.launch()
            token_dev.copy_to_host(ring[0:1], stream=s)
            if logprobs is not None:  # (OUT_SIZE,) int32
                self.logprobs_out.copy_to_host(lp_ring[0], stream=s)
            event.record(s)
            if i + 1 < len(forwards):
                forwards[i + 1].launch()  # runs while the host works out the next mask
            event.synchronize()  # token i is on the host
            token = int(ring[0])
            constraint.accept(token)
            if self.finite_flag is not None and (
                (i + 1) % FINITE_CHECK_EVERY == 0 or i + 1 == len(forwards) or token in eos
            ):
                self.raise_if_not_finite(pos)
            yield token if logprobs is None else token_logprobs(lp_ring[0], token, logprobs)
            if token in eos or constraint.finished:
                return

    def _decode(
        self,
        steps: list[GraphStep | EagerStep],
        pos: int,
        feed_end: int,
        eos: frozenset[int],
        logprobs: int | None = None,
    ) -> Iterator[int] | Iterator[TokenLogprobs]:
        """Run the token steps at positions pos, pos + 1, ..., yielding the token each samples
        up to one of `eos` (with logprobs = k: its TokenLogprobs, from the step's logprobs_out,
        copied into the slot's row of a second pinned ring beside the token),
        with up to decode_lookahead steps enqueued ahead of the one the host waits for: after
        each step its token is copied into the step's slot of a pinned ring and an event is
        recorded; the host reads a slot once its event has passed, while the GPU runs the steps
        after it (no host round trip between steps). When the caller stops (an EOS, or it
        closes the iterator), the steps enqueued past the last token it took still run: they
        write the KV rows of later positions, which a step always rewrites before any step reads
        them, and move the state, which is then set to what the last taken step left (its token,
        its position + 1), as a loop that waits for every token leaves it."""
        from pycalm.kernels.logprobs import token_logprobs

        ring, events, lp_ring = self._tokens_host, self._token_events, self._logprobs_host
        token_dev = self.state[STATE_TOKEN : STATE_TOKEN + 1]
        enqueued = taken = 0
        token = 0
        try:
            while taken < len(steps):
                # keep up to len(ring) steps in flight; step i's slot is free once i - len(ring) is taken
                while enqueued < len(steps) and enqueued < taken + len(ring):
                    slot = enqueued % len(ring)
                    steps[enqueued].launch()
                    token_dev.copy_to_host(ring[slot : slot + 1], stream=self.stream)
                    if logprobs is not None:  # (OUT_SIZE,) int32 into the slot's row
                        self.logprobs_out.copy_to_host(lp_ring[slot], stream=self.stream)
                    events[slot].record(self.stream)
                    enqueued += 1
                slot = taken % len(ring)
                events[slot].synchronize()  # step `taken` and its token copy are done
                token = int(ring[slot])
                taken += 1
                if self.finite_flag is not None and (
                    taken % FINITE_CHECK_EVERY == 0 or taken == len(steps) or token in eos
                ):
                    self.raise_if_not_finite(pos)  # before the token of a failed step goes out
                yield token if logprobs is None else token_logprobs(lp_ring[slot], token, logprobs)
                if token in eos:
                    return
        finally:
            if enqueued > taken > 0:  # set after the steps in flight, in stream order
                self._set_state(token, pos + taken, feed_end)
