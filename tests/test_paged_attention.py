"""pycalm.kernels.attention over a paged KV cache (M rows, each its own sequence at its own
position, the batched pass's attention) against batch_attention_ref, and each row against
attention_ref over its sequence's keys laid out contiguously (the pages gathered back in order).

The cases cover both KV dtypes, GQA groups 1, 2, 3, pages of 16 rows in a shuffled pool (every
sequence spans several non-contiguous pages, none in order), pages of 8, rows at position 0, at
the last row of a page and the first of the next, several rows of one sequence at different
positions, padding rows (seq -1) which must come out zero, a sliding window, M odd, one or two
rows whose keys take several splits (merged by the last block: short splits of CHUNK keys), and
pool rows no row may read holding NaN (unused pages, the rows past a sequence's end), which must
not reach the output. Under the simulator the head_dims are 16 and 32; with PYCALM_TEST_GPU=1
the same cases run on the GPU, plus Llama-3-8B's heads (head_dim 128, 32 heads / 8 kv heads) at
positions up to ~3000.
Tolerance: the kernel writes fp16, so half an fp16 ulp (2^-11 relative) on top of
tests/test_attention.py's 2e-5 absolute for float32 sums in another order (outputs are convex
mixes of V rows in [-1, 1]): tests/test_prefill_attention.py's, the other fp16-output attention.
"""

import numpy as np
import pytest
from gpu import GPU
from numba import cuda
from tiny_models import attention_config as config

from pycalm.cpu.reference import attention_ref, batch_attention_ref
from pycalm.errors import PycalmError
from pycalm.kernels.attention import KVCache, attention, attention_scratch, attention_span
from pycalm.kernels.rows import Pages
from pycalm.model import formats

CHUNK = 8  # the shortest split of the split-K kernel's tests (a block's 2 simulated warps: a tile each)


