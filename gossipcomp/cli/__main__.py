"""`python -m gossipcomp.cli` runs the command line, as `python -m gossipcomp` does."""

import sys

from gossipcomp.cli import main

sys.exit(main())
