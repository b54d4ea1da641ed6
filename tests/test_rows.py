"""The T-row kernels of pycalm.kernels.rows against their references in pycalm.cpu.reference, and
the references against the one-token ones row by row (embed_ref, rmsnorm_ref, rope_ref,
moe_route_ref at each row's position).

Odd shapes: T = 1, dims not a multiple of the block, pos0 > 0 with the cache rows around the
block holding sentinels that must stay, partial rotary dims, Qwen2's bias, both KV dtypes, more
rows than a block's threads for the expert grouping. With PYCALM_TEST_GPU=1 the same tests run on
the GPU, plus real-model sizes.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gpu import GPU
from numba import cuda

from pycalm.cpu.reference import (
    embed_ref,
    embed_rows_ref,
    feed_tokens_ref,
    kv_round,
    moe_group_ref,
    moe_route_ref,
    moe_route_rows_ref,
    qkv_rows_ref,
    rmsnorm_ref,
    rmsnorm_rows_ref,
    rope_ref,
    rope_rows_ref,
)
from pycalm.errors import PycalmError
from pycalm.kernels.attention import KVCache
from pycalm.kernels.common import STATE_POS, STATE_SIZE, STATE_TOKEN
from pycalm.kernels.rows import (
    ExpertRows,
    Pages,
    RowRoutes,
    embed_rows,
    feed_tokens,
    moe_group,
    moe_route_rows,
    qkv_pages,
    qkv_rows,
    rmsnorm_rows,
    take_rows,
)
from pycalm.model import formats
from pycalm.model.config import ModelConfig


def config(n_heads=2, n_kv_heads=1, head_dim=8, n_experts=0, k=0):
    """A config with these sizes (the row kernels read no others)."""
    return ModelConfig(
        arch="llama", dim=n_heads * head_dim, hidden_dim=8, head_dim=head_dim, n_layers=1, n_heads=n_heads,
        n_kv_heads=n_kv_heads, vocab_size=8, max_seq_len=4096, rope_theta=1e4, rotary_dim=head_dim,
        norm_eps=1e-5, bos_id=1, eos_ids=(), n_experts=n_experts, n_experts_active=k,
    )  # fmt: skip


class Layer:
    """The layer weights a row kernel reads (the rest of pycalm.gpu.engine.LayerWeights)."""

    def __init__(self, **weights):
        self.__dict__.update(weights)


def _state(pos0):
    state = np.zeros(4, np.int32)
    state[STATE_POS] = pos0
    return cuda.to_device(state)


# dim not a multiple of the block (gf4: 9 words); q4: 3 groups of 32, 2 of 64
@pytest.mark.parametrize(
    "dtype,dim,group",
    [("fp16", 72, 32), ("fp8", 72, 32), ("gf4", 72, 32), ("q8", 72, 32), ("q4", 96, 32), ("q4", 128, 64)],
)
@pytest.mark.parametrize("n_rows", [1, 5])
def test_embed_rows(dtype, dim, group, n_rows):
    rng = np.random.default_rng(n_rows)
    vocab = 37
    table = formats.encode(rng.standard_normal((vocab, dim)).astype(np.float32) * 3, dtype, group=group)
    tokens = rng.integers(0, vocab, n_rows).astype(np.int32)
    tokens[-1] = tokens[0]  # a repeated token
    x = cuda.to_device(np.full((n_rows, dim), np.nan, np.float32))
    stream = cuda.stream()
    device_table = (
        formats.Quantized(cuda.to_device(table.codes), cuda.to_device(table.scales))
        if isinstance(table, formats.Quantized)
        else cuda.to_device(table)
    )
    embed_rows(device_table, cuda.to_device(tokens), x, dtype, stream=stream)
    stream.synchronize()
    want = embed_rows_ref(table, tokens, dtype)
    np.testing.assert_array_equal(x.copy_to_host(), want)  # decoding is exact
    np.testing.assert_array_equal(want, np.stack([embed_ref(table, t, dtype) for t in tokens]))


def test_embed_rows_rejects_bad_input():
    with pytest.raises(PycalmError, match="unsupported embedding dtype"):
        embed_rows(None, None, None, "int4", stream=0)
    x = cuda.to_device(np.zeros((3, 8), np.float32))
    with pytest.raises(PycalmError, match="2 tokens for 3 rows"):
        embed_rows(x, cuda.to_device(np.zeros(2, np.int32)), x, "fp16", stream=0)


@pytest.mark.parametrize(
    "n_rows,dim",
    [(1, 40), (6, 100), (2, 300)] + ([(37, 4096), (3, 2048), (8, 1536), (2, 8200)] if GPU else []),
)
def test_rmsnorm_rows(n_rows, dim):
    rng = np.random.default_rng(dim)
    x = (3 * rng.standard_normal((n_rows, dim))).astype(np.float32)
    x[0] *= 100  # rows of very different scale
    w = rng.uniform(0.5, 1.5, dim).astype(np.float32)
    out = cuda.to_device(np.full((n_rows, dim), np.nan, np.float16))
    stream = cuda.stream()
    rmsnorm_rows(cuda.to_device(x), cuda.to_device(w), 1e-5, out, stream=stream)
    stream.synchronize()
    got = out.copy_to_host().astype(np.float32)
    want = rmsnorm_rows_ref(x, w, 1e-5).astype(np.float32)
    # float32 sums in another order can move a value across an fp16 rounding boundary: one ulp
    np.testing.assert_allclose(got, want, rtol=2.0**-10, atol=2.0**-24)
    assert np.mean(got == want) > 0.95
    rows = np.stack([rmsnorm_ref(row, w, 1e-5) for row in x])
    np.testing.assert_allclose(want, rows, rtol=2.0**-11, atol=2.0**-24)  # the fp16 rounding only
    # with rms: each row's rsqrt(mean(x^2) + eps) too (a folded norm's scale), and the same out
    rms = cuda.to_device(np.full(n_rows, np.nan, np.float32))
    out2 = cuda.to_device(np.full((n_rows, dim), np.nan, np.float16))
    rmsnorm_rows(cuda.to_device(x), cuda.to_device(w), 1e-5, out2, stream=stream, rms=rms)
    stream.synchronize()
    assert np.array_equal(out2.copy_to_host().astype(np.float32), got)
    want_rms = 1 / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1) + 1e-5)
    np.testing.assert_allclose(rms.copy_to_host(), want_rms, rtol=1e-5)


def test_rmsnorm_script_runs_its_check():
    """scripts/kernels/rmsnorm_rows.py (the shipped launch and a row held in registers, an
    experiment): both within the reference's tolerance, the registers version shipped's bits."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "kernels" / "rmsnorm_rows.py"
    p = subprocess.run([sys.executable, str(script), "--tiny"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.count("(ok)") == 4 and p.stdout.count("shipped's bits (ok)") == 2


QKV_CASES = [
    # kv_dtype, bias, n_heads, n_kv_heads, head_dim, n_rot, T, pos0
    ("fp16", True, 4, 2, 8, 4, 5, 3),
    ("fp8", False, 4, 2, 8, 4, 5, 3),
    ("fp16", False, 3, 1, 8, 3, 1, 6),  # partial rotary: rotary_dim 6 of head_dim 8; T = 1
    ("fp8", True, 2, 2, 16, 8, 7, 0),
]
GPU_QKV_CASES = [("fp16", True, 14, 2, 64, 32, 300, 40), ("fp8", False, 32, 8, 128, 64, 77, 1000)]


@pytest.mark.parametrize(
    "kv_dtype,bias,n_heads,n_kv_heads,head_dim,n_rot,n_rows,pos0", QKV_CASES + (GPU_QKV_CASES if GPU else [])
)
def test_qkv_rows(kv_dtype, bias, n_heads, n_kv_heads, head_dim, n_rot, n_rows, pos0):
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    seq_len = pos0 + n_rows + 3
    rng = np.random.default_rng(n_rows + pos0)
    qkv = (2 * rng.standard_normal((n_rows, q_dim + 2 * kv_dim))).astype(np.float32)
    b = rng.standard_normal(q_dim + 2 * kv_dim).astype(np.float32) if bias else None
    freqs = (1.0 / 10000.0 ** (np.arange(n_rot) / n_rot)).astype(np.float32)
    sentinel = np.float16(1.0) if kv_dtype == "fp16" else np.uint8(0x55)
    k0 = np.full((seq_len, kv_dim), sentinel)  # rows outside pos0 .. pos0 + T - 1 keep it
    kc, vc = cuda.to_device(k0), cuda.to_device(k0)
    q = cuda.to_device(np.full((n_rows, q_dim), np.nan, np.float32))
    stream = cuda.stream()
    layer = Layer(bqkv=None if b is None else cuda.to_device(b))
    cfg = config(n_heads, n_kv_heads, head_dim)
    qkv_rows(
        cuda.to_device(qkv), layer, cuda.to_device(freqs), _state(pos0), q, KVCache(kc, vc, kv_dtype), cfg,
        stream=stream,
    )  # fmt: skip
    stream.synchronize()
    q_ref, k_ref, v_ref = qkv_rows_ref(qkv, b, pos0, freqs, n_heads, n_kv_heads, head_dim)

    # sin / cos to ~1e-6 of the pair's magnitude (common.sincos); unrotated columns exact
    pair = np.abs(np.concatenate([q_ref, k_ref], axis=1)).reshape(n_rows, -1, 2).sum(2)
    tol = np.repeat(2e-6 * pair + 1e-7, 2, axis=1)  # (T, q_dim + kv_dim)
    got_q = q.copy_to_host()
    assert np.all(np.abs(got_q - q_ref) <= tol[:, :q_dim])
    rotated = (np.arange(head_dim) < 2 * n_rot)[None, :].repeat(n_heads, 0).reshape(-1)
    np.testing.assert_array_equal(got_q[:, ~rotated], q_ref[:, ~rotated])

    kh, vh = kc.copy_to_host(), vc.copy_to_host()
    block = np.arange(pos0, pos0 + n_rows)
    other = np.ones(seq_len, bool)
    other[block] = False
    for cache in (kh, vh):
        assert np.array_equal(cache[other].view(np.uint8), k0[other].view(np.uint8)), (
            "rows outside the block touched"
        )
    # v is not rotated: bias add and encoding are the decode path's, bit for bit
    np.testing.assert_array_equal(formats.decode(vh[block], kv_dtype), kv_round(v_ref, kv_dtype))
    # k: stored = the reference's rounding, or its neighbour where the rotation's float32 value
    # sits within the tolerance of a rounding boundary (one quantum)
    dec = formats.decode(kh[block], kv_dtype).astype(np.float64)
    quantum = np.abs(k_ref) * (2.0**-10 if kv_dtype == "fp16" else 2.0**-2) + 2.0**-16
    assert np.all(np.abs(dec - k_ref) <= tol[:, q_dim:] + quantum)
    assert np.mean(dec == kv_round(k_ref, kv_dtype)) >= 0.9


@pytest.mark.parametrize("kv_dtype,bias", [("fp16", True), ("fp8", False)])
def test_qkv_pages(kv_dtype, bias):
    """Rows of two sequences and a padding row over a pool of 5 pages of 4 rows: sequence 0's
    positions 3..6 (pages 3 and 0, crossing a page), sequence 1's position 5 (page 4), a row of
    sequence -1. Each row is qkv_rows_ref's at its own position, its k and v land in the pool
    row its table gives, and no other pool row changes."""
    n_heads, n_kv_heads, head_dim, n_rot, page = 4, 2, 8, 4, 4
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    positions = np.array([3, 4, 5, 6, 5, 0], np.int32)
    seq_of_row = np.array([0, 0, 0, 0, 1, -1], np.int32)
    table = np.array([[3, 0, 2], [2, 4, 2]], np.int32)  # (n_seqs, max_pages)
    want_rows = [15, 0, 1, 2, 17]  # page table[s, pos // 4] * 4 + pos % 4 of the live rows
    rng = np.random.default_rng(11)
    n_rows = len(positions)
    qkv = (2 * rng.standard_normal((n_rows, q_dim + 2 * kv_dim))).astype(np.float32)
    b = rng.standard_normal(q_dim + 2 * kv_dim).astype(np.float32) if bias else None
    freqs = (1.0 / 10000.0 ** (np.arange(n_rot) / n_rot)).astype(np.float32)
    sentinel = np.float16(1.0) if kv_dtype == "fp16" else np.uint8(0x55)
    k0 = np.full((5 * page, kv_dim), sentinel)
    kc, vc = cuda.to_device(k0), cuda.to_device(k0)
    q = cuda.to_device(np.full((n_rows, q_dim), np.nan, np.float32))
    stream = cuda.stream()
    pages = Pages(cuda.to_device(positions), cuda.to_device(seq_of_row), cuda.to_device(table), page)
    layer = Layer(bqkv=None if b is None else cuda.to_device(b))
    qkv_pages(
        cuda.to_device(qkv), layer, cuda.to_device(freqs), pages, q, KVCache(kc, vc, kv_dtype),
        config(n_heads, n_kv_heads, head_dim), stream=stream,
    )  # fmt: skip
    stream.synchronize()
    got_q, kh, vh = q.copy_to_host(), kc.copy_to_host(), vc.copy_to_host()
    for t, row in enumerate(want_rows):
        q_ref, k_ref, v_ref = qkv_rows_ref(
            qkv[t : t + 1], b, int(positions[t]), freqs, n_heads, n_kv_heads, head_dim
        )
        pair = np.abs(np.concatenate([q_ref, k_ref], axis=1)).reshape(-1, 2).sum(1)
        tol = np.repeat(2e-6 * pair + 1e-7, 2)  # (q_dim + kv_dim,)
        assert np.all(np.abs(got_q[t] - q_ref[0]) <= tol[:q_dim])
        np.testing.assert_array_equal(formats.decode(vh[row : row + 1], kv_dtype), kv_round(v_ref, kv_dtype))
        dec = formats.decode(kh[row : row + 1], kv_dtype).astype(np.float64)[0]
        quantum = np.abs(k_ref[0]) * (2.0**-10 if kv_dtype == "fp16" else 2.0**-2) + 2.0**-16
        assert np.all(np.abs(dec - k_ref[0]) <= tol[q_dim:] + quantum)
    assert np.all(np.isnan(got_q[-1]))  # the padding row: untouched
    other = np.ones(5 * page, bool)
    other[want_rows] = False
    for cache in (kh, vh):
        assert np.array_equal(cache[other].view(np.uint8), k0[other].view(np.uint8)), (
            "other pool rows touched"
        )


def test_take_rows():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((7, 45)).astype(np.float32)
    rows = np.array([6, 0, 3, 3], np.int32)
    out = cuda.to_device(np.full((3, 45), np.nan, np.float32))
    take_rows(cuda.to_device(x), cuda.to_device(rows), out, stream=0)
    np.testing.assert_array_equal(out.copy_to_host(), x[rows[:3]])
    with pytest.raises(PycalmError, match="take_rows"):
        take_rows(cuda.to_device(x), cuda.to_device(rows[:2]), out, stream=0)


@pytest.mark.parametrize("row0_ahead", [True, False])
def test_feed_tokens(row0_ahead):
    """Rows whose prev is >= 0 feed the token the last pass sampled (chosen[prev]); the others
    keep theirs; row 0's token goes to the one-row step's state when it takes one."""
    rng = np.random.default_rng(13)
    n = 37
    tokens = rng.integers(0, 1000, n).astype(np.int32)
    prev = np.where(rng.random(n) < 0.5, rng.integers(0, 9, n), -1).astype(np.int32)
    prev[0] = 4 if row0_ahead else -1
    chosen = rng.integers(1000, 2000, 9).astype(np.int32)
    state = np.zeros(STATE_SIZE, np.int32)
    state[STATE_TOKEN] = 77
    d_tokens, d_state = cuda.to_device(tokens), cuda.to_device(state)
    feed_tokens(d_tokens, cuda.to_device(prev), cuda.to_device(chosen), d_state, stream=0)
    want = feed_tokens_ref(tokens, prev, chosen)
    np.testing.assert_array_equal(d_tokens.copy_to_host(), want)
    assert d_state.copy_to_host()[STATE_TOKEN] == (chosen[4] if row0_ahead else 77)
    assert np.all(want[prev >= 0] >= 1000) and np.array_equal(want[prev < 0], tokens[prev < 0])  # (the ref)
    with pytest.raises(PycalmError, match="feed_tokens"):
        feed_tokens(d_tokens, cuda.to_device(prev[:3]), cuda.to_device(chosen), d_state, stream=0)


def test_rope_rows_ref_is_rope_ref_row_by_row():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 24)).astype(np.float32)
    freqs = (1.0 / 10000.0 ** (np.arange(3) / 3)).astype(np.float32)
    got = rope_rows_ref(x, 9, freqs, 8)
    np.testing.assert_array_equal(got, np.stack([rope_ref(x[t], 9 + t, freqs, 8) for t in range(4)]))


