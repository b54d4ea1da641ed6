"""prefill_attention (block-causal attention of T query rows) against prefill_attention_ref, and
both against T calls of the decode reference attention_ref at positions pos0 .. pos0 + T - 1.

The cases cover T = 1, T not a multiple of a block's query positions, pos0 > 0 with earlier
cache rows filled, GQA groups 1, 2, 3, 7 (a block of 16 rows holds 16 // group positions), a
sliding window shorter than T and one longer than the context, both KV dtypes, contexts of
several key tiles (16 keys a tile under the simulator), and cache rows past pos0 + T holding NaN
(stale rows of an earlier context), which must not reach the output. Under the simulator the
head_dims are 16 and 32; with PYCALM_TEST_GPU=1 the same cases run on the GPU, plus the real
models' head_dims 64 and 128 with the GPU's blocks.
Tolerance: the kernel writes fp16, so half an fp16 ulp (2^-11 relative) on top of 2e-5 absolute
for float32 sums in another order (outputs are convex mixes of V rows in [-1, 1]); q and p reach
the tensor cores as two fp16 parts each (pycalm.kernels.prefill_attention), which the same
tolerance holds.
"""

import numpy as np
import pytest
from gpu import GPU
from numba import cuda
from tiny_models import attention_config as config

from pycalm.cpu.reference import attention_ref, prefill_attention_ref
from pycalm.errors import PycalmError
from pycalm.kernels.attention import KVCache
from pycalm.kernels.common import STATE_POS, STATE_ROWS
from pycalm.kernels.matmul import sm_count
from pycalm.kernels.prefill_attention import (
    MAX_SPLITS,
    prefill_attention,
    prefill_attention_bytes,
    prefill_attention_flops,
    prefill_attention_scratch,
    split_count,
)
from pycalm.model import formats


def _case(n_heads, n_kv_heads, head_dim, kv_dtype, n_rows, pos0, window, seed):
    rng = np.random.default_rng(seed)
    seq_len = pos0 + n_rows + 5
    kv_dim = n_kv_heads * head_dim
    q = rng.standard_normal((n_rows, n_heads * head_dim)).astype(np.float32)
    k = rng.uniform(-1, 1, (seq_len, kv_dim)).astype(np.float32)
    v = rng.uniform(-1, 1, (seq_len, kv_dim)).astype(np.float32)
    k[rng.integers(0, pos0 + n_rows, 3)] *= 4  # a few large scores: peaked rows, tiles whose max differ
    kq, vq = formats.encode(k, kv_dtype), formats.encode(v, kv_dtype)
    kq.view(np.uint8)[pos0 + n_rows :] = 0xFF  # NaN as fp16 and e5m2: rows no query may read
    vq.view(np.uint8)[pos0 + n_rows :] = 0xFF
    return q, kq, vq, formats.decode(kq, kv_dtype), formats.decode(vq, kv_dtype)


def _run(n_heads, n_kv_heads, head_dim, kv_dtype, n_rows, pos0, window, seed=0, split=False, **shape):
    """With split, the launch takes a scratch (the keys split over blocks where they are few), and
    runs twice on it: the merging blocks reset its counters, so the second gives the same bits."""
    q, kq, vq, kd, vd = _case(n_heads, n_kv_heads, head_dim, kv_dtype, n_rows, pos0, window, seed)
    state = np.array([0, 0, 0, 0], np.int32)
    state[STATE_POS] = pos0
    stream = cuda.stream()
    cache = KVCache(cuda.to_device(kq), cuda.to_device(vq), kv_dtype)
    cfg = config(n_heads, n_kv_heads, head_dim, window)
    scratch = prefill_attention_scratch(cfg, stream) if split else None
    outs = []
    for _ in range(2 if split else 1):
        out = cuda.to_device(np.full((n_rows, n_heads * head_dim), np.nan, np.float16))
        prefill_attention(cuda.to_device(q), cache, cuda.to_device(state), out, cfg, stream=stream,
                          scratch=scratch, **shape)  # fmt: skip
        outs.append(out.copy_to_host(stream=stream))
    stream.synchronize()
    assert all(np.array_equal(o.view(np.uint16), outs[0].view(np.uint16)) for o in outs)
    got = outs[0].astype(np.float32)
    want = prefill_attention_ref(q, kd, vd, pos0, n_heads, n_kv_heads, head_dim, window)
    np.testing.assert_allclose(got, want, rtol=2.0**-11, atol=2e-5)
    # the key property: row t is the decode attention of q[t] at position pos0 + t
    rows = [
        attention_ref(q[t], kd, vd, pos0 + t + 1, n_heads, n_kv_heads, head_dim, window)
        for t in range(n_rows)
    ]
    np.testing.assert_allclose(got, np.stack(rows), rtol=2.0**-11, atol=2e-5)


