"""gossipcomp: communication-efficient decentralized training over gRPC."""

__version__ = "0.1.0"
