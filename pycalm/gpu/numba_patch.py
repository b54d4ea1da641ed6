"""A compile-time fix to numba-cuda's lowering, installed by pycalm.gpu before any kernel compiles."""

from __future__ import annotations


def install() -> None:
    """Make numba-cuda's lowering find its singly assigned variables in linear time.

    Lower._find_singly_assigned_variable rescans a variable's whole basic block for every
    variable, which is quadratic in the block size; the unrolled matvec loop bodies are blocks
    of thousands of statements, and this one scan took half of their compile time (tens of
    seconds each). The replacement counts each block's assignments once and returns the same
    set. numba-cuda is pinned (0.30.4); if its lowering ever lacks the method, nothing is
    patched."""
    try:
        from collections import Counter, defaultdict

        from numba.cuda import lowering
    except ImportError:  # pragma: no cover
        return
    if not hasattr(lowering.Lower, "_find_singly_assigned_variable"):  # pragma: no cover
        return
    ir_mod = lowering.ir

    def _find_singly_assigned_variable(self: object) -> None:
        sav = set()
        if not self.func_ir.func_id.is_generator:
            blocks = self.func_ir.blocks
            use_defs = lowering.compute_use_defs(blocks)
            alloca_vars = lowering.must_use_alloca(blocks)
            var_assign_map = defaultdict(set)
            for blk, vl in use_defs.defmap.items():
                for var in vl:
                    var_assign_map[var].add(blk)
            var_use_map = defaultdict(set)
            for blk, vl in use_defs.usemap.items():
                for var in vl:
                    var_use_map[var].add(blk)
            counts: dict = {}  # block -> how often each name is assigned in it
            for var, blks in var_assign_map.items():
                if var not in alloca_vars and len(blks) == 1 and not var_use_map[var]:
                    [defblk] = blks
                    if defblk not in counts:
                        insts = self.blocks[defblk].find_insts(ir_mod.assign_types)
                        counts[defblk] = Counter(stmt.target.name for stmt in insts)
                    if counts[defblk][var] == 1:
                        sav.add(var)
        self._singly_assigned_vars = sav
        self._blk_local_varmap = {}

    lowering.Lower._find_singly_assigned_variable = _find_singly_assigned_variable
