"""QKV projection fused with bias, RoPE and the KV-cache write.

qkv = Wqkv x (+ bqkv)            rows: q (n_heads * head_dim), k, v (n_kv_heads * head_dim each)
q, k rotated in interleaved pairs: for i < rotary_dim / 2, with a = pos * freqs[i],
    (x[2i], x[2i+1]) -> (x[2i] cos a - x[2i+1] sin a, x[2i] sin a + x[2i+1] cos a)
k, v written to the caches at row `pos`; q goes to the attention step.
"""

from __future__ import annotations

import numpy as np

from pycalm.kernels.matvec import matvec_ref


def rope_ref(x: np.ndarray, pos: int, freqs: np.ndarray, head_dim: int) -> np.ndarray:
    """x: (n_heads * head_dim,) float32, freqs: (rotary_dim // 2,) float32 -> rotated copy."""
    out = x.astype(np.float32).reshape(-1, head_dim).copy()
    half = freqs.shape[0]
    angle = np.float32(pos) * freqs.astype(np.float32)  # (rotary_dim // 2,) float32, as the GPU does
    c, s = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    x0 = out[:, 0 : 2 * half : 2].copy()
    x1 = out[:, 1 : 2 * half : 2].copy()
    out[:, 0 : 2 * half : 2] = x0 * c - x1 * s
    out[:, 1 : 2 * half : 2] = x0 * s + x1 * c
    return out.reshape(-1)


