"""attention (flash-decoding chunk + combine kernels) against attention_ref.

Shapes stay small for the simulator but cover: odd n_pos (chunks that end mid-team), several
live chunks and blocks that exit early, a sliding window, both KV dtypes, GQA groups 1, 3, 7.
Tolerance: float32 dots of head_dim terms and sums of up to n_pos terms in a different order
than NumPy's: 2e-5 absolute on outputs of size ~1 (values are convex mixes of V rows in [-1, 1]).
"""

import numpy as np
import pytest
from numba import cuda

from pycalm import formats
from pycalm.kernels.attention import (
    MIN_CHUNK,
    attention,
    attention_chunks,
    attention_ref,
    attention_scratch_shape,
)


def _run(n_heads, n_kv_heads, head_dim, seq_len, n_pos, kv_dtype, window, seed):
    rng = np.random.default_rng(seed)
    kv_dim = n_kv_heads * head_dim
    q = rng.standard_normal(n_heads * head_dim).astype(np.float32)
    k = rng.uniform(-1, 1, (seq_len, kv_dim)).astype(np.float32)
    v = rng.uniform(-1, 1, (seq_len, kv_dim)).astype(np.float32)
    # a few large scores so the softmax is not flat and the per-chunk maxima differ
    k[rng.integers(0, n_pos, 3)] *= 4
    kq, vq = formats.encode(k, kv_dtype), formats.encode(v, kv_dtype)
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
    part = np.full(attention_scratch_shape(n_heads, n_kv_heads, head_dim, seq_len), np.nan, np.float32)
    out = np.full(n_heads * head_dim, np.nan, np.float32)
    d_out = cuda.to_device(out)
    stream = cuda.stream()
    nbytes = attention(
        cuda.to_device(q),
        cuda.to_device(kq),
        cuda.to_device(vq),
        cuda.to_device(state),
        d_out,
        n_heads,
        n_kv_heads,
        head_dim,
        kv_dtype,
        window,
        stream=stream,
        part=cuda.to_device(part),
    )
    stream.synchronize()
    got = d_out.copy_to_host()
    assert nbytes > 0
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,kv_dtype,n_pos,window",
    [
        (2, 2, 32, "fp16", 5, 0),  # group 1, one chunk, most teams idle
        (3, 1, 32, "fp8", 37, 0),  # group 3, fp8, three chunks, the last one partial
        (7, 1, 16, "fp16", 21, 0),  # group 7, 4 lanes a team, two chunks
        (3, 1, 64, "fp8", 41, 20),  # sliding window: start = 21, two chunks
        (4, 1, 32, "fp16", 35, 100),  # window longer than the context: no effect
    ],
)
def test_attention_matches_ref(n_heads, n_kv_heads, head_dim, kv_dtype, n_pos, window):
    _run(n_heads, n_kv_heads, head_dim, 64, n_pos, kv_dtype, window, seed=n_pos)


def test_chunk_count_is_fixed_and_bounded():
    # fixed by shapes only; never more chunks than seq_len needs at MIN_CHUNK positions each
    assert attention_chunks(32, 8, 8192) == 64
    assert attention_chunks(14, 2, 32768) == 256
    assert attention_chunks(32, 8, 100) == -(-100 // MIN_CHUNK)
    # the combine kernel's chunk weights (n_chunks floats of shared memory) stay small
    assert attention_chunks(32, 1, 1 << 20) * 4 <= 4096
