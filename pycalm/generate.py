"""`python -m pycalm.generate`: pycalm.app.generate's command line."""

import sys

from pycalm.app.generate import main

if __name__ == "__main__":
    sys.exit(main())