def _pool(seq_lens, page_size, rng, spare_pages=3):
    """A shuffled pool: sequence s's pages are distinct random pool pages (never in order when
    it has several), with spare pages no sequence owns. -> block_table (n_seqs, max_pages)
    int32 (unused entries -1), n_pages."""
    n_pages_of = [-(-n // page_size) for n in seq_lens]
    n_pages = sum(n_pages_of) + spare_pages
    order = rng.permutation(n_pages)
    table = np.full((len(seq_lens), max(n_pages_of)), -1, np.int32)
    i = 0
    for s, n in enumerate(n_pages_of):
        pages = order[i : i + n]
        if n > 1 and np.all(np.diff(pages) == 1):  # contiguous by chance: reverse them
            pages = pages[::-1]
        table[s, :n] = pages
        i += n
    return table, n_pages


def _run(
    n_heads, n_kv_heads, head_dim, kv_dtype, rows, page_size=16, window=0, seed=0, kernel="batch", **shape
):
    """rows: (sequence, position) a row (sequence -1: padding). Each sequence holds keys up to
    its rows' largest position; the pool rows past that and the spare pages hold NaN."""
    rng = np.random.default_rng(seed)
    seq_of_row = np.array([s for s, _ in rows], np.int32)
    positions = np.array([p for _, p in rows], np.int32)
    n_seqs = max(s for s, _ in rows) + 1
    seq_lens = [max(p for s, p in rows if s == i) + 1 for i in range(n_seqs)]
    table, n_pages = _pool(seq_lens, page_size, rng)
    kv_dim, q_dim = n_kv_heads * head_dim, n_heads * head_dim
    # every pool row NaN (all-ones bits, as fp16 and e5m2), then each sequence's keys written
    kq = np.full((n_pages * page_size, kv_dim * (2 if kv_dtype == "fp16" else 1)), 0xFF, np.uint8)
    kq = kq.view(np.float16) if kv_dtype == "fp16" else kq
    vq = kq.copy()
    for s, n in enumerate(seq_lens):
        k = rng.uniform(-1, 1, (n, kv_dim)).astype(np.float32)
        v = rng.uniform(-1, 1, (n, kv_dim)).astype(np.float32)
        k[rng.integers(0, n, 2)] *= 4  # a few large scores: peaked rows, tiles whose max differ
        t = np.arange(n)
        pool_rows = table[s, t // page_size] * page_size + t % page_size
        kq[pool_rows] = formats.encode(k, kv_dtype)
        vq[pool_rows] = formats.encode(v, kv_dtype)
    q = rng.standard_normal((len(rows), q_dim)).astype(np.float32)
    kd, vd = formats.decode(kq, kv_dtype), formats.decode(vq, kv_dtype)

    out = cuda.to_device(np.full((len(rows), q_dim), np.nan, np.float16))
    stream = cuda.stream()
    cache = KVCache(cuda.to_device(kq), cuda.to_device(vq), kv_dtype)
    cfg = config(n_heads, n_kv_heads, head_dim, window)
    args = [cuda.to_device(a) for a in (q, table, seq_of_row, positions)]
    # pycalm.kernels.attention over the pages, short splits (several merge)
    pool_len = n_pages * page_size
    scratch = attention_scratch(n_heads, n_kv_heads, head_dim, kv_dtype, pool_len, chunk=CHUNK,
                                rows=len(rows), paged=True, stream=stream)  # fmt: skip
    span = attention_span(int(positions.max()), CHUNK, pool_len)
    pages = Pages(args[3], args[2], args[1], page_size, span, scratch)
    state = cuda.to_device(np.zeros(8, np.int32))  # (unread over pages)
    attention(args[0], cache, state, out, cfg, scratch, stream=stream, span=span, pages=pages)
    stream.synchronize()
    got = out.copy_to_host().astype(np.float32)
    want = batch_attention_ref(q, kd, vd, table, seq_of_row, positions, page_size, n_heads, n_kv_heads,
                               head_dim, window)  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=2.0**-11, atol=2e-5)
    # the key property: row r is the decode attention of q[r] over its sequence's keys, in order
    for r, (s, p) in enumerate(rows):
        if s < 0:
            np.testing.assert_array_equal(got[r], 0.0)
            continue
        t = np.arange(p + 1)
        pool_rows = table[s, t // page_size] * page_size + t % page_size
        ref = attention_ref(q[r], kd[pool_rows], vd[pool_rows], p + 1, n_heads, n_kv_heads, head_dim, window)
        np.testing.assert_allclose(got[r], ref, rtol=2.0**-11, atol=2e-5)


SIM_CASES = [
    # n_heads, n_kv_heads, head_dim, kv_dtype, page_size, window, rows (sequence, position)
    # group 2, fp16: position 0, a page's last row (15) and the next page's first (16), a padding
    # row, and three pages (40); M = 5
    (4, 2, 16, "fp16", 16, 0, [(0, 40), (1, 0), (2, 15), (-1, 0), (3, 16)]),
    # the same rows on fp8
    (4, 2, 16, "fp8", 16, 0, [(0, 40), (1, 0), (2, 15), (-1, 0), (3, 16)]),
    # group 3 (heads 0, 2 on warp 0, head 1 on warp 1), head_dim 32; two rows of one sequence at
    # different positions, rows out of sequence order; M = 3
    (3, 1, 32, "fp8", 16, 0, [(1, 33), (0, 47), (1, 20)]),
    # a sliding window of 20: starts mid-page (keys 27..46), one row shorter than the window
    (4, 2, 16, "fp16", 16, 20, [(0, 46), (1, 9), (-1, 0)]),
    # pages of 8 (a tile spans two pages), group 1, padding first
    (2, 2, 16, "fp16", 8, 0, [(-1, 0), (0, 29), (1, 8)]),
]
GPU_CASES = [
    # Llama-3-8B heads: 32 heads / 8 kv heads, head_dim 128, contexts up to ~3000
    (32, 8, 128, "fp16", 16, 0, [(0, 2999), (1, 0), (2, 1023), (-1, 0), (3, 1500), (4, 16), (5, 2048)]),
    (32, 8, 128, "fp8", 16, 0, [(0, 2999), (1, 0), (2, 1023), (-1, 0), (3, 1500), (4, 16), (5, 2048)]),
    (32, 8, 128, "fp8", 16, 1024, [(0, 2999), (1, 511), (2, 1024), (0, 1000), (3, 2500)]),  # Mistral's window
    (14, 2, 64, "fp16", 32, 0, [(0, 777), (1, 64), (2, 5)]),  # Qwen2.5-0.5B heads: group 7
    (32, 4, 64, "fp8", 16, 0, [(i, 37 * i) for i in range(33)]),  # TinyLlama heads (group 8), M = 33
]


@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,kv_dtype,page_size,window,rows",
    SIM_CASES + [(2, 1, 16, "fp8", 8, 0, [(0, 100)]), (4, 2, 16, "fp16", 16, 30, [(1, 70), (0, 3)])]
    + (GPU_CASES if GPU else []),
)  # fmt: skip
def test_paged_split_attention_matches_refs(n_heads, n_kv_heads, head_dim, kv_dtype, page_size, window, rows):
    """pycalm.kernels.attention over pages: the same cases, and one or two rows whose keys take
    several splits (each a few tiles), merged by the last block."""
    _run(
        n_heads,
        n_kv_heads,
        head_dim,
        kv_dtype,
        rows,
        page_size,
        window,
        seed=len(rows) + head_dim,
        kernel="split",
    )


def test_paged_attention_rejects_bad_pages():
    q = cuda.to_device(np.zeros((3, 64), np.float32))
    out = cuda.to_device(np.zeros((3, 64), np.float16))
    pool = cuda.to_device(np.zeros((32, 32), np.float16))
    table = cuda.to_device(np.zeros((2, 2), np.int32))
    rows = cuda.to_device(np.zeros(3, np.int32))
    cfg = config(4, 2, 16)
    scratch = attention_scratch(4, 2, 16, "fp16", 32, chunk=CHUNK, rows=3, paged=True)

    def call(page_size=16, rows=rows):
        pages = Pages(rows, rows, table, page_size, 32, scratch)
        attention(q, KVCache(pool, pool, "fp16"), rows, out, cfg, scratch, stream=0, span=32, pages=pages)

    with pytest.raises(PycalmError, match="page size 12"):
        call(page_size=12)
    with pytest.raises(PycalmError, match="page size 64"):  # more than the pool's 32 rows
        call(page_size=64)
    with pytest.raises(PycalmError, match="positions and seq_of_row"):
        call(rows=cuda.to_device(np.zeros(4, np.int32)))
