"""Constrained decoding's cost per token on the GPU: tok/s of plain decoding against decoding
under a JSON constraint (response_format json_object, or a schema), and the host's mask work
per token alone (llguidance's mask and the matcher's step, pycalm.app.constrain).

    python scripts/bench_constrained.py                      # Llama-3-8B shape, fp16, 128,256 ids
    python scripts/bench_constrained.py --dtypes fp16,q4 --tokens 512
    python scripts/bench_constrained.py --tiny               # a tiny shape, under the simulator too

The weights are random (scripts/bench.py's RandomDeviceModel), and so is the vocabulary: a
tokenizer made up for the purpose of 128,256 byte strings (the 256 single bytes, then words,
numbers, punctuation runs and JSON-like pieces, with and without a leading space, as a BPE
vocabulary holds) with one EOS. The constrained loop (GpuEngine._decode_constrained) runs the
next step's forward while the host computes the mask, so the cost is what the host's work does
not hide, plus the mask kernel, the mask's copy and the split step's second graph launch.
A random model's JSON may close early; decoding then starts again, and only the tokens after
each call's first are timed (the decode, not the prompt).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


class MadeUpTokenizer:
    """What pycalm.app.constrain reads of a tokenizer, over n made-up byte strings: the 256
    single bytes first, the last id the EOS (special)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
        seen = {bytes([b]) for b in range(256)}
        tokens = [bytes([b]) for b in range(256)]
        pieces = ['{"', '":', '",', '"}', "},", "],", '["', "[{", "}]", ": ", ", ", "null", "true", "false"]
        while len(tokens) < n - 1:
            kind = rng.integers(6)
            if kind < 3:  # a word, capitalised or not, with a space or not
                w = "".join(rng.choice(list(letters[:26]), rng.integers(2, 10)))
                w = w.capitalize() if rng.random() < 0.2 else w
                w = (" " + w) if rng.random() < 0.5 else w
            elif kind == 3:  # a number
                w = str(int(rng.integers(0, 10 ** int(rng.integers(1, 5)))))
            elif kind == 4:  # punctuation and JSON pieces
                w = "".join(rng.choice(pieces, rng.integers(1, 3)))
            else:  # a run of spaces or newlines
                w = rng.choice([" ", "\n", "\t"]) * int(rng.integers(2, 9))
            b = w.encode()
            if b not in seen:
                seen.add(b)
                tokens.append(b)
        self._tokens = tokens + [b"<|eot|>"]
        self.vocab_size = len(self._tokens)
        self.eos_ids = (self.vocab_size - 1,)
        self.bos_id = -1

    def is_special(self, i: int) -> bool:
        return i == self.vocab_size - 1

    def token_bytes(self, i: int) -> bytes:
        return self._tokens[i]

    def token_text(self, i: int) -> str:
        return self._tokens[i].decode("utf-8", errors="replace")

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return list(text.encode())  # byte by byte (the single bytes are ids 0 to 255)


SCHEMA = {  # a nested object of some size, for --schema
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
        },
    },
    "required": ["name", "age", "tags", "address"],
}


def mask_time(tok: MadeUpTokenizer, make: object, tokens: int, seed: int = 0) -> float:
    """Seconds per token of the host's work alone: fill_mask, then accept a random allowed id."""
    rng = np.random.default_rng(seed)
    c = make()
    out = np.zeros(-(-tok.vocab_size // 32), np.uint32)
    n, t = 0, 0.0
    while n < tokens:
        t0 = time.perf_counter()
        c.fill_mask(out)
        t += time.perf_counter() - t0
        bits = np.unpackbits(out.view(np.uint8), bitorder="little")[: tok.vocab_size]
        allowed = np.flatnonzero(bits)
        token = int(rng.choice(allowed))
        t0 = time.perf_counter()
        c.accept(token)
        t += time.perf_counter() - t0
        n += 1
        if c.finished or token in tok.eos_ids:
            c = make()
    return t / n


def decode_rate(
    engine: object, ids: list[int], tokens: int, sampling: object, make: object
) -> tuple[float, int]:
    """(tok/s of the decode, calls): generate until `tokens` tokens after each call's first are
    timed (a constraint that finishes early starts a new call)."""
    timed, seconds, calls = 0, 0.0, 0
    while timed < tokens:
        c = make()
        options = {} if c is None else {"constraint": c}
        first = last = None
        n = 0
        for _ in engine.generate(ids, 0, tokens - timed + 1, sampling, **options):
            last = time.perf_counter()
            first = first or last
            n += 1
        calls += 1
        if n > 1:
            timed += n - 1
            seconds += last - first
    return timed / seconds, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="fp16")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--schema", action="store_true", help="a nested JSON schema instead of json_object")
    ap.add_argument(
        "--tiny", action="store_true", help="a tiny shape (1 layer, 512 ids): a check that it runs"
    )
    args = ap.parse_args()

    from bench import RandomDeviceModel, config_for
    from numba import config as numba_config

    from pycalm.app.constrain import Constraint
    from pycalm.cpu.sampler import SamplingParams
    from pycalm.gpu.engine import EngineOptions, GpuEngine
    from pycalm.model.config import ModelConfig

    vocab = 512 if args.tiny else 128_256
    t0 = time.perf_counter()
    tok = MadeUpTokenizer(vocab)
    schema = SCHEMA if args.schema else None
    what = "the schema" if args.schema else "json_object"

    def make() -> object:
        return Constraint.json_schema(tok, schema, vocab_size=vocab)

    make()  # builds (and caches) llguidance's tokenizer
    print(
        f"vocabulary of {vocab:,} made-up tokens, llguidance tokenizer built: {time.perf_counter() - t0:.1f} s"
    )
    per_token = mask_time(tok, make, 32 if args.tiny else 2000)
    print(f"host mask work ({what}): {per_token * 1e6:.0f} us a token (fill_mask + accept)")
    sampling = SamplingParams(temperature=args.temperature, top_p=0.95, seed=1)
    tokens = 4 if args.tiny else args.tokens
    for dtype in args.dtypes.split(","):
        if args.tiny:
            cfg = ModelConfig(arch="llama", dim=32, hidden_dim=48, head_dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                              vocab_size=vocab, max_seq_len=64, rotary_dim=16, rope_theta=1e4, norm_eps=1e-5,
                              bos_id=-1, eos_ids=(), weight_dtype=dtype)  # fmt: skip
        else:
            cfg = config_for("llama3-8b", dtype, 4096)
        seq_len = 64 if args.tiny else 4096
        options = EngineOptions(attention_chunk=16) if numba_config.ENABLE_CUDASIM else EngineOptions()
        engine = GpuEngine(RandomDeviceModel(cfg), seq_len=seq_len, kv_dtype="fp16", options=options)
        ids = [int(t) for t in np.random.default_rng(0).integers(0, 256, 8)]
        # warm-up: compile every kernel and capture the graphs of both loops
        decode_rate(engine, ids, 2, sampling, lambda: None)
        decode_rate(engine, ids, 2, sampling, make)
        plain, _ = decode_rate(engine, ids, tokens, sampling, lambda: None)
        constrained, calls = decode_rate(engine, ids, tokens, sampling, make)
        slower = 100 * (plain / constrained - 1)
        print(
            f"{'tiny' if args.tiny else 'llama3-8b'} {dtype}: plain {plain:.1f} tok/s, constrained ({what}) "
            f"{constrained:.1f} tok/s ({calls} calls): {slower:+.1f}% time a token "
            f"({1e3 / plain:.3f} -> {1e3 / constrained:.3f} ms)"
        )
        del engine


if __name__ == "__main__":
    main()
