"""Mixture of experts (Mixtral): routing, and the chosen experts' FFN on the matvec kernels.

  xb = rmsnorm(x) * ffn_norm
  logits = G xb  (G: (n_experts, dim) float32);  chosen = the k largest (ties: lower index first)
  weights = softmax(logits[chosen]);  x += sum_j weights_j * W2_e(silu(W1_e xb) * W3_e xb)
Only the chosen experts' weights are read. References: pycalm.cpu.reference.moe_route_ref,
moe_ffn_gate_ref, moe_matvec_residual_ref.

On the GPU a layer's MoE block is three launches, with no host round trip (the token step is
one captured CUDA graph, so the chosen experts live in device memory, never in launch
arguments):
  moe_route            route.ids (k,) int32, route.weights (k,) float32   (one block)
  moe_ffn_gate         h[s] = weights[s] * silu(W1_e xb) * (W3_e xb), e = ids[s]
  moe_matvec_residual  x += sum over slots s of W2_e h[s]
k = n_experts_active. h is (k * hidden_dim,) float32, slot by slot; it carries the routing
weight, so that the W2 launch adds every slot straight into the residual. The two expert
launches are the slot form of pycalm.kernels.matvec's kernel ("Expert slots"): a stack
(n_experts, rows, cols) is viewed as (n_experts * rows, cols) and slot s reads the rows of
expert ids[s].

Routing kernel, thread mapping: one block. Thread t takes columns t, t + blockDim, ... of x; for
each it loads x, norm_w and the n_experts gate weights of the column (the kernel is compiled per
n_experts, so the n_experts partial sums are registers and their loads are in flight together)
and adds x^2 for the norm. Each warp reduces its n_experts partial sums with shuffles into
shared memory ([expert, warp]); warp e then reduces expert e's warp sums the same way (a fixed
butterfly order: the logits are deterministic) and scales them by rsqrt(mean(x^2) + eps), as the
matvec kernels' rms_factor does (the norm factors out of the dot products). Thread 0 picks the
top k by scans of the logits in shared memory (strict >: ties go to the lower index; the picks
come out in descending order), takes the softmax over them and writes route_ids and route_w; it
reads nothing back from global memory (each read-after-write there is a round trip to L2).

Bytes moved: routing G (4 n_experts dim), x and norm_w (8 dim), the route (8 k); the expert
launches k / n_experts of each stack (the chosen experts' matrices only) and the activations.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import config as _numba_config
from numba import cuda, float32, int32

from pycalm.errors import PycalmError
from pycalm.kernels.common import WARP, block_reduce_sum, dependent_start, warp_reduce_sum
from pycalm.kernels.matvec import GATE, RESIDUAL, launch_matvec
from pycalm.model.formats import Quantized


@dataclass(frozen=True)
class Route:
    """The experts chosen for the current token, in device memory (written by moe_route, read
    by the expert launches: a captured graph follows the routing)."""

    ids: object  # (n_experts_active,) int32, in descending logit order
    weights: object  # (n_experts_active,) float32, the softmax over the chosen logits


# ---------------------------------------------------------------------------------------------
# GPU kernels

MAX_EXPERTS = 32  # a warp's worth: thread e < n_experts finishes logit e
THREADS = 1024  # routing block (the simulator runs a Python thread per thread: fewer there)
SIM_THREADS = 64


@functools.cache
def route_row(n_experts: int):  # noqa: ANN201
    """The device function that routes one row for n_experts experts (a compile-time size: the
    partial sums are registers), a block a row: route_row(gate, x, norm_w, eps, k, route_ids,
    route_w) with gate (n_experts, dim) float32, x (dim,) float32, norm_w (dim,) float32,
    route_ids (k,) int32 and route_w (k,) float32 written by thread 0. moe_route_kernel (the
    token step) and pycalm.kernels.rows.moe_route_rows_kernel (a block a row of T) call it.
    Reference: pycalm.cpu.reference.moe_route_ref of rmsnorm_ref(x) * norm_w."""
    n = n_experts

    @cuda.jit(device=True, inline=True)
    def route_row(gate, x, norm_w, eps, k, route_ids, route_w):  # noqa: ANN001, ANN202
        part = cuda.shared.array((MAX_EXPERTS, WARP), float32)  # [e, warp]: a warp's sum for logit e
        logits = cuda.shared.array(MAX_EXPERTS, float32)
        chosen = cuda.shared.array(MAX_EXPERTS, int32)  # 1: already picked
        pick = cuda.shared.array(MAX_EXPERTS, int32)  # the picks in order (no global round trip)
        scratch = cuda.shared.array(WARP, float32)  # block reduction
        t = cuda.threadIdx.x
        lane = t % WARP
        warp = t // WARP
        dim = x.shape[0]
        acc = cuda.local.array(n, float32)  # constant indices after unrolling: registers
        for e in range(n):
            acc[e] = float32(0.0)
        ss = float32(0.0)
        for i in range(t, dim, cuda.blockDim.x):
            v = x[i]
            ss += v * v
            xn = v * norm_w[i]  # rmsnorm(x) * norm_w, the rsqrt factor applied to the sums
            for e in range(n):
                acc[e] += gate[e, i] * xn
        for e in range(n):
            s = warp_reduce_sum(acc[e])  # every lane gets the warp's sum
            if lane == 0:
                part[e, warp] = s
        # its first barrier also makes every warp's part visible to the block
        ss = block_reduce_sum(ss, scratch)
        rms = float32(1.0) / math.sqrt(ss / float32(dim) + eps)
        n_warps = cuda.blockDim.x // WARP
        for e in range(warp, n, n_warps):  # warp-uniform: warp e sums expert e's warp sums
            s = warp_reduce_sum(part[e, lane] if lane < n_warps else float32(0.0))
            if lane == 0:
                logits[e] = s * rms
                chosen[e] = 0
        cuda.syncthreads()  # every logit is written and no expert is marked chosen
        if t == 0:
            for j in range(k):  # the largest unpicked logit; strict >: ties to the lower index
                best = -1
                for e in range(n):
                    if chosen[e] == 0 and (best < 0 or logits[e] > logits[best]):
                        best = e
                chosen[best] = 1
                pick[j] = best
            top = logits[pick[0]]  # the first pick is the largest: exp(l - top) <= 1
            total = float32(0.0)
            for j in range(k):
                total += math.exp(logits[pick[j]] - top)
            for j in range(k):  # the only global writes: nothing is read back
                route_ids[j] = pick[j]
                route_w[j] = math.exp(logits[pick[j]] - top) / total

    return route_row


@functools.cache
def moe_route_kernel(n_experts: int):  # noqa: ANN201
    """The routing kernel for n_experts experts: route_row for the token, one block.
    Reference: pycalm.cpu.reference.moe_route_ref. Arguments: gate (n_experts, dim) float32, x
    (dim,) float32, norm_w (dim,) float32, eps float32, k int32, route_ids (k,) int32 and
    route_w (k,) float32 (written)."""
    route = route_row(n_experts)

    def moe_route_kernel(gate, x, norm_w, eps, k, route_ids, route_w):
        dependent_start()  # in a programmatic graph: wait for the earlier kernels
        route(gate, x, norm_w, eps, k, route_ids, route_w)

    moe_route_kernel.__name__ = moe_route_kernel.__qualname__ = f"moe_route_kernel_{n_experts}"
    return cuda.jit(cache=True)(moe_route_kernel)


def moe_route(
    layer: object, x: object, route: Route, cfg: object, *, stream: object, threads: int | None = None
) -> None:
    """route.ids, route.weights = the top k experts of G (rmsnorm(x) * ffn_norm) and the softmax
    over their logits, k = cfg.n_experts_active. layer: .moe_gate (n_experts, dim) float32,
    .ffn_norm (dim,) float32; x (dim,) float32. threads: a multiple of 32 up to 1024 (default
    THREADS; SIM_THREADS under the simulator). Reference: pycalm.cpu.reference.moe_route_ref."""
    gate = layer.moe_gate
    n_experts, k = gate.shape[0], cfg.n_experts_active
    if not 0 < n_experts <= MAX_EXPERTS:
        raise PycalmError(f"moe_route: {n_experts} experts; the routing kernel takes 1..{MAX_EXPERTS}")
    if not 0 < k <= n_experts:
        raise PycalmError(f"moe_route: k = {k} experts of {n_experts}")
    if threads is None:
        threads = SIM_THREADS if _numba_config.ENABLE_CUDASIM else THREADS
    kernel = moe_route_kernel(n_experts)
    args = (gate, x, layer.ffn_norm, np.float32(cfg.norm_eps), np.int32(k), route.ids, route.weights)
    kernel[1, threads, stream](*args)


def _stack_2d(w: object) -> object:
    """(n_experts, rows, cols) stack -> its (n_experts * rows, cols) view (no copy); q8 / q4: the
    codes' view, and the scales as they are (the matvec launch flattens their leading dims)."""
    if isinstance(w, Quantized):
        return Quantized(_stack_2d(w.codes), w.scales)
    return w.reshape(w.shape[0] * w.shape[1], w.shape[2])


