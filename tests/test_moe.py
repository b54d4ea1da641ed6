"""Mixtral routing: the engines against an independent NumPy forward pass written here.

What Mixtral's sparse MoE block computes (transformers' MixtralSparseMoeBlock, reread in NumPy):
  router logits = G xb  (G: (n_experts, dim));  probs = softmax over ALL experts;
  the k largest probs chosen, renormalised to sum to 1 (= a softmax over the chosen logits);
  out = sum over chosen e of weight_e * w2_e (silu(w1_e xb) * w3_e xb).
`numpy_forward` below is the whole model written from the Hugging Face source tensors (float64,
rotate-half RoPE as transformers applies it, softmax over all experts then top-k, as
transformers does), sharing no code with pycalm: it checks the converter's expert stacking and
q/k permutation as much as the engine's routing.

The engines hold fp16 matrices, so the independent forward uses the same fp16-rounded matrices
(the router stays float32, as the converter keeps it). With a float32 KV cache the only
difference left is float32 against float64 arithmetic; with the fp16 KV cache the independent
forward rounds keys and values to fp16 at the same point.

ENGINES lists the engines under test, the GPU engine (pycalm.gpu.engine.GpuEngine) among them: on the
GPU (PYCALM_TEST_GPU=1) on every case; under the CUDA simulator in CI (about a minute a token
step here) on the crafted routing of test_mixtral_forced_experts only, over SIM_GPU_TOKENS.

The kernels of the MoE block (pycalm.kernels.moe: routing, expert slots) are tested against
their NumPy references in the middle section.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from device_weights import to_device
from gpu import GPU, gpu_only
from numba import cuda
from tiny_models import TinyModel, make_hf_llama, write_safetensors

from pycalm.convert.main import convert
from pycalm.cpu.engine import CpuEngine
from pycalm.cpu.reference import (
    matvec_x_ref,
    moe_ffn_gate_ref,
    moe_matvec_residual_ref,
    moe_route_ref,
    rmsnorm_ref,
    silu_ref,
)
from pycalm.kernels.matvec import XCHUNK
from pycalm.kernels.moe import Route, moe_ffn_gate, moe_matvec_residual, moe_route
from pycalm.model import formats
from pycalm.model.loader import open_model

N_EXPERTS = 4
TOP_K = 2
TOKENS = [5, 17, 3, 42, 9, 30]

# (engine, KV cache dtype, relative L2 tolerance on each position's logits). Measured on the CPU
# engine: 4.0e-7 (fp32 KV) and 4.4e-7 (fp16 KV; the independent forward rounds its keys and values
# to fp16 as the cache does, and not doing so costs 1e-3): float32 vs float64 arithmetic only.
# The GPU engine (fp16 KV; it has no float32 cache): measured 2.6e-7 / 3.5e-7 on the first two
# positions under the simulator (the CPU engine: 3.1e-7 / 2.2e-7), float32 arithmetic in another
# order only, so the CPU engine's bound holds for it too.
GPU_ONLY = gpu_only("simulator time")
ENGINES = [("cpu", "fp32", 1e-5), ("cpu", "fp16", 1e-5), ("gpu", "fp16", 1e-5)]
# positions the GPU engine runs under the simulator: the first (whose routing at layer 0 the
# forced-experts test crafts) and the second (a second KV row, routes that differ from the first)
SIM_GPU_TOKENS = 2


def tokens_for(kind: str) -> list[int]:
    return TOKENS if kind == "cpu" or GPU else TOKENS[:SIM_GPU_TOKENS]


def make_engine(kind: str, model: object, seq_len: int, kv: str) -> object:
    if kind == "cpu":
        return CpuEngine(model, seq_len=seq_len, kv_dtype=kv)
    from pycalm.gpu.engine import GpuEngine

    return GpuEngine(model, seq_len=seq_len, kv_dtype=kv)


# ---------------------------------------------------------------------------------------------
# The independent forward pass (Hugging Face layout and conventions, float64)


def fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


def held_weights(tiny: TinyModel) -> dict[str, np.ndarray]:
    """The source tensors as the fp16 engines hold them: matrices fp16-rounded, the router,
    norms (and biases) float32, all as float64 arrays."""
    out = {}
    for name, w in tiny.weights.items():
        is_router = name.endswith("block_sparse_moe.gate.weight")
        out[name] = fp16(w) if w.ndim == 2 and not is_router else w.astype(np.float64)
    return out


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x) + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def rope(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """transformers' rotate-half RoPE on (n_heads, head_dim): pairs (i, i + head_dim/2)."""
    hd = x.shape[-1]
    freqs = pos * theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    cos, sin = np.cos(np.concatenate([freqs, freqs])), np.sin(np.concatenate([freqs, freqs]))
    rot = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], axis=-1)
    return x * cos + rot * sin


