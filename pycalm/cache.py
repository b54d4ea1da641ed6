"""`python -m pycalm.cache`: pycalm.app.cache's command line."""

import sys

from pycalm.app.cache import main

if __name__ == "__main__":
    sys.exit(main())