# (weights, KV dtype, bias, rows, scaled): 3 query heads and 1 kv head of 12 (qkv 60 columns: a
# partial last 16-row tile of Wqkv, rotary pairs 0..3 of each head's 6), K = 96
SKINNY_QKV_CASES = [
    ("fp16", "fp16", True, 3, False),
    ("q8", "fp8", False, 13, True),
    ("q4", "fp16", True, 27, True),
]
if GPU:
    SKINNY_QKV_CASES += [("fp16", "fp8", True, 8, True), ("q4", "fp16", False, 64, True)]


@pytest.mark.parametrize("dtype,kv_dtype,bias,n_rows,scaled", SKINNY_QKV_CASES)
def test_skinny_qkv_is_skinny_then_qkv_rows(dtype, kv_dtype, bias, n_rows, scaled):
    """skinny_qkv (the QKV product with qkv_rows's epilogue in its own) writes q and the cache
    rows bit for bit as skinny_matmul into qkv, then qkv_rows, do: the same sums, the same pair
    arithmetic."""
    from device_weights import to_device

    from pycalm.kernels.skinny import skinny_matmul, skinny_qkv

    n_heads, n_kv_heads, head_dim, dim, pos0 = 3, 1, 12, 96, 5
    cfg = config(n_heads, n_kv_heads, head_dim)
    q_dim, kv_dim, cols = cfg.q_dim, cfg.kv_dim, cfg.qkv_dim
    rng = np.random.default_rng(n_rows)
    x = formats.fp16_encode(rng.standard_normal((n_rows, dim)) * 0.5)
    w = to_device(formats.encode(rng.standard_normal((cols, dim)).astype(np.float32), dtype))
    layer = Layer(bqkv=cuda.to_device(rng.standard_normal(cols).astype(np.float32)) if bias else None)
    freqs = cuda.to_device((1.0 / 10000.0 ** (np.arange(4) / 4)).astype(np.float32))
    scale = cuda.to_device(np.exp(rng.uniform(-1, 1, n_rows)).astype(np.float32)) if scaled else None
    seq_len = pos0 + n_rows + 2
    sentinel = np.float16(1.0) if kv_dtype == "fp16" else np.uint8(0x55)
    stream = cuda.stream()
    outs = []
    for fused in (False, True):
        q = cuda.to_device(np.full((n_rows, q_dim), np.nan, np.float32))
        cache = KVCache(*(cuda.to_device(np.full((seq_len, kv_dim), sentinel)) for _ in range(2)), kv_dtype)
        if fused:
            skinny_qkv(cuda.to_device(x), w, dtype, layer, freqs, _state(pos0), q, cache, cfg, stream=stream,
                       scale=scale)  # fmt: skip
        else:
            qkv = cuda.to_device(np.full((n_rows, cols), np.nan, np.float32))
            skinny_matmul(cuda.to_device(x), w, qkv, dtype, stream=stream, scale=scale)
            qkv_rows(qkv, layer, freqs, _state(pos0), q, cache, cfg, stream=stream)
        stream.synchronize()
        outs.append([q.copy_to_host().view(np.uint32), cache.k.copy_to_host().view(np.uint8),
                     cache.v.copy_to_host().view(np.uint8)])  # fmt: skip
    assert np.all(np.isfinite(outs[0][0].view(np.float32)))
    for got, want, name in zip(outs[1], outs[0], ("q", "k", "v"), strict=True):
        assert np.array_equal(got, want), name