def moe_block(w: dict[str, np.ndarray], prefix: str, xb: np.ndarray, k: int) -> tuple[np.ndarray, list]:
    """-> (block output, [(expert, weight), ...] in descending weight order)."""
    logits = w[prefix + "gate.weight"] @ xb
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    chosen = np.argsort(-probs, kind="stable")[:k]
    weights = probs[chosen] / probs[chosen].sum()
    out = np.zeros_like(xb)
    for e, g in zip(chosen, weights, strict=True):
        ex = f"{prefix}experts.{e}."
        h = silu(w[ex + "w1.weight"] @ xb) * (w[ex + "w3.weight"] @ xb)
        out += g * (w[ex + "w2.weight"] @ h)
    return out, list(zip(chosen.tolist(), weights.tolist(), strict=True))


def numpy_forward(
    w: dict[str, np.ndarray], cfg: dict, tokens: list[int], kv16: bool
) -> tuple[np.ndarray, list[list]]:
    """Logits (len(tokens), vocab) of the whole causal sequence, and the routing of every
    (layer, position): routes[layer][pos] = [(expert, weight), ...]."""
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim, eps, theta = cfg["hidden_size"], cfg["rms_norm_eps"], cfg["rope_theta"]
    hd = dim // n_heads
    x = np.stack([w["model.embed_tokens.weight"][t] for t in tokens])  # (T, dim)
    T = len(tokens)
    routes = []
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        xb = np.stack([rmsnorm(r, w[p + "input_layernorm.weight"], eps) for r in x])
        q = (xb @ w[p + "self_attn.q_proj.weight"].T).reshape(T, n_heads, hd)
        k = (xb @ w[p + "self_attn.k_proj.weight"].T).reshape(T, n_kv, hd)
        v = (xb @ w[p + "self_attn.v_proj.weight"].T).reshape(T, n_kv, hd)
        q = np.stack([rope(q[t], t, theta) for t in range(T)])
        k = np.stack([rope(k[t], t, theta) for t in range(T)])
        if kv16:  # the KV cache stores fp16
            k, v = fp16(k), fp16(v)
        att = np.zeros((T, n_heads, hd))
        for t in range(T):
            for h in range(n_heads):
                g = h // (n_heads // n_kv)
                s = k[: t + 1, g] @ q[t, h] / np.sqrt(hd)
                pr = np.exp(s - s.max())
                att[t, h] = (pr / pr.sum()) @ v[: t + 1, g]
        x = x + att.reshape(T, -1) @ w[p + "self_attn.o_proj.weight"].T
        layer_routes = []
        for t in range(T):
            xb = rmsnorm(x[t], w[p + "post_attention_layernorm.weight"], eps)
            out, route = moe_block(w, p + "block_sparse_moe.", xb, cfg["num_experts_per_tok"])
            x[t] = x[t] + out
            layer_routes.append(route)
        routes.append(layer_routes)
    x = np.stack([rmsnorm(r, w["model.norm.weight"], eps) for r in x])
    return x @ w["lm_head.weight"].T, routes


def layer0_moe_input(w: dict[str, np.ndarray], cfg: dict, token: int) -> np.ndarray:
    """xb entering layer 0's MoE block at position 0 (attention over one position is its value)."""
    n_heads, n_kv, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    p = "model.layers.0."
    x = w["model.embed_tokens.weight"][token]
    v = w[p + "self_attn.v_proj.weight"] @ rmsnorm(x, w[p + "input_layernorm.weight"], eps)
    att = np.repeat(v.reshape(n_kv, -1), n_heads // n_kv, axis=0).reshape(-1)
    x = x + w[p + "self_attn.o_proj.weight"] @ att
    return rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)


# ---------------------------------------------------------------------------------------------


