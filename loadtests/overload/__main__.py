"""`python -m loadtests.overload`: see the package's docstring."""

import sys

from loadtests.overload.cli import main

sys.exit(main())
