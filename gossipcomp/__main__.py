"""`python -m gossipcomp` runs the command line."""

import sys

from gossipcomp.cli import main

sys.exit(main())