def _stack_rows(w: object) -> int:
    """The rows of one expert's matrix in a stored (n_experts, rows, cols) stack."""
    return (w.codes if isinstance(w, Quantized) else w).shape[1]


def moe_ffn_gate(layer: object, x: object, h: object, route: Route, cfg: object, *, stream: object) -> None:
    """h[s * hidden_dim + r] = weights[s] * (silu(W1_e xn) * (W3_e xn))[r], e = route.ids[s],
    xn = rmsnorm(x) * layer.ffn_norm, for the k = cfg.n_experts_active slots. layer: .w1, .w3
    stored (n_experts, hidden_dim, dim) stacks (q8 / q4: Quantized), both in the format
    .dtypes["w1"], .ffn_norm (dim,) float32; x (dim,) float32; h (k * hidden_dim,) float32.
    Reference: pycalm.cpu.reference.moe_ffn_gate_ref."""
    k, hidden_dim, dtype = cfg.n_experts_active, _stack_rows(layer.w1), layer.dtypes["w1"]
    if layer.dtypes["w3"] != dtype:
        raise PycalmError(
            f"moe_ffn_gate: w1 in {dtype} and w3 in {layer.dtypes['w3']}: one launch takes one format"
        )
    if h.shape[0] != k * hidden_dim or route.ids.shape[0] < k or route.weights.shape[0] < k:
        raise PycalmError(f"moe_ffn_gate: h of {h.shape[0]} for {k} slots of {hidden_dim}")
    launch_matvec(
        _stack_2d(layer.w1), _stack_2d(layer.w3), x, layer.ffn_norm, cfg.norm_eps, h, dtype, GATE,
        stream=stream, route_ids=route.ids, route_w=route.weights, n_slots=k, expert_rows=hidden_dim,
    )  # fmt: skip


def moe_matvec_residual(
    layer: object, h: object, x: object, route: Route, cfg: object, *, stream: object
) -> None:
    """x += sum over the k = cfg.n_experts_active slots s of W2_e h[s * hidden_dim : (s + 1) *
    hidden_dim], e = route.ids[s]. layer: .w2 stored (n_experts, dim, hidden_dim) stack (q8 / q4:
    Quantized) in the format .dtypes["w2"]; h (k * hidden_dim,) float32; x (dim,) float32.
    Reference: pycalm.cpu.reference.moe_matvec_residual_ref."""
    w2, k, dim = layer.w2, cfg.n_experts_active, _stack_rows(layer.w2)
    if x.shape[0] != dim or route.ids.shape[0] < k or h.shape[0] % k:
        raise PycalmError(f"moe_matvec_residual: x of {x.shape[0]} and h of {h.shape[0]} for {k} slots")
    w = _stack_2d(w2)
    launch_matvec(
        w, w, h, None, 0.0, x, layer.dtypes["w2"], RESIDUAL, stream=stream,
        route_ids=route.ids, route_w=h, n_slots=k, expert_rows=dim,
    )  # fmt: skip
