"""python -m pycalm: the `pycalm` command (pycalm.app.cli)."""

import sys

from pycalm.app.cli import main

sys.exit(main())
