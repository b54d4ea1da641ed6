"""`python -m pycalm.serve`: pycalm.app.serve's command line."""

import sys

from pycalm.app.serve import main

if __name__ == "__main__":
    sys.exit(main())
