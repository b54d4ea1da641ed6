"""The engines behind `pycalm.generate`, one interface for the CPU reference and the GPU.

    engine.generate(ids, start_pos, max_new, sampling) -> iterator of new token ids
    engine.logits(token, pos) -> (vocab_size,) float32

`generate` feeds `ids` at positions start_pos.. (the KV cache keeps what came before, so a chat
goes on turn after turn), then samples up to `max_new` tokens, stopping after an EOS id.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from pycalm.cpu.reference import ReferenceEngine
from pycalm.cpu.sampler import Sampler, SamplingParams
from pycalm.errors import PycalmError


class CpuEngine:
    """The NumPy reference engine with the CPU sampler."""

    device = "cpu"

    def __init__(self, model: object, seq_len: int, kv_dtype: str = "fp16") -> None:
        self.ref = ReferenceEngine(model, seq_len=seq_len, kv_dtype=kv_dtype)
        self.config = model.config
        self.seq_len = self.ref.seq_len

    def logits(self, token: int, pos: int) -> np.ndarray:
        return self.ref.forward(token, pos)

    def generate(
        self, ids: list[int], start_pos: int, max_new: int, sampling: SamplingParams
    ) -> Iterator[int]:
        if not ids:
            raise PycalmError("nothing to feed: the prompt encodes to no tokens")
        if start_pos + len(ids) > self.seq_len:
            raise PycalmError(
                f"prompt of {len(ids)} tokens at position {start_pos} does not fit the context of {self.seq_len} tokens"
            )
        sampler = Sampler(sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.seed)
        eos = set(self.config.eos_ids)
        pos = start_pos
        for tok in ids[:-1]:  # prefill: only the cache matters
            self.ref.forward(tok, pos)
            pos += 1
        token = ids[-1]
        for _ in range(max_new):
            if pos >= self.seq_len:
                return
            token = sampler.sample(self.ref.forward(token, pos))
            pos += 1
            yield token
            if token in eos:
                return
