"""Opening a MODEL argument: the pycalm file it names or converts to (resolve_model) and the
engine that runs it (make_engine). Shared by the CLI, the API and the server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pycalm.app.fetch import DEFAULT_MODEL, KNOWN_MODELS, fetch_gguf
from pycalm.cpu.engine import CpuEngine, check_threads
from pycalm.errors import PycalmError
from pycalm.model.config import kv_dtype_for


def resolve_model(arg: str | None, dtype: str, cache: Path, log: Callable[[str], None]) -> Path:
    """A pycalm model file for MODEL, recognised by its contents (never its name): a pycalm file
    is used as is (open_model then checks it); a Hugging Face folder or a GGUF file is converted
    once and cached, keyed on its content (pycalm.app.cache). A name that is no path on disk and
    reads ORG/NAME[:TAG] is a model on the Hugging Face Hub (pycalm.app.hub), downloaded once
    and converted likewise."""
    from pycalm.app import cache as model_cache
    from pycalm.app.hub import hub_model, parse_hub_name
    from pycalm.convert.main import source_kind

    if arg is None or arg in KNOWN_MODELS:
        src = fetch_gguf(arg or DEFAULT_MODEL, cache, log=True)
    elif not Path(arg).exists() and parse_hub_name(arg) is not None:
        src, name, source = hub_model(arg, log)
        return model_cache.converted(src, dtype, cache, log, name=name, source=source)
    else:
        src = Path(arg)
        if not src.exists():
            raise PycalmError(f"model not found: {arg}")
        kind = source_kind(src)
        if kind == "safetensors":
            return src
        if kind is None:
            raise PycalmError(f"{arg}: not a pycalm model file, GGUF file or Hugging Face model folder")
    return model_cache.converted(src, dtype, cache, log)


def make_engine(
    model: object,
    device: str,
    seq_len: int,
    kv: str,
    log: Callable[[str], None],
    check_finite: bool = False,
    batch_invariant: bool = False,
    kernels: str = "fast",
    threads: int | None = None,
) -> object:
    """The GPU engine when asked for or when a CUDA GPU is present, else the CPU reference; the
    KV cache format `kv` (auto, fp16, fp8) for seq_len positions decided by kv_dtype_for.
    check_finite: the GPU engine checks every step's logits for NaN and infinity (--check-finite).
    batch_invariant: the GPU engine runs every token through the multi-token forward, the CPU
    engine every token through its token step (--batch-invariant). threads: the CPU engine's
    BLAS threads (--threads; None: pycalm.cpu.engine.DEFAULT_THREADS). kernels: the GPU engine's
    kernels, fast or simple (--kernels; pycalm.gpu.engine.EngineOptions)."""
    check_threads(threads)  # a bad count is an error on either device
    kv_dtype = kv_dtype_for(kv, seq_len)
    if device in ("auto", "gpu"):
        from pycalm.gpu import engine as gpu_model

        reason = gpu_model.gpu_unavailable_reason()
        if reason is None:
            options = gpu_model.EngineOptions(
                check_finite=check_finite, batch_invariant=batch_invariant, kernels=kernels
            )
            if threads is not None:
                log("pycalm: --threads sets the CPU engine's threads; the GPU engine runs without it")
            return gpu_model.GpuEngine(model, seq_len=seq_len, kv_dtype=kv_dtype, options=options)
        if device == "gpu":
            raise PycalmError(f"--device gpu: {reason}")
        log(f"pycalm: {reason}; running the CPU reference engine")
    if check_finite:
        log("pycalm: --check-finite checks the GPU engine's logits; the CPU engine runs without it")
    return CpuEngine(
        model, seq_len=seq_len, kv_dtype=kv_dtype, threads=threads, batch_invariant=batch_invariant
    )


def make_speculative(
    engine: object,
    speculate: str,
    *,
    draft_model: str | None,
    draft_k: int | None,
    dtype: str,
    cache: Path,
    kv: str,
    log: Callable[[str], None],
    threads: int | None = None,
) -> object:
    """engine itself for speculate "off", else a pycalm.app.speculative.SpeculativeEngine around
    it: "ngram" (prompt lookup), "draft" (draft_model, opened as MODEL is and run on the same
    device with its own KV cache of as many positions; its vocabulary must be the target's),
    "auto" (speculation_default: n-gram lookup for greedy calls on the GPU, else off).
    draft_k: drafts a pass (None: adaptive)."""
    from pycalm.app.speculative import (
        SPECULATE,
        SpeculationOptions,
        SpeculativeEngine,
        make_drafter,
        speculation_default,
    )

    if speculate not in SPECULATE:
        raise PycalmError(f"speculate must be one of {', '.join(SPECULATE)}, not {speculate!r}")
    if draft_k is not None and not 1 <= draft_k <= 63:
        raise PycalmError(f"draft k must be 1 to 63, not {draft_k}")
    greedy_only = speculate == "auto"
    if speculate == "auto":
        speculate = speculation_default(engine)
    if speculate == "off":
        return engine
    draft_engine = None
    if speculate == "draft":
        if draft_model is None:
            raise PycalmError("--speculate draft needs a draft model (--draft-model)")
        from pycalm.model.loader import open_model

        draft_file = open_model(resolve_model(draft_model, dtype, cache, log))
        draft_engine = make_engine(draft_file, engine.device, engine.seq_len, kv, log, threads=threads,
                                   batch_invariant=getattr(engine, "batch_invariant", False))  # fmt: skip
    options = SpeculationOptions(k=draft_k, greedy_only=greedy_only)
    return SpeculativeEngine(engine, make_drafter(speculate, engine, draft_engine), options)
