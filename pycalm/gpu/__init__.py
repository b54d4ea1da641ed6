"""The GPU engine: buffers, the token step (engine.py), the multi-token forward (prefill.py),
CUDA graphs (graph.py), and how the kernels get compiled: once per machine into a disk cache
(kernel_cache.py), by worker processes while the weights load (precompile.py).

Importing this package installs the kernel cache and numba_patch before any kernel module is
imported (numba fixes a kernel's cache folder when the kernel is declared).
"""

from numba import config as _numba_config

if not _numba_config.ENABLE_CUDASIM:
    from pycalm.gpu import kernel_cache as _kernel_cache
    from pycalm.gpu import numba_patch as _numba_patch

    _numba_patch.install()
    _kernel_cache.install()
