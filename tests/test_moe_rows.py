"""The expert FFN of T rows (pycalm.kernels.moe_rows: the grouped tensor-core matmul and the
combine) against pycalm.cpu.reference's expert_gate_ref, expert_matmul_ref and moe_combine_rows_ref,
and those against the token step's MoE references row by row.

Routing crafted so that one expert takes every row, one none, and the others split the rest,
with each expert as the first choice of some rows and the second of others; T not a multiple
of the simulator's 32-row tile, N not a multiple of its 32 (gate: 16) outputs, K = 8 x odd.
Tolerances as in tests/test_matmul.py: fp16 inputs and decoded weights make the tensor cores'
products exact, so the kernel differs from the reference by the order of the float32 sums
(1e-5 of the |X| |W|^T sum) and, for the gate's fp16 output, one fp16 rounding.
"""

import numpy as np
import pytest
from device_weights import to_device
from gpu import gpu_only
from numba import cuda

from pycalm.cpu.reference import (
    expert_gate_ref,
    expert_matmul_ref,
    matvec_residual_ref,
    moe_combine_rows_ref,
    moe_ffn_gate_ref,
    moe_group_ref,
    moe_matvec_residual_ref,
)
from pycalm.errors import PycalmError
from pycalm.kernels.moe_rows import expert_matmul, moe_combine_rows
from pycalm.kernels.rows import ExpertRows, RowRoutes, moe_group
from pycalm.model import formats

RTOL = 1e-5


