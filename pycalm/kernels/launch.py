"""Launch shapes of the row-group kernels (pycalm.kernels.matvec, qkv, moe): warps a block, blocks.

A row-group kernel's warps loop over row groups (grid-stride: warp w of block b takes groups
b * teams + w, then that plus blocks * teams, ...; a team is the `split` warps that share a
group). One decision per launch, in row_group_launch:

1. Warps a block. WARPS (16) by default: a block stages x once in shared memory for all its
   warps, so big blocks stage it few times. Two refinements, for launches whose x is one chunk:
   * where every warp can take exactly one row group, the block size from MIN_WARPS..MAX_WARPS
     that puts the fewest groups on the busiest SM with every block resident (balance_warps):
     1280 groups in blocks of 8 warps are 160 blocks, so 28 of 132 SMs would take two; 10
     warps make 128 blocks of one round each;
   * otherwise 8 warps instead of 16 where 16 would leave SMs without a block (fill_sms): a
     2048-row matrix in blocks of 16 warps of two rows is 64 blocks for 132 SMs.
   Launches with split row groups keep their warps (the teams must be whole), and so do those
   whose x is staged in several chunks (each block restages x per chunk).
2. Blocks: every block resident at once (at most BLOCKS_PER_SM an SM, and at most what the
   kernel's registers and shared memory allow, from the CUDA occupancy calculator), and every
   warp the same number of groups (no warp does one more group than the others), so no SM
   waits for a tail.

Under the CUDA simulator every thread is a Python thread: SIM_WARPS warps a block and at most
SIM_BLOCKS blocks keep the idle threads and the per-block start-up cost down (the warps loop
over the groups, so any shape is correct).
"""

from __future__ import annotations

import functools

from numba import config as _numba_config
from numba import cuda

from pycalm.errors import PycalmError
from pycalm.kernels.common import WARP

WARPS = 16  # warps a block by default
MIN_WARPS, MAX_WARPS = 4, 32  # the block sizes balance_warps chooses from
BLOCKS_PER_SM = 8  # blocks an SM at most (also capped by the kernel's occupancy)
SIM_WARPS = 2
SIM_BLOCKS = 2


@functools.cache
def n_sm() -> int:
    """Streaming multiprocessors of the current GPU (132 on an H200; the simulator has none)."""
    try:
        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    except Exception:  # noqa: BLE001  (simulator: no such attribute)
        return 132


_RESIDENT: dict = {}


def resident_blocks(kernel: object, args: tuple, threads: int) -> int | None:
    """Blocks of `kernel` an SM holds at once at `threads` threads a block (registers, shared
    memory), from the CUDA occupancy calculator; compiles the kernel for args on first use.
    0: a block does not fit. None under the simulator."""
    if _numba_config.ENABLE_CUDASIM:
        return None
    key = (kernel, threads)
    if key not in _RESIDENT:
        compiled = kernel._compile_for_args(*args)  # numba's own launch path does the same
        _RESIDENT[key] = compiled.max_cooperative_grid_blocks(threads) // n_sm()
    return _RESIDENT[key]


def blocks_for(n_groups: int, warps: int, split: int, resident: int | None) -> int:
    """Blocks for n_groups row groups: every block resident at once (at most BLOCKS_PER_SM an SM)
    and every team (the warps sharing a group) the same number of groups."""
    per_sm = min(BLOCKS_PER_SM, max(1, resident)) if resident is not None else BLOCKS_PER_SM
    teams = warps // split  # the row groups a block takes at once
    per_team = max(1, -(-n_groups // (n_sm() * per_sm * teams)))
    return max(1, -(-n_groups // (teams * per_team)))


def balance_warps(n_groups: int, resident: object) -> tuple[int, int]:
    """(warps a block, MIN_WARPS..MAX_WARPS, that put the fewest row groups on the busiest SM
    with every block resident, the groups a warp then takes); (WARPS, 0) where no block size
    fits. resident(threads): blocks an SM holds. Ties: fewer groups a warp (shorter chains),
    then fewer blocks (fewer x stagings)."""
    best: tuple[tuple[int, int, int], int] | None = None
    sms = n_sm()
    for warps in range(MIN_WARPS, MAX_WARPS + 1):
        per_sm = min(BLOCKS_PER_SM, resident(warps * WARP) or 0)
        if per_sm < 1:
            continue  # a block of this many warps does not fit an SM (registers)
        per_warp = -(-n_groups // (sms * per_sm * warps))
        blocks = -(-n_groups // (warps * per_warp))
        busiest = -(-blocks // sms) * warps * per_warp  # row groups on the busiest SM
        key = (busiest, per_warp, blocks)
        if best is None or key < best[0]:
            best = (key, warps)
    return (WARPS, 0) if best is None else (best[1], best[0][1])


def row_group_launch(
    kernel: object, args: tuple, n_groups: int, n_chunks: int, split: int = 1
) -> tuple[int, int]:
    """(blocks, threads) of a launch of the row-group `kernel` on `args` over n_groups row
    groups; n_chunks: the x chunks a block stages (1: x whole); split: warps that share a
    group. The rules and their reasons are the module docstring's."""
    resident = functools.partial(resident_blocks, kernel, args)
    warps = WARPS if split == 1 else 8 * split  # split: 16 warps, 8 teams of 2
    if _numba_config.ENABLE_CUDASIM:
        warps = max(1, SIM_WARPS // split) * split  # the kernel reads blockDim: whole teams
        return min(blocks_for(n_groups, warps, split, None), SIM_BLOCKS), warps * WARP
    if split == 1 and n_chunks == 1 and resident(warps * WARP) is not None:
        balanced, per_warp = balance_warps(n_groups, resident)
        if per_warp == 1:
            warps = balanced  # every warp one group, spread evenly
        elif -(-n_groups // warps) < n_sm():
            warps = 8  # 16 would leave SMs without a block
    if warps % split:
        raise PycalmError(f"{warps} warps a block do not make row groups of {split} warps")
    return blocks_for(n_groups, warps, split, resident(warps * WARP)), warps * WARP
