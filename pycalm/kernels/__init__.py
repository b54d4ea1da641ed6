"""GPU kernels, one module per family. Each module holds, in order: a docstring (the math, the
thread mapping, the bytes moved, the NumPy reference it must match), the `@cuda.jit` kernel(s)
(`<op>_kernel`) and the launcher (`<op>`). The references (`<op>_ref`) live together in
pycalm.cpu.reference, in forward order, with the CPU engine built from them.
Under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) the shim in `_cudasim` adds the warp
shuffles the simulator lacks, so the kernels run unmodified on a CPU. Compiling them (the disk
cache, a lowering fix) is pycalm.gpu's business.
"""

from numba import config as _numba_config

# small grids are deliberate here (one-thread step kernels, per-head attention blocks)
_numba_config.CUDA_LOW_OCCUPANCY_WARNINGS = False

if _numba_config.ENABLE_CUDASIM:
    from pycalm.kernels import _cudasim

    _cudasim.install()