def crafted_routes(n_rows: int, n_experts: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Expert 0 in every row (first choice in even rows, last in odd ones), expert
    n_experts - 1 in none, the others spread over the remaining choices."""
    ids = np.zeros((n_rows, k), np.int32)
    for t in range(n_rows):
        others = rng.permutation(np.arange(1, n_experts - 1))[: k - 1]
        ids[t] = [0, *others] if t % 2 == 0 else [*others, 0]
    w = rng.uniform(0.1, 1.0, (n_rows, k)).astype(np.float32)
    return ids, w / w.sum(1, keepdims=True)


def grouped(ids: np.ndarray, w: np.ndarray, n_experts: int, stream) -> tuple[RowRoutes, ExpertRows]:
    """The routes on the device and moe_group's grouping of them (checked against its reference)."""
    n_rows = ids.shape[0]
    routes = RowRoutes(cuda.to_device(ids), cuda.to_device(w))
    experts = ExpertRows(
        cuda.to_device(np.full(n_experts, -7, np.int32)),
        cuda.to_device(np.full((n_experts, n_rows), -7, np.int32)),
        cuda.to_device(np.full((n_experts, n_rows), np.nan, np.float32)),
    )
    moe_group(routes, experts, stream=stream)
    stream.synchronize()
    count = experts.count.copy_to_host()
    np.testing.assert_array_equal(count, moe_group_ref(ids, w, n_experts)[0])
    assert count[0] == n_rows and count[-1] == 0  # one expert takes all rows, one none
    return routes, experts


def sum_scale(x: np.ndarray, w: np.ndarray, dtype: str, ids: np.ndarray, by_slot: bool) -> np.ndarray:
    """|X| |W_e|^T for each slot: what the float32 rounding of its sums is relative to."""
    n_rows, k = ids.shape
    out = np.zeros((n_rows * k, w.shape[1]))
    for t in range(n_rows):
        for j in range(k):
            row = x[t * k + j] if by_slot else x[t]
            out[t * k + j] = np.abs(formats.decode(w[ids[t, j]], dtype)) @ np.abs(row.astype(np.float64))
    return out


def reference_weights(stored: tuple, dtype: str) -> tuple[tuple, str]:
    """The stacks as the references take them, and their dtype: as stored, except q8 decoded to
    float32 (the row scale goes onto the kernel's sums) and q4 decoded and rounded to fp16 (what
    the tensor cores multiply; see tests/test_matmul.py)."""
    if dtype == "q8":
        return tuple(formats.decode(s, dtype) for s in stored), "fp32"
    if dtype == "q4":
        return tuple(formats.fp16_encode(formats.decode(s, dtype)) for s in stored), "fp16"
    return stored, dtype


# q4/mixed: w1 in groups of 32 beside w3 and w2 in groups of 64 (the converter's policy can leave
# them so: it moves one matrix at a time within the bit budget)
GROUPS = {"q4/mixed": (32, 64, 64)}


@pytest.mark.parametrize("dtype", ["fp16", "fp8", "gf4", "q8", "q4", "q4/mixed"])
def test_expert_matmul_and_combine(dtype):
    rng = np.random.default_rng(["fp16", "fp8", "gf4", "q8", "q4", "q4/mixed"].index(dtype))
    dtype, groups = dtype.split("/")[0], GROUPS.get(dtype, (32, 32, 32))
    n_rows, n_experts, k, dim, hidden_dim = 37, 5, 2, 40, 24  # 37 rows: two 32-row tiles
    if dtype in formats.QUANTIZED:  # K: q8's 16-code loads, q4's groups of 32 (w2: two) or 64
        dim, hidden_dim = (64, 128) if max(groups) == 64 else (32, 64)
    ids, w = crafted_routes(n_rows, n_experts, k, rng)
    stream = cuda.stream()
    routes, experts = grouped(ids, w, n_experts, stream)

    def stack(rows: int, cols: int, group: int) -> np.ndarray | formats.Quantized:
        x = rng.standard_normal((n_experts, rows, cols)).astype(np.float32)
        return formats.encode(x, dtype, group=group) if dtype == "q4" else formats.encode(x, dtype)

    stored = (
        stack(hidden_dim, dim, groups[0]),
        stack(hidden_dim, dim, groups[1]),
        stack(dim, hidden_dim, groups[2]),
    )
    w1_dev, w3_dev, w2_dev = (to_device(s) for s in stored)
    (w1, w3, w2), dtype_ref = reference_weights(stored, dtype)
    xb = formats.fp16_encode(rng.standard_normal((n_rows, dim)) * 0.5)  # the normed rows

    # h[t k + j] = silu(xb[t] W1_e^T) * (xb[t] W3_e^T)
    h = cuda.to_device(np.full((n_rows * k, hidden_dim), np.nan, np.float16))
    expert_matmul(
        cuda.to_device(xb), w1_dev, h, dtype, experts, routes, stream=stream, mode="gate", w3=w3_dev
    )
    stream.synchronize()
    got_h = h.copy_to_host()
    want_h = expert_gate_ref(xb, w1, w3, dtype_ref, ids)
    assert np.all(np.isfinite(got_h)), "a slot left unwritten"
    a = np.abs(expert_matmul_ref(np.repeat(xb, k, 0), w1, dtype_ref, ids))  # |xb W1^T| of each slot
    b = np.abs(expert_matmul_ref(np.repeat(xb, k, 0), w3, dtype_ref, ids))
    da, db = RTOL * sum_scale(xb, w1, dtype_ref, ids, False), RTOL * sum_scale(xb, w3, dtype_ref, ids, False)
    # one fp16 rounding each side, and the sums' float32 error through the gate (see test_matmul)
    tol = 2.0**-10 * np.abs(want_h.astype(np.float64)) + 1.1 * b * da + (a + 0.28) * db + 2.0**-24
    err = np.abs(got_h.astype(np.float64) - want_h)
    assert np.all(err <= tol), f"gate: max err / tol {np.max(err / tol):.3g}"

    # y[t k + j] = h[t k + j] W2_e^T, from the reference's h (the kernel's input exactly)
    y = cuda.to_device(np.full((n_rows * k, dim), np.nan, np.float32))
    expert_matmul(cuda.to_device(want_h), w2_dev, y, dtype, experts, routes, stream=stream)
    stream.synchronize()
    got_y = y.copy_to_host()
    want_y = expert_matmul_ref(want_h, w2, dtype_ref, ids)
    err = np.abs(got_y.astype(np.float64) - want_y)
    assert np.all(err <= RTOL * sum_scale(want_h, w2, dtype_ref, ids, True) + 1e-30), "w2 slots"

    # x[t] += sum_j w[t, j] y[t k + j]
    x0 = rng.standard_normal((n_rows, dim)).astype(np.float32)
    x = cuda.to_device(x0)
    moe_combine_rows(cuda.to_device(want_y), routes, x, stream=stream)
    stream.synchronize()
    want_x = moe_combine_rows_ref(want_y, w, x0)
    np.testing.assert_allclose(x.copy_to_host(), want_x, rtol=1e-6, atol=1e-6 * np.abs(want_y).max())

    # the row references are the token step's MoE references row by row (fp16 rounding of h apart)
    xf = xb.astype(np.float32)
    for t in (0, n_rows - 1):
        slots = slice(t * k, (t + 1) * k)
        h_tok = moe_ffn_gate_ref(w1, w3, xf[t], dtype_ref, ids[t], np.ones(k, np.float32))
        np.testing.assert_allclose(want_h[slots].reshape(-1), h_tok, rtol=2.0**-10, atol=2.0**-24)
        x_tok = moe_matvec_residual_ref(w2, h_tok * np.repeat(w[t], hidden_dim), dtype_ref, ids[t], x0[t])
        np.testing.assert_allclose(want_x[t], x_tok, rtol=3e-3, atol=3e-3 * np.abs(x_tok).max())
        y_tok = matvec_residual_ref(w2[ids[t, 0]], want_h[t * k].astype(np.float32), dtype_ref, x0[t])
        np.testing.assert_allclose(x0[t] + want_y[t * k], y_tok, rtol=1e-5, atol=1e-5 * np.abs(y_tok).max())


@gpu_only("realistic shapes")
@pytest.mark.parametrize("dtype", ["fp16", "fp8", "gf4", "q8", "q4"])
def test_expert_matmul_mixtral_shape(dtype):
    """Mixtral-like: dim 4096, hidden_dim 14336 (a slice of it: 1432; q8 / q4: 1440, whole
    groups), 8 experts, top 2, 300 rows routed at random, on the default tile."""
    rng = np.random.default_rng(7)
    n_rows, n_experts, k, dim, hidden_dim = 300, 8, 2, 4096, 1440 if dtype in formats.QUANTIZED else 1432
    ids = np.stack([rng.permutation(n_experts)[:k] for _ in range(n_rows)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (n_rows, k)).astype(np.float32)
    stream = cuda.stream()
    routes = RowRoutes(cuda.to_device(ids), cuda.to_device(w))
    experts = ExpertRows(*(cuda.device_array(s, d) for s, d in
                           ((n_experts, np.int32), ((n_experts, n_rows), np.int32), ((n_experts, n_rows), np.float32))))  # fmt: skip
    moe_group(routes, experts, stream=stream)

    def stack(rows: int, cols: int) -> np.ndarray | formats.Quantized:
        return formats.encode(rng.standard_normal((n_experts, rows, cols)).astype(np.float32), dtype)

    stored = stack(hidden_dim, dim), stack(hidden_dim, dim), stack(dim, hidden_dim)
    w1_dev, w3_dev, w2_dev = (to_device(s) for s in stored)
    (w1, w3, w2), dtype_ref = reference_weights(stored, dtype)
    xb = formats.fp16_encode(rng.standard_normal((n_rows, dim)) * 0.05)
    h = cuda.device_array((n_rows * k, hidden_dim), np.float16)
    expert_matmul(
        cuda.to_device(xb), w1_dev, h, dtype, experts, routes, stream=stream, mode="gate", w3=w3_dev
    )
    want_h = expert_gate_ref(xb, w1, w3, dtype_ref, ids)
    got_h = h.copy_to_host(stream=stream)
    stream.synchronize()
    rel = np.linalg.norm(got_h.astype(np.float32) - want_h) / np.linalg.norm(want_h.astype(np.float32))
    assert rel < 1e-3
    y = cuda.device_array((n_rows * k, dim), np.float32)
    expert_matmul(cuda.to_device(want_h), w2_dev, y, dtype, experts, routes, stream=stream)
    want_y = expert_matmul_ref(want_h, w2, dtype_ref, ids)
    got_y = y.copy_to_host(stream=stream)
    stream.synchronize()
    assert np.linalg.norm(got_y - want_y) / np.linalg.norm(want_y) < 1e-5


def test_expert_matmul_rejects_bad_shapes():
    ids = cuda.to_device(np.zeros((3, 2), np.int32))
    routes = RowRoutes(ids, cuda.to_device(np.zeros((3, 2), np.float32)))
    experts = ExpertRows(
        cuda.to_device(np.zeros(4, np.int32)), cuda.to_device(np.zeros((4, 3), np.int32)), None
    )
    w = cuda.to_device(np.zeros((4, 8, 16), np.float16))
    x = cuda.to_device(np.zeros((3, 16), np.float16))
    with pytest.raises(PycalmError, match="plain or gate"):
        expert_matmul(x, w, None, "fp16", experts, routes, stream=0, mode="residual")
    with pytest.raises(PycalmError, match="w3"):
        expert_matmul(x, w, None, "fp16", experts, routes, stream=0, mode="gate")
    out = cuda.to_device(np.zeros((6, 8), np.float32))
    with pytest.raises(PycalmError, match="do not fit"):  # plain reads the 6 slots, not the 3 rows
        expert_matmul(x, w, out, "fp16", experts, routes, stream=0)
    with pytest.raises(PycalmError, match="moe_combine_rows"):
        moe_combine_rows(out, routes, cuda.to_device(np.zeros((3, 9), np.float32)), stream=0)
