"""Penalties and logit bias on the GPU: the logits the sampler reads, in the token step.

The reference is pycalm.cpu.reference.penalties_ref (its section gives the rule). For each
token v, in float32, with n = counts[v] the times v was generated so far in this choice:

    l = logits[v]
    if n > 0 or prompt[v]:  l = l / r if l > 0 else l * r      repetition_penalty r
    l = l - frequency * n                                     frequency_penalty
    if n > 0:  l = l - presence                               presence_penalty
    out[v] = l + bias[v]                                      logit_bias

`out` is a buffer of its own: the logits stay the model's for the logprobs kernel and the
finite check, and the sampler reads `out`.

The counts follow the choice on the device, with no host work between tokens: the step at
position pos embeds state[STATE_TOKEN], which the step before sampled when pos >= feed end
(below it, the prompt's token from `feed`). So the kernel, which runs after the classifier and
before the sampler (state[STATE_TOKEN] is still the step's input), first counts that token: the
thread that owns v = state[STATE_TOKEN] reads counts[v], adds one and writes it back, and no
other thread touches counts[v] (no atomics, no race). The last token a choice samples is never
counted: no step samples after it. GpuEngine.generate resets the counts, and sets the prompt's
flags, the penalties and the bias, before the first step (PenaltyBuffers.reset).

The penalties' values (params) are device memory too, not launch arguments, so one captured
graph serves every request that has penalties, whatever their values.

Thread mapping: a grid-stride loop over the vocabulary, a token a thread at a time, coalesced.
Bytes moved: vocab_size * (4 logits + 4 counts + 1 prompt flag + 4 bias read, 4 out written)
= 17 bytes a token of the vocabulary (2.2 MB at 128k, about a microsecond of an H200's
bandwidth), and 4 more for the one count written. Launched only in the step of a request with
penalties or a bias (GpuEngine.graph keys its graphs by it): plain decoding is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda, float32

from pycalm.cpu.reference import check_penalties, logit_bias_dense, prompt_flags
from pycalm.kernels.common import STATE_FEED_END, STATE_POS, STATE_TOKEN, dependent_start

PRESENCE, FREQUENCY, REPETITION = 0, 1, 2  # params' layout
PARAMS_SIZE = 3
PENALTY_THREADS = 256
PENALTY_BLOCKS = 64  # a 150k vocabulary in about 10 tokens a thread


@dataclass
class PenaltyBuffers:
    """A choice's penalty state on the device."""

    counts: object  # (vocab_size,) int32, times each token was generated
    prompt: object  # (vocab_size,) uint8, 1 for the prompt's tokens
    bias: object  # (vocab_size,) float32, the logit bias
    params: object  # (PARAMS_SIZE,) float32: presence, frequency, repetition
    out: object  # (vocab_size,) float32, the logits the sampler reads

    @classmethod
    def allocate(cls, vocab_size: int, stream: object) -> PenaltyBuffers:
        def zeros(dtype: type) -> object:
            return cuda.to_device(np.zeros(vocab_size, dtype), stream=stream)

        params = cuda.to_device(np.array([0.0, 0.0, 1.0], np.float32), stream=stream)
        return cls(zeros(np.int32), zeros(np.uint8), zeros(np.float32), params, zeros(np.float32))

    def reset(self, sampling: object, prompt: list[int], stream: object) -> None:
        """Set for a new choice of `sampling` (a SamplingParams) over `prompt` (the request's whole
        prompt): no token counted yet, the prompt's flags, the bias and the penalties' values."""
        s, vocab_size = sampling, self.counts.shape[0]
        check_penalties(
            s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.logit_bias, vocab_size
        )
        self.counts.copy_to_device(np.zeros(vocab_size, np.int32), stream=stream)
        self.prompt.copy_to_device(prompt_flags(prompt, vocab_size), stream=stream)
        self.bias.copy_to_device(logit_bias_dense(s.logit_bias, vocab_size), stream=stream)
        values = np.zeros(PARAMS_SIZE, np.float32)
        values[PRESENCE], values[FREQUENCY] = s.presence_penalty, s.frequency_penalty
        values[REPETITION] = s.repetition_penalty
        self.params.copy_to_device(values, stream=stream)


@cuda.jit(cache=True)
def penalty_kernel(logits, state, counts, prompt, bias, params, out):  # noqa: ANN001
    dependent_start()  # in a programmatic graph: wait for the classifier
    token = state[STATE_TOKEN]
    fresh = state[STATE_POS] >= state[STATE_FEED_END]  # the step's input token was sampled
    presence, frequency, repetition = params[PRESENCE], params[FREQUENCY], params[REPETITION]
    for v in range(cuda.grid(1), logits.shape[0], cuda.gridsize(1)):
        n = counts[v]
        if fresh and v == token:  # this thread alone reads and writes counts[token]
            n += 1
            counts[v] = n
        x = logits[v]
        if n > 0 or prompt[v] != 0:
            x = x / repetition if x > float32(0.0) else x * repetition
        x = x - frequency * float32(n)
        if n > 0:
            x = x - presence
        out[v] = x + bias[v]


def penalize(logits: object, state: object, buffers: PenaltyBuffers, *, stream: object) -> object:
    """buffers.out = penalties_ref(logits, counts, prompt, ...) after counting the step's input
    token (see the module docstring); logits (vocab_size,) float32, state (STATE_SIZE,) int32.
    Returns buffers.out, what the sampler reads."""
    n = logits.shape[0]
    threads = min(PENALTY_THREADS, 32 * -(-n // 32))
    blocks = min(PENALTY_BLOCKS, -(-n // threads))
    b = buffers
    penalty_kernel[blocks, threads, stream](logits, state, b.counts, b.prompt, b.bias, b.params, b.out)
    return b.out