def test_qkv_rows_rejects_bad_shapes():
    qkv = cuda.to_device(np.zeros((2, 30), np.float32))
    q = cuda.to_device(np.zeros((2, 16), np.float32))
    layer, cfg = Layer(bqkv=None), config(2, 1, 8)
    with pytest.raises(PycalmError, match="KV-cache dtype"):
        qkv_rows(qkv, layer, None, None, q, KVCache(None, None, "fp32"), cfg, stream=0)
    with pytest.raises(PycalmError, match="do not fit"):
        qkv_rows(qkv, layer, None, None, q, KVCache(None, None, "fp16"), cfg, stream=0)


@pytest.mark.parametrize("n_rows,n_experts,k", [(1, 8, 2), (9, 4, 3)] + ([(300, 8, 2)] if GPU else []))
def test_moe_route_rows_and_group(n_rows, n_experts, k):
    rng = np.random.default_rng(n_rows + k)
    dim, eps = 48, 1e-5
    gate = rng.standard_normal((n_experts, dim)).astype(np.float32)
    x = (2 * rng.standard_normal((n_rows, dim))).astype(np.float32)
    norm_w = rng.uniform(0.5, 1.5, dim).astype(np.float32)
    ids = cuda.to_device(np.full((n_rows, k), -7, np.int32))
    w = cuda.to_device(np.full((n_rows, k), np.nan, np.float32))
    stream = cuda.stream()
    layer = Layer(moe_gate=cuda.to_device(gate), ffn_norm=cuda.to_device(norm_w))
    cfg = config(n_experts=n_experts, k=k).replace(norm_eps=eps)
    moe_route_rows(layer, cuda.to_device(x), RowRoutes(ids, w), cfg, stream=stream)
    stream.synchronize()
    ids_ref, w_ref = moe_route_rows_ref(gate, x, norm_w, eps, k)
    for t in (0, n_rows - 1):  # the reference is the decode routing, row by row
        one_ids, one_w = moe_route_ref(gate, rmsnorm_ref(x[t], norm_w, eps), k)
        np.testing.assert_array_equal(ids_ref[t], one_ids)
        np.testing.assert_array_equal(w_ref[t], one_w)
    # random logits: no two within float32 noise of each other, so the picks are the same
    np.testing.assert_array_equal(ids.copy_to_host(), ids_ref)
    np.testing.assert_allclose(w.copy_to_host(), w_ref, rtol=1e-5, atol=1e-6)

    count = cuda.to_device(np.full(n_experts, -7, np.int32))
    rows = cuda.to_device(np.full((n_experts, n_rows), -7, np.int32))
    row_w = cuda.to_device(np.full((n_experts, n_rows), np.nan, np.float32))
    moe_group(RowRoutes(ids, w), ExpertRows(count, rows, row_w), stream=stream)
    stream.synchronize()
    count_ref, rows_ref, row_w_ref = moe_group_ref(ids.copy_to_host(), w.copy_to_host(), n_experts)
    np.testing.assert_array_equal(count.copy_to_host(), count_ref)
    np.testing.assert_array_equal(rows.copy_to_host(), rows_ref)
    np.testing.assert_array_equal(row_w.copy_to_host(), row_w_ref)
    assert count_ref.sum() == n_rows * k


