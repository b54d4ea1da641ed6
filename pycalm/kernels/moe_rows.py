"""Mixtral's expert FFN for T rows at once (prefill), on the tensor cores, each expert's weights
read once a pass.

  routes      = each row's top k experts and their weights     rows.moe_route_rows
  experts     = the rows grouped by expert                     rows.moe_group
  h[t k + j]  = silu(xb[t] W1_e^T) * (xb[t] W3_e^T)            expert_matmul "gate"   expert_gate_ref
  y[t k + j]  = h[t k + j] W2_e^T                               expert_matmul "plain"  expert_matmul_ref
  x[t]       += sum over j = 0..k-1 of weights[t, j] y[t k + j] moe_combine_rows       moe_combine_rows_ref

with e = routes.ids[t, j] and k = n_experts_active: slot t k + j is row t's j-th choice. The
references are in pycalm.cpu.reference (next to the token step's MoE references, which they match
row by row up to the fp16 rounding of the matmuls' inputs).

The two expert launches are pycalm.kernels.matmul's tensor-core kernel in its grouped form: a
block takes one m-tile of one expert's group (moe_group's row list), gathers those rows of X by
cp.async (GATE: the normed token rows xb; PLAIN: the slots of h) and writes its outputs to their
slots; the weights come from the expert's matrix in the (n_experts, N, K) stack. The grid is
n_experts x ceil(T / BM) m-tiles by the N tiles, the expert's count on the device deciding which
blocks work (nothing is read back to the host, so a captured graph would replay it).

Determinism: every slot's sums are one block's, written once (no atomics), and the combine adds
a row's k slots in a fixed order, so a prompt gives the same logits on every run. The routing
weight is applied in the combine, as route-weight * (h W2^T).

moe_combine_rows: a thread an element of x (grid (column blocks, T)), reading the row's k slots
of y. Bytes moved by the layer's FFN: each expert's w1, w3 and w2 once (later m-tiles of a group
find them in L2); h (T k hidden_dim fp16) written and read back, y (T k dim float32) written and
read back, x read and written.
"""

from __future__ import annotations

from numba import config as _numba_config
from numba import cuda

from pycalm.errors import PycalmError
from pycalm.kernels.common import dependent_start
from pycalm.kernels.matmul import (
    MODES,
    SIM_TILE,
    TILE,
    UNIT,
    Tile,
    make_matmul_kernel,
    weight_args,
)
from pycalm.kernels.rows import ExpertRows, RowRoutes
from pycalm.model.formats import Quantized

THREADS = 32 if _numba_config.ENABLE_CUDASIM else 256  # moe_combine_rows' block


def expert_matmul(
    x: object,
    w: object,
    out: object,
    dtype: str,
    experts: ExpertRows,
    routes: RowRoutes,
    *,
    stream: object,
    mode: str = "plain",
    w3: object = None,
    tile: Tile | None = None,
) -> None:
    """For every slot t k + j (row t's j-th expert e = routes.ids[t, j]):
    "plain": out[t k + j] = x[t k + j] W_e^T, x (T k, K) float16 (the slots of h), out (T k, N)
    float32; "gate": out[t k + j] = silu(x[t] W_e^T) * (x[t] W3_e^T), x (T, K) float16 (the
    normed rows), out (T k, N) float16. W (and W3): stored (n_experts, N, K) stacks in `dtype`
    (q8 / q4: a formats.Quantized of the codes' and the scales' stacks);
    experts: moe_group's grouping of routes. Device arrays. References:
    pycalm.cpu.reference.expert_matmul_ref, expert_gate_ref."""
    if mode not in ("plain", "gate"):
        raise PycalmError(f"unknown expert matmul mode {mode!r} (plain or gate)")
    if (mode == "gate") != (w3 is not None):
        raise PycalmError("the gate takes w3, and only the gate")
    tile = tile or (SIM_TILE if _numba_config.ENABLE_CUDASIM else TILE)
    n_experts, n_cols = (w.codes if isinstance(w, Quantized) else w).shape[:2]
    n_rows, k = routes.ids.shape
    x_rows = n_rows if mode == "gate" else n_rows * k
    if x.shape[0] != x_rows or out.shape != (n_rows * k, n_cols) or experts.rows.shape != (n_experts, n_rows):
        raise PycalmError(
            f"expert_matmul {mode}: x {x.shape}, out {out.shape}, groups {experts.rows.shape} do not fit"
            f" {n_rows} rows of {k} experts of {n_experts} x {n_cols}"
        )
    if x.shape[1] % UNIT:
        raise PycalmError(f"expert_matmul needs K a multiple of {UNIT}, got {x.shape[1]}")
    kernel = make_matmul_kernel(dtype, MODES[mode], tile, grouped=True)
    out_n = tile.block_n // 2 if mode == "gate" else tile.block_n
    grid = (n_experts * -(-n_rows // tile.block_m), -(-n_cols // out_n))
    weights = weight_args(_stack_2d(w), None if w3 is None else _stack_2d(w3), dtype, x.shape[1])
    kernel[grid, tile.threads, stream](x, *weights, out, experts.count, experts.rows, routes.ids)


def _stack_2d(w: object) -> object:
    """(n_experts, rows, cols) stack -> its (n_experts * rows, cols) view (no copy); q8 / q4: the
    codes' and the scales' views alike (scales (n_experts * rows,) / (n_experts * rows, groups, 2))."""
    if isinstance(w, Quantized):
        return Quantized(
            _stack_2d(w.codes), w.scales.reshape(w.scales.shape[0] * w.scales.shape[1], *w.scales.shape[2:])
        )
    return w.reshape(w.shape[0] * w.shape[1], w.shape[2])


@cuda.jit(cache=True)
def moe_combine_rows_kernel(y, weights, x):  # noqa: ANN001, ANN201
    """Thread (column i, row t): x[t, i] += weights[t, j] * y[t k + j, i] for j = 0..k-1 in
    order. y (T k, dim) float32, weights (T, k) float32, x (T, dim) float32."""
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t = cuda.blockIdx.y
    if i < x.shape[1]:
        k = weights.shape[1]
        acc = x[t, i]
        for j in range(k):
            acc += weights[t, j] * y[t * k + j, i]
        x[t, i] = acc


def moe_combine_rows(y: object, routes: RowRoutes, x: object, *, stream: object) -> None:
    """x[t] += sum over j of routes.weights[t, j] * y[t k + j], j in order; y (T k, dim)
    float32, x (T, dim) float32. Reference: pycalm.cpu.reference.moe_combine_rows_ref."""
    n_rows, dim = x.shape
    if routes.weights.shape[0] != n_rows or y.shape != (n_rows * routes.weights.shape[1], dim):
        raise PycalmError(f"moe_combine_rows: y {y.shape}, weights {routes.weights.shape}, x {x.shape}")
    moe_combine_rows_kernel[(-(-dim // THREADS), n_rows), THREADS, stream](y, routes.weights, x)
