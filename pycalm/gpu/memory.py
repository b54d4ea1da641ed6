"""GPU memory: what does not fit is one line naming it, the bytes it needs and the bytes free.

GpuEngine (the weights, the KV cache) and pycalm.gpu.prefill (its row buffers) check each size known
in advance against the device's free memory before allocating (require_gpu_memory), and turn a
driver out-of-memory error while allocating into the same kind of line (out_of_memory_as_error).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pycalm.errors import PycalmError

CUDA_ERROR_OUT_OF_MEMORY = 2  # the CUresult of an allocation the device cannot hold


def gpu_memory_info() -> tuple[float, float]:
    """(free, total) bytes of the current GPU's memory (the simulator: infinite), after numba's
    pending frees (it frees arrays no longer referenced in batches) are done."""
    from numba import cuda

    context = cuda.current_context()
    if hasattr(context, "deallocations"):  # (not the simulator's)
        context.deallocations.clear()
    free, total = context.get_memory_info()
    return free, total


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def require_gpu_memory(what: str, nbytes: int, reserve: float = 0) -> None:
    """A one-line PycalmError unless `what` (nbytes), and `reserve` bytes beside it, fit the GPU's
    free memory: checked before allocating whatever has a size known in advance."""
    free, total = gpu_memory_info()
    if nbytes + reserve > free:
        beside = f" beside a reserve of {_mib(reserve)}" if reserve else ""
        raise PycalmError(
            f"out of GPU memory: {what} needs {_mib(nbytes)} ({nbytes:,} bytes){beside}, "
            f"{_mib(free)} of the GPU's {_mib(total)} are free"
        )


@contextmanager
def out_of_memory_as_error(what: str, nbytes: int) -> Iterator[None]:
    """An out-of-memory CudaAPIError while allocating `what` becomes the same one-line error."""
    from numba.cuda.cudadrv.driver import CudaAPIError

    try:
        yield
    except CudaAPIError as e:
        code = getattr(e, "code", e.args[0] if e.args else None)  # the simulator's: args only
        if getattr(code, "value", code) != CUDA_ERROR_OUT_OF_MEMORY:
            raise
        free, total = gpu_memory_info()
        raise PycalmError(
            f"out of GPU memory: allocating {what} ({_mib(nbytes)}, {nbytes:,} bytes) failed, "
            f"{_mib(free)} of the GPU's {_mib(total)} free"
        ) from None
