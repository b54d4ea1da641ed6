"""Test session set-up.

Kernels run under numba's CUDA simulator unless PYCALM_TEST_GPU=1 (then the same tests run on
the real GPU). The simulator must be chosen before numba is first imported, so it is set here.
"""

import os

if os.environ.get("PYCALM_TEST_GPU") != "1":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
