"""The coordinator and its client: what plans merged compression, and a peer's side of it.

- reports.py: a peer's report checked at the door (every field hostile until bounded);
- planning.py: `Coordinator`, the network's state: reports -> cost model -> plan -> schedule,
  and the rate controller's link levels;
- service.py: `CoordinatorServer`, the Report RPC served over gRPC;
- client.py: `CoordinatorClient`, a peer's non-blocking reports and the schedules it stages.

The names are importable from the package itself (``from gossipcomp.coordinator import
Coordinator``), each from its module on first use, so importing the client (as a peer's trainer
does) loads neither the planning state nor the service.
"""

from __future__ import annotations

from gossipcomp import lazy_exports

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # a report checked at the door
    "MAX_LEVELS": "gossipcomp.coordinator.reports",
    "MAX_MARGIN": "gossipcomp.coordinator.reports",
    "MAX_NAME_CHARS": "gossipcomp.coordinator.reports",
    "MAX_NAMES_CHARS": "gossipcomp.coordinator.reports",
    "MAX_REPORTED_EPOCH": "gossipcomp.coordinator.reports",
    "MAX_REPORTED_ROUND": "gossipcomp.coordinator.reports",
    "MAX_SAMPLES_PER_LINK": "gossipcomp.coordinator.reports",
    "MAX_SECONDS": "gossipcomp.coordinator.reports",
    "MAX_SIGNATURE_CHARS": "gossipcomp.coordinator.reports",
    "MAX_TENSORS": "gossipcomp.coordinator.reports",
    "MemberReport": "gossipcomp.coordinator.reports",
    "ReportRefused": "gossipcomp.coordinator.reports",
    # the network's state and its plans
    "ADAPTIVE_PLANNER": "gossipcomp.coordinator.planning",
    "Coordinator": "gossipcomp.coordinator.planning",
    # the Report RPC over gRPC
    "MAX_REPORT_BYTES": "gossipcomp.coordinator.service",
    "REPORT_CALL_TIMEOUT": "gossipcomp.coordinator.service",
    "REPORT_CALLS_PER_CONNECTION": "gossipcomp.coordinator.service",
    "REPORT_HEADER_TIMEOUT": "gossipcomp.coordinator.service",
    "REPORT_LIMITS": "gossipcomp.coordinator.service",
    "REPORTS_IN_FLIGHT": "gossipcomp.coordinator.service",
    "SERVICE_NAME": "gossipcomp.coordinator.service",
    "CoordinatorServer": "gossipcomp.coordinator.service",
    # a peer's side
    "CoordinatorClient": "gossipcomp.coordinator.client",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
