import sys

from pycalm.convert.main import main

sys.exit(main())
