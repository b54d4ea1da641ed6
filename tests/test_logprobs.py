"""Logprobs: the kernel (pycalm.kernels.logprobs) against logprobs_ref, the GPU engine's
generate(..., logprobs=k) against logprobs_ref over the CPU engine's logits, and the server's
`logprobs` / `top_logprobs` through the openai client."""

from __future__ import annotations

import numpy as np
import pytest
from gpu import GPU

from pycalm.cpu.reference import MAX_TOP_LOGPROBS, logprobs_ref
from pycalm.errors import PycalmError
from pycalm.kernels.common import STATE_SIZE, STATE_TOKEN


def run_kernel(logits: np.ndarray, token: int) -> np.ndarray:
    from numba import cuda

    from pycalm.kernels.logprobs import OUT_SIZE, logprobs

    state = np.zeros(STATE_SIZE, np.int32)
    state[STATE_TOKEN] = token
    out = cuda.to_device(np.zeros(OUT_SIZE, np.int32))
    s = cuda.stream()
    logprobs(cuda.to_device(logits.astype(np.float32)), cuda.to_device(state), out, stream=s)
    s.synchronize()
    return out.copy_to_host()


def check(got, want) -> None:
    """Kernel against reference: the same ids in the same order; logprobs within the float32
    logsumexp's rounding (a few ulps of the largest logit: 1e-5 absolute at logits of magnitude
    up to 30; -inf equal)."""
    assert got.token == want.token and got.top_ids == want.top_ids
    assert np.allclose([got.logprob, *got.top_logprobs], [want.logprob, *want.top_logprobs], rtol=0, atol=1e-5)


@pytest.mark.parametrize("vocab", [37, 203, 4099] if not GPU else [151_936, 128_256, 49_153])
def test_kernel_matches_reference(vocab):
    """Random logits at odd vocabulary sizes (37: fewer than the block's threads, and under K
    per thread), with ties at the top (two equal maxima and equal logits straddling rank K) and
    -inf entries (masked tokens): the same top ids (descending logit, lower id first) and logprobs."""
    from pycalm.kernels.logprobs import K, token_logprobs

    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
    order = np.argsort(-logits, kind="stable")
    logits[order[1]] = logits[order[0]]  # a tie at the top: the lower id goes first
    logits[order[K - 2 : K + 3]] = logits[order[K - 2]]  # a run of equal logits across rank K
    logits[rng.choice(vocab, vocab // 5, replace=False)] = -np.inf
    logits[order[0]] = logits[order[1]] = logits.max() + 1  # the two maxima kept finite
    for token in (int(order[0]), int(rng.integers(vocab))):
        out = run_kernel(logits, token)
        for k in (0, 1, 7, MAX_TOP_LOGPROBS):
            check(token_logprobs(out, token, k), logprobs_ref(logits, token, k))


def test_kernel_few_finite():
    """Fewer finite logits than K: the -inf ones fill the list by id (as the reference orders
    them); the chosen token's logprob is -inf when it is masked."""
    from pycalm.kernels.logprobs import token_logprobs

    logits = np.full(45, -np.inf, np.float32)
    logits[[3, 17, 40]] = [1.0, 2.5, 1.0]
    for token in (17, 5):
        check(token_logprobs(run_kernel(logits, token), token, 20), logprobs_ref(logits, token, 20))


def test_reference_rejects_k():
    with pytest.raises(PycalmError, match="top logprobs must be 0 to 20"):
        logprobs_ref(np.zeros(4), 0, 21)
