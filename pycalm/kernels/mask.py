"""Constrained decoding on the GPU: the logits of the ids a constraint does not allow to -inf.

The math (reference: pycalm.cpu.reference.mask_logits_ref): for every id i < vocab_size,

    logits[i] = -inf   unless bit (i % 32) of mask[i // 32] is set

so the sampler that runs next (pycalm.kernels.sample) draws among the allowed ids only (an -inf
logit has probability 0, and greedy takes the best allowed id). The mask (ceil(vocab_size / 32),)
uint32 is the constraint's (pycalm.app.constrain), computed on the host while the GPU runs the
step's forward and copied to the device before this kernel (pycalm.gpu.engine's constrained
decode loop).

Thread mapping: a grid-stride loop, one logit a thread per turn, so a warp's 32 threads write
32 consecutive logits (coalesced) and read the same mask word (one broadcast load).

Bytes moved: the mask read (vocab_size / 8 bytes: 16 kB at 128k ids) and 4 bytes written for
each disallowed id (up to vocab_size * 4: 513 kB at 128k, which stays in L2 for the sampler);
the allowed logits are not touched.
"""

from __future__ import annotations

import math

from numba import cuda, float32, uint32

from pycalm.kernels.common import dependent_start

MASK_THREADS = 256
MASK_BLOCKS = 128  # 32k threads: four logits a thread at a 128k vocabulary
NEG_INF = float32(-math.inf)


@cuda.jit(cache=True)
def mask_logits_kernel(logits, mask):  # noqa: ANN001
    dependent_start()  # in a programmatic graph: wait for the classifier's logits
    for i in range(cuda.grid(1), logits.shape[0], cuda.gridsize(1)):
        word = mask[i >> 5]  # the word of ids 32 (i // 32) .. 32 (i // 32) + 31
        if (word >> uint32(i & 31)) & uint32(1) == uint32(0):
            logits[i] = NEG_INF


def mask_logits(logits: object, mask: object, *, stream: object) -> None:
    """logits (vocab_size,) float32, in place; mask (ceil(vocab_size / 32),) uint32, bit i % 32 of
    word i // 32 set where id i is allowed."""
    n = logits.shape[0]
    threads = min(MASK_THREADS, 32 * -(-n // 32))
    blocks = min(MASK_BLOCKS, -(-n // threads))
    mask_logits_kernel[blocks, threads, stream](logits, mask)
