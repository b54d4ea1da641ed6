"""embed kernels against embed_ref: exact (decoding is exact in every format)."""

import numpy as np
import pytest
from numba import cuda

from pycalm import formats
from pycalm.errors import PycalmError
from pycalm.kernels.embed import embed
from pycalm.reference import embed_ref


@pytest.mark.parametrize("dtype", ["fp16", "fp8", "gf4"])
def test_embed_matches_ref(dtype):
    rng = np.random.default_rng(1)
    vocab, dim = 37, 136  # dim not a multiple of the block size
    table = formats.encode(rng.standard_normal((vocab, dim)).astype(np.float32) * 3, dtype)
    token = 29
    state = np.array([token, 5, 0, 0], np.int32)
    d_x = cuda.to_device(np.full(dim, np.nan, np.float32))
    stream = cuda.stream()
    embed(cuda.to_device(table), cuda.to_device(state), d_x, dtype, stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(d_x.copy_to_host(), embed_ref(table, token, dtype))


def test_embed_rejects_unknown_dtype():
    with pytest.raises(PycalmError, match="unsupported embedding dtype"):
        embed(None, None, None, "int4", stream=None)
