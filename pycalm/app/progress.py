"""A progress line on stderr, redrawn in place ("\\r"), for the long steps a user waits on: a
download (pycalm.app.fetch) and a perplexity evaluation (pycalm.app.generate). Silent when off: the
callers turn it on only when stderr is a terminal, so logs and pipes get no control characters."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

REDRAW_S = 0.1  # at most ten redraws a second


def bar(fraction: float, width: int = 30) -> str:
    """[#####     ]: a fraction done, from 0 to 1."""
    return f"[{'#' * int(width * min(max(fraction, 0.0), 1.0)):<{width}}]"


class ProgressLine:
    """Counts work done out of `total` (0: unknown) and redraws the caller's line of it."""

    def __init__(self, total: int, enabled: bool, text: Callable[[int, float], str]) -> None:
        self.total, self.enabled, self.text = total, enabled, text  # text(done, elapsed seconds)
        self.done = 0
        self.start = time.perf_counter()
        self._drawn = 0.0

    def update(self, done: int) -> None:
        """Work done so far is `done`: redraw when due, and always at the end."""
        self.done = done
        now = time.perf_counter()
        if not self.enabled or (now - self._drawn < REDRAW_S and done != self.total):
            return
        self._drawn = now
        sys.stderr.write("\r" + self.text(done, now - self.start))
        sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
