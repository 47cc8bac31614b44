"""The coordinator and its client: what plans merged compression, and a peer's side of it.

- reports.py: a peer's report checked at the door (every field hostile until bounded);
- planning.py: `Coordinator`, the network's state: reports -> cost model -> plan -> schedule,
  and the rate controller's link levels;
- service.py: `CoordinatorServer`, the Report RPC served over gRPC;
- client.py: `CoordinatorClient`, a peer's non-blocking reports and the schedules it stages;
- membership.py: `MemberLiveness`, who is in a live network (removal of silent members,
  admission of reporting ranks).

The names are importable from the package itself (``from gossipcomp.coordinator import
Coordinator``), each from its module on first use, so importing the client (as a peer's trainer
does) loads neither the planning state nor the service.
"""

from __future__ import annotations

from gossipcomp import lazy_exports

# module -> the public names it defines, each imported from it on first use
_EXPORTS = {
    "gossipcomp.coordinator.reports": (
        "MAX_LEVELS MAX_MARGIN MAX_NAME_CHARS MAX_NAMES_CHARS MAX_REPORTED_EPOCH "
        "MAX_REPORTED_ROUND MAX_SAMPLES_PER_LINK MAX_SECONDS MAX_SIGNATURE_CHARS "
        "MAX_TENSORS MemberReport ReportRefused"
    ),
    "gossipcomp.coordinator.planning": "ADAPTIVE_PLANNER Coordinator",
    "gossipcomp.coordinator.service": (
        "MAX_REPORT_BYTES REPORT_CALL_TIMEOUT REPORT_CALLS_PER_CONNECTION "
        "REPORT_HEADER_TIMEOUT REPORT_LIMITS REPORTS_IN_FLIGHT SERVICE_NAME "
        "CoordinatorServer"
    ),
    "gossipcomp.coordinator.client": "CoordinatorClient",
    "gossipcomp.coordinator.membership": "DEFAULT_MEMBER_TIMEOUT MemberLiveness",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