def test_moe_group_ref_lists_rows_in_order():
    ids = np.array([[2, 0], [0, 1], [2, 1]], np.int32)
    weights = np.array([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1]], np.float32)
    count, rows, row_w = moe_group_ref(ids, weights, 4)
    np.testing.assert_array_equal(count, [2, 2, 2, 0])
    np.testing.assert_array_equal(rows, [[0, 1, -1], [1, 2, -1], [0, 2, -1], [-1, -1, -1]])
    np.testing.assert_array_equal(row_w[0], np.float32([0.4, 0.7, 0.0]))
    np.testing.assert_array_equal(row_w[2], np.float32([0.6, 0.9, 0.0]))


@pytest.mark.parametrize("n_rows,n_experts,k", [(70, 8, 2)] + ([(4000, 8, 2)] if GPU else []))
def test_moe_group_many_rows(n_rows, n_experts, k):
    # more rows than a block's threads (64: two warps): the prefix sums of warps and steps add up
    rng = np.random.default_rng(n_rows)
    ids = np.stack([rng.permutation(n_experts)[:k] for _ in range(n_rows)]).astype(np.int32)
    ids[: n_rows // 2, 0] = 3  # a popular expert (k = 2: the other pick is any but 3)
    ids[: n_rows // 2, 1] = rng.choice([0, 1, 2, 4, 5, 6, 7], n_rows // 2)
    weights = rng.uniform(0, 1, (n_rows, k)).astype(np.float32)
    count = cuda.to_device(np.full(n_experts, -7, np.int32))
    rows = cuda.to_device(np.full((n_experts, n_rows), -7, np.int32))
    row_w = cuda.to_device(np.full((n_experts, n_rows), np.nan, np.float32))
    stream = cuda.stream()
    routes = RowRoutes(cuda.to_device(ids), cuda.to_device(weights))
    moe_group(routes, ExpertRows(count, rows, row_w), stream=stream, threads=64)
    stream.synchronize()
    count_ref, rows_ref, row_w_ref = moe_group_ref(ids, weights, n_experts)
    np.testing.assert_array_equal(count.copy_to_host(), count_ref)
    np.testing.assert_array_equal(rows.copy_to_host(), rows_ref)
    np.testing.assert_array_equal(row_w.copy_to_host(), row_w_ref)
