"""The end of a token step: choose what the next step feeds, and move to the next position.

The reference is pycalm.cpu.reference.advance_ref. The whole step is one captured CUDA graph, so
the per-token values live on the device, in `state` (its layout: pycalm.kernels.common):
  state[STATE_TOKEN]     the token the next step embeds (the sampler has just written its pick)
  state[STATE_POS]       the position of the step that just ran; advanced by one here
  state[STATE_FEED_END]  positions below it take their token from `feed` (the prompt), so a
                         prompt is prefilled by replaying the same graph, with no host work
  feed[pos]              past the feed end, the sampler's pick is written there: feed holds the
                         token of every position the steps have reached, so the tokens of k
                         steps are one slice of it on the device (a draft model's drafts:
                         GpuEngine.greedy_tokens)

One thread does it: a few words of memory, launched once per token.
"""

from __future__ import annotations

from numba import cuda

from pycalm.kernels.common import STATE_FEED_END, STATE_POS, STATE_TOKEN, dependent_start


@cuda.jit(cache=True)
def advance_kernel(state, feed):  # noqa: ANN001
    dependent_start()  # in a programmatic graph: wait for the earlier kernels
    if cuda.grid(1) == 0:
        nxt = state[STATE_POS] + 1
        if nxt < state[STATE_FEED_END]:
            state[STATE_TOKEN] = feed[nxt]
        elif nxt < feed.shape[0]:  # (a feed of seq_len + 1 holds the context's last pick too)
            feed[nxt] = state[STATE_TOKEN]
        state[STATE_POS] = nxt


def advance(state: object, feed: object, *, stream: object) -> None:
    """state (STATE_SIZE,) int32: pos += 1, and token = feed[pos] while pos < feed end, else
    feed[pos] = token; feed (seq_len + 1,) int32, the tokens by position."""
    advance_kernel[1, 32, stream](state, feed)
