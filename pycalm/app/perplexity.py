"""Perplexity of a model on a text: the windows a long text is scored in (llama.cpp's
perplexity) and the mean negative log-likelihood over them. Shared by `-x` and LLM.perplexity."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def windows(n_tokens: int, window: int) -> list[tuple[int, int, int]]:
    """The windows a text of n_tokens is evaluated in, llama.cpp's perplexity style, as
    (start, end, first): ids[start:end] is fed from position 0 and scores (predicts) the tokens
    start + first .. end - 1. One window when the text fits; else each window is `window` long
    (the last may be shorter), starts window - window // 2 after the one before, and scores only
    the tokens past its first half (the first window scores all of its own): every token from the
    second on is scored exactly once, with window // 2 tokens of context or more."""
    if n_tokens <= window:
        return [(0, n_tokens, 1)]
    half = window // 2
    spans, start = [(0, window, 1)], 0
    while start + window < n_tokens:
        start += window - half
        spans.append((start, min(start + window, n_tokens), half))
    return spans


NLL_ROWS = 16  # rows of logits in float64 at a time: 6 MB at a 49,152 vocabulary, reused
# from one group to the next where a whole block's float64 copy is a fresh mapping to fault in


def mean_nll(engine: object, ids: list[int], progress: Callable[[int, float], None] | None = None) -> float:
    """The mean negative log-likelihood of ids[1:], each token given the ones before it, in the
    context-sized windows of `windows` (one when ids fit the context). Both engines compute the
    logits of every position of a window in their multi-token forward (prefill_logits, blocks
    of rows). progress(tokens scored, their summed negative log-likelihood) is called after each
    block."""
    nll, scored = 0.0, 0
    targets = np.asarray(ids, dtype=np.int64)
    for start, end, first in windows(len(ids), engine.seq_len):
        feed = ids[start : end - 1]  # row r's logits predict ids[start + r + 1]
        row = 0
        # blocks of (rows, vocab_size) logits, of window positions row .. row + rows - 1
        for block in engine.prefill_logits(feed, 0):
            rows = np.arange(max(row, first - 1), row + len(block))  # those this window scores
            # the log-softmax in float64, NLL_ROWS rows at a time
            for i in range(0, len(rows), NLL_ROWS):
                keep = rows[i : i + NLL_ROWS]
                logits = block[keep - row].astype(np.float64)  # (rows, vocab_size)
                target = logits[np.arange(len(keep)), targets[start + keep + 1]]  # (rows,)
                m = logits.max(axis=1)
                logits -= m[:, None]
                log_sum = m + np.log(np.exp(logits, out=logits).sum(axis=1))
                nll += float((log_sum - target).sum())
            scored += len(rows)
            if len(rows) and progress is not None:
                progress(scored, nll)
            row += len(block)
    return nll / scored
