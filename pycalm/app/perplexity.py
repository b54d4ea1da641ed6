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


def mean_nll(engine: object, ids: list[int], progress: Callable[[int, float], None] | None = None) -> float:
    """The mean negative log-likelihood of ids[1:], each token given the ones before it, in the
    context-sized windows of `windows` (one when ids fit the context). The GPU engine computes
    the logits of every position of a window in its multi-token forward (prefill_logits, blocks
    of rows); the CPU engine one token step a position. progress(tokens scored, their summed
    negative log-likelihood) is called after each block."""
    nll, scored = 0.0, 0
    targets = np.asarray(ids, dtype=np.int64)
    for start, end, first in windows(len(ids), engine.seq_len):
        feed = ids[start : end - 1]  # row r's logits predict ids[start + r + 1]
        if hasattr(engine, "prefill_logits"):
            blocks = engine.prefill_logits(feed, 0)
        else:
            blocks = (engine.logits(token, pos)[None] for pos, token in enumerate(feed))
        row = 0
        for block in blocks:  # (rows, vocab_size) logits of window positions row .. row + rows - 1
            keep = np.arange(max(row, first - 1), row + len(block))  # the rows this window scores
            if len(keep):
                logits = block[keep - row].astype(np.float64)
                m = logits.max(axis=1)
                log_sum = m + np.log(np.exp(logits - m[:, None]).sum(axis=1))
                nexts = targets[start + keep + 1]
                nll += float((log_sum - logits[np.arange(len(keep)), nexts]).sum())
                scored += len(keep)
                if progress is not None:
                    progress(scored, nll)
            row += len(block)
    return nll / scored
