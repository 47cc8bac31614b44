"""Run a whole gossip network, or one peer of it, on digits over real gRPC.

`run_simulation` puts every peer of a topology in this process (each with its own gRPC server on
a loopback port, each training in its own thread); `run_peer` runs one peer of a network whose
other peers live in other processes or machines. Both train with experiment.PeerTrainer and
return the same Report. Either may run over mutual TLS: `run_peer` with the peer's own files,
`run_simulation` with a throwaway CA and certificates that exist only while it runs; and with
TLS, peers may also sign every message (`run_peer` with its key and the topology's public keys,
`run_simulation` with throwaway keys).

The package: setup.py (the run's settings; building and training the peers of one process),
results.py (the Report), workers.py (`--workers`: peers spread over worker processes),
network.py (run_simulation), single.py (run_peer). Its names are imported from here, each
on first use (PEP 562): the command line's parsers take PeerLevels, CheckpointPolicy and
MAX_WORKERS from setup.py and workers.py without loading run_simulation's network and the
coordinator's service it runs.
"""

from __future__ import annotations

from gossipcomp import lazy_exports

# module -> the public names it defines, each imported from it on first use
_EXPORTS = {
    "gossipcomp.experiment.simulation.network": "run_simulation",
    "gossipcomp.experiment.simulation.setup": "CheckpointPolicy PeerLevels ProgressCallback",
    "gossipcomp.experiment.simulation.single": "peer_keys run_peer",
    "gossipcomp.experiment.simulation.workers": (
        "MAX_WORKERS WORKER_START_SECONDS WorkerFailed usable_cores"
    ),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
