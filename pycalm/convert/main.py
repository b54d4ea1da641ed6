"""Convert a Hugging Face folder or a GGUF file into one pycalm model file.

    python -m pycalm.convert SRC OUT --dtype fp16|fp8|gf4|q8|q4 [--bits B] [--calibrate TEXT]

Every model quirk is settled here, so the runtime sees one layout (docs/MODEL_FILE.md):
- q/k rows of each head are permuted from rotate-half order (HF checkpoints, Qwen2 GGUF files)
  to interleaved rotary pairs, biases too; Llama-architecture GGUF files already are;
- q, k and v are fused into one `wqkv` matrix (and `bqkv` bias) so one matvec produces all three;
- RoPE inverse frequencies, with Llama-3 scaling applied, are stored as `rope_freqs`;
- Mixtral's experts are stacked into (n_experts, rows, cols) tensors, the router kept in float32;
- the tokenizer (sentencepiece proto or HF tokenizers JSON) and chat template travel inside.

A conversion is a plan (`Converted`): the config (`make_config`) and, for each output tensor,
the source rows it is made of (`make_plan`; `Source`: read, permuted, concatenated). The two
readers feed them: pycalm.convert.hf (Hugging Face folders) and pycalm.convert.gguf (GGUF files).
Then the plan streams: each output tensor is read from the source (dequantized, for GGUF), encoded
(pycalm.model.formats) and written in row chunks of at most CHUNK_ELEMS values, so memory stays bounded
whatever the model size. Up to `threads` chunks are read and encoded at once, on threads (NumPy
lets go of the GIL in its array loops), and written in order. The file appears under its final
name only when complete.

Shapes: a source matrix is (rows, cols) = (out_features, in_features) in both HF and GGUF.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from pycalm.convert.common import CHUNK_ELEMS, DEFAULT_BITS, Converted, Source
from pycalm.errors import OneLineParser, PycalmError
from pycalm.model import formats
from pycalm.model.config import WEIGHT_DTYPES, ModelConfig
from pycalm.model.loader import ModelWriter, TensorSpec

# ---------------------------------------------------------------------------------------------
# Writing


class Progress:
    """A one-line progress bar on stderr (tensors and megabytes written); silent when off."""

    def __init__(self, n_tensors: int, total_bytes: int, enabled: bool) -> None:
        self.n_tensors = n_tensors
        self.total = max(total_bytes, 1)
        self.enabled = enabled
        self.done_tensors = 0
        self.done_bytes = 0
        self.start = time.perf_counter()
        self._drawn = 0.0  # when the bar was last redrawn: at most ten redraws a second

    def update(self, nbytes: int, tensor_done: bool = False) -> None:
        self.done_bytes += nbytes
        self.done_tensors += tensor_done
        now = time.perf_counter()
        if not self.enabled or (now - self._drawn < 0.1 and self.done_tensors < self.n_tensors):
            return
        self._drawn = now
        frac = self.done_bytes / self.total
        bar = "#" * int(30 * frac)
        sys.stderr.write(
            f"\rconverting [{bar:<30}] {self.done_tensors}/{self.n_tensors} tensors "
            f"{self.done_bytes / 1e6:.1f}/{self.total / 1e6:.1f} MB {now - self.start:.0f}s"
        )
        sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


MAX_THREADS = 8  # the default of convert's threads: the cores, at most this many


def default_threads() -> int:
    """The encoding threads a conversion takes by default: the cores, at most MAX_THREADS."""
    return max(1, min(MAX_THREADS, os.cpu_count() or 1))


def _in_order(fn: Callable, items: Iterable, pool: Executor | None, ahead: int) -> Iterator:
    """fn(item) for each item, in order: on the pool, at most `ahead` of them under way at once
    (so memory stays bounded), else one after another here. An exception is raised where its
    result is due; the calls still queued then are cancelled."""
    if pool is None:
        yield from map(fn, items)
        return
    pending: deque = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()


def _write_matrix(
    w: ModelWriter,
    spec: TensorSpec,
    src: Source,
    config: ModelConfig,
    progress: Progress,
    pool: Executor | None = None,
    ahead: int = 1,
) -> str:
    """Encode and write matrix spec.name from `src` in row chunks (q8 / q4: the codes, then
    `<name>.scales`), up to `ahead` chunks encoded at once on the pool; returns how it was made
    (Source.origin)."""
    dtype, group = config.dtype_of(spec.name), config.group_of(spec.name)
    rows = int(np.prod(spec.shape[:-1], dtype=np.int64))
    packed = formats.GF4_GROUP if dtype == "gf4" else formats.Q4_NIBBLES if dtype == "q4" else 1
    cols = spec.shape[-1] * packed
    if (src.rows, src.cols) != (rows, cols):
        raise PycalmError(
            f"{src.label}: shape ({src.rows}, {src.cols}) does not make {spec.name} ({rows}, {cols})"
        )
    step = max(1, CHUNK_ELEMS // cols)

    def encode(r0: int) -> np.ndarray | formats.Quantized:
        try:
            return src.encode_rows(np.arange(r0, min(rows, r0 + step)), dtype, group)
        except ValueError as e:
            raise PycalmError(f"{src.label}: {e}") from None

    scales = []  # q8 / q4: each chunk's scales, written after the codes
    starts = range(0, rows, step)
    for r0, data in zip(starts, _in_order(encode, starts, pool, ahead), strict=True):
        r1 = min(rows, r0 + step)
        if isinstance(data, formats.Quantized):
            scales.append(data.scales)
            data = data.codes
        w.write(spec.name, data)
        progress.update(data.nbytes, tensor_done=r1 == rows and not scales)
    if scales:
        name = spec.name + ".scales"
        stacked = np.concatenate(scales)
        w.write(name, stacked.reshape(w.specs[w.specs.index(spec) + 1].shape))
        progress.update(stacked.nbytes, tensor_done=True)
    return src.origin(dtype, group)


def write_converted(conv: Converted, out: Path, progress: bool = True, threads: int = 0) -> Path:
    """Stream every planned tensor into the model file at `out`, encoding up to `threads` row
    chunks at once (0: default_threads())."""
    threads = threads or default_threads()
    try:
        w = ModelWriter(out, conv.config, conv.tokenizer_kind, conv.tokenizer_blob, conv.chat_template)
    except ValueError as e:
        raise PycalmError(str(e)) from None
    except OSError as e:  # a folder that cannot be made or written, a full disk
        in_the_way = isinstance(e, (FileExistsError, NotADirectoryError))
        why = f"cannot make the folder {out.parent}: a file is in the way" if in_the_way else e.strerror
        raise PycalmError(f"cannot write {out}: {why}") from None
    bar = Progress(len([s for s in w.specs if not s.name.endswith(".scales")]), w.total_bytes, progress)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="pycalm-convert") if threads > 1 else None
    with w, pool or contextlib.nullcontext():  # the pool's exit waits for its chunks under way
        for spec in w.pending():
            if spec.name.endswith(".scales"):
                continue  # written with its matrix
            item = conv.plan[spec.name]
            if isinstance(item, Source):
                origin = _write_matrix(w, spec, item, conv.config, bar, pool, threads)
                conv.origins[origin] = conv.origins.get(origin, 0) + 1
                continue
            vec = np.asarray(item(), dtype=np.float32)
            if vec.shape != spec.shape:
                raise PycalmError(
                    f"{spec.name}: source has shape {list(vec.shape)}, expected {list(spec.shape)}"
                )
            if not np.all(np.isfinite(vec)):
                raise PycalmError(f"{spec.name}: contains NaN or infinity")
            w.write(spec.name, vec)
            bar.update(vec.nbytes, tensor_done=True)
    bar.update(len(conv.tokenizer_blob), tensor_done=True)
    bar.finish()
    return out


def source_kind(path: Path) -> str | None:
    """What `path` holds, by its contents, never its name: "hf" (a folder), "gguf" (a file that
    starts with the GGUF magic), "safetensors" (an 8-byte little-endian header length then a
    JSON object: a pycalm model file, or another safetensors file), or None (anything else).
    A file that cannot be read is a PycalmError."""
    if path.is_dir():
        return "hf"
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError as e:
        raise PycalmError(f"{path}: cannot read: {e.strerror}") from None
    if head[:4] == b"GGUF":
        return "gguf"
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") >= 2:
        return "safetensors"
    return None


def plan_conversion(src: str | Path, dtype: str = "fp16") -> Converted:
    """Read and check a Hugging Face folder or a GGUF file (its header: architecture,
    hyperparameters, tensor list, tokenizer) and plan its conversion; nothing is written, so a
    caller can say what it converts only once the source is known to be good."""
    src = Path(src)
    if dtype not in WEIGHT_DTYPES:
        raise PycalmError(f"unsupported weight dtype {dtype!r} (one of {', '.join(WEIGHT_DTYPES)})")
    if not src.exists():
        raise PycalmError(f"source not found: {src}")
    kind = source_kind(src)
    # the readers build on this module's sources and plan, so they are imported here
    if kind == "hf":
        from pycalm.convert.hf import from_hf

        return from_hf(src, dtype)
    if kind == "gguf":
        from pycalm.convert.gguf import from_gguf

        return from_gguf(src, dtype)
    raise PycalmError(f"{src}: neither a Hugging Face folder nor a GGUF file")


def convert(
    src: str | Path,
    out: str | Path,
    dtype: str = "fp16",
    progress: bool = True,
    *,
    policy: bool = True,
    bits: float = DEFAULT_BITS,
    calibrate: str | Path | None = None,
    log: Callable[[str], None] | None = None,
    threads: int = 0,
) -> Path:
    """Convert an HF folder or a GGUF file at `src` into a pycalm model file at `out`, encoding
    on `threads` threads (0: default_threads()).

    q4 takes the mixed-precision policy unless `policy` is off (then every matrix is q4 in
    groups of 32): each matrix's format within `bits` a weight (pycalm.convert.quantize.plan_dtypes),
    in the order the calibration text `calibrate` measures (pycalm.convert.calibrate) when given, else
    the default order. `log` gets the summary: how each matrix was made, the bits a weight.
    """
    conv = plan_conversion(src, dtype)
    if dtype == "q4" and policy:
        from pycalm.convert.quantize import plan_dtypes

        on_grid = {n for n, item in conv.plan.items() if isinstance(item, Source) and item.on_q4_grid}
        steps = None
        if calibrate is not None:
            from pycalm.convert.calibrate import rank_steps

            steps = rank_steps(conv, Path(calibrate), on_grid, log=log)
        conv.config = plan_dtypes(conv.config, on_grid, bits, steps)
    elif calibrate is not None:
        raise PycalmError("--calibrate ranks the matrices of a q4 model: use it with --dtype q4")
    path = write_converted(conv, Path(out), progress, threads)
    if log is not None:
        for origin, count in conv.origins.items():
            log(f"{count} matrices: {origin}")
        if dtype in formats.QUANTIZED:
            from pycalm.convert.quantize import average_bits

            cfg = conv.config
            line = f"{average_bits(cfg):.3f} bits a weight over the matrices, scales included"
            if dtype == "q4":
                q8 = sum(d == "q8" for _, d in cfg.tensor_dtypes)
                line += f" ({q8} matrices in q8, {len(cfg.q4_groups)} in q4 groups of 64)"
            log(line)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="python -m pycalm.convert",
        description="Convert an HF folder or GGUF file to a pycalm model file.",
    )
    parser.add_argument("src", help="Hugging Face model folder, or a GGUF file")
    parser.add_argument("out", help="output pycalm model file (.safetensors)")
    parser.add_argument(
        "--dtype",
        choices=WEIGHT_DTYPES,
        default="fp16",
        help="weight format (default fp16, lossless; q8 is within 0.3%% of its perplexity and q4 within 5%%, both faster than fp8 / gf4 on a GPU)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--bits",
        type=float,
        default=DEFAULT_BITS,
        help=f"q4: bits a weight on average, scales included (default {DEFAULT_BITS})",
    )
    parser.add_argument(
        "--calibrate",
        metavar="TEXT",
        help="q4: rank the matrices by their effect on this text's output (KL divergence) and keep "
        "the worst in q8 within --bits",
    )
    parser.add_argument(
        "--no-policy", action="store_true", help="q4: every matrix in q4, groups of 32 (no q8 matrices)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        metavar="N",
        help=f"row chunks read and encoded at once (default: the cores, at most {MAX_THREADS})",
    )
    args = parser.parse_args(argv)
    if args.threads < 0:
        parser.error(f"--threads must be 0 or more, got {args.threads}")
    start = time.perf_counter()
    try:
        path = convert(
            args.src,
            args.out,
            args.dtype,
            progress=not args.quiet,
            policy=not args.no_policy,
            bits=args.bits,
            calibrate=args.calibrate,
            log=lambda line: print(line, file=sys.stderr),
            threads=args.threads,
        )
    except (PycalmError, OSError) as e:  # OSError: the OS's own message names the path
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the writer has removed its partial file
        print("", file=sys.stderr)
        return 130
    size = path.stat().st_size
    print(
        f"wrote {path} ({size / 1e6:.1f} MB, {args.dtype}) in {time.perf_counter() - start:.1f}s",
        file=sys.stderr,
    )
    return 0
