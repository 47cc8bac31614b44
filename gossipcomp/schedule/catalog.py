"""The names of the merge planners, which planners.py registers its classes under: the command
line's flag tables list them without importing the planners' cost model (and torch)."""

from __future__ import annotations

PLANNER_NAMES = ("per-tensor", "single", "mergecomp", "mgwfbp", "strategy")
