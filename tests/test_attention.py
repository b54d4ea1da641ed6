"""attention (one kernel: a block per kv head and split of the keys, the last one of a kv head
merges) against attention_ref.

Shapes stay small for the simulator (splits of at least SPLIT = 16 positions, on the GPU too) but
cover: odd n_pos (splits and tiles that end mid-warp), one live split (no partials) and several
(the last-block merge, run twice on one scratch so a counter left non-zero would show), splits of
several tiles (the two-stage stream), splits that grow with the span (split_len), blocks that
exit early, a grid over a span shorter than the cache, rows past pos that hold NaN, a sliding
window, both KV dtypes, GQA groups 1, 3, 7, teams of 8 to 32 lanes a row.
Tolerance: float32 dots of head_dim terms and sums of up to n_pos terms in a different order
than NumPy's: 2e-5 absolute on outputs of size ~1 (values are convex mixes of V rows in [-1, 1]).
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from pycalm.cpu.reference import attention_ref, prefill_attention_ref
from pycalm.errors import PycalmError
from pycalm.kernels.attention import (
    CHUNK,
    TARGET_BLOCKS,
    KVCache,
    attention,
    attention_chunk_len,
    attention_scratch,
    attention_span,
    split_len,
)
from pycalm.model import formats
from pycalm.model.config import ModelConfig

SPLIT = 16  # the shortest split: every case past 16 positions goes through the last-block merge


def config(n_heads: int, n_kv_heads: int, head_dim: int, window: int = 0) -> ModelConfig:
    """A model config with these attention sizes (the rest is never read by attention)."""
    return ModelConfig(
        arch="llama",
        dim=n_heads * head_dim,
        hidden_dim=8,
        head_dim=head_dim,
        n_layers=1,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=8,
        max_seq_len=64,
        rope_theta=10000.0,
        rotary_dim=head_dim,
        norm_eps=1e-5,
        bos_id=1,
        eos_ids=(),
        sliding_window=window,
    )


def _run(
    n_heads,
    n_kv_heads,
    head_dim,
    seq_len,
    n_pos,
    kv_dtype,
    window,
    seed,
    chunk=SPLIT,
    span=None,
):
    rng = np.random.default_rng(seed)
    kv_dim = n_kv_heads * head_dim
    q = rng.standard_normal(n_heads * head_dim).astype(np.float32)
    k = rng.uniform(-1, 1, (seq_len, kv_dim)).astype(np.float32)
    v = rng.uniform(-1, 1, (seq_len, kv_dim)).astype(np.float32)
    # a few large scores so the softmax is not flat and the per-chunk maxima differ
    k[rng.integers(0, n_pos, 3)] *= 4
    kq, vq = formats.encode(k, kv_dtype), formats.encode(v, kv_dtype)
    # rows past pos hold all-ones bits (NaN as fp16 / e5m2; stale rows of an earlier context),
    # which must not reach the output
    kq.view(np.uint8)[n_pos:] = 0xFF
    vq.view(np.uint8)[n_pos:] = 0xFF
    want = attention_ref(
        q,
        formats.decode(kq, kv_dtype),
        formats.decode(vq, kv_dtype),
        n_pos,
        n_heads,
        n_kv_heads,
        head_dim,
        window,
    )
    state = np.array([0, n_pos - 1, 0, 0], np.int32)
    stream = cuda.stream()
    scratch = attention_scratch(n_heads, n_kv_heads, head_dim, kv_dtype, seq_len, chunk=chunk, stream=stream)
    scratch.part.copy_to_device(np.full(scratch.part.shape, np.nan, np.float32), stream=stream)
    cache = KVCache(cuda.to_device(kq), cuda.to_device(vq), kv_dtype)
    d_q, d_state = cuda.to_device(q), cuda.to_device(state)
    cfg = config(n_heads, n_kv_heads, head_dim, window)
    for _ in range(2):  # the second launch finds the counters the first one left
        d_out = cuda.to_device(np.full(n_heads * head_dim, np.nan, np.float32))
        attention(d_q, cache, d_state, d_out, cfg, scratch, stream=stream, span=span)
        stream.synchronize()
        np.testing.assert_allclose(d_out.copy_to_host(), want, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(scratch.count.copy_to_host(), 0)


@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,kv_dtype,n_pos,window",
    [
        (2, 2, 32, "fp16", 5, 0),  # group 1, one split, one partial tile: most warps idle
        (3, 1, 32, "fp8", 37, 0),  # group 3, fp8 (8 lanes a row), three splits, the last partial
        (7, 1, 16, "fp16", 21, 0),  # group 7 (padded to 8), 8 lanes a row, two splits
        (3, 1, 64, "fp8", 41, 20),  # sliding window: start = 21, two splits
        (4, 1, 32, "fp16", 35, 100),  # window longer than the context: no effect
        (2, 1, 128, "fp16", 50, 0),  # 2 words of a row a lane; outputs > threads: several a thread
        (4, 2, 8, "fp8", 29, 0),  # 8-byte rows (test models): copied word by word into padded rows
        (3, 1, 6, "fp16", 19, 0),  # 12-byte rows, group 3
    ],
)
def test_attention_matches_ref(n_heads, n_kv_heads, head_dim, kv_dtype, n_pos, window):
    _run(n_heads, n_kv_heads, head_dim, 64, n_pos, kv_dtype, window, seed=n_pos)


@pytest.mark.parametrize("n_pos,span", [(37, 48), (37, 37), (16, 16), (50, 64)])
def test_attention_over_a_span(n_pos, span):
    # a grid of ceil(span / 16) chunks a head on a cache of 64 positions: 3 chunks with 3 live,
    # 1 partial chunk of 5, one chunk, the whole cache
    _run(3, 1, 32, 64, n_pos, "fp8", 0, seed=n_pos + span, span=span)


def test_a_fixed_split_gives_the_same_bits_at_every_span():
    # split given (the batch-invariant rows pass: split_len of the whole cache): the grid covers a
    # span's splits of that length, and a row's output is the same bits whatever the span; the
    # default split of each span (16 or 32 positions here) is another sum
    rng = np.random.default_rng(4)
    n_heads, n_kv_heads, head_dim, seq_len, pos = 3, 1, 32, 64, 20
    q = rng.standard_normal(n_heads * head_dim).astype(np.float32)
    k = rng.uniform(-1, 1, (seq_len, n_kv_heads * head_dim)).astype(np.float16)
    v = rng.uniform(-1, 1, (seq_len, n_kv_heads * head_dim)).astype(np.float16)
    stream = cuda.stream()
    scratch = attention_scratch(n_heads, n_kv_heads, head_dim, "fp16", seq_len, chunk=SPLIT, stream=stream)
    cache = KVCache(cuda.to_device(k), cuda.to_device(v), "fp16")
    d_q, d_state = cuda.to_device(q), cuda.to_device(np.array([0, pos, 0, 0], np.int32))
    cfg = config(n_heads, n_kv_heads, head_dim, 0)
    want = attention_ref(
        q, k.astype(np.float32), v.astype(np.float32), pos + 1, n_heads, n_kv_heads, head_dim
    )

    def run(span: int, split: int | None) -> np.ndarray:
        d_out = cuda.to_device(np.full(n_heads * head_dim, np.nan, np.float32))
        attention(d_q, cache, d_state, d_out, cfg, scratch, stream=stream, span=span, split=split)
        stream.synchronize()
        return d_out.copy_to_host()

    fixed = [run(span, 2 * SPLIT) for span in (32, 64)]
    assert np.array_equal(fixed[0], fixed[1])
    for out in (*fixed, run(32, None)):
        np.testing.assert_allclose(out, want, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(scratch.count.copy_to_host(), 0)


def test_attention_span_covers_the_position():
    # chunk times the smallest power of two past pos, at most seq_len
    assert [attention_span(p, 16, 100) for p in (0, 15, 16, 31, 32, 63, 64, 99)] == [
        16,
        16,
        32,
        32,
        64,
        64,
        100,
        100,
    ]
    assert attention_span(0, 256, 100) == 100
    want = [256, 256, 512, 512, 1024, 4096]
    assert [attention_span(p, 256, 4096) for p in (0, 255, 256, 511, 512, 4095)] == want
    for seq_len in (1, 7, 300, 4096):
        for pos in range(seq_len):
            span = attention_span(pos, 16, seq_len)
            assert pos < span <= min(seq_len, max(16, 2 * (pos + 1)))
            assert span == seq_len or span & (span - 1) == 0
    with pytest.raises(PycalmError, match="position 100"):
        attention_span(100, 16, 100)


def test_default_chunk():
    # the engine's default shortest split: two warp tiles a warp (8 positions under the simulator)
    assert attention_chunk_len(64, "fp16") == CHUNK
    _run(3, 1, 32, 64, 50, "fp16", 0, seed=1, chunk=None)


def test_split_len_keeps_the_grid_within_target():
    # the shortest split while the grid fits, then doubling; never past the span
    for span in (1, 16, 37, 64, 4096, 32768):
        for n_kv in (1, 2, 8):
            split = split_len(span, 16, n_kv)
            assert split >= 16 and split & (split - 1) == 0
            assert n_kv * -(-span // split) <= TARGET_BLOCKS or split >= span
            assert split == 16 or n_kv * -(-span // (split // 2)) > TARGET_BLOCKS


def test_splits_grow_with_the_span():
    # chunks of 2 on one kv head: a cache of 4 TARGET_BLOCKS positions in more splits than
    # TARGET_BLOCKS allows, so the launch takes splits of 4 (several warp tiles) and merges the rest
    seq_len = 4 * TARGET_BLOCKS
    assert split_len(seq_len, 2, 1) == 4
    _run(2, 1, 32, seq_len, seq_len - 3, "fp16", 0, seed=7, chunk=2)


def test_head_sizes_outside_the_kernel_are_named():
    with pytest.raises(PycalmError, match="head_dim 5"):  # 10-byte rows: no whole words
        attention_chunk_len(5, "fp16")
    rows = cuda.to_device(np.zeros((16, 33 * 8), np.float16))
    with pytest.raises(PycalmError, match="with 33 query heads"):
        attention(rows, KVCache(rows, rows, "fp16"), rows, rows, config(33, 1, 8), None, stream=0)


def test_bad_arguments_are_named():
    stream = cuda.stream()
    scratch = attention_scratch(4, 2, 32, "fp16", 16, chunk=SPLIT, stream=stream)
    q = cuda.to_device(np.zeros(4 * 32, np.float32))
    rows = cuda.to_device(np.zeros((64, 64), np.float16))
    state = cuda.to_device(np.zeros(4, np.int32))
    cfg = config(4, 2, 32)
    with pytest.raises(PycalmError, match="scratch"):  # made for 16 positions, cache holds 64
        attention(q, KVCache(rows, rows, "fp16"), state, q, cfg, scratch, stream=stream)
    with pytest.raises(PycalmError, match="KV cache dtype"):
        attention(q, KVCache(rows, rows, "bf16"), state, q, cfg, scratch, stream=stream)
    with pytest.raises(PycalmError, match="power of two"):
        attention_scratch(4, 2, 32, "fp16", 16, chunk=24)
    scratch = attention_scratch(4, 2, 32, "fp16", 64, chunk=SPLIT, stream=stream)
    for span in (0, 65):
        with pytest.raises(PycalmError, match="span"):
            attention(q, KVCache(rows, rows, "fp16"), state, q, cfg, scratch, stream=stream, span=span)


def test_kernel_script_runs_its_check():
    # scripts/kernels/attention.py (the versions and their timing table): the shipped kernel, two
    # tunings of the earlier per-head kernel (one warp with more lanes a row; one lane a row) and
    # one of the shipped kernel's (warp tiles of 8 positions, 2 stages) checked against the
    # reference at a tiny shape (on the simulator or the GPU, as here)
    script = Path(__file__).resolve().parents[1] / "scripts" / "kernels" / "attention.py"
    p = subprocess.run(
        [sys.executable, str(script), "--tiny", "--variants", "default,w32kw2,kw8vw4,s_t8st2"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.count("error") == 24


@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,kv_dtype,pos0,rows,window,out_dtype",
    [
        (3, 1, 32, "fp16", 29, 3, 0, np.float32),  # three rows, the first two splits apart
        (4, 2, 64, "fp8", 40, 5, 0, np.float16),  # fp16 out (the rows pass's wo input)
        (2, 1, 32, "fp16", 37, 4, 20, np.float16),  # a sliding window: each row's own start
    ],
)
def test_rows_match_prefill_ref(n_heads, n_kv_heads, head_dim, kv_dtype, pos0, rows, window, out_dtype):
    # rows consecutive positions of one sequence, causal: row r is attention_ref at pos0 + r + 1
    # positions, its own splits and merge (a counter each (row, kv head)), run twice on one scratch
    rng = np.random.default_rng(pos0 + rows)
    seq_len, kv_dim = 64, n_kv_heads * head_dim
    q = rng.standard_normal((rows, n_heads * head_dim)).astype(np.float32)
    k = rng.uniform(-1, 1, (seq_len, kv_dim)).astype(np.float32)
    v = rng.uniform(-1, 1, (seq_len, kv_dim)).astype(np.float32)
    kq, vq = formats.encode(k, kv_dtype), formats.encode(v, kv_dtype)
    kq.view(np.uint8)[pos0 + rows :] = 0xFF  # past the last row: NaN, never read
    vq.view(np.uint8)[pos0 + rows :] = 0xFF
    kd, vd = formats.decode(kq, kv_dtype), formats.decode(vq, kv_dtype)
    want = prefill_attention_ref(q, kd, vd, pos0, n_heads, n_kv_heads, head_dim, window)
    stream = cuda.stream()
    scratch = attention_scratch(
        n_heads, n_kv_heads, head_dim, kv_dtype, seq_len, chunk=SPLIT, rows=rows, stream=stream
    )
    cache = KVCache(cuda.to_device(kq), cuda.to_device(vq), kv_dtype)
    d_q = cuda.to_device(q)
    d_state = cuda.to_device(np.array([0, pos0, 0, 0], np.int32))
    cfg = config(n_heads, n_kv_heads, head_dim, window)
    tol = 2e-5 if out_dtype == np.float32 else 2e-5 + 2.5e-4  # fp16 out: half an ulp below 1
    for _ in range(2):
        d_out = cuda.to_device(np.full((rows, n_heads * head_dim), np.nan, out_dtype))
        attention(d_q, cache, d_state, d_out, cfg, scratch, stream=stream, span=pos0 + rows)
        stream.synchronize()
        np.testing.assert_allclose(d_out.copy_to_host().astype(np.float32), want, rtol=0, atol=tol)
    np.testing.assert_array_equal(scratch.count.copy_to_host(), 0)
