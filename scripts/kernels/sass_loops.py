"""Instructions a lane issues in one turn of a kernel's hot loop, read from its machine code (no
GPU needed): the decode attention's stream loop (a warp tile), the skinny matmul's step loop and
the tiled matmul's (pycalm.kernels.matmul: a step of BK = 32 columns).

Where a kernel is bound by issue rather than by bytes, its time follows these counts: the decode
attention at 32k positions keeps about 16 warps an SM, each streaming 2 KB warp tiles (Llama-3-8B,
fp16 KV), and at 4 schedulers an SM issuing one instruction a cycle a tile of N instructions
costs at least 16 N / 4 cycles an SM for 32 KB, so N above about 440 caps the cache stream below
the copy ceiling at any issue efficiency. The skinny matmul's 8-row q4 step moves 1,280 bytes of
codes and scales a warp, the same reasoning for its 234 instructions. Each kernel is compiled as
the engine compiles it (numba to PTX for sm_90a, with its launch bounds or register cap), then:
  - ptxas -v: registers and spill bytes;
  - cuobjdump --dump-sass: the backward branches are the loops; a loop's turn is its instruction count
    (skinny: per 8 mma, since the compiler may unroll the step loop; its chunks wholly in K take
    a loop of unchecked loads, the rest a checked one), with the opcodes that fill it.

    python3 scripts/kernels/sass_loops.py attention                # Llama-3-8B and TinyLlama, fp16 / fp8 KV
    python3 scripts/kernels/sass_loops.py attention --tiles 4,8 --stages 4,3
    python3 scripts/kernels/sass_loops.py skinny --dtypes q4,gf4 --rows 8,64
    python3 scripts/kernels/sass_loops.py skinny --ops      # and each loop's opcode counts
    python3 scripts/kernels/sass_loops.py skinny --dtypes q4 --rows 32 --min-blocks 2
    python3 scripts/kernels/sass_loops.py skinny --dtypes q4,gf4 --rows 32 --row-tiles 4
    python3 scripts/kernels/sass_loops.py matmul --dtypes gf4,fp16 --modes residual,gate
    python3 scripts/kernels/sass_loops.py matmul --matmul-tiles "64,64,1,2,4,4;64,128,1,4,4,2"

ptxas is the nvidia-cuda-nvcc wheel's (numba's NVVM comes with it) or one on PATH; cuobjdump and
the nvdisasm it runs come from wheels (`python3 -m pip install nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm`) or from PATH.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: pycalm

from numba import cuda, types  # noqa: E402

from pycalm.kernels import attention, matmul, skinny  # noqa: E402
from pycalm.kernels.matmul import MODES  # noqa: E402

ATTENTION_SHAPES = {"Llama-3-8B": (128, 4), "TinyLlama": (64, 8)}  # head_dim, query heads a kv head


def tool(name: str, wheels: tuple[str, ...]) -> str:
    """The path of a CUDA tool: a wheel's bin/ (nvidia.<module>) first, then PATH."""
    for module in wheels:
        try:
            for root in importlib.import_module(module).__path__:
                path = os.path.join(root, "bin", name)
                if os.path.exists(path):
                    return path
        except ImportError:
            pass
    found = shutil.which(name)
    if found is None:
        sys.exit(
            f"error: no {name}: install the wheel named in this script's docstring, or put {name} on PATH"
        )
    return found


PTXAS = tool("ptxas", ("nvidia.cuda_nvcc",))
CUOBJDUMP = tool("cuobjdump", ("nvidia.cu13", "nvidia.cuda_cuobjdump"))
NVDISASM = tool("nvdisasm", ("nvidia.cu13", "nvidia.cuda_nvdisasm"))  # cuobjdump runs it


