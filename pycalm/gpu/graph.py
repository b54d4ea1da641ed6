"""A CUDA graph captured from the numba kernel launches that one function makes on a stream.

Launching a numba kernel from Python costs tens of microseconds; replaying the same launches
from a graph costs about 1 us a kernel (docs/HARDWARE.md, "Launch costs").
Capture goes through the CUDA driver bindings on the numba stream's own handle, so the kernels
and launchers need no change.

programmatic=True (Hopper and up) turns every kernel -> kernel edge of the captured graph into a
programmatic dependency (programmatic dependent launch): a kernel may then launch as soon as
every block of the one before it has run griddepcontrol.launch_dependents, load its weights,
and wait in griddepcontrol.wait until the kernel before it has finished; the launch gap and the
first DRAM round trip overlap the previous kernel's tail. Every kernel of pycalm.kernels calls
both (pycalm.kernels.common: dependent_start, or the weights' first loads before the wait), so
the result is the same as with plain edges.
"""

from __future__ import annotations

from collections.abc import Callable


class GraphStep:
    """A CUDA graph captured from the launches that a function makes on a numba stream."""

    def __init__(self, stream: object, record: Callable[[], object], programmatic: bool = False) -> None:
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
        self.programmatic_edges = _programmatic_edges(cu, graph) if programmatic else 0
        self.exec = _check(cu.cuGraphInstantiate(graph, 0))

    def launch(self) -> None:
        _check(self._cu.cuGraphLaunch(self.exec, self.stream.handle))


def _programmatic_edges(cu: object, graph: object) -> int:
    """Replace every kernel -> kernel edge of graph by a programmatic one; -> how many."""
    if hasattr(cu, "cuGraphAddDependencies_v2"):  # cuda-bindings 12.3+: the edge-data calls
        get, add, remove = (
            cu.cuGraphGetEdges_v2,
            cu.cuGraphAddDependencies_v2,
            cu.cuGraphRemoveDependencies_v2,
        )
    else:  # 13.x: the plain names take edge data
        get, add, remove = cu.cuGraphGetEdges, cu.cuGraphAddDependencies, cu.cuGraphRemoveDependencies
    n = _check(get(graph, 0))[-1]
    frm, to, _, n = _check(get(graph, n))
    kernel = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL

    def is_kernel(node: object) -> bool:
        return _check(cu.cuGraphNodeGetType(node)) == kernel

    pairs = [(f, t) for f, t in zip(frm[:n], to[:n], strict=True) if is_kernel(f) and is_kernel(t)]
    if not pairs:
        return 0
    src, dst = [f for f, _ in pairs], [t for _, t in pairs]
    _check(remove(graph, src, dst, [cu.CUgraphEdgeData() for _ in pairs], len(pairs)))
    edges = []
    for _ in pairs:
        e = cu.CUgraphEdgeData()
        e.type = cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
        e.from_port = cu.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
        edges.append(e)
    _check(add(graph, src, dst, edges, len(pairs)))
    return len(pairs)


def _check(result: tuple) -> object:
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return rest[0] if len(rest) == 1 else (rest or None)