def tiny_mixtral(tmp_path: Path, name: str = "mixtral", seed: int = 0) -> TinyModel:
    return make_hf_llama(
        tmp_path,
        arch="mixtral",
        dim=32,
        hidden_dim=48,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=64,
        n_experts=N_EXPERTS,
        seed=seed,
        name=name,
    )


def rewrite(tiny: TinyModel, changes: dict[str, np.ndarray]) -> None:
    """Replace source tensors (the folder is float32) and keep tiny.weights in step."""
    tiny.weights.update({k: v.astype(np.float32) for k, v in changes.items()})
    write_safetensors(tiny.path / "model.safetensors", {k: ("F32", v) for k, v in tiny.weights.items()})


def converted(tiny: TinyModel, tmp_path: Path) -> object:
    return open_model(convert(tiny.path, tmp_path / f"{tiny.path.name}.pycalm", "fp16", progress=False))


def engine_logits(kind: str, model: object, kv: str, tokens: list[int]) -> np.ndarray:
    engine = make_engine(kind, model, len(tokens), kv)
    return np.stack([engine.logits(t, pos) for pos, t in enumerate(tokens)]).astype(np.float64)


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    err = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert err.max() < rtol, f"relative error per position {err}"
    assert (got.argmax(-1) == want.argmax(-1)).all()


# ---------------------------------------------------------------------------------------------
# moe_route_ref on crafted router logits


