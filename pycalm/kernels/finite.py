"""A debug check of a token step's logits: is every one finite (no NaN, no infinity)?

GpuEngine launches it after the classifier when EngineOptions.check_finite is on (the CLI's
--check-finite), so the check is part of each captured step and costs no host round trip. The
reference is check_finite_ref. `flag` is three int32 on the device, zero until a check fails:

  flag[FLAG_FAILED]    1 once any step's logits held a NaN or an infinity
  flag[FLAG_POS]       the position of the first such step (state[STATE_POS] as it ran)
  flag[FLAG_INDEX]     the index of one non-finite logit of that step

Only the first failing step is recorded: a compare-and-swap on flag[FLAG_FAILED] picks one
thread of one step, and every later failure leaves the flag alone. The host reads the flag when
it chooses (pycalm.gpu.engine: every FINITE_CHECK_EVERY tokens and at the end of a call).

A grid-stride loop over the vocabulary: each thread reads vocab_size / (blocks * threads)
float32 logits, which the sampler reads anyway (a few hundred kB a token).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from pycalm.kernels.common import STATE_POS, dependent_start

FLAG_FAILED, FLAG_POS, FLAG_INDEX = 0, 1, 2
FLAG_SIZE = 3
CHECK_THREADS = 256
CHECK_BLOCKS = 32  # enough to stream a 150k vocabulary in a few microseconds


def check_finite_ref(logits: np.ndarray, pos: int, flag: np.ndarray) -> None:
    """flag as the kernel leaves it: set (1, pos, the first non-finite index) unless already set."""
    bad = np.flatnonzero(~np.isfinite(logits))
    if len(bad) and flag[FLAG_FAILED] == 0:
        flag[FLAG_FAILED], flag[FLAG_POS], flag[FLAG_INDEX] = 1, pos, bad[0]


@cuda.jit(cache=True)
def check_finite_kernel(logits, state, flag):  # noqa: ANN001
    dependent_start()  # in a programmatic graph: wait for the classifier
    for i in range(cuda.grid(1), logits.shape[0], cuda.gridsize(1)):
        if not math.isfinite(logits[i]):
            # the first thread to find one (of the first failing step) records it; the flag is
            # read by the host only after the stream has passed this kernel
            if cuda.atomic.cas(flag, FLAG_FAILED, 0, 1) == 0:
                flag[FLAG_POS] = state[STATE_POS]
                flag[FLAG_INDEX] = i


def check_finite(logits: object, state: object, flag: object, *, stream: object) -> None:
    """logits (vocab_size,) float32; state (STATE_SIZE,) int32; flag (FLAG_SIZE,) int32, set as
    the module docstring says when a logit is NaN or infinite."""
    n = logits.shape[0]
    threads = min(CHECK_THREADS, 32 * -(-n // 32))
    blocks = min(CHECK_BLOCKS, -(-n // threads))
    check_finite_kernel[blocks, threads, stream](logits, state, flag)
