"""Topologies: YAML -> networkx graph -> mixing matrix W, validation and spectral quantities.

A topology fixes who talks to whom, how much each peer trusts each neighbour (W) and where each
rank listens. W is sparse (memory linear in the edges: a peer needs only its own row), sizes are
checked against MAX_PEERS and MAX_EDGES before any graph is built, and the spectrum is computed
only when asked: exactly from the dense W up to MAX_DENSE_PEERS peers, by sparse methods above.

The package: checks.py (limits, TopologyError, the checks of graph, W and addresses), core.py
(the Topology class), rounds.py (the per-round W of time-varying topologies: one-peer
exponential, base-k, random matchings, explicit rounds), spectrum.py (extreme eigenvalues of a
large sparse W), spec.py (a spec mapping -> Topology), files.py (a file or a shipped name ->
Topology). Its names are imported from here.
"""

from gossipcomp.topology.checks import MAX_DENSE_PEERS, MAX_EDGES, MAX_PEERS, TopologyError
from gossipcomp.topology.core import Topology
from gossipcomp.topology.files import load_topology, shipped_topologies
from gossipcomp.topology.spec import (
    DEFAULT_BASE_PORT,
    WEIGHT_SCHEMES,
    build_topology,
    topology_from_dict,
)

__all__ = [
    "DEFAULT_BASE_PORT",
    "MAX_DENSE_PEERS",
    "MAX_EDGES",
    "MAX_PEERS",
    "WEIGHT_SCHEMES",
    "Topology",
    "TopologyError",
    "build_topology",
    "load_topology",
    "shipped_topologies",
    "topology_from_dict",
]
