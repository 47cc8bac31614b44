"""The old import path of gossipcomp.workload.training, kept so users' `from gossipcomp.training import
...` goes on working (tests/test_layers.py imports every old public path once)."""

from gossipcomp.workload.training import *  # noqa: F403
