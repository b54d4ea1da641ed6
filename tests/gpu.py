"""The tests' GPU switch: with PYCALM_TEST_GPU=1 the kernels run on the real GPU, otherwise under
numba's CUDA simulator (tests/conftest.py turns it on before numba is first imported).

    from gpu import GPU, gpu_only

    big = 4096 if GPU else 40                     # a realistic shape where there is a GPU

    @gpu_only("realistic shapes")                 # the `gpu` mark: skipped under the simulator
    def test_llama_3_8b_shape(): ...
"""

from __future__ import annotations

import os

import pytest

GPU = os.environ.get("PYCALM_TEST_GPU") == "1"


def gpu_only(reason: str) -> pytest.MarkDecorator:
    """The `gpu` mark: the test needs the real GPU, and under the simulator conftest.py skips it
    saying why not there (`reason`, e.g. "simulator time")."""
    return pytest.mark.gpu(reason=reason)
