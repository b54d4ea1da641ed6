"""rmsnorm kernel against rmsnorm_ref. Tolerance: a float32 sum of squares in a different order
(relative error ~dim * 2^-24 on the scale factor) -> rtol 1e-5 on outputs."""

import numpy as np
import pytest
from numba import cuda

from pycalm.cpu.reference import rmsnorm_ref
from pycalm.kernels.norm import rmsnorm


@pytest.mark.parametrize("dim,in_place", [(72, False), (520, True)])
def test_rmsnorm_matches_ref(dim, in_place):
    rng = np.random.default_rng(dim)
    x = (rng.standard_normal(dim) * 5).astype(np.float32)
    w = rng.uniform(0.5, 1.5, dim).astype(np.float32)
    want = rmsnorm_ref(x, w, 1e-5)
    d_x = cuda.to_device(x)
    d_out = d_x if in_place else cuda.to_device(np.full(dim, np.nan, np.float32))
    stream = cuda.stream()
    rmsnorm(d_x, cuda.to_device(w), 1e-5, d_out, stream=stream, threads=128)
    stream.synchronize()
    np.testing.assert_allclose(d_out.copy_to_host(), want, rtol=1e-5, atol=1e-6)