SIM_CASES = [
    # n_heads, n_kv_heads, head_dim, kv_dtype, T, pos0, window  (16 rows a block under the simulator)
    (2, 2, 16, "fp16", 1, 0, 0),  # T = 1 at position 0: one key
    (3, 1, 16, "fp8", 7, 7, 0),  # group 3: 5 positions a block (15 rows), the second block ragged
    (4, 2, 32, "fp16", 11, 20, 0),  # group 2, pos0 > 0: keys 0..30 in two tiles, two blocks
    (7, 1, 16, "fp16", 3, 14, 0),  # group 7: 2 positions a block (14 of 16 rows used)
    (2, 1, 32, "fp8", 13, 10, 6),  # a sliding window shorter than T: each row's keys start late
    (4, 4, 16, "fp16", 9, 0, 40),  # group 1, a window longer than the context: no effect
    (2, 1, 16, "fp8", 1, 37, 0),  # T = 1 late in the context: three tiles, the decode step's shape
    (2, 1, 16, "fp16", 5, 70, 0),  # one block over five tiles: split, five splits (the merge's odd tail)
]
GPU_CASES = [
    (32, 8, 128, "fp16", 77, 100, 0),  # Llama-3-8B heads: group 4, 8 positions a block
    (32, 8, 128, "fp8", 300, 0, 0),
    (32, 32, 128, "fp8", 5, 700, 0),  # group 1
    (14, 2, 64, "fp16", 37, 50, 0),  # Qwen2.5-0.5B heads: group 7
    (32, 4, 64, "fp8", 130, 33, 50),  # TinyLlama heads (group 8), a window of 50
    (9, 3, 64, "fp16", 1, 300, 0),  # SmolLM2 heads: group 3, T = 1
    (32, 8, 128, "fp16", 40, 3000, 0),  # a chat turn deep in the context: 40 blocks, 6 splits
]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,kv_dtype,n_rows,pos0,window", SIM_CASES + (GPU_CASES if GPU else [])
)
def test_prefill_attention_matches_refs(n_heads, n_kv_heads, head_dim, kv_dtype, n_rows, pos0, window, split):
    """Unsplit, and with a scratch: then the launches of fewer blocks than a wave split their keys
    (under the simulator's 2 SMs, splits of a tile at least: 2, 3 and 5 splits in four cases, the
    blocks past the tiles returning at once; on the GPU, splits of 4 tiles at least: the 5-row
    case's 3 splits of its 12 tiles, the 40-row case's 6 of 48)."""
    _run(n_heads, n_kv_heads, head_dim, kv_dtype, n_rows, pos0, window, seed=n_rows + pos0, split=split)


