"""embed kernels against embed_ref: exact (decoding is exact in every format)."""

import numpy as np
import pytest
from numba import cuda

from pycalm.cpu.reference import embed_ref
from pycalm.errors import PycalmError
from pycalm.kernels.embed import embed
from pycalm.model import formats


def to_device(table):
    """A stored table on the device (a q8 / q4 Quantized: both arrays)."""
    if isinstance(table, formats.Quantized):
        return formats.Quantized(cuda.to_device(table.codes), cuda.to_device(table.scales))
    return cuda.to_device(table)


# dim not a multiple of the block size; q4: 3 groups of 32, 2 of 64
@pytest.mark.parametrize(
    "dtype,dim,group",
    [("fp16", 136, 32), ("fp8", 136, 32), ("gf4", 136, 32), ("q8", 136, 32), ("q4", 96, 32), ("q4", 128, 64)],
)
def test_embed_matches_ref(dtype, dim, group):
    rng = np.random.default_rng(1)
    vocab = 37
    table = formats.encode(rng.standard_normal((vocab, dim)).astype(np.float32) * 3, dtype, group=group)
    token = 29
    state = np.array([token, 5, 0, 0], np.int32)
    d_x = cuda.to_device(np.full(dim, np.nan, np.float32))
    stream = cuda.stream()
    embed(to_device(table), cuda.to_device(state), d_x, dtype, stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(d_x.copy_to_host(), embed_ref(table, token, dtype))


def test_embed_rejects_unknown_dtype():
    with pytest.raises(PycalmError, match="unsupported embedding dtype"):
        embed(None, None, None, "int4", stream=None)
