"""Two compile-time fixes to numba-cuda's front end, installed by pycalm.gpu before any kernel
compiles. Neither changes a byte of the PTX. The lowering's scan (linear_singly_assigned) took
half of the unrolled matvecs' compile; the inliner's copies (share_inline_copies) half of the
rest of the engine's (the largest kernel of each of its 29 kernel functions: 97 s -> 49 s to PTX;
skinny's q4 gate at two A tiles 9.8 s -> 3.4 s). numba-cuda is pinned (0.30.4); where its code
is not the code these were written for, nothing is patched."""

from __future__ import annotations


def install() -> None:
    """Install both fixes (linear_singly_assigned, share_inline_copies)."""
    linear_singly_assigned()
    share_inline_copies()


def linear_singly_assigned() -> None:
    """Make numba-cuda's lowering find its singly assigned variables in linear time.

    Lower._find_singly_assigned_variable rescans a variable's whole basic block for every
    variable, which is quadratic in the block size; the unrolled matvec loop bodies are blocks
    of thousands of statements, and this one scan took half of their compile time (tens of
    seconds each). The replacement counts each block's assignments once and returns the same
    set."""
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


def share_inline_copies() -> bool:
    """Make numba's inliner copy a callee's IR in one pass instead of a pass a block; False
    (nothing changed) where its inliner is not the one this was written for.

    InlineWorker.inline_ir copies the callee's IR (numba-cuda 0.30: `copy.deepcopy(block)` for
    each block, NVIDIA/numba-cuda#688), and a Var's deep copy copies its Scope, every variable
    of the function: each block's copy copies the whole function again. The skinny matmul
    kernel inlines about 15 device functions of dozens of blocks, and the copies were most of
    its front end's time. Here the blocks of one copy share one memo, so the scope and its
    variables are copied once and shared by the copied blocks, as by the original's blocks. A
    block seen again (inline_ir copies its own copy once more) or another function's block
    starts a fresh memo. One copy is under way at a time: numba compiles under its global
    compiler lock, whichever thread asks. The PTX is the same bytes either way
    (tests/test_ptx.py compiles kernels both ways and compares them)."""
    import copy
    import inspect
    import types

    try:
        from numba.cuda.core import inline_closurecall, ir
    except ImportError:  # pragma: no cover
        return False
    if inline_closurecall.copy is not copy or "copy.deepcopy(block)" not in inspect.getsource(
        inline_closurecall.InlineWorker.inline_ir
    ):
        return False
    last: dict = {"scope": None, "memo": {}}  # the copy under way: the source scope, its memo

    def deepcopy(x: object, memo: dict | None = None) -> object:
        if memo is None and isinstance(x, ir.Block):
            if last["scope"] is not x.scope or id(x) in last["memo"]:
                last["scope"], last["memo"] = x.scope, {}
            return copy.deepcopy(x, last["memo"])
        return copy.deepcopy(x, memo)

    inline_closurecall.copy = types.SimpleNamespace(**{**vars(copy), "deepcopy": deepcopy})
    return True
