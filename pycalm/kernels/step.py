"""The end of a token step: choose what the next step feeds, and move to the next position.

The whole step is one captured CUDA graph, so per-token values live on the device:
  state[STATE_TOKEN]  the token the next step embeds (the sampler has just written its pick)
  state[STATE_POS]    the position of the step that just ran; advanced by one here
  state[STATE_FEED_END]  positions below it take their token from `feed` (the prompt), so a
                      prompt is prefilled by replaying the same graph, with no host work
  tokens[pos]        every token that went in at pos (prompt and generated), for the host to read

One thread does it: a few words of memory, launched once per token.
"""

from __future__ import annotations

from numba import cuda

from pycalm.kernels.common import STATE_POS, STATE_TOKEN, dependent_start

STATE_FEED_END = 2  # state[2]: positions below it are fed from `feed` (see the docstring)
STATE_SIZE = 4


@cuda.jit
def advance_kernel(state, feed, tokens):  # noqa: ANN001
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    if cuda.grid(1) == 0:
        nxt = state[STATE_POS] + 1
        if nxt < state[STATE_FEED_END]:
            state[STATE_TOKEN] = feed[nxt]
        if nxt < tokens.shape[0]:
            tokens[nxt] = state[STATE_TOKEN]
        state[STATE_POS] = nxt


def advance(state: object, feed: object, tokens: object, *, stream: object) -> int:
    """state (>=3,) int32, feed (seq_len,) int32, tokens (seq_len,) int32 -> bytes moved."""
    advance_kernel[1, 32, stream](state, feed, tokens)
    return 6 * 4


COMPILE_CHECK = [(advance_kernel, "void(int32[::1], int32[::1], int32[::1])")]