def qkv_ref(
    wqkv: np.ndarray,
    bqkv: np.ndarray | None,
    x: np.ndarray,
    dtype: str,
    pos: int,
    freqs: np.ndarray,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> q (n_heads*head_dim,), k, v (n_kv_heads*head_dim,), float32; q and k rotated."""
    qkv = matvec_ref(wqkv, x, dtype)
    if bqkv is not None:
        qkv = qkv + bqkv.astype(np.float32)
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    q = rope_ref(qkv[:q_dim], pos, freqs, head_dim)
    k = rope_ref(qkv[q_dim : q_dim + kv_dim], pos, freqs, head_dim)
    v = qkv[q_dim + kv_dim :].astype(np.float32)
    return q, k, v


# =============================================================================================
# GPU kernel: RMSNorm + QKV matvec + bias + RoPE + KV-cache write, one launch
#
# Thread mapping: the row-group matvec of pycalm.kernels.matvec (one warp, R consecutive rows of
# Wqkv, x = rmsnorm(x) * norm_w staged in shared memory once: dim <= XCHUNK). head_dim is even,
# so the rows 2i, 2i + 1 of a group never straddle a head and are exactly one rotary pair
# (i = (row % head_dim) / 2): the warp holds both values after its reduction and rotates them
# with no barrier. Lane 0 writes q, or encodes k / v to the cache dtype and writes them at row
# pos = state[STATE_POS]. The bias is a runtime flag (a missing bias passes x as a dummy), so
# one kernel a weight kind and KV dtype serves models with and without q/k/v biases.
#
# Bytes moved: Wqkv, x, norm_w, the bias, q written (4 q_dim) and one cache row of k and v.
# =============================================================================================

import functools  # noqa: E402

from numba import cuda, float32, uint8, uint64  # noqa: E402

from pycalm.errors import PycalmError  # noqa: E402
from pycalm.kernels.common import (  # noqa: E402
    STATE_POS,
    WARP,
    fp8_encode,
    fp16_encode,
    grid_dependency_wait,
    launch_dependents,
    sincos,
    warp_reduce_sum,
)
from pycalm.kernels.matvec import (  # noqa: E402
    KINDS,
    XCHUNK,
    XPAIRS,
    Variant,
    launch_shape,
    make_group_dot,
    make_preload,
    make_stage_x,
    row_scale,
    staged_rms,
    variant_for,
    weight_kind,
)


def _make_store(fp8_kv: bool):  # noqa: ANN202
    @cuda.jit(device=True, inline=True)
    def store_pair(a, b, r0, bias, has_bias, freqs, pos, q, k_cache, v_cache, q_dim, kv_dim, head_dim):  # noqa: ANN001, ANN202
        """Rows r0, r0 + 1 (values a, b): bias, RoPE for q and k, then q or the caches."""
        if has_bias:
            a += bias[r0]
            b += bias[r0 + 1]
        i = (r0 % head_dim) // 2  # the rotary pair within the head
        if r0 < q_dim + kv_dim and i < freqs.shape[0]:
            sn, cs = sincos(float32(pos) * freqs[i])
            a, b = a * cs - b * sn, a * sn + b * cs
        if r0 < q_dim:
            q[r0] = a
            q[r0 + 1] = b
        else:
            if r0 < q_dim + kv_dim:
                c = r0 - q_dim
                cache = k_cache
            else:
                c = r0 - q_dim - kv_dim
                cache = v_cache
            if fp8_kv:
                cache[pos, c] = uint8(fp8_encode(a))
                cache[pos, c + 1] = uint8(fp8_encode(b))
            else:
                cache[pos, c] = fp16_encode(a)
                cache[pos, c + 1] = fp16_encode(b)

    return store_pair


def _qkv_source(n_rows: int, unroll: int, early: bool) -> str:
    rr = range(n_rows)
    accs = ", ".join(f"a{r}" for r in rr)
    cs = ", ".join(f"c{r}_{u}" for u in range(unroll) for r in rr)
    mats = ", ".join(f"w, r{i}" for i in rr)
    src = [
        "def qkv_rope_kernel(w, bias, x, x64, norm_w, eps, freqs, state, q, k_cache, v_cache, q_dim, kv_dim,",
        "                    head_dim, has_bias):",
        "    xs = cuda.shared.array(XPAIRS, uint64)  # x (one chunk) as float pairs, transposed by word",
        "    scratch = cuda.shared.array(32, float32)  # block reduction",
        "    lane = cuda.threadIdx.x % WARP",
        "    warp = cuda.threadIdx.x // WARP",
        "    n_warps = cuda.blockDim.x // WARP",
        "    rows = w.shape[0]",
        "    cols = x.shape[0]",
        "    nw = w.shape[1] // UNIT  # loads a row",
        f"    n_groups = (rows + {n_rows - 1}) // {n_rows}",
        "    stride = cuda.gridDim.x * n_warps",
        "    g = cuda.blockIdx.x * n_warps + warp",
    ]
    src += [f"    r{i} = min({n_rows} * min(g, n_groups - 1) + {i}, rows - 1)" for i in rr]
    if early:
        src.append(f"    {cs}, = preload({mats}, 0, nw, lane)  # streams in while x is staged")
    src += [
        "    grid_dependency_wait()  # x and state come from earlier kernels: read them after they finish",
        "    pos = state[STATE_POS]",
    ]
    src += [
        "    ss = stage_x(x64, norm_w, xs, 0, cols, 1)  # x * norm_w, and this thread's sum of x^2",
        "    scale = float32(ROW_SCALE) * staged_rms(ss, cols, eps, scratch)  # its barrier publishes xs",
        "    while g < n_groups:  # warp-uniform: the shuffles below see every lane",
        f"        {accs}, = group_dot({cs + ', ' if early else ''}{mats}, xs, 0, nw, lane)",
        "        gn = g + stride",
    ]
    src += [
        "        if gn >= n_groups:  # this warp's last weights are in: the next kernel may launch",
        "            launch_dependents()  # (and load its own while this one reduces and writes)",
    ]
    src += [f"        r{i} = min({n_rows} * min(gn, n_groups - 1) + {i}, rows - 1)" for i in rr]
    if early:
        src.append(f"        {cs}, = preload({mats}, 0, nw, lane)  # the next group's first step")
    src += [f"        a{i} = warp_reduce_sum(a{i}) * scale  # every lane gets the row sum" for i in rr]
    src.append("        if lane == 0:")
    for p in range(n_rows // 2):
        src.append(f"            if {n_rows} * g + {2 * p} < rows:  # rows is even: the pair is whole")
        src.append(
            f"                store_pair(a{2 * p}, a{2 * p + 1}, {n_rows} * g + {2 * p}, bias, has_bias, freqs, pos, q,"
        )
        src.append("                           k_cache, v_cache, q_dim, kv_dim, head_dim)")
    src.append("        g = gn")
    return "\n".join(src)


@functools.cache
def qkv_kernel_for(kind: str, v: Variant, kv_dtype: str):  # noqa: ANN201
    """The fused QKV kernel for a weight kind, inner-loop variant and KV-cache dtype."""
    k = KINDS[kind]
    cvt = v.cvt and k.dtype != "gf4"
    scope = {
        "cuda": cuda,
        "float32": float32,
        "uint64": uint64,
        "WARP": WARP,
        "XPAIRS": XPAIRS,
        "UNIT": max(1, k.load_bytes // 8),
        "STATE_POS": STATE_POS,
        "ROW_SCALE": row_scale(k.dtype, cvt),
        "staged_rms": staged_rms,
        "grid_dependency_wait": grid_dependency_wait,
        "launch_dependents": launch_dependents,
        "warp_reduce_sum": warp_reduce_sum,
        "stage_x": make_stage_x(kind),
        "group_dot": make_group_dot(kind, v.rows, v.unroll, v.prefetch, cvt, v.early),
        "store_pair": _make_store(kv_dtype == "fp8"),
        "preload": make_preload(kind, v.rows, v.unroll),
    }
    name = f"qkv_rope_kernel_{kind}_r{v.rows}u{v.unroll}{'p' if v.prefetch else ''}{'c' if cvt else ''}{'e' if v.early else ''}_{kv_dtype}"
    exec(
        compile(_qkv_source(v.rows, v.unroll, v.early), f"<pycalm.kernels.qkv generated {name}>", "exec"),
        scope,
    )  # noqa: S102
    fn = scope["qkv_rope_kernel"]
    fn.__name__ = fn.__qualname__ = name
    return cuda.jit(fn)


def qkv_rope(
    wqkv: object,
    bqkv: object,
    x: object,
    norm_w: object,
    eps: float,
    rope_freqs: object,
    state: object,
    q: object,
    k_cache: object,
    v_cache: object,
    dtype: str,
    kv_dtype: str,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    *,
    stream: object,
    variant: Variant | None = None,
) -> int:
    """q = rope(Wq xn + bq); k_cache[pos] = enc(rope(Wk xn + bk)); v_cache[pos] = enc(Wv xn + bv).

    wqkv: stored (q_dim + 2 kv_dim, dim); bqkv (q_dim + 2 kv_dim,) float32 or None; x, norm_w
    (dim,) float32; rope_freqs (rotary_dim // 2,) float32; state int32 (pos = state[STATE_POS]);
    q (q_dim,) float32; caches (seq_len, kv_dim) float16 ("fp16") or uint8 ("fp8"); variant:
    the inner loop's shape (the benchmark's alternatives), None for the default.
    -> bytes moved.
    """
    if kv_dtype not in ("fp16", "fp8"):
        raise PycalmError(f"unsupported KV-cache dtype {kv_dtype!r} (fp16 or fp8)")
    if x.shape[0] > XCHUNK:
        raise PycalmError(f"qkv_rope: dim {x.shape[0]} is above the {XCHUNK} columns one block stages")
    wv, kind = weight_kind(wqkv, dtype, variant.wide if variant is not None else True)
    v = variant_for(kind, variant)
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    rows = wqkv.shape[0]
    assert rows == q_dim + 2 * kv_dim and head_dim % 2 == 0
    has_bias = bqkv is not None
    kernel = qkv_kernel_for(kind, v, kv_dtype)  # (the warps a block are not compiled in)
    args = (
        wv, bqkv if has_bias else x, x, x.view(np.uint64), norm_w, np.float32(eps), rope_freqs, state, q,
        k_cache, v_cache,
        q_dim, kv_dim, head_dim, np.int32(has_bias),
    )  # fmt: skip
    v = v._replace(direct=False)  # qkv always stages x (and its norm)
    grid, n_threads = launch_shape(kernel, args, -(-rows // v.rows), x.shape[0], v, variant is None)
    kernel[grid, n_threads, stream](*args)
    kv_row = 2 * kv_dim * k_cache.dtype.itemsize
    extra = int(bqkv.nbytes) if has_bias else 0
    return int(wqkv.nbytes) + int(x.nbytes) + int(norm_w.nbytes) + extra + 4 * q_dim + kv_row


_SIG_KV = {"fp16": "float16", "fp8": "uint8"}
COMPILE_CHECK = [
    (
        qkv_kernel_for(kind, variant_for(kind, None), kv),
        f"void({'uint32' if KINDS[kind].load_bytes == 4 else 'uint64'}[:, ::1], float32[::1], float32[::1], uint64[::1], "
        f"float32[::1], float32, float32[::1], int32[::1], float32[::1], {_SIG_KV[kv]}[:, ::1], "
        f"{_SIG_KV[kv]}[:, ::1], int64, int64, int64, int32)",
    )
    for kind in ("fp16", "fp8", "gf4", "fp8n", "gf4n")
    for kv in ("fp16", "fp8")
]
