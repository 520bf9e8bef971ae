"""`python -m loadtests.load.overload`: see the package's docstring."""

import sys

from loadtests.load.overload.cli import main

sys.exit(main())
