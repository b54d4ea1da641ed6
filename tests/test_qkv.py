"""qkv_rope (RMSNorm + QKV matvec + bias + RoPE + KV-cache write) against qkv_ref / kv_round."""

from types import SimpleNamespace

import numpy as np
import pytest
from device_weights import to_device
from numba import cuda

from pycalm.cpu.reference import kv_round, qkv_ref, rmsnorm_ref
from pycalm.kernels.attention import KVCache
from pycalm.kernels.common import STATE_POS, STATE_TOKEN
from pycalm.kernels.qkv import qkv_rope
from pycalm.model import formats

RTOL = 1e-5  # of the row's |W| |x| sum: float32 accumulation order (see test_matvec)


@pytest.mark.parametrize(
    "dtype,kv_dtype,bias,dim,n_rot",
    [
        ("fp16", "fp16", True, 72, 4),
        ("fp8", "fp8", False, 72, 4),
        ("gf4", "fp16", False, 144, 3),  # partial rotary: rotary_dim 6 of head_dim 8
        ("gf4", "fp8", True, 72, 4),
        ("fp16", "fp8", False, 136, 3),
        ("gf4", "fp16", True, 256, 4),  # gf4 16-byte loads: 4 rows (two rotary pairs) a warp
        ("q8", "fp16", True, 72, 4),  # q8 8-byte loads
        ("q8", "fp8", False, 144, 3),  # q8 16-byte loads
        ("q4", "fp16", True, 96, 4),  # q4 groups of 32: 3 a row
        ("q4/64", "fp8", False, 128, 4),  # q4 groups of 64: 2 loads a group
    ],
)
def test_qkv_rope(dtype, kv_dtype, bias, dim, n_rot):
    n_heads, n_kv_heads, head_dim, seq_len, pos, eps = 4, 2, 8, 9, 5, 1e-5
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    rows = q_dim + 2 * kv_dim
    rng = np.random.default_rng(dim + n_rot)
    dtype, _, group = dtype.partition("/")  # q4/64: q4 in groups of 64
    w = formats.encode(rng.standard_normal((rows, dim)).astype(np.float32), dtype, group=int(group or 32))
    wd = formats.decode(w, dtype).astype(np.float64)
    b = rng.standard_normal(rows).astype(np.float32) if bias else None
    x = (2 * rng.standard_normal(dim)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, dim).astype(np.float32)
    freqs = (1.0 / 10000.0 ** (np.arange(n_rot) / n_rot)).astype(np.float32)
    state = np.array([17, pos, 0, 0], np.int32)
    assert state[STATE_POS] == pos and state[STATE_TOKEN] == 17

    if kv_dtype == "fp16":
        k0 = np.full((seq_len, kv_dim), 1.0, np.float16)  # sentinel: rows other than pos keep it
    else:
        k0 = np.full((seq_len, kv_dim), 0x55, np.uint8)
    kc, vc = cuda.to_device(k0), cuda.to_device(k0)
    q = cuda.to_device(np.full(q_dim, np.nan, np.float32))
    layer = SimpleNamespace(
        wqkv=to_device(w), bqkv=None if b is None else cuda.to_device(b), attn_norm=cuda.to_device(nw),
        dtypes={"wqkv": dtype},
    )  # fmt: skip
    cfg = SimpleNamespace(
        n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, norm_eps=eps, weight_dtype=dtype
    )
    cache = KVCache(kc, vc, kv_dtype)
    qkv_rope(layer, cuda.to_device(x), cuda.to_device(freqs), cuda.to_device(state), q, cache, cfg,
             stream=cuda.default_stream())  # fmt: skip
    cuda.synchronize()

    xn = rmsnorm_ref(x, nw, eps)
    # (q8, q4: the reference takes x in 16 bits, as the kernel)
    q_ref, k_ref, v_ref = qkv_ref(w, b, xn, dtype, pos, freqs, n_heads, n_kv_heads, head_dim)
    # tolerance per output: the row errors of both rows of its rotary pair (rotation mixes them)
    row_tol = RTOL * (np.abs(wd) @ np.abs(xn.astype(np.float64)))
    pair_tol = np.repeat(row_tol.reshape(-1, 2).sum(1), 2) + 1e-6 * np.repeat(
        np.abs(np.concatenate([q_ref, k_ref, v_ref])).reshape(-1, 2).sum(1), 2
    )  # + sin / cos rounding
    tq, tk, tv = pair_tol[:q_dim], pair_tol[q_dim : q_dim + kv_dim], pair_tol[q_dim + kv_dim :]
    got_q = q.copy_to_host()
    assert np.all(np.abs(got_q - q_ref) <= tq)

    kh, vh = kc.copy_to_host(), vc.copy_to_host()
    other = np.arange(seq_len) != pos
    assert np.array_equal(kh[other].view(np.uint8), k0[other].view(np.uint8)), "other k rows touched"
    assert np.array_equal(vh[other].view(np.uint8), k0[other].view(np.uint8)), "other v rows touched"
    for got, want, tol in ((kh[pos], k_ref, tk), (vh[pos], v_ref, tv)):
        dec = formats.decode(got, kv_dtype).astype(np.float64)
        # stored = the reference's rounding of the same value; where the kernel's float32 value
        # differs by the tolerance, the rounding may pick the neighbour: one quantum
        quantum = np.abs(want) * (2.0**-10 if kv_dtype == "fp16" else 2.0**-2) + 2.0**-16
        assert np.all(np.abs(dec - want) <= tol + quantum)
        assert np.mean(dec == kv_round(want, kv_dtype)) >= 0.9
