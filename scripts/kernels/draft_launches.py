"""What a small model's token step (a speculative draft's: Qwen2.5-0.5B in q8) spends beside its
weight bytes: the captured step at positions 0.. and 150.. (where the pair's drafts run, the
prompts' 100-300 positions) as shipped and with one launch shape changed at a time.

Variants (each a fresh engine; the package's functions are replaced in this process only):
  shipped          as the package runs it
  att_c16, att_c64 the attention's shortest split 16 / 64 positions (attention.CHUNK; shipped 32)
  no_attention     the attention launches left out (outputs wrong: timing only), the bound on
                   what a faster attention saves
  w2_split1        w2's row groups one warp each (the shipped q8 / fp8 w2 takes two)
  w2_split4        w2's row groups four warps each, in blocks of 16 warps (4 groups a block):
                   each warp walks a quarter of the row, so a matrix of few rows keeps more
                   loads in flight
  res_split2       every residual launch (wo too) two warps a group

    python scripts/kernels/draft_launches.py [--shapes qwen2.5-0.5b] [--dtypes q8] [--variants all]
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
from pathlib import Path

from numba import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import RandomDeviceModel, config_for, time_replays  # noqa: E402

import pycalm.kernels.attention as attention_module  # noqa: E402
import pycalm.kernels.matvec as matvec_module  # noqa: E402
from pycalm.cpu.sampler import SamplingParams  # noqa: E402
from pycalm.gpu.engine import EngineOptions, GpuEngine  # noqa: E402
from pycalm.kernels.launch import blocks_for, resident_blocks  # noqa: E402

SHIPPED = {
    "chunk": attention_module.CHUNK,
    "attention": attention_module.attention,
    "split_for": matvec_module.split_for,
    "launch": matvec_module.row_group_launch,
}
SPLIT_WARPS = 16  # warps a block of the four-warp groups (four groups): 128 registers a thread fit


def launch_split4(
    kernel: object, args: tuple, n_groups: int, n_chunks: int, split: int = 1
) -> tuple[int, int]:
    """row_group_launch, but groups of four warps in blocks of SPLIT_WARPS warps (the package's
    rule, 8 teams a block, would take 32 warps: more registers than an SM holds)."""
    if split != 4:
        return SHIPPED["launch"](kernel, args, n_groups, n_chunks, split)
    threads = SPLIT_WARPS * 32
    return blocks_for(n_groups, SPLIT_WARPS, split, resident_blocks(kernel, args, threads)), threads


def split_w2(n: int):  # noqa: ANN201
    """split_for giving the launches the package splits (w2's long residual rows) n warps a group."""

    def split_for(dtype: str, mode: int, loads_a_lane: int, slots: bool) -> int:
        shipped = SHIPPED["split_for"](dtype, mode, loads_a_lane, slots)
        return n if shipped > 1 else shipped

    return split_for


def split_residuals(dtype: str, mode: int, loads_a_lane: int, slots: bool) -> int:
    return 2 if mode == matvec_module.RESIDUAL and not slots else 1


def skip(*args: object, **kwargs: object) -> None:
    """A launch left out."""


VARIANTS = {  # name -> (attention chunk, attention launch, split_for)
    "shipped": (SHIPPED["chunk"], SHIPPED["attention"], SHIPPED["split_for"]),
    "att_c16": (16, SHIPPED["attention"], SHIPPED["split_for"]),
    "att_c64": (64, SHIPPED["attention"], SHIPPED["split_for"]),
    "no_attention": (SHIPPED["chunk"], skip, SHIPPED["split_for"]),
    "w2_split1": (SHIPPED["chunk"], SHIPPED["attention"], split_w2(1)),
    "w2_split4": (SHIPPED["chunk"], SHIPPED["attention"], split_w2(4)),
    "res_split2": (SHIPPED["chunk"], SHIPPED["attention"], split_residuals),
}


def time_variant(shape: str, dtype: str, variant: tuple) -> tuple[float, float]:
    """ms a token step at positions 0..31 and 150..249 in this variant (a graph a span)."""
    chunk, attention, split_for = variant
    attention_module.CHUNK, attention_module.attention = chunk, attention
    matvec_module.split_for, matvec_module.row_group_launch = split_for, launch_split4
    try:
        cfg = config_for(shape, dtype, 4096)
        engine = GpuEngine(RandomDeviceModel(cfg), seq_len=4096, kv_dtype="fp16", options=EngineOptions())
        step = functools.partial(engine.graph, SamplingParams())
        time_replays(engine, step, 0, 16)  # capture and warm up
        time_replays(engine, step, 150, 16)
        first = min(time_replays(engine, step, 0, 32) for _ in range(3))
        late = min(time_replays(engine, step, 150, 100) for _ in range(3))
        del engine, step
        gc.collect()
        cuda.current_context().deallocations.clear()
    finally:
        attention_module.CHUNK, attention_module.attention = SHIPPED["chunk"], SHIPPED["attention"]
        matvec_module.split_for, matvec_module.row_group_launch = SHIPPED["split_for"], SHIPPED["launch"]
    return first * 1e3, late * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen2.5-0.5b")
    ap.add_argument("--dtypes", default="q8")
    ap.add_argument("--variants", default="all", help="'all' or names: " + ",".join(VARIANTS))
    args = ap.parse_args()
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    print("| shape | weights | variant | ms at 0-31 | ms at 150-249 |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            for name in names:
                first, late = time_variant(shape, dtype, VARIANTS[name])
                print(f"| {shape} | {dtype} | {name} | {first:.3f} | {late:.3f} |", flush=True)


if __name__ == "__main__":
    main()
