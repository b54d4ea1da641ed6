"""Decode benchmark on the GPU: tok/s, GB/s and % of the copy ceiling, per format and shape.

Random weights are made directly on the GPU (no multi-GB files to move). For each shape and
weight format it times, with CUDA events after warm-up:
  - the first 256 tokens (positions 0..255) as graph replays,
  - the last 32 at a 4000-token offset (positions 4000..4031: the KV cache read grows),
  - each kernel role (qkv, attention, wo, ffn_gate, w2, classifier) alone: its launches for all
    layers captured in a graph of their own, so GB/s per kernel excludes the others.
GB/s divides pycalm.gpu.engine.step_bytes (every weight a launch reads, the KV cache at the position,
attention's partials and the float32 activations; per role the same count) by the time.
The copy ceiling is measured in the same run, after the cells (torch device-to-device copy in a
process of its own when torch is there, else a numba uint64 copy), counting bytes read plus
bytes written.

    python scripts/bench.py                          # llama3-8b and tinyllama-1.1b, all formats
    python scripts/bench.py --shapes tinyllama-1.1b --dtypes fp16 --tokens 64
    python scripts/bench.py --shapes mixtral-8x7b --dtypes fp8,gf4
    python scripts/bench.py --shapes path/to/config.json
    python scripts/bench.py --plain                  # the engine with plain graph edges only
    python scripts/bench.py --kernels simple         # the engine on the simple kernels (no per-kernel split)

The engine's default step has programmatic graph edges where the GPU has them (compute
capability 9.0+, pycalm.gpu.graph); the same step captured with plain edges is timed alongside.

--prefill adds the multi-token forward (pycalm.gpu.prefill): for prompts of --lengths tokens (128,
512, 2048, 4000) the prefill's tok/s (wall clock, launches included, best of 2-3 after a
warm-up) and TFLOP/s (2 x the layers' weights x T plus attention's FLOPs; the classifier does
not run on prompt rows) against 989 TFLOP/s, the H200's dense fp16 tensor-core rate; the time to
the first token of a 2,048-token prompt (warm: prefill of 2,047, then the last prompt token's
step); and for --split cells the time of each kernel role of that prefill (each role's launches
for all layers of a chunk captured in a graph of their own). Mixtral's FLOPs count the active
experts a token goes through (n_experts_active of the FFN), as its GB/s count the active bytes.
A model that does not fit the GPU's free memory runs with as many layers as fit, and its rows
say how many; a cell that fails (a format the engine does not take) prints why and the run goes
on. The table of the issue-14 prefill, every shape and format, in about six minutes:

    python scripts/bench.py --prefill --no-decode --shapes llama3-8b,tinyllama-1.1b,mixtral-8x7b \
        --dtypes fp16,fp8,gf4,q8,q4
    python scripts/bench.py --prefill --no-decode --shapes llama3-8b --dtypes fp16 --chunks 512,2048

Mixture-of-experts shapes (mixtral-8x7b) count only the bytes a token reads: the
n_experts_active chosen experts' matrices of every layer (and the float32 router), not the
whole expert stacks.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpubench import copy_ceiling, fill  # noqa: E402

from pycalm.convert.main import DEFAULT_BITS  # noqa: E402
from pycalm.convert.quantize import plan_dtypes  # noqa: E402
from pycalm.cpu.sampler import SamplingParams  # noqa: E402
from pycalm.gpu.engine import EngineOptions, GpuEngine, step_bytes  # noqa: E402
from pycalm.gpu.graph import GraphStep  # noqa: E402
from pycalm.gpu.prefill import Prefill  # noqa: E402
from pycalm.kernels.common import STATE_FEED_END, STATE_POS, STATE_SIZE, STATE_TOKEN  # noqa: E402
from pycalm.model import formats  # noqa: E402
from pycalm.model.config import ModelConfig  # noqa: E402

SHAPES = {
    "llama3-8b": dict(
        arch="llama",
        dim=4096,
        hidden_dim=14336,
        head_dim=128,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    "tinyllama-1.1b": dict(
        arch="llama",
        dim=2048,
        hidden_dim=5632,
        head_dim=64,
        n_layers=22,
        n_heads=32,
        n_kv_heads=4,
        vocab_size=32000,
        rope_theta=10000.0,
    ),
    "smollm2-135m": dict(
        arch="llama",
        dim=576,
        hidden_dim=1536,
        head_dim=64,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        vocab_size=49152,
        rope_theta=100000.0,
    ),
    # issue 30's pair: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B
    "qwen2.5-0.5b": dict(
        arch="qwen2",
        qkv_bias=True,
        dim=896,
        hidden_dim=4864,
        head_dim=64,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        vocab_size=151936,
        rope_theta=1000000.0,
    ),
}
SHAPES["qwen2.5-1.5b"] = dict(
    SHAPES["qwen2.5-0.5b"], dim=1536, hidden_dim=8960, head_dim=128, n_layers=28, n_heads=12
)
# Mixtral-8x7B: Mistral-7B's attention and widths, 8 experts of the FFN, 2 active a token
SHAPES["mixtral-8x7b"] = dict(
    SHAPES["llama3-8b"], arch="mixtral", vocab_size=32000, rope_theta=1e6, n_experts=8, n_experts_active=2
)
CALM_H200 = {  # calm's own tok/s on this H200, 2026-11-29 (docs/BENCHMARKS.md, "Decode")
    ("llama3-8b", "fp16"): 193,
    ("llama3-8b", "fp8"): 322,
    ("llama3-8b", "gf4"): 266,
    ("tinyllama-1.1b", "fp16"): 764,
    ("tinyllama-1.1b", "fp8"): 1225,
    ("tinyllama-1.1b", "gf4"): 1032,
}
# calm's published figures measured on an H100, where no H200 figure exists: printed with the GPU
# named and not compared (a different GPU)
CALM_H100 = {("mixtral-8x7b", "fp8"): 200}


def config_for(shape: str, dtype: str, seq_len: int) -> ModelConfig:
    if shape.endswith(".json"):
        hf = json.loads(Path(shape).read_text())
        n_heads = hf["num_attention_heads"]
        spec = dict(
            arch="llama",
            dim=hf["hidden_size"],
            hidden_dim=hf["intermediate_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads", n_heads),
            vocab_size=hf["vocab_size"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            rope_theta=float(hf.get("rope_theta", 10000.0)),
        )
        if hf.get("num_local_experts"):
            spec.update(
                arch="mixtral", n_experts=hf["num_local_experts"], n_experts_active=hf["num_experts_per_tok"]
            )
    else:
        spec = dict(SHAPES[shape])
    cfg = ModelConfig(
        **spec,
        max_seq_len=seq_len,
        rotary_dim=spec["head_dim"],
        norm_eps=1e-5,
        bos_id=1,
        eos_ids=(),
        weight_dtype=dtype,
    )
    # q4: the converter's default mixed-precision policy (what `convert --dtype q4` writes from a
    # fp16 source: the sensitive matrices in q8, groups of 64 then 32 within DEFAULT_BITS)
    return plan_dtypes(cfg, set(), DEFAULT_BITS) if dtype == "q4" else cfg


# ---------------------------------------------------------------------------------------------
# random weights made on the GPU


def random_words(n_words: int, seed: int, mask: int, bits: int) -> object:
    return fill(cuda.device_array(n_words, np.uint32), seed, mask, bits)


# masks keep the sign and low mantissa bits random and pin the exponent to small normals
# fp16 pair: exponent 01011 or 01010 (about 2^-4..2^-5); fp8 quad: same exponent in each byte
_FP16_MASK, _FP16_BITS = 0x87FF87FF, 0x28002800
_FP8_MASK, _FP8_BITS = 0x87878787, 0x28282828
# gf4: random codes, scale byte fixed to e5m2 0x2C (0.0625)
_GF4_MASK, _GF4_BITS = 0xFFFFFF00, 0x0000002C


# q8: random code bytes, every row's scale 0.05 / 127; q4: random nibbles, every group's step
# d = 2^-8 and offset m = -8 d (fp16 0x1C00, 0xA800: Q4_0's symmetric codes)
_Q8_SCALE_BITS = int(np.float32(0.05 / 127).view(np.uint32))
_Q4_SCALE_BITS = 0xA8001C00  # one (d, m) pair of fp16 halves, d low


def random_weights(
    rows: int, cols: int, dtype: str, seed: int, stack: tuple[int, ...] = (), group: int = 32
) -> object:
    """A (*stack, rows, cols) matrix of random finite weights stored as pycalm.model.formats stores
    `dtype` (gf4: (*stack, rows, cols // 8) uint32; q8 / q4: a formats.Quantized of codes and
    scales, q4 in groups of `group` columns), made on the GPU."""
    n = int(np.prod(stack, dtype=np.int64)) * rows * cols
    if dtype == "q8":
        codes = random_words(n // 4, seed, 0xFFFFFFFF, 0).view(np.int8).reshape(*stack, rows, cols)
        scales = random_words(n // cols, seed, 0, _Q8_SCALE_BITS).view(np.float32).reshape(*stack, rows)
        return formats.Quantized(codes, scales)
    if dtype == "q4":
        codes = random_words(n // 8, seed, 0xFFFFFFFF, 0).reshape(*stack, rows, cols // 8)
        scales = random_words(n // group, seed, 0, _Q4_SCALE_BITS).view(np.float16)
        return formats.Quantized(codes, scales.reshape(*stack, rows, cols // group, 2))
    if dtype == "fp16":
        return random_words(n // 2, seed, _FP16_MASK, _FP16_BITS).view(np.float16).reshape(*stack, rows, cols)
    if dtype == "fp8":
        return random_words(n // 4, seed, _FP8_MASK, _FP8_BITS).view(np.uint8).reshape(*stack, rows, cols)
    return random_words(n // 8, seed, _GF4_MASK, _GF4_BITS).reshape(*stack, rows, cols // 8)


class RandomDeviceModel:
    """What GpuEngine needs of a model (config, device_tensor), with random weights on the GPU."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self._seed = 1
        self._scales: dict[str, object] = {}  # q8 / q4: "NAME.scales" made with NAME's codes

    def device_tensor(self, name: str) -> object:
        c = self.config
        self._seed += 1
        if name.endswith(".scales"):
            return self._scales.pop(name)
        if name == "rope_freqs":
            i = np.arange(c.rotary_dim // 2, dtype=np.float64)
            return cuda.to_device((c.rope_theta ** (-2 * i / c.rotary_dim)).astype(np.float32))
        if name.endswith("norm"):
            return cuda.to_device(np.ones(c.dim, np.float32))
        if name.endswith("bqkv"):
            return cuda.to_device(np.zeros(c.qkv_dim, np.float32))
        if name.endswith("moe_gate"):  # (n_experts, dim) float32 router, small random weights
            rng = np.random.default_rng(self._seed)
            return cuda.to_device(
                (rng.standard_normal((c.n_experts, c.dim)) / np.sqrt(c.dim)).astype(np.float32)
            )
        rows, cols = {
            "tok_embeddings": (c.vocab_size, c.dim),
            "output": (c.vocab_size, c.dim),
            "wqkv": (c.qkv_dim, c.dim),
            "wo": (c.dim, c.q_dim),
            "w1": (c.hidden_dim, c.dim),
            "w3": (c.hidden_dim, c.dim),
            "w2": (c.dim, c.hidden_dim),
        }[name.split(".")[-1]]
        # MoE: w1, w3, w2 are stacks (n_experts, rows, cols)
        stack = (c.n_experts,) if c.n_experts and name.split(".")[-1] in ("w1", "w2", "w3") else ()
        w = random_weights(rows, cols, c.dtype_of(name), self._seed, stack, c.group_of(name))
        if isinstance(w, formats.Quantized):
            self._scales[name + ".scales"] = w.scales
            return w.codes
        return w


# ---------------------------------------------------------------------------------------------


_TORCH_COPY = """
import numpy as np, torch
a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
b = torch.empty_like(a)
times = []
for _ in range(12):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    b.copy_(a)
    e.record()
    e.synchronize()
    times.append(s.elapsed_time(e) / 1e3)
print(2 * 2**30 / float(np.median(times[2:])) / 1e9)
"""


def copy_ceiling_gbs() -> tuple[float, str]:
    """Device-to-device copy bandwidth (read + write), 2 GiB, median of 10: torch's copy in a
    process of its own, so that nothing of torch's (its CUDA initialisation, its allocator) is in
    the timed process; numba's uint64 copy where torch is missing. main runs it after the cells.
    (Measured on the H200: with torch's copy first in the same process TinyLlama fp8 timed 1,212
    tok/s, this way 1,213: the order does not matter, but it keeps the cells clean.)"""
    p = subprocess.run([sys.executable, "-c", _TORCH_COPY], capture_output=True, text=True)
    if p.returncode == 0:
        return float(p.stdout.split()[-1]), "torch copy"
    return copy_ceiling(cuda.stream()), "numba uint64 copy"


def set_state(engine: GpuEngine, token: int, pos: int, feed_end: int = 0) -> None:
    """The engine's per-token state on the device (pycalm.kernels.common's STATE_* layout): the
    token the next step embeds, its position, and the end of the fed prompt."""
    host = np.zeros(STATE_SIZE, np.int32)
    host[STATE_TOKEN], host[STATE_POS], host[STATE_FEED_END] = token, pos, feed_end
    engine.state.copy_to_device(host, stream=engine.stream)


def time_replays(engine: GpuEngine, step: Callable[[int], GraphStep], pos0: int, n: int) -> float:
    """Seconds per step over n steps starting at position pos0; step(pos) is the graph to
    replay at pos (the engine's step for pos's attention span, or one graph throughout)."""
    graphs = [step(p) for p in range(pos0, pos0 + n)]  # captured before the timing
    set_state(engine, token=1, pos=pos0)
    s, e = cuda.event(timing=True), cuda.event(timing=True)
    s.record(engine.stream)
    for g in graphs:
        g.launch()
    e.record(engine.stream)
    e.synchronize()
    return cuda.event_elapsed_time(s, e) / 1e3 / n


def kernel_roles(engine: GpuEngine, pos: int) -> dict[str, tuple[object, int]]:
    """Graphs of one kernel role each (its launches for all layers) for steps at pos, and the
    bytes each moves (step_bytes)."""
    from pycalm.kernels.attention import attention
    from pycalm.kernels.matvec import ffn_gate, matvec, matvec_residual
    from pycalm.kernels.moe import moe_ffn_gate, moe_matvec_residual, moe_route
    from pycalm.kernels.qkv import qkv_rope

    e, cfg, s = engine, engine.config, engine.stream
    eps, span = cfg.norm_eps, engine.span(pos)
    roles = {  # role -> the launch for one layer (each matrix in its own format: L.dtypes)
        "qkv_rope": lambda L, cache: qkv_rope(L, e.x, e.rope_freqs, e.state, e.q, cache, cfg, stream=s),
        "attention": lambda L, cache: attention(e.q, cache, e.state, e.att, cfg, e.att_scratch, stream=s, span=span),
        "wo+res": lambda L, cache: matvec_residual(L.wo, e.att, e.x, L.dtypes["wo"], stream=s),
        "ffn_gate": lambda L, cache: ffn_gate(L.w1, L.w3, e.x, e.h, L.dtypes["w1"], stream=s, norm_w=L.ffn_norm,
                                              eps=eps),
        "w2+res": lambda L, cache: matvec_residual(L.w2, e.h, e.x, L.dtypes["w2"], stream=s),
    }  # fmt: skip
    if cfg.n_experts:  # the MoE block instead (the experts' launches read the chosen ones only)
        del roles["ffn_gate"], roles["w2+res"]
        roles["moe_route"] = lambda L, cache: moe_route(L, e.x, e.route, cfg, stream=s)
        roles["ffn_gate"] = lambda L, cache: moe_ffn_gate(L, e.x, e.h, e.route, cfg, stream=s)
        roles["w2+res"] = lambda L, cache: moe_matvec_residual(L, e.h, e.x, e.route, cfg, stream=s)

    def every_layer(launch: Callable) -> None:
        for L, cache in zip(e.layers, e.kv_caches, strict=True):
            launch(L, cache)

    def classifier() -> None:
        matvec(e.output, e.x, e.logits_buf, e.output_dtype, stream=s, norm_w=e.norm, eps=eps)

    nbytes = step_bytes(cfg, e.kv_dtype, pos, e.att_scratch.chunk)
    out = {
        name: (GraphStep(s, functools.partial(every_layer, fn)), nbytes[name]) for name, fn in roles.items()
    }
    out["classifier"] = (GraphStep(s, classifier), nbytes["classifier"])
    return out


def bench_one(
    shape: str, dtype: str, tokens: int, programmatic: bool | None = None, kernels: str = "fast"
) -> dict:
    t0 = time.perf_counter()
    cfg = config_for(shape, dtype, 4096)
    options = EngineOptions(programmatic=programmatic, kernels=kernels)
    engine = GpuEngine(RandomDeviceModel(cfg), seq_len=4096, kv_dtype="fp16", options=options)
    step = functools.partial(engine.graph, SamplingParams())  # pos -> the step's graph
    step(0)
    setup_s = time.perf_counter() - t0
    time_replays(engine, step, 0, 16)  # warm-up
    t_first = time_replays(engine, step, 0, tokens)
    t_last = time_replays(engine, step, 4000, 32)
    t_plain = None
    if engine.programmatic:  # the same step with plain edges, timed alongside
        span = engine.span(tokens - 1)
        plain = GraphStep(engine.stream, functools.partial(engine.forward, SamplingParams(), span))
        time_replays(engine, lambda p: plain, 0, 16)
        t_plain = time_replays(engine, lambda p: plain, 0, tokens)

    # the bytes a step moves (step_bytes: every weight once, the KV cache up to pos, the
    # activations), averaged over the timed positions
    kv_dtype, chunk = engine.kv_dtype, engine.att_scratch.chunk

    def mean_bytes(first: int, n: int) -> float:
        return float(
            np.mean([sum(step_bytes(cfg, kv_dtype, p, chunk).values()) for p in range(first, first + n)])
        )

    bytes_first = mean_bytes(0, tokens)
    bytes_last = mean_bytes(4000, 32)
    roles = {}
    for name, (graph, nbytes) in (kernel_roles(engine, 128) if kernels == "fast" else {}).items():
        set_state(engine, token=1, pos=128)
        graph.launch()
        t = time_replays(engine, lambda p, g=graph: g, 128, 20)
        roles[name] = (t, nbytes / t / 1e9 if t > 0 else float("nan"))
    res = dict(
        shape=shape,
        dtype=dtype,
        tok_s=1 / t_first,
        gbs=bytes_first / t_first / 1e9,
        tok_s_4000=1 / t_last,
        programmatic=engine.programmatic,
        tok_s_plain=1 / t_plain if t_plain else None,
        gbs_4000=bytes_last / t_last / 1e9,
        ceiling=float("nan"),  # main fills it in after the cells
        setup_s=setup_s,
        roles=roles,
        calm=CALM_H200.get((shape, dtype)),
        calm_h100=CALM_H100.get((shape, dtype)),
        # MoE: the bytes (GB/s) count the active experts only
        experts=f"{cfg.n_experts_active} of {cfg.n_experts} experts" if cfg.n_experts else None,
    )
    del engine
    return res


# ---------------------------------------------------------------------------------------------
# prefill: the multi-token forward (pycalm.gpu.prefill) over prompts of T tokens

TENSOR_PEAK = 989.0  # TFLOP/s: the H200's dense fp16 tensor-core rate (datasheet, wgmma)
PREFILL_LENGTHS = (128, 512, 2048, 4000)


def layer_weights(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The (N, K) weight matrices a prefill row multiplies through in one layer, by matmul role
    (MoE: the n_experts_active experts a row goes through, stacked along N)."""
    slots = cfg.n_experts_active if cfg.n_experts else 1
    ffn = ("expert gate", "expert w2") if cfg.n_experts else ("matmul gate", "matmul w2+res")
    return {
        "matmul qkv": (cfg.qkv_dim, cfg.dim),
        "matmul wo+res": (cfg.dim, cfg.q_dim),
        ffn[0]: (slots * 2 * cfg.hidden_dim, cfg.dim),  # w1 and w3
        ffn[1]: (slots * cfg.dim, cfg.hidden_dim),
    }


def fit_layers(cfg: ModelConfig, chunk: int, seq_len: int) -> ModelConfig:
    """cfg with as many of its layers as fit the GPU's free memory: the layers' weights (every
    expert), the fp16 KV cache of seq_len positions, the embedding and classifier, the prefill
    buffers of a chunk and 2 GiB to spare."""
    bits = formats.bits_per_weight(cfg.weight_dtype, cfg.dim, cfg.q4_group)
    experts = max(cfg.n_experts, 1)
    layer = bits / 8 * (cfg.qkv_dim * cfg.dim + cfg.dim * cfg.q_dim + experts * 3 * cfg.hidden_dim * cfg.dim)
    layer += 2 * seq_len * cfg.kv_dim * 2
    slots = cfg.n_experts_active if cfg.n_experts else 1
    rows = chunk * (
        cfg.dim * 10 + cfg.qkv_dim * 4 + cfg.q_dim * 6 + slots * (cfg.hidden_dim * 2 + cfg.dim * 4)
    )
    fixed = bits / 8 * 2 * cfg.vocab_size * cfg.dim + rows + (64 << 20) + (2 << 30)
    free, _ = cuda.current_context().get_memory_info()
    return cfg.replace(n_layers=max(1, min(cfg.n_layers, int((free - fixed) // layer))))


def prefill_flops(cfg: ModelConfig, n_tokens: int) -> int:
    """2 x the layers' weights x T (the classifier is not run on prompt rows) plus attention's
    (pycalm.kernels.prefill_attention.prefill_attention_flops, every row over its keys)."""
    from pycalm.kernels.prefill_attention import prefill_attention_flops

    params = cfg.n_layers * sum(n * k for n, k in layer_weights(cfg).values())
    return 2 * params * n_tokens + cfg.n_layers * prefill_attention_flops(n_tokens, 0, cfg)


def time_prefill(engine: GpuEngine, ids: list[int], reps: int) -> float:
    """Seconds for engine.prefill(ids, 0), wall clock to the stream's end (launches included),
    the best of reps."""
    best = float("inf")
    for _ in range(reps):
        engine.stream.synchronize()
        t0 = time.perf_counter()
        engine.prefill(ids, 0)
        engine.stream.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def prefill_roles(engine: GpuEngine, n_tokens: int) -> dict[str, float]:
    """Seconds of each kernel role of a prefill of n_tokens (its launches for all layers and
    every chunk, each role's launches of a chunk captured in a graph of their own and replayed;
    MoE: the routing and grouping of the rows as of the last prefill)."""
    from pycalm.kernels.moe_rows import expert_matmul, moe_combine_rows
    from pycalm.kernels.prefill_attention import prefill_attention
    from pycalm.kernels.rows import embed_rows, moe_group, moe_route_rows, qkv_rows, rmsnorm_rows

    e, cfg, s = engine, engine.config, engine.stream
    eps = cfg.norm_eps
    p = Prefill(engine, engine.prefill_chunk)  # row buffers of its own (fit_layers spares them)

    def matmul(x: object, *args: object, **kwargs: object) -> None:  # the pass's products (Prefill.products)
        p.products(x.shape[0])(x, *args, **kwargs)

    roles = {  # role -> its launches for one layer and a chunk of rows b (formats: L.dtypes)
        "rmsnorm_rows": lambda L, c, b: (rmsnorm_rows(b.x, L.attn_norm, eps, b.xb, stream=s),
                                              rmsnorm_rows(b.x, L.ffn_norm, eps, b.xb, stream=s)),
        "matmul qkv": lambda L, c, b: matmul(b.xb, L.wqkv, b.qkv, L.dtypes["wqkv"], stream=s),
        "qkv_rows": lambda L, c, b: qkv_rows(b.qkv, L, e.rope_freqs, e.state, b.q, c, cfg, stream=s),
        "prefill_attention": lambda L, c, b: prefill_attention(b.q, c, e.state, b.att, cfg, stream=s,
                                                               scratch=p.tiles_scratch),
        "matmul wo+res": lambda L, c, b: matmul(b.att, L.wo, b.x, L.dtypes["wo"], stream=s, mode="residual"),
        "matmul gate": lambda L, c, b: matmul(b.xb, L.w1, b.h, L.dtypes["w1"], stream=s, mode="gate", w3=L.w3),
        "matmul w2+res": lambda L, c, b: matmul(b.h, L.w2, b.x, L.dtypes["w2"], stream=s, mode="residual"),
    }  # fmt: skip
    if cfg.n_experts:  # the MoE block instead of the dense FFN
        del roles["matmul gate"], roles["matmul w2+res"]
        roles.update({
            "moe_route_rows": lambda L, c, b: moe_route_rows(L, b.x, b.routes, cfg, stream=s),
            "moe_group": lambda L, c, b: moe_group(b.routes, b.experts, stream=s),
            "expert gate": lambda L, c, b: expert_matmul(b.xb, L.w1, b.h, L.dtypes["w1"], b.experts, b.routes,
                                                         stream=s, mode="gate", w3=L.w3),
            "expert w2": lambda L, c, b: expert_matmul(b.h, L.w2, b.y, L.dtypes["w2"], b.experts, b.routes,
                                                       stream=s),
            "moe_combine_rows": lambda L, c, b: moe_combine_rows(b.y, b.routes, b.x, stream=s),
        })  # fmt: skip

    def every_layer(launch: Callable, b: object) -> None:
        for L, cache in zip(e.layers, e.kv_caches, strict=True):
            launch(L, cache, b)

    out = dict.fromkeys(["embed_rows", *roles], 0.0)
    for pos0 in range(0, n_tokens, p.max_chunk):
        n = min(p.max_chunk, n_tokens - pos0)
        b = p.buffers.first(n)
        tokens = e.feed[pos0 : pos0 + n]
        for fn in roles.values():  # once uncaptured: what a launch sets up on first use (TMA maps)
            every_layer(fn, b)
        s.synchronize()
        graphs = {name: GraphStep(s, functools.partial(every_layer, fn, b)) for name, fn in roles.items()}
        graphs["embed_rows"] = GraphStep(
            s, functools.partial(embed_rows, e.tok_embeddings, tokens, b.x, e.embed_dtype, stream=s)
        )
        for name, g in graphs.items():
            out[name] += time_replays(e, lambda q, g=g: g, pos0, 3)  # sets state: pos0
    return out


def bench_prefill(
    shape: str,
    dtype: str,
    lengths: list[int],
    chunk: int,
    split: bool,
    first_tokens: int = 2048,
    kernels: str = "fast",
) -> dict:
    """tok/s and TFLOP/s of the prefill of each prompt length; time to the first token of a
    prompt of first_tokens (warm: the prefill of all but its last token, then the last token's
    step, which samples the first new one); with split, the time of each kernel role of a
    prefill of first_tokens."""
    full = config_for(shape, dtype, 4096)
    cfg = fit_layers(full, chunk, 4096)
    options = EngineOptions(prefill_chunk=chunk, kernels=kernels)
    engine = GpuEngine(RandomDeviceModel(cfg), seq_len=4096, kv_dtype="fp16", options=options)
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(3, cfg.vocab_size, max([*lengths, first_tokens]))]
    engine.prefill(ids[:128], 0)  # compiles every kernel
    cells = {}
    for n in lengths:
        t = time_prefill(engine, ids[:n], 2 if n > 512 else 3)
        flops = prefill_flops(cfg, n)
        cells[n] = dict(seconds=t, tok_s=n / t, tflops=flops / t / 1e12)
    greedy = SamplingParams(temperature=0.0)
    list(engine.generate(ids[:first_tokens], 0, 1, greedy))  # warm: the step's graph captured
    engine.stream.synchronize()
    t0 = time.perf_counter()
    list(engine.generate(ids[:first_tokens], 0, 1, greedy))
    ttft = time.perf_counter() - t0
    roles = prefill_roles(engine, first_tokens) if split and kernels == "fast" else None
    del engine
    gc.collect()
    cuda.current_context().deallocations.clear()  # the next cell's model needs the memory now
    layers = (
        f" ({cfg.n_layers} of {full.n_layers} layers: the rest do not fit)"
        if cfg.n_layers < full.n_layers
        else ""
    )
    return dict(shape=shape + layers, dtype=dtype, chunk=chunk, cells=cells, ttft=ttft, roles=roles, cfg=cfg)


def bench_invariant(shape: str, dtype: str, tokens: int, programmatic: bool | None = None) -> dict:
    """Decoding with EngineOptions.batch_invariant (every token step the multi-token forward's
    one-row pass and the classifier, captured, the token drawn on the device): tok/s of generate
    after a 16-token prompt, warm, from its first token to its last (decode, as llama-bench's tg
    counts it: the host's loop in, the prompt's pass out) and from the call (the prompt's pass
    in); and the ms of its step alone (the captured step replayed at positions 128.., as the token
    step's cells), so that what generate adds and what the graph's edges cost (programmatic:
    pycalm.gpu.graph's, as EngineOptions.programmatic) show apart."""
    cfg = fit_layers(config_for(shape, dtype, 4096), 16, 4096)
    options = EngineOptions(batch_invariant=True, prefill_chunk=16, programmatic=programmatic)
    engine = GpuEngine(RandomDeviceModel(cfg), seq_len=4096, kv_dtype="fp16", options=options)
    ids = [int(t) for t in np.random.default_rng(0).integers(3, cfg.vocab_size, 16)]
    greedy = SamplingParams(temperature=0.0)
    list(engine.generate(ids, 0, 4, greedy))  # compiles every kernel
    t0 = time.perf_counter()
    stamps = [time.perf_counter() for _ in engine.generate(ids, 0, tokens, greedy)]  # each token's arrival
    n, seconds = len(stamps), stamps[-1] - t0
    step = functools.partial(engine.graph, greedy)
    time_replays(engine, step, 128, 8)  # warm-up
    replay = time_replays(engine, step, 128, 32)
    edges = "programmatic" if engine.programmatic else "plain"
    del engine
    gc.collect()
    cuda.current_context().deallocations.clear()
    return {
        "tok_s": n / seconds,
        "decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]) if n > 1 else math.nan,
        "step_s": replay,
        "edges": edges,
    }


def bench_depths(
    shape: str, dtype: str, depths: list[int], kv_dtype: str, programmatic: bool | None = None
) -> dict:
    """Decode after D tokens of context, for each D of depths: tok/s of the 32 graph replays at
    positions D .. D + 31 (llama.cpp's `llama-bench -n 32 -d D`), in one engine whose context
    holds the longest, with the kv_dtype cache; and the bandwidth bound of each, one read of the
    weights and of the cache at the copy ceiling (the caller divides: bytes are returned)."""
    seq_len = max(depths) + 32
    cfg = config_for(shape, dtype, seq_len)
    options = EngineOptions(programmatic=programmatic)
    engine = GpuEngine(RandomDeviceModel(cfg), seq_len=seq_len, kv_dtype=kv_dtype, options=options)
    step = functools.partial(engine.graph, SamplingParams())  # pos -> the step's graph
    cells = {}
    for depth in depths:
        time_replays(engine, step, depth, 8)  # warm-up (and the span's capture)
        t = time_replays(engine, step, depth, 32)
        nbytes = np.mean(
            [
                sum(step_bytes(cfg, kv_dtype, p, engine.att_scratch.chunk).values())
                for p in range(depth, depth + 32)
            ]
        )
        cells[depth] = {"tok_s": 1 / t, "bytes": float(nbytes)}
    del engine
    gc.collect()
    cuda.current_context().deallocations.clear()
    return {"shape": shape, "dtype": dtype, "kv": kv_dtype, "cells": cells}


ROWS = (1, 2, 4, 8, 16, 32, 64)


def bench_rows(
    shape: str, dtype: str, rows: list[int], both: bool, programmatic: bool | None = None, pos: int = 128
) -> dict:
    """ms of a rows pass (GpuEngine.forward_rows: its captured graph replayed at position pos)
    for each row count, beside the token step's ms at the same position, in one engine; with
    `both`, every row count also with the tiled matmul (skinny's crossover); programmatic as
    EngineOptions.programmatic (both graphs' edges)."""
    seq_len = max(4096, pos + 2 * ROWS[-1])
    cfg = fit_layers(config_for(shape, dtype, seq_len), max(rows), seq_len)
    options = EngineOptions(programmatic=programmatic)
    engine = GpuEngine(RandomDeviceModel(cfg), seq_len=seq_len, kv_dtype="fp16", options=options)
    step = functools.partial(engine.graph, SamplingParams())
    step(0)
    time_replays(engine, step, 0, 16)  # warm-up
    token_step = time_replays(engine, step, pos, 64)
    rng = np.random.default_rng(0)
    prefill = engine._prefill_step()
    cells: dict[str, dict[int, float]] = {}
    for kind in ("skinny", "tile") if both else ("default",):
        if kind != "default":
            prefill.skinny_rows = dict.fromkeys(prefill.skinny_rows, 64 if kind == "skinny" else 0)
            prefill._rows_graphs.clear()
        cells[kind] = {}
        for n in rows:
            ids = [int(t) for t in rng.integers(3, cfg.vocab_size, n)]
            engine.forward_rows(ids, pos)  # compiles and captures the bucket's pass
            engine.forward_rows(ids, pos)
            bucket = next(b for b in ROWS if b >= n)
            graph = prefill._rows_graphs[(bucket, "logits", prefill.span_of(pos, bucket))]  # the logits pass
            s, e = cuda.event(timing=True), cuda.event(timing=True)
            s.record(engine.stream)
            for _ in range(20):
                graph.launch()
            e.record(engine.stream)
            e.synchronize()
            cells[kind][n] = cuda.event_elapsed_time(s, e) / 1e3 / 20
    del engine, prefill
    gc.collect()
    cuda.current_context().deallocations.clear()
    return dict(shape=shape, dtype=dtype, token_step=token_step, cells=cells, layers=cfg.n_layers, pos=pos)


def print_rows(results: list[dict], rows: list[int]) -> None:
    pos = results[0]["pos"] if results else 128
    print(f"\nrows pass (GpuEngine.forward_rows, graph replay at position {pos}): ms, and x the token step")
    print(f"| shape | weights | kernels | token step | {' | '.join(f'{n} rows' for n in rows)} |")
    print("|---|---|---|---|" + "---|" * len(rows))
    for r in results:
        for kind, cells in r["cells"].items():
            t1 = r["token_step"]
            body = " | ".join(f"{1e3 * cells[n]:.2f} ({cells[n] / t1:.2f}x)" for n in rows)
            print(f"| {r['shape']} | {r['dtype']} | {kind} | {1e3 * t1:.2f} | {body} |")


def print_prefill(results: list[dict], lengths: list[int]) -> None:
    from pycalm.kernels.prefill_attention import prefill_attention_flops

    print(f"\nprefill (tok/s, TFLOP/s, % of the {TENSOR_PEAK:.0f} TFLOP/s dense fp16 tensor-core peak)")
    head = " | ".join(f"T={n}" for n in lengths)
    print(f"| shape | weights | chunk | {head} | first token @2048 |")
    print("|---|---|---|" + "---|" * len(lengths) + "---|")
    for r in results:
        cells = " | ".join(
            f"{c['tok_s']:,.0f} tok/s, {c['tflops']:.0f} TF ({100 * c['tflops'] / TENSOR_PEAK:.0f}%)"
            for c in r["cells"].values()
        )
        print(f"| {r['shape']} | {r['dtype']} | {r['chunk']} | {cells} | {1e3 * r['ttft']:.0f} ms |")
    for r in results:
        if not r["roles"]:
            continue
        cfg, total = r["cfg"], sum(r["roles"].values())
        print(f"\n{r['shape']} {r['dtype']}, 2048 tokens in chunks of {r['chunk']}: the kernels alone {1e3 * total:.1f} ms"
              f" (prefill {1e3 * r['cells'].get(2048, {}).get('seconds', float('nan')):.1f} ms)")  # fmt: skip
        print("| kernel | ms | % of the kernels | TFLOP/s |")
        print("|---|---|---|---|")
        mats = layer_weights(cfg)
        for name, t in r["roles"].items():
            tf = ""
            if name in mats:
                n_w, k_w = mats[name]
                tf = f"{2 * 2048 * n_w * k_w * cfg.n_layers / t / 1e12:.0f}"
            elif name == "prefill_attention":
                tf = f"{cfg.n_layers * prefill_attention_flops(2048, 0, cfg) / t / 1e12:.1f}"
            print(f"| {name} | {1e3 * t:.1f} | {100 * t / total:.0f}% | {tf} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama3-8b,tinyllama-1.1b")
    ap.add_argument("--dtypes", default="fp16,fp8,gf4")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument(
        "--plain",
        action="store_true",
        help="plain graph edges only (default: programmatic edges where the GPU has them, and the"
        " plain-edge step timed alongside)",
    )
    ap.add_argument("--prefill", action="store_true", help="also time the prefill (the multi-token forward)")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode cells (with --prefill)")
    ap.add_argument(
        "--invariant-decode",
        action="store_true",
        help="only time generate with batch-invariant decoding (every token a one-row multi-token pass)",
    )
    ap.add_argument("--lengths", default=",".join(map(str, PREFILL_LENGTHS)), help="prefill prompt lengths")
    ap.add_argument(
        "--rows",
        nargs="?",
        const=",".join(map(str, ROWS)),
        help="only time the rows pass (GpuEngine.forward_rows) at these row counts beside the token step",
    )
    ap.add_argument(
        "--rows-both", action="store_true", help="with --rows: skinny and tiled products at every count"
    )
    ap.add_argument(
        "--tiles-unsplit",
        action="store_true",
        help="with --rows: the prefill attention's launches unsplit (no scratch: a block a kv head's whole key range)",
    )
    ap.add_argument(
        "--rows-at",
        type=int,
        default=128,
        help="with --rows: the passes' and the token step's position (a chat turn or drafts deep in the context)",
    )
    ap.add_argument(
        "--attention-blocks",
        type=int,
        help="the decode attention's blocks a launch at most (pycalm.kernels.attention.TARGET_BLOCKS; at most"
        " the engine's 512): fewer, longer splits, and a shorter merge",
    )
    ap.add_argument(
        "--split-attention-rows",
        type=int,
        help="with --rows: passes of up to N rows take the split-K attention (the engine's:"
        " pycalm.gpu.prefill.SPLIT_ATTENTION_ROWS)",
    )
    ap.add_argument(
        "--chunks",
        default=str(EngineOptions().prefill_chunk),
        help="prefill chunk sizes to time (rows a pass; default: the engine's)",
    )
    ap.add_argument(
        "--first-tokens", type=int, default=2048, help="prompt length of the time-to-first-token cell"
    )
    ap.add_argument(
        "--split", default="llama3-8b:fp16", help="SHAPE:DTYPE cells whose prefill is timed kernel by kernel"
    )
    ap.add_argument(
        "--kernels",
        choices=("fast", "simple"),
        default="fast",
        help="the engine's kernels (EngineOptions.kernels); simple: no per-kernel split",
    )
    ap.add_argument(
        "--depths",
        help="decode after these contexts (e.g. 0,4000,8000,16000,32000): tok/s of 32 steps each, and %% of"
        " the bandwidth bound (one read of the weights and the cache at the copy ceiling)",
    )
    ap.add_argument("--kv", default="fp16", help="KV cache dtypes of the --depths cells (fp16, fp8)")
    ap.add_argument(
        "--no-wgmma",
        action="store_true",
        help="prompt passes take the mma.sync tile, not pycalm.kernels.wgmma_matmul (the numbers before it)",
    )
    args = ap.parse_args()
    print(f"GPU: {cuda.get_current_device().name}", flush=True)
    if args.no_wgmma:
        import pycalm.kernels.wgmma_matmul

        wgmma = pycalm.kernels.wgmma_matmul
        wgmma.WGMMA_MIN_ROWS = dict.fromkeys(wgmma.WGMMA_MIN_ROWS, 1 << 30)  # no pass is that long
    if args.attention_blocks:
        import pycalm.kernels.attention

        pycalm.kernels.attention.TARGET_BLOCKS = min(
            args.attention_blocks, pycalm.kernels.attention.TARGET_BLOCKS
        )
    if args.split_attention_rows is not None:
        import pycalm.gpu.prefill

        pycalm.gpu.prefill.SPLIT_ATTENTION_ROWS = args.split_attention_rows
    if args.tiles_unsplit:
        import pycalm.kernels.prefill_attention

        pycalm.kernels.prefill_attention.prefill_attention_scratch = lambda cfg, stream=0: None
    if args.rows:
        counts = [int(n) for n in args.rows.split(",")]
        found = []
        for shape in args.shapes.split(","):
            for dtype in args.dtypes.split(","):
                r = bench_rows(
                    shape, dtype, counts, args.rows_both, False if args.plain else None, args.rows_at
                )
                found.append(r)
                print_rows([r], counts)
        print_rows(found, counts)
        return
    if args.depths:
        depths = [int(n) for n in args.depths.split(",")]
        ceiling, how = copy_ceiling_gbs()
        print(f"copy ceiling {ceiling:,.0f} GB/s ({how})", flush=True)
        print("| weights | KV | " + " | ".join(f"D = {d:,}" for d in depths) + " |")
        print("|---|---|" + "---|" * len(depths))
        for shape in args.shapes.split(","):
            for dtype in args.dtypes.split(","):
                for kv in args.kv.split(","):
                    r = bench_depths(shape, dtype, depths, kv, False if args.plain else None)
                    cells = " | ".join(
                        f"{c['tok_s']:.0f} ({100 * c['tok_s'] * c['bytes'] / (ceiling * 1e9):.0f}%)"
                        for c in r["cells"].values()
                    )
                    print(f"| {shape} {dtype} | {kv} | {cells} |", flush=True)
        return
    if args.invariant_decode:
        for shape in args.shapes.split(","):
            for dtype in args.dtypes.split(","):
                # the engine's edges, then plain ones beside them where those were programmatic
                r = bench_invariant(shape, dtype, args.tokens, False if args.plain else None)
                runs = (
                    [r] if r["edges"] == "plain" else [r, bench_invariant(shape, dtype, args.tokens, False)]
                )
                for r in runs:
                    print(
                        f"batch-invariant decode {shape} {dtype}: {r['decode_tok_s']:.0f} tok/s after the first token,"
                        f" {r['tok_s']:.0f} with the prompt ({args.tokens} tokens); its step alone"
                        f" {1e3 * r['step_s']:.2f} ms ({r['edges']} edges)",
                        flush=True,
                    )
        return
    if args.prefill:
        lengths = [int(n) for n in args.lengths.split(",")]
        prefill = []
        for shape in args.shapes.split(","):
            for dtype in args.dtypes.split(","):
                for chunk in map(int, args.chunks.split(",")):
                    split = f"{shape}:{dtype}" in args.split.split(",") and chunk == int(
                        args.chunks.split(",")[0]
                    )
                    try:
                        r = bench_prefill(
                            shape, dtype, lengths, chunk, split, args.first_tokens, args.kernels
                        )
                    except Exception as e:  # noqa: BLE001 - a format the engine does not take yet
                        print(
                            f"prefill {shape} {dtype} chunk {chunk}: failed: {type(e).__name__}: {e}",
                            flush=True,
                        )
                        gc.collect()
                        cuda.current_context().deallocations.clear()
                        continue
                    prefill.append(r)
                    cells = "  ".join(
                        f"T={n} {c['tok_s']:,.0f} tok/s {c['tflops']:.0f} TF" for n, c in r["cells"].items()
                    )
                    print(
                        f"prefill {shape} {dtype} chunk {chunk}: {cells}; first token @2048 {1e3 * r['ttft']:.0f} ms",
                        flush=True,
                    )
        print_prefill(prefill, lengths)
        if args.no_decode:
            if args.json:
                Path(args.json).write_text(
                    json.dumps([{k: v for k, v in r.items() if k != "cfg"} for r in prefill], indent=1)
                )
            return
    results = []
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            r = bench_one(shape, dtype, args.tokens, False if args.plain else None, args.kernels)
            results.append(r)
            roles = "  ".join(f"{k} {v[1]:,.0f}" for k, v in r["roles"].items())
            moe = f" (bytes of the {r['experts']} active a token)" if r["experts"] else ""
            if r["tok_s_plain"]:
                moe += f" [programmatic edges; plain edges {r['tok_s_plain']:.0f} tok/s]"
            print(
                f"{shape} {dtype}: {r['tok_s']:.0f} tok/s {r['gbs']:,.0f} GB/s{moe}; @4000 {r['tok_s_4000']:.0f} tok/s; per kernel GB/s: {roles}",
                flush=True,
            )
    ceiling, how = copy_ceiling_gbs()  # after the timed cells (see copy_ceiling_gbs)
    print(f"copy ceiling: {ceiling:,.0f} GB/s ({how})", flush=True)
    for r in results:
        r["ceiling"] = ceiling
    print()
    print(
        f"| shape | weights | tok/s (first {args.tokens}) | GB/s | % of copy | tok/s @4000 | @4000 vs first | calm tok/s | vs calm |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        calm = r["calm"]
        vs = f"{r['tok_s'] / calm:.2f}x" if calm else "-"
        # an H100 figure is shown with its GPU and not compared
        calm_txt = str(calm) if calm else f"~{r['calm_h100']} (H100)" if r["calm_h100"] else "-"
        shape = f"{r['shape']} ({r['experts']} active)" if r["experts"] else r["shape"]
        print(
            f"| {shape} | {r['dtype']} | {r['tok_s']:.0f} | {r['gbs']:,.0f} | {100 * r['gbs'] / r['ceiling']:.0f}% | "
            f"{r['tok_s_4000']:.0f} | {100 * (r['tok_s_4000'] / r['tok_s'] - 1):+.0f}% | {calm_txt} | {vs} |"
        )
    if any(r["experts"] for r in results):
        print("\nMoE rows: GB/s counts the bytes a token reads, the active experts' weights only.")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                results, indent=1, default=lambda o: None if isinstance(o, float) and math.isnan(o) else o
            )
        )


if __name__ == "__main__":
    main()
