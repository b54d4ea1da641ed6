"""GPU smoke check: numba launches captured into a CUDA graph on a numba stream, replay cost."""

import sys
import time
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pycalm.gpu.graph import GraphStep  # noqa: E402


@cuda.jit
def bump(state, x):
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] += np.float32(state[1])


@cuda.jit
def adv(state):
    if cuda.grid(1) == 0:
        state[1] += 1


def main() -> None:
    s = cuda.stream()
    x = cuda.to_device(np.zeros(4096, np.float32), stream=s)
    state = cuda.to_device(np.zeros(4, np.int32), stream=s)
    n_k = 160

    def record() -> None:
        for _ in range(n_k):
            bump[16, 256, s](state, x)
        adv[1, 32, s](state)

    record()
    s.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        record()
    s.synchronize()
    eager = (time.perf_counter() - t) / 10
    state.copy_to_device(np.zeros(4, np.int32), stream=s)
    x.copy_to_device(np.zeros(4096, np.float32), stream=s)
    g = GraphStep(s, record)
    for _ in range(3):
        g.launch()
    st = state.copy_to_host(stream=s)
    xv = x.copy_to_host(stream=s)
    s.synchronize()
    # steps at pos 0,1,2: x = n_k * (0 + 1 + 2)
    print("state", st, "x[0]", xv[0], "expected", n_k * 3)
    ev0, ev1 = cuda.event(timing=True), cuda.event(timing=True)
    ev0.record(s)
    for _ in range(100):
        g.launch()
    ev1.record(s)
    ev1.synchronize()
    per = cuda.event_elapsed_time(ev0, ev1) / 100 * 1e3
    print(
        f"eager: {eager * 1e6:.0f} us/step ({eager * 1e6 / (n_k + 1):.1f} us/launch); graph: {per:.0f} us/step ({per / (n_k + 1):.2f} us/kernel)"
    )


if __name__ == "__main__":
    main()