def test_route_ref_crafted_logits():
    # x = first unit vector: the router logits are exactly column 0 of the gate
    logits = np.array([0.5, 3.0, -1.0, 2.0, 2.9, -4.0, 0.0, 1.0], np.float32)
    gate = np.zeros((8, 5), np.float32)
    gate[:, 0] = logits
    x = np.eye(5, dtype=np.float32)[0]
    ids, w = moe_route_ref(gate, x, 2)
    assert ids.tolist() == [1, 4]  # descending logit order
    e = np.exp([3.0 - 3.0, 2.9 - 3.0])
    np.testing.assert_allclose(w, e / e.sum(), rtol=1e-6)
    # softmax over the chosen == softmax over all experts, then renormalised over the top k
    p = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    np.testing.assert_allclose(w, p[[1, 4]] / p[[1, 4]].sum(), rtol=1e-6)
    ids, w = moe_route_ref(gate, x, 1)
    assert ids.tolist() == [1] and w.tolist() == [1.0]
    ids, w = moe_route_ref(gate, x, 8)
    assert ids.tolist() == [1, 4, 3, 7, 0, 6, 2, 5]
    np.testing.assert_allclose(w, p[ids], rtol=1e-6)
    # the softmax must not overflow on large logits
    ids, w = moe_route_ref(gate * 100, x, 2)
    assert ids.tolist() == [1, 4] and np.isfinite(w).all()
    np.testing.assert_allclose(w, [1 / (1 + np.exp(-10.0)), 1 / (1 + np.exp(10.0))], rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# the GPU kernels (the CUDA simulator in CI) against the NumPy references


def route_gpu(gate: np.ndarray, x: np.ndarray, nw: np.ndarray, eps: float, k: int, threads: int):
    route = Route(cuda.to_device(np.full(k, -1, np.int32)), cuda.to_device(np.full(k, np.nan, np.float32)))
    layer = SimpleNamespace(moe_gate=cuda.to_device(gate), ffn_norm=cuda.to_device(nw))
    cfg = SimpleNamespace(n_experts_active=k, norm_eps=eps)
    moe_route(layer, cuda.to_device(x), route, cfg, stream=cuda.default_stream(), threads=threads)
    cuda.synchronize()
    return route.ids.copy_to_host(), route.weights.copy_to_host()


@pytest.mark.parametrize(
    "dim,n_experts,k,threads",
    # odd sizes; 32 threads: one warp; 64 and 96: the warps' partial sums, rows not a multiple of
    # the block; 32 experts: the most the kernel takes
    [(72, 8, 2, 64), (40, 5, 3, 32), (136, 8, 8, 96), (24, 32, 4, 64)],
)
def test_route_kernel_matches_ref(dim, n_experts, k, threads):
    rng = np.random.default_rng(dim * 100 + n_experts)
    eps = 1e-5
    gate = rng.standard_normal((n_experts, dim)).astype(np.float32)
    x = (2 * rng.standard_normal(dim)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, dim).astype(np.float32)
    xn = rmsnorm_ref(x, nw, eps)
    want_ids, want_w = moe_route_ref(gate, xn, k)
    ids, w = route_gpu(gate, x, nw, eps, k, threads)
    # the logits differ from the reference's by float32 summation order (and where the norm's
    # factor is applied): a few roundings of |G| |xn|; 1e-6 of it bounds that for these lengths
    dl = 1e-6 * np.max(np.abs(gate) @ np.abs(xn))
    # the seeds give picks apart by more than that (else the comparison of ids would be a tie)
    logits = np.sort(gate.astype(np.float64) @ xn)[::-1]
    gaps = -np.diff(logits[: min(k + 1, n_experts)])
    assert gaps.min() > 4 * dl, gaps
    assert ids.tolist() == want_ids.tolist()
    # softmax over the picks: |d w_j| <= w_j (|d l_j| + max |d l|) <= 2 max |d l|
    np.testing.assert_allclose(w, want_w, rtol=0, atol=2 * dl + 1e-7)
    assert abs(float(w.sum()) - 1.0) < 1e-6


def test_route_kernel_ties():
    """Equal router logits: the lower expert index is picked first, as moe_route_ref does. The
    arithmetic is exact on both sides (x all ones and eps 0: rmsnorm(x) is x; the gate weights
    are multiples of 2**-7 with exact sums), so the ties are ties for both."""
    rng = np.random.default_rng(3)
    dim = 72
    gate = (rng.integers(-1, 2, (8, dim)) / 128).astype(np.float32)  # logits within +-0.5625
    gate[[1, 6]] = 1 / 32  # experts 1 and 6 tie for the largest logit, 2.25
    gate[[2, 5]] = 1 / 64  # experts 2 and 5 for the next, 1.125
    x, nw = np.ones(dim, np.float32), np.ones(dim, np.float32)
    want_ids, want_w = moe_route_ref(gate, x, 4)
    assert want_ids.tolist() == [1, 6, 2, 5]
    ids, w = route_gpu(gate, x, nw, 0.0, 4, 64)
    assert ids.tolist() == [1, 6, 2, 5]
    assert w[0] == w[1] and w[2] == w[3] and w[1] > w[2]
    np.testing.assert_allclose(w, want_w, rtol=0, atol=1e-7)
    ids, _ = route_gpu(gate, x, nw, 0.0, 3, 64)
    assert ids.tolist() == [1, 6, 2]  # a tie at the k-th place goes to the lower index too


def expert_stack(rng, n_experts: int, rows: int, cols: int, dtype: str, chosen: list[int]) -> np.ndarray:
    """A stored (n_experts, rows, cols) stack of random experts (q8 / q4: a Quantized of stacked
    codes and scales); the experts not in `chosen` are all 0x7F bytes (q4: its scales; q8: 0xFF
    bytes of its scales): NaN in every format (fp16 0x7F7F, e5m2 0x7F, gf4 a NaN group scale, q8 a
    NaN float32 scale, q4 NaN fp16 steps and offsets), so an output that read any of their weights
    is not finite."""
    ws = [
        formats.encode(rng.standard_normal((rows, cols)).astype(np.float32), dtype) for _ in range(n_experts)
    ]
    if dtype in formats.QUANTIZED:
        w = formats.Quantized(np.stack([e.codes for e in ws]), np.stack([e.scales for e in ws]))
    else:
        w = np.stack(ws)
    for e in set(range(n_experts)) - set(chosen):
        (w.scales if dtype in formats.QUANTIZED else w)[e].view(np.uint8)[...] = (
            0xFF if dtype == "q8" else 0x7F
        )
        assert np.isnan(formats.decode(expert(w, e), dtype)).all()
    return w


def expert(w: object, e: int) -> object:
    """Expert e's stored matrix of a stack (q8 / q4: its codes and scales)."""
    return formats.Quantized(w.codes[e], w.scales[e]) if isinstance(w, formats.Quantized) else w[e]


def decoded_stack(w: object, dtype: str) -> np.ndarray:
    """The (n_experts, rows, cols) float32 weights of a stored stack."""
    n = (w.codes if isinstance(w, formats.Quantized) else w).shape[0]
    return np.stack([formats.decode(expert(w, e), dtype) for e in range(n)])


# (dtype, n_experts, hidden_dim, dim): (32, 64) takes the wide (16-byte load) kernels of every
# dtype, (24, 40) the narrow fp8 / gf4 / q8 ones (rows of 40 and 24 columns are not whole
# 16-byte loads; fp16 rows of them are; q4 rows always are). Small, because the simulator's cost
# is per block (a Python thread per CUDA thread): about 0.3 s a block of 64 threads.
MOE_CASES = [
    ("fp16", 4, 32, 64),
    ("fp8", 4, 32, 64),
    ("gf4", 4, 32, 64),
    ("fp8", 4, 24, 40),
    ("gf4", 4, 24, 40),
    ("q8", 4, 32, 64),
    ("q8", 4, 24, 40),
    ("q4", 4, 32, 64),
]


@pytest.mark.parametrize("dtype,n_experts,hidden_dim,dim", MOE_CASES)
def test_expert_kernels_match_ref(dtype, n_experts, hidden_dim, dim):
    """moe_ffn_gate and moe_matvec_residual on experts 3 and 1 of 4 (route ids in device memory):
    values against float64 products of the decoded weights, and the other experts never read."""
    rng = np.random.default_rng(hidden_dim + dim)
    eps, chosen = 1e-5, [3, 1]
    w1, w3 = (expert_stack(rng, n_experts, hidden_dim, dim, dtype, chosen) for _ in range(2))
    w2 = expert_stack(rng, n_experts, dim, hidden_dim, dtype, chosen)
    x = (2 * rng.standard_normal(dim)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, dim).astype(np.float32)
    ids, gw = np.array(chosen, np.int32), np.array([0.7, 0.3], np.float32)
    k = len(chosen)
    route = Route(cuda.to_device(ids), cuda.to_device(gw))
    layer = SimpleNamespace(
        w1=to_device(w1), w3=to_device(w3), w2=to_device(w2), ffn_norm=cuda.to_device(nw),
        dtypes={"w1": dtype, "w3": dtype, "w2": dtype},
    )  # fmt: skip
    cfg = SimpleNamespace(n_experts_active=k, norm_eps=eps)
    h = cuda.to_device(np.full(k * hidden_dim, np.nan, np.float32))
    moe_ffn_gate(layer, cuda.to_device(x), h, route, cfg, stream=cuda.default_stream())
    cuda.synchronize()
    got = h.copy_to_host().astype(np.float64)
    assert np.isfinite(got).all(), "an unchosen expert's (NaN) weights were read, or h not written"
    # float64 want and the tolerance of tests/test_matvec.py's test_ffn_gate, per slot
    xn = rmsnorm_ref(x, nw, eps).astype(np.float64)
    xq = matvec_x_ref(xn, dtype).astype(np.float64)  # the x the kernels multiply (q8, q4: 16 bits)
    for s, e in enumerate(chosen):
        w1d, w3d = (
            formats.decode(expert(w1, e), dtype).astype(np.float64),
            formats.decode(expert(w3, e), dtype).astype(np.float64),
        )
        a, b = w1d @ xq, w3d @ xq
        ta, tb = 1e-5 * (np.abs(w1d) @ np.abs(xn)), 1e-5 * (np.abs(w3d) @ np.abs(xn))
        want = gw[s] * silu_ref(a) * b
        tol = gw[s] * (1.1 * ta * (np.abs(b) + tb) + (np.abs(a) + ta) * tb) + 1e-6 * np.abs(want)
        part = got[s * hidden_dim : (s + 1) * hidden_dim]
        assert np.all(np.abs(part - want) <= tol), f"slot {s}: max err {np.max(np.abs(part - want)):.3g}"
    # the NumPy reference agrees with it (float32, the reference's own order)
    w1f, w3f = decoded_stack(w1, dtype), decoded_stack(w3, dtype)
    ref_h = moe_ffn_gate_ref(w1f, w3f, xq.astype(np.float32), "fp32", ids, gw)
    np.testing.assert_allclose(ref_h, got, rtol=1e-4, atol=1e-4 * np.abs(got).max())

    # x += W2_3 h[0] + W2_1 h[1], with h as the gate wrote it
    hv = h.copy_to_host()
    r0 = rng.standard_normal(dim).astype(np.float32)
    r = cuda.to_device(r0)
    moe_matvec_residual(layer, h, r, route, cfg, stream=cuda.default_stream())
    cuda.synchronize()
    got = r.copy_to_host().astype(np.float64)
    assert np.isfinite(got).all(), "an unchosen expert's (NaN) weights were read"
    want, scale = r0.astype(np.float64), np.abs(r0).astype(np.float64)
    hq = np.concatenate([matvec_x_ref(hv[s * hidden_dim : (s + 1) * hidden_dim], dtype) for s in range(k)])
    for s, e in enumerate(chosen):
        w2d, hs = (
            formats.decode(expert(w2, e), dtype).astype(np.float64),
            hq[s * hidden_dim : (s + 1) * hidden_dim].astype(np.float64),
        )
        want = want + w2d @ hs
        scale = scale + np.abs(w2d) @ np.abs(hs)
    assert np.all(np.abs(got - want) <= 1e-5 * scale), (
        f"max err / scale {np.max(np.abs(got - want) / scale):.3g}"
    )
    ref_r = moe_matvec_residual_ref(decoded_stack(w2, dtype), hq.astype(np.float32), "fp32", ids, r0)
    assert np.all(np.abs(ref_r - want) <= 1e-5 * scale)


@pytest.mark.skipif(GPU, reason="the simulator's threads (on a GPU: test_expert_kernels_match_ref)")
def test_expert_kernels_match_ref_under_racing_threads(monkeypatch):
    """The q8 case of test_expert_kernels_match_ref with every NumPy allocation handing the GIL
    over first, so that the simulator's threads interleave where a block's shared and local
    arrays are made: every thread of a block must get the same shared array of a call site (two
    threads that made two would each miss the other's writes), whatever the interleaving."""
    empty = np.empty

    def yielding_empty(*args: object, **kwargs: object) -> np.ndarray:
        time.sleep(0)  # another simulated thread runs here
        return empty(*args, **kwargs)

    monkeypatch.setattr(np, "empty", yielding_empty)
    test_expert_kernels_match_ref("q8", 4, 32, 64)


@pytest.mark.parametrize("dtype", ["fp16", "gf4", "q4"])
def test_expert_residual_chunked(dtype):
    """hidden_dim above XCHUNK (Mixtral's 14336): each slot's h is staged in two chunks."""
    rng = np.random.default_rng(11)
    n_experts, dim, chosen = 3, 3, [2, 0]
    hidden_dim = XCHUNK + (160 if dtype == "q4" else 144)  # q4: whole groups of 32
    w2 = expert_stack(rng, n_experts, dim, hidden_dim, dtype, chosen)
    hv = rng.standard_normal(2 * hidden_dim).astype(np.float32)
    r0 = rng.standard_normal(dim).astype(np.float32)
    r = cuda.to_device(r0)
    route = Route(cuda.to_device(np.array(chosen, np.int32)), cuda.to_device(np.ones(2, np.float32)))
    cfg = SimpleNamespace(n_experts_active=2)
    moe_matvec_residual(
        SimpleNamespace(w2=to_device(w2), dtypes={"w2": dtype}),
        cuda.to_device(hv),
        r,
        route,
        cfg,
        stream=cuda.default_stream(),
    )
    cuda.synchronize()
    got = r.copy_to_host().astype(np.float64)
    want, scale = r0.astype(np.float64), np.abs(r0).astype(np.float64)
    for s, e in enumerate(chosen):
        w2d, hs = (
            formats.decode(expert(w2, e), dtype).astype(np.float64),
            hv[s * hidden_dim : (s + 1) * hidden_dim],
        )
        want, scale = want + w2d @ hs, scale + np.abs(w2d) @ np.abs(hs)
    assert np.isfinite(got).all()
    assert np.all(np.abs(got - want) <= 1e-5 * scale)


# ---------------------------------------------------------------------------------------------
# whole tiny Mixtral: engines vs the independent forward


@pytest.mark.parametrize(
    "kind,kv,rtol", [pytest.param(*e, marks=GPU_ONLY) if e[0] == "gpu" else e for e in ENGINES]
)
def test_mixtral_matches_numpy(tmp_path, kind, kv, rtol):
    tiny = tiny_mixtral(tmp_path)
    model = converted(tiny, tmp_path)
    assert model.config.n_experts == N_EXPERTS and model.config.n_experts_active == TOP_K
    want, routes = numpy_forward(held_weights(tiny), tiny.config, TOKENS, kv16=kv == "fp16")
    got = engine_logits(kind, model, kv, TOKENS)
    assert_close(got, want, rtol)
    # the routes are varied (otherwise a routing bug could hide): several experts are used
    used = {e for layer in routes for route in layer for e, _ in route}
    assert len(used) >= 3, used


@pytest.mark.parametrize("kind,kv,rtol", ENGINES)
def test_mixtral_forced_experts(tmp_path, kind, kv, rtol):
    """Layer 0's router crafted so that, at position 0, experts 3 and 0 are chosen with weights
    softmax([2, 1]) = (0.731, 0.269): the engine must follow it, and its logits at position 0
    must equal the independent forward's and differ from those of other routings."""
    tokens = tokens_for(kind)
    tiny = tiny_mixtral(tmp_path)
    w = held_weights(tiny)
    xb = layer0_moe_input(w, tiny.config, TOKENS[0])
    target = np.array([1.0, -3.0, -2.0, 2.0])  # router logits wanted at (layer 0, position 0)
    router = np.outer(target, xb) / (xb @ xb)  # G xb == target
    rewrite(tiny, {"model.layers.0.block_sparse_moe.gate.weight": router})
    w = held_weights(tiny)
    want, routes = numpy_forward(w, tiny.config, tokens, kv16=kv == "fp16")
    (e0, g0), (e1, g1) = routes[0][0]
    assert (e0, e1) == (3, 0)
    np.testing.assert_allclose([g0, g1], [1 / (1 + np.exp(-1.0)), 1 / (1 + np.exp(1.0))], rtol=1e-4)

    model = converted(tiny, tmp_path)
    # the converted router gives the crafted logits, and moe_route_ref picks the same experts
    gate = model.tensor("layers.0.moe_gate")
    ids, weights = moe_route_ref(gate, xb.astype(np.float32), TOP_K)
    assert ids.tolist() == [3, 0]
    np.testing.assert_allclose(weights, [g0, g1], rtol=1e-4)

    got = engine_logits(kind, model, kv, tokens)
    assert_close(got, want, rtol)
    # the routes over these positions are varied: several experts, and not one pair throughout
    used = {e for layer in routes for route in layer for e, _ in route}
    pairs = {tuple(e for e, _ in route) for layer in routes for route in layer}
    assert len(used) >= 3 and len(pairs) >= 3, routes

    # the check has teeth: the same model with experts 3 and 0 weighted equally (no softmax over
    # the chosen), or with experts 3 and 2 instead, gives different logits at position 0
    def with_route(route: list) -> np.ndarray:
        out = np.zeros_like(xb)
        p = "model.layers.0.block_sparse_moe."
        for e, g in route:
            ex = f"{p}experts.{e}."
            out += g * (w[ex + "w2.weight"] @ (silu(w[ex + "w1.weight"] @ xb) * (w[ex + "w3.weight"] @ xb)))
        return out

    good = with_route([(3, g0), (0, g1)])
    for wrong in ([(3, 0.5), (0, 0.5)], [(3, g0), (2, g1)]):
        diff = np.linalg.norm(with_route(wrong) - good) / np.linalg.norm(good)
        assert diff > 0.05, diff


def test_config_json_round_trip(tmp_path):
    """The converter reads the routing hyperparameters from config.json, not from defaults."""
    tiny = tiny_mixtral(tmp_path)
    cfg = json.loads((tiny.path / "config.json").read_text())
    cfg["num_experts_per_tok"] = 3
    (tiny.path / "config.json").write_text(json.dumps(cfg))
    model = converted(tiny, tmp_path)
    assert (model.config.n_experts, model.config.n_experts_active) == (N_EXPERTS, 3)
    tiny.config["num_experts_per_tok"] = 3
    want, routes = numpy_forward(held_weights(tiny), tiny.config, TOKENS[:3], kv16=False)
    assert all(len(r) == 3 for layer in routes for r in layer)
    assert_close(engine_logits("cpu", model, "fp32", TOKENS[:3]), want, 1e-5)
