"""python -m pycalm: the `pycalm` command (pycalm.cli)."""

import sys

from pycalm.cli import main

sys.exit(main())
