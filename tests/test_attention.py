"""attention (one kernel: chunk blocks, the last one of a head combines) against attention_ref.

Shapes stay small for the simulator (chunks of CHUNK = 16 positions, on the GPU too) but cover: odd
n_pos (chunks that end mid-team), one live chunk (no partials) and several (the last-block
combine, run twice on one scratch so a counter left non-zero would show), blocks that exit
early, a grid over a span shorter than the cache, rows past pos that hold NaN, a sliding
window, both KV dtypes, GQA groups 1, 3, 7.
Tolerance: float32 dots of head_dim terms and sums of up to n_pos terms in a different order
than NumPy's: 2e-5 absolute on outputs of size ~1 (values are convex mixes of V rows in [-1, 1]).
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from pycalm.cpu.reference import attention_ref
from pycalm.errors import PycalmError
from pycalm.kernels.attention import (
    MAX_CHUNK,
    REG_WORDS,
    THREADS,
    KVCache,
    attention,
    attention_chunk_len,
    attention_scratch,
    attention_span,
)
from pycalm.model import formats
from pycalm.model.config import ModelConfig

CHUNK = 16  # positions a block: every case past 16 positions goes through the last-block combine


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
    chunk=CHUNK,
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
    scratch = attention_scratch(n_heads, head_dim, kv_dtype, seq_len, chunk=chunk, stream=stream)
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
        (2, 2, 32, "fp16", 5, 0),  # group 1, one chunk, most teams idle
        (3, 1, 32, "fp8", 37, 0),  # group 3, fp8, three chunks, the last one partial
        (7, 1, 16, "fp16", 21, 0),  # group 7, 2 lanes a K team, two chunks
        (3, 1, 64, "fp8", 41, 20),  # sliding window: start = 21, two chunks
        (4, 1, 32, "fp16", 35, 100),  # window longer than the context: no effect
        (2, 1, 128, "fp16", 50, 0),  # head_dim > threads of a simulated block: dims loop
    ],
)
def test_attention_matches_ref(n_heads, n_kv_heads, head_dim, kv_dtype, n_pos, window):
    _run(n_heads, n_kv_heads, head_dim, 64, n_pos, kv_dtype, window, seed=n_pos)


@pytest.mark.parametrize("n_pos,span", [(37, 48), (37, 37), (16, 16), (50, 64)])
def test_attention_over_a_span(n_pos, span):
    # a grid of ceil(span / 16) chunks a head on a cache of 64 positions: 3 chunks with 3 live,
    # 1 partial chunk of 5, one chunk, the whole cache
    _run(3, 1, 32, 64, n_pos, "fp8", 0, seed=n_pos + span, span=span)


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


def test_default_chunk_is_one_block_per_head_at_short_context():
    # the engine's default chunk: 16 positions under the simulator (4 chunks here), 256 on the GPU (one)
    _run(3, 1, 32, 64, 50, "fp16", 0, seed=1, chunk=None)


def test_chunk_len_fits_registers():
    # a power of two, and a thread's share of the chunk's K words stays within REG_WORDS
    for head_dim, kv_dtype in ((64, "fp16"), (128, "fp16"), (128, "fp8"), (256, "fp16")):
        chunk = attention_chunk_len(head_dim, kv_dtype)
        assert chunk & (chunk - 1) == 0 and chunk <= MAX_CHUNK
        words = head_dim // (8 if kv_dtype == "fp8" else 4)
        assert chunk * words <= REG_WORDS * THREADS or chunk == 1


def test_bad_arguments_are_named():
    stream = cuda.stream()
    scratch = attention_scratch(4, 32, "fp16", 16, chunk=CHUNK, stream=stream)
    q = cuda.to_device(np.zeros(4 * 32, np.float32))
    rows = cuda.to_device(np.zeros((64, 64), np.float16))
    state = cuda.to_device(np.zeros(4, np.int32))
    cfg = config(4, 2, 32)
    with pytest.raises(PycalmError, match="scratch"):  # made for 16 positions, cache holds 64
        attention(q, KVCache(rows, rows, "fp16"), state, q, cfg, scratch, stream=stream)
    with pytest.raises(PycalmError, match="KV cache dtype"):
        attention(q, KVCache(rows, rows, "bf16"), state, q, cfg, scratch, stream=stream)
    with pytest.raises(PycalmError, match="power of two"):
        attention_scratch(4, 32, "fp16", 16, chunk=24)
    scratch = attention_scratch(4, 32, "fp16", 64, chunk=CHUNK, stream=stream)
    for span in (0, 65):
        with pytest.raises(PycalmError, match="span"):
            attention(q, KVCache(rows, rows, "fp16"), state, q, cfg, scratch, stream=stream, span=span)


def test_kernel_script_runs_its_check():
    # scripts/kernels/attention.py (the versions and their timing table): the shipped kernel and
    # two other tunings of its copy (one warp with more lanes a row; one lane a row) checked
    # against the reference at a tiny shape (on the simulator or the GPU, as here)
    script = Path(__file__).resolve().parents[1] / "scripts" / "kernels" / "attention.py"
    p = subprocess.run(
        [sys.executable, str(script), "--tiny", "--variants", "default,w32kw2,kw8vw4"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.count("error") == 18