def machine_code(kernel: object, sig: tuple) -> tuple[str, list[tuple[int, str]]]:
    """ptxas's resource line and the SASS (address, instruction) of one compiled kernel (no
    code, and ptxas's complaint, where it refuses the kernel: too much shared memory, say)."""
    options = getattr(kernel, "targetoptions", {})
    bounds, cap = options.get("launch_bounds"), options.get("max_registers")
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0, "a"), launch_bounds=bounds)
    with tempfile.TemporaryDirectory() as d:
        src, obj = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        Path(src).write_text(ptx)
        limit = [f"-maxrregcount={cap}"] if cap else []  # matmul's register cap (cuda.jit's max_registers)
        r = subprocess.run(
            [PTXAS, "-arch=sm_90a", "-v", *limit, src, "-o", obj], capture_output=True, text=True
        )
        if r.returncode:
            lines = r.stderr.strip().splitlines()
            return "ptxas: " + next((x for x in lines if "error" in x), lines[-1])[-90:], []
        regs = re.search(r"Used (\d+) registers", r.stderr)
        spill = re.search(r"(\d+) bytes spill stores", r.stderr)
        info = f"{regs.group(1) if regs else '?'} registers, {spill.group(1) if spill else '?'} bytes spilled"
        env = dict(os.environ, PATH=os.path.dirname(NVDISASM) + os.pathsep + os.environ.get("PATH", ""))
        dump = subprocess.run(
            [CUOBJDUMP, "--dump-sass", obj], capture_output=True, text=True, check=True, env=env
        ).stdout
    code = []
    for line in dump.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,6})\*/\s+(.*?);", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2).strip()))
    return info, code


def loops(code: list[tuple[int, str]]) -> list[list[str]]:
    """The instructions of each loop: from a backward branch's target to the branch."""
    found = []
    for at, text in code:
        m = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if m and "BRA.DIV" not in text and int(m.group(1), 16) < at:
            found.append([t for a, t in code if int(m.group(1), 16) <= a <= at])
    return found


def opcodes(body: list[str]) -> str:
    """The loop's opcodes, most frequent first (predicates and modifiers dropped)."""
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    return ", ".join(f"{op} {n}" for op, n in ops.most_common(12))


