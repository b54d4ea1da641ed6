"""A precompile worker process (`python -m pycalm.gpu.precompile_worker SPEC WORKER`): it walks
the engine of SPEC on stand-in weights, recording every launch, then compiles the kernels it
claims into the kernel cache (pycalm.gpu.precompile says how the workers share the work)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pycalm.gpu.precompile import Walk, claim, mark_groups, schedule, virtual_memory


class StandInModel:
    """What GpuEngine needs of a model (config, device_tensor): every tensor a model file of
    this config holds (a q8 / q4 matrix's scales too), as a device array of its stored dtype
    and shape, its bytes never set."""

    def __init__(self, config: object) -> None:
        from pycalm.model.loader import expected_tensors

        self.config = config
        self._specs = {s.name: s for s in expected_tensors(config, 1)}

    def device_tensor(self, name: str) -> object:
        from numba import cuda

        spec = self._specs[name]
        return cuda.device_array(spec.shape, spec.dtype)


def walk_engine(spec: dict, walk: Walk) -> None:
    """Build the engine of `spec` (engine_spec's) on stand-in weights and enqueue every token
    step variant, the multi-token forward and the batched step, each under its group (the
    caller has installed `walk`, which records the launches, and on a GPU virtual_memory)."""
    from pycalm.cpu.sampler import SamplingParams
    from pycalm.gpu.engine import EngineOptions, GpuEngine
    from pycalm.gpu.prefill import ROW_BUCKETS, Prefill
    from pycalm.model.config import ModelConfig

    cfg = ModelConfig.from_json(spec["config"])
    options = EngineOptions(**{**spec["options"], "parallel_compile": 0})
    engine = GpuEngine(StandInModel(cfg), spec["seq_len"], spec["kv_dtype"], options=options)
    # greedy (argmax) and sampled at temperature alone (sample_wide's kernels)
    for walk.group, temperature in (("step", 0.0), ("sample", 1.0)):
        for span in sorted({engine.span(p) for p in range(engine.seq_len)}):
            engine.forward(SamplingParams(temperature=temperature), span)
    # a top-k or min-p cut samples in one block (sample_kernel)
    engine.forward(SamplingParams(temperature=1.0, top_k=40), engine.span(0))
    engine.forward(SamplingParams(), engine.span(0), True)  # a request for logprobs adds their kernel
    engine.forward(SamplingParams(), engine.span(0), penalties=True)  # penalties or a bias: theirs
    engine.sample_step(SamplingParams(), masked=True)  # constrained decoding adds the mask kernel
    walk.group = "prefill"
    if engine.multi_token:
        prefill = Prefill(engine, engine.prefill_chunk)
        # a prompt's chunk, and a rows pass of each kind of product (skinny's n-tile counts)
        buckets = (1, 16, 32, ROW_BUCKETS[-1])  # one a compiled skinny n-tile count (1, 2, 4, 8)
        for rows in sorted({min(r, engine.seq_len) for r in (*buckets, prefill.max_chunk)}):
            prefill.forward_rows(0, rows)
        for rows in sorted({*buckets, prefill.logit_rows}):
            prefill.classify_rows(0, rows)
        # a rows pass's sampling of every row (any bucket: the same argument types)
        from pycalm.kernels.sample import RowSampling, sample_rows

        params = RowSampling(*(a[:1] for a in prefill.row_sampling))
        sample_rows(prefill.buffers.logits[:1], params, prefill.row_coins[:1], prefill.row_sampled[:1],
                    stream=engine.stream, **prefill.sample_options)  # fmt: skip
        # serve --parallel's batched steps over a paged pool of one context (stand-in memory:
        # its size is no argument type), where the engine batches
        from pycalm.batch.blocks import BLOCK_SIZE
        from pycalm.gpu.batched import BatchedGpuEngine

        if BatchedGpuEngine.refusal(engine) is None:
            walk.group = "batch"
            BatchedGpuEngine(engine, n_blocks=-(-engine.seq_len // BLOCK_SIZE), block_size=BLOCK_SIZE).walk()


def worker_main(spec_path: str, worker: int) -> int:
    """A worker process: walk, then compile the claimed kernels into the cache, marking each one
    done and each group whose kernels are all done. Prints a JSON line per kernel it compiled
    (key, seconds) and one at the end (kernels seen)."""
    spec = json.loads(Path(spec_path).read_text())
    from pycalm.gpu import kernel_cache as cache

    cache.set_root(spec["root"])  # before any kernel module is imported
    from numba.cuda.dispatcher import CUDADispatcher

    walk = Walk()
    with walk.installed(CUDADispatcher) as real_compile, virtual_memory():
        walk_engine(spec, walk)
    claims, markers = Path(spec["claims"]), {g: Path(m) for g, m in spec["markers"].items()}
    items = schedule(walk.items)
    mark_groups(items, claims, markers)  # a group without kernels (no multi-token forward)
    for item in items:
        if not claim(claims, item.file):
            continue
        t0 = time.perf_counter()
        real_compile(item.kernel, item.argtypes)
        (claims / f"{item.file}.done").touch()
        print(json.dumps(dict(worker=worker, key=item.key, s=round(time.perf_counter() - t0, 3))), flush=True)
        mark_groups(items, claims, markers)
    print(json.dumps(dict(worker=worker, done=len(items))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1], int(sys.argv[2])))
