"""The old import path of gossipcomp.workload.data, kept so users' `from gossipcomp.data import
...` goes on working (tests/test_layers.py imports every old public path once)."""

from gossipcomp.workload.data import *  # noqa: F403
