"""The rows pass at 16 and 32 rows with each choice of product kind for q4's and gf4's passes of
17 to 32 rows (pycalm.gpu.prefill's SKINNY_ROWS and SKINNY_GATE_ROWS), timed by scripts/bench.py
in this process:

  gate   as shipped: the gate launch on pycalm.kernels.panel, qkv, wo and w2 on skinny's
  all    every product on the panel (SKINNY_ROWS 16 for both formats)
  none   every product on skinny (SKINNY_GATE_ROWS empty)

    python3 scripts/kernels/rows_kinds.py gate          # then all, then none (a process each)
    python3 scripts/kernels/rows_kinds.py all --dtypes q4 --rows 32
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository: pycalm

import pycalm.gpu.prefill as prefill  # noqa: E402


def main() -> None:
    """Set the product kinds, then run bench.py's rows table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("kinds", choices=["gate", "all", "none"])
    parser.add_argument("--dtypes", default="q4,gf4")
    parser.add_argument("--rows", default="16,32")
    args = parser.parse_args()
    print("=", args.kinds)
    if args.kinds == "all":
        prefill.SKINNY_ROWS.update(q4=16, gf4=16)
    elif args.kinds == "none":
        prefill.SKINNY_GATE_ROWS.clear()
    sys.argv = ["bench.py", "--rows", args.rows, "--shapes", "llama3-8b", "--dtypes", args.dtypes]
    runpy.run_path(str(ROOT / "scripts" / "bench.py"), run_name="__main__")


if __name__ == "__main__":
    main()
