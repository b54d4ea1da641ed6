"""A CUDA graph captured from the numba kernel launches that one function makes on a stream.

Launching a numba kernel from Python costs 15-43 us; replaying the same launches from a graph
costs about 1 us a kernel (ARCHITECTURE.md). Capture goes through the CUDA driver bindings on
the numba stream's own handle, so the kernels and launchers need no change.
"""

from __future__ import annotations

from collections.abc import Callable


class GraphStep:
    """A CUDA graph captured from the launches that a function makes on a numba stream."""

    def __init__(self, stream: object, record: Callable[[], object]) -> None:
        from cuda.bindings import driver as cu

        self._cu = cu
        self.stream = stream
        handle = stream.handle
        _check(cu.cuStreamBeginCapture(handle, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
        try:
            record()
        finally:
            graph = _check(cu.cuStreamEndCapture(handle))
        self.graph = graph
        self.exec = _check(cu.cuGraphInstantiate(graph, 0))

    def launch(self) -> None:
        _check(self._cu.cuGraphLaunch(self.exec, self.stream.handle))


def _check(result: tuple) -> object:
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return rest[0] if len(rest) == 1 else (rest or None)