def test_prefill_attention_split_counts():
    """The launches split where their blocks leave a wave's slots idle, and not where they fill it."""
    wave = 2 * sm_count()  # head_dim 128: two blocks an SM
    assert split_count(wave, 128) == 1
    assert split_count(wave // 2, 128) == 2
    assert split_count(1, 128) == min(MAX_SPLITS, wave)


@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,kv_dtype,n_rows,pos0,window,page",
    [(4, 2, 32, "fp16", 11, 20, 0, 4), (3, 1, 16, "fp8", 7, 9, 5, 8)]
    + ([(32, 8, 128, "fp16", 200, 100, 0, 16), (32, 8, 128, "fp8", 77, 500, 0, 16)] if GPU else []),
)
def test_prefill_attention_over_pages_is_the_contiguous_bits(
    n_heads, n_kv_heads, head_dim, kv_dtype, n_rows, pos0, window, page
):
    """The paged form (a batched pass of one sequence's prompt chunk, pycalm.gpu.batched): the
    cache rows scattered over a pool by a shuffled block table, q padded to a bucket of more
    rows, state[STATE_ROWS] the live ones: each live row's output is the contiguous cache's bits,
    and the padding rows' out is zero (the products after the attention read it)."""
    q, kq, vq, _, _ = _case(n_heads, n_kv_heads, head_dim, kv_dtype, n_rows, pos0, window, seed=5)
    seq_len, cfg = kq.shape[0], config(n_heads, n_kv_heads, head_dim, window)
    n_pages = -(-seq_len // page)
    rng = np.random.default_rng(6)
    table = rng.permutation(n_pages + 3)[:n_pages].astype(np.int32)  # (max_pages,) the sequence's pages
    rows = table[np.arange(seq_len) // page] * page + np.arange(seq_len) % page  # its positions' pool rows
    pool_k = np.full(((n_pages + 3) * page, kq.shape[1] * kq.itemsize), 0xFF, np.uint8).view(
        kq.dtype
    )  # NaN elsewhere
    pool_v = pool_k.copy()
    pool_k[rows], pool_v[rows] = kq, vq
    state = np.zeros(4, np.int32)
    state[STATE_POS], state[STATE_ROWS] = pos0, n_rows
    cfg_args = dict(stream=cuda.default_stream())
    want = cuda.to_device(np.full((n_rows, n_heads * head_dim), np.nan, np.float16))
    prefill_attention(cuda.to_device(q), KVCache(cuda.to_device(kq), cuda.to_device(vq), kv_dtype),
                      cuda.to_device(state), want, cfg, **cfg_args)  # fmt: skip
    bucket = 1 << (n_rows - 1).bit_length()  # the pass's rows: padding past n_rows
    padded = np.concatenate([q, rng.standard_normal((bucket - n_rows, q.shape[1])).astype(np.float32)])
    got = cuda.to_device(np.full((bucket, n_heads * head_dim), np.nan, np.float16))
    pool = KVCache(cuda.to_device(pool_k), cuda.to_device(pool_v), kv_dtype)
    prefill_attention(cuda.to_device(padded), pool, cuda.to_device(state), got, cfg, **cfg_args,
                      table=cuda.to_device(table), page_size=page)  # fmt: skip
    got, want = got.copy_to_host(), want.copy_to_host()
    assert np.array_equal(got[:n_rows].view(np.uint16), want.view(np.uint16))
    assert np.array_equal(got[n_rows:], np.zeros_like(got[n_rows:]))
    with pytest.raises(PycalmError, match="power of two"):
        out = cuda.to_device(np.zeros((bucket, n_heads * head_dim), np.float16))
        prefill_attention(cuda.to_device(padded), pool, cuda.to_device(state), out, cfg, **cfg_args,
                          table=cuda.to_device(table), page_size=6)  # fmt: skip


def test_prefill_attention_block_shapes():
    # a block of 2 warps (32 rows: 16 positions of group 2) and tiles of 32 keys
    _run(4, 2, 16, "fp16", 21, 9, 0, warps=2, keys=32)


def test_prefill_attention_rejects_bad_shapes():
    q = cuda.to_device(np.zeros((3, 64), np.float32))
    out = cuda.to_device(np.zeros((3, 64), np.float16))
    cache = cuda.to_device(np.zeros((8, 32), np.float16))
    state = cuda.to_device(np.zeros(4, np.int32))
    with pytest.raises(PycalmError, match="KV cache dtype"):
        prefill_attention(q, KVCache(cache, cache, "fp32"), state, out, config(4, 2, 16), stream=0)
    with pytest.raises(PycalmError, match="not \\(T, 32\\)"):
        prefill_attention(q, KVCache(cache, cache, "fp16"), state, out, config(2, 2, 16), stream=0)
    with pytest.raises(PycalmError, match="fewer than the group 32"):
        prefill_attention(q, KVCache(cache, cache, "fp16"), state, out, config(32, 1, 16), stream=0, warps=1)
    with pytest.raises(PycalmError, match="24 keys a tile: not a multiple of 16"):
        prefill_attention(q, KVCache(cache, cache, "fp16"), state, out, config(4, 2, 16), stream=0, keys=24)
    with pytest.raises(PycalmError, match="head_dim 24 is not a multiple of 16"):
        prefill_attention(q, KVCache(cache, cache, "fp16"), state, out, config(4, 2, 24), stream=0)


def test_prefill_attention_flops_and_bytes():
    # 3 rows at positions 2, 3, 4 see 3, 4, 5 keys (a window of 4: 3, 4, 4)
    assert prefill_attention_flops(3, 2, config(2, 1, 8)) == 4 * 8 * 2 * 12
    assert prefill_attention_flops(3, 2, config(2, 1, 8, window=4)) == 4 * 8 * 2 * 11
    # q f32 and out f16 of 3 rows x 16, K and V rows 0..4 (window 4: 1..4) of 8 fp16 each
    assert prefill_attention_bytes(3, 2, config(2, 1, 8), "fp16") == 3 * 16 * 6 + 2 * 5 * 8 * 2
    assert prefill_attention_bytes(3, 2, config(2, 1, 8, window=2), "fp8") == 3 * 16 * 6 + 2 * 4 * 8


def _kernel_script() -> object:
    """scripts/kernels/prefill_attention.py as a module (imported with its folder on the path, as
    it imports its neighbours)."""
    import importlib
    import sys
    from pathlib import Path

    folder = str(Path(__file__).resolve().parents[1] / "scripts" / "kernels")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module("prefill_attention")
    finally:
        sys.path.remove(folder)


def test_kernel_script_versions():
    """scripts/kernels/prefill_attention.py (the versions: the fp32 SIMT kernel the tensor-core one
    replaced, kept for comparison, and q and p rounded once) imports, and its versions pass their
    checks at a small shape under the simulator (on the GPU: the real one)."""
    script = _kernel_script()
    cfg = script.config(4, 2, 32)
    cache = script.random_cache(40, cfg.kv_dim, "fp8", seed=3)
    for spec in (
        {"simt": (16, 8)},
        {"warps": 2, "keys": 32},
        {"tc": False},
        {"wg": True},
        {"wg": 2},
    ):
        assert script.check(cache, cfg, spec, 9, 17) <= 1, spec


@pytest.mark.parametrize(("n_heads", "n_kv_heads", "head_dim"), [(4, 1, 128), (8, 2, 64)])
def test_kernel_script_wgmma_version_at_model_head_dims(n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    """scripts/kernels/prefill_attention.py's wg and wg2 versions (the steps on wgmma) at Llama-3-8B's and
    TinyLlama's head_dim and group, both KV dtypes, over several tiles of keys: head_dim 128 takes
    two column blocks of q and K in the swizzled layout, 64 one."""
    script = _kernel_script()
    cfg = script.config(n_heads, n_kv_heads, head_dim)
    for kv_dtype in ("fp16", "fp8"):
        cache = script.random_cache(80, cfg.kv_dim, kv_dtype, seed=3)
        for spec in ({"wg": True}, {"wg": 2}):  # one K / V buffer, two
            assert script.check(cache, cfg, spec, 19, 40) <= 1, (kv_dtype, spec)
