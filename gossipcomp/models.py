"""The old import path of gossipcomp.workload.models, kept so users' `from gossipcomp.models import
...` goes on working (tests/test_layers.py imports every old public path once)."""

from gossipcomp.workload.models import *  # noqa: F403