def report_attention(args: argparse.Namespace) -> None:
    f32_2, i32_1 = types.float32[:, ::1], types.int32[::1]
    print("decode attention (pycalm.kernels.attention): instructions a lane a warp tile, the stream loop")
    print("| shape | KV | threads | tile | stages | registers | a warp tile | a position |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        head_dim, group = ATTENTION_SHAPES[shape]
        for kv in args.kv.split(","):
            for tile in map(int, args.tiles.split(",")):
                for stages in map(int, args.stages.split(",")):
                    kernel = attention.attention_kernel(head_dim, group, kv, args.threads, tile, stages)
                    cache = types.float16[:, ::1]
                    sig = (f32_2, cache, cache, i32_1, types.float32[:, :, ::1], i32_1, f32_2, types.int32,
                           types.int32, i32_1, i32_1, types.int32[:, ::1], types.int32)  # fmt: skip
                    info, code = machine_code(kernel, sig)
                    # the stream loop: the loop that waits for the ring (DEPBAR) and holds the shuffles
                    body = max((b for b in loops(code) if any("DEPBAR" in t for t in b)), key=len, default=[])
                    print(f"| {shape} | {kv} | {args.threads} | {tile} | {stages} | {info} | {len(body)} | "
                          f"{len(body) / tile:.0f} |")  # fmt: skip
                    if args.ops:
                        print(f"  {opcodes(body)}")


def report_skinny(args: argparse.Namespace) -> None:
    u2 = types.uint32[:, ::1]
    print("skinny matmul (pycalm.kernels.skinny): instructions a lane per 8 mma in the step loop")
    print("| weights | mode | rows | warps | A tiles | registers | per 8 mma: unchecked / checked loop |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for mode in args.modes.split(","):
            for rows in map(int, args.rows.split(",")):
                n_tiles = skinny.n_tiles_for(rows)
                row_tiles = args.row_tiles or skinny.row_tiles_for(dtype, n_tiles)
                kernel = skinny.make_skinny_kernel(
                    dtype,
                    MODES[mode],
                    n_tiles,
                    args.warps,
                    skinny.UNROLL,
                    args.min_blocks,
                    row_tiles,
                    args.x_words or skinny.x_words_for(dtype, n_tiles),
                )
                out = types.float16[:, ::1] if mode == "gate" else types.float32[:, ::1]
                weights = {
                    "fp16": (u2, u2),
                    "fp8": (types.uint8[:, ::1], types.uint8[:, ::1]),
                    "gf4": (u2, u2),
                    "q8": (types.int8[:, ::1], types.float32[::1], types.int8[:, ::1], types.float32[::1]),
                    "q4": (u2, u2, u2, u2),
                }[dtype]
                info, code = machine_code(kernel, (u2, *weights, out))
                # the step loops in code order: the chunks wholly in K (unchecked loads), then the
                # checked one (the last chunk; every chunk where the kernel takes no unchecked loop)
                steps = [b for b in loops(code) if any("HMMA" in t for t in b)]
                per = " / ".join(f"{len(b) * 8 / sum('HMMA' in t for t in b):.0f}" for b in steps)
                print(f"| {dtype} | {mode} | {rows} | {args.warps} | {row_tiles} | {info} | {per} |")
                body = steps[0] if steps else []
                if args.ops:
                    print(f"  {opcodes(body)}")


def report_matmul(args: argparse.Namespace) -> None:
    u2, f16_2 = types.uint32[:, ::1], types.float16[:, ::1]
    print("tiled matmul (pycalm.kernels.matmul): instructions a lane a step of K (BK = 32) in the step loop")
    print(
        "| weights | mode | tile (BM, BN, WM, WN, stages, blocks) | split | registers | a step | HMMA | per mma |"
    )
    print("|---|---|---|---|---|---|---|---|")
    named = {
        "MID_TILE": (matmul.MID_TILE, True),
        "TILE": (matmul.TILE, False),
        "ROW_TILE": (matmul.ROW_TILE, True),
    }
    tiles = [
        named[spec] if spec in named else (matmul.Tile(*(int(v) for v in spec.split(","))), True)
        for spec in args.matmul_tiles.split(";")
    ]
    for dtype in args.dtypes.split(","):
        for mode in args.modes.split(","):
            for tile, split in tiles:
                kernel = matmul.make_matmul_kernel(dtype, matmul.MODES[mode], tile, split=split)
                weights = {
                    "fp16": (f16_2, f16_2),
                    "fp8": (types.uint8[:, ::1], types.uint8[:, ::1]),
                    "gf4": (u2, u2),
                    "q8": (types.int8[:, ::1], types.float32[::1], types.int8[:, ::1], types.float32[::1]),
                    "q4": (u2, types.float16[:, :, ::1], u2, types.float16[:, :, ::1]),
                }[dtype]
                out = f16_2 if mode == "gate" else types.float32[:, ::1]
                sig = (f16_2, *weights, out, *((types.float32[::1], types.int32[::1]) if split else ()))
                info, code = machine_code(kernel, sig)
                body = max((b for b in loops(code) if any("HMMA" in t for t in b)), key=len, default=[])
                mma = sum("HMMA" in t for t in body)
                per = f"{len(body) / mma:.1f}" if mma else "-"
                print(
                    f"| {dtype} | {mode} | {tuple(tile)[:6]} | {split} | {info} | {len(body)} | {mma} | {per} |"
                )
                if args.ops:
                    print(f"  {opcodes(body)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=("attention", "skinny", "matmul"))
    ap.add_argument(
        "--shapes", default="Llama-3-8B,TinyLlama", help="attention: " + ",".join(ATTENTION_SHAPES)
    )
    ap.add_argument("--kv", default="fp16,fp8", help="attention: KV cache dtypes")
    ap.add_argument("--threads", type=int, default=attention.THREADS, help="attention: threads a block")
    ap.add_argument("--tiles", default=str(attention.TILE), help="attention: positions a warp tile")
    ap.add_argument("--stages", default=str(attention.STAGES), help="attention: stages of a warp's ring")
    ap.add_argument("--dtypes", default="fp16,fp8,gf4,q8,q4", help="skinny, matmul: weight formats")
    ap.add_argument("--modes", default="plain", help="skinny, matmul: plain, residual, gate")
    ap.add_argument(
        "--matmul-tiles",
        default="MID_TILE;TILE",
        help="matmul: MID_TILE (split), TILE, ROW_TILE (split) or BM,BN,WM,WN,stages,blocks (split); ...",
    )
    ap.add_argument("--rows", default="8,64", help="skinny: rows a pass (its n-tile count and A tiles)")
    ap.add_argument("--warps", type=int, default=skinny.WARPS, help="skinny: warps a block")
    ap.add_argument(
        "--min-blocks",
        type=int,
        default=0,
        help="skinny: blocks an SM the registers must allow (launch bounds)",
    )
    ap.add_argument(
        "--row-tiles", type=int, default=0, help="skinny: A tiles a warp (0: the package's, row_tiles_for)"
    )
    ap.add_argument(
        "--x-words",
        type=int,
        default=0,
        help="skinny: words of X a lane loads with its weights (0: the package's, x_words_for)",
    )
    ap.add_argument("--ops", action="store_true", help="also each loop's opcode counts")
    args = ap.parse_args()
    if args.kernel == "attention":
        report_attention(args)
    elif args.kernel == "matmul":
        report_matmul(args)
    else:
        report_skinny(args)


if __name__ == "__main__":
    main()
