"""Imports point down the layers of docs/design.md: a module never imports one of a higher
layer, and the graph layer loads neither gRPC nor a terminal library."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from helpers import loaded_modules

PACKAGE = Path(__file__).resolve().parent.parent / "gossipcomp"

# module path under gossipcomp (a unit, or a dotted path inside one) -> layer: a module takes
# the layer of the longest key that is it or a package above it, and may import any module of
# its own layer or a lower one
LAYERS = {
    "inputs": 0,
    "proto": 0,
    "compress": 1,
    "workload": 1,
    "data": 1,  # the old public paths of workload.data, .models and .training
    "models": 1,
    "training": 1,
    "security": 1,
    "topology": 2,
    "transport": 3,
    "rendezvous": 3,  # peer addresses from torch's store: above the topology it fills
    "schedule": 4,
    "gossip": 5,
    "allreduce": 5,
    "outer": 5,  # outer optimizers and drift correction of local-update training
    "peer": 7,
    "peer.links": 6,
    "coordinator": 7,
    "coordinator.client": 8,  # the coordinator's package holds the client a layer above it
    "experiment": 9,
    "experiment.report": 10,
    "experiment.simulation": 11,
    "experiment.presentation": 11,
    "experiment.plot": 11,
    "cli": 12,
    "__main__": 13,
    # modules that sit above their unit: the all-reduce command line and launcher
    "allreduce.command": 11,
    "allreduce.__main__": 13,
    # compression levels: one package whose modules sit at the layers of what they use (its
    # __init__ imports nothing)
    "levels": 0,
    "levels.ladder": 1,
    "levels.notices": 3,
    "levels.rate": 4,
    "levels.progress": 4,
    "levels.edges": 4,
    "levels.senders": 4,
    "levels.codecs": 5,
    "levels.peer": 7,
}


def _unit(module: str) -> str:
    return module.split(".")[0]


def _layer(module: str) -> int:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):  # the longest key first
        layer = LAYERS.get(".".join(parts[:end]))
        if layer is not None:
            return layer
    raise KeyError(f"{module}: no layer in LAYERS for it or a package above it")


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level]
                found.add(".".join([*base, node.module]))
            elif node.module.startswith("gossipcomp."):
                found.add(node.module.removeprefix("gossipcomp."))
        elif isinstance(node, ast.Import):
            found |= {
                a.name.removeprefix("gossipcomp.")
                for a in node.names
                if a.name.startswith("gossipcomp.")
            }
    return found


def test_every_import_points_down_the_layers():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).with_suffix("")
        module = ".".join(relative.parts).removesuffix(".__init__")
        if not module or module == "__init__" or _unit(module) == "topologies":
            continue
        for imported in _imports(path, module):
            if _layer(imported) > _layer(module):
                wrong.append(f"{module} (layer {_layer(module)}) imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_the_graph_layer_loads_no_grpc_and_no_terminal_library():
    statement = "import gossipcomp.topology, gossipcomp.schedule, gossipcomp.compress"
    assert not {"grpc", "rich"} & set(loaded_modules(statement, "grpc", "rich"))


def test_a_peer_loads_no_coordinator_service():
    """The schedule messages peers pass each other live below both (schedule/messages.py), so
    importing a peer loads no module of the coordinator's package (its service included)."""
    assert loaded_modules("from gossipcomp.peer import Peer", "gossipcomp.coordinator") == []


def test_the_coordinator_client_loads_no_coordinator_service():
    """A peer's trainer imports the client, and `from gossipcomp.coordinator import X` keeps
    working for every name the coordinator's modules define, each loaded on first use: the
    client loads neither the coordinator's planning state nor its gRPC service."""
    loaded = loaded_modules("import gossipcomp.coordinator.client", "gossipcomp.coordinator")
    assert loaded == ["gossipcomp.coordinator", "gossipcomp.coordinator.client"]
    import gossipcomp.coordinator as package

    for module, names in package._EXPORTS.items():  # noqa: SLF001
        for name in names.split():
            assert getattr(package, name) is getattr(sys.modules[module], name), name


def test_each_levels_module_imports_alone_and_loads_nothing_above_its_layer():
    """gossipcomp/levels/ spans layers 1 to 7 with an __init__ that imports nothing: importing
    one of its modules first (the transport importing `notices`) works, with no import cycle
    through the units it uses, and loads no module of a higher layer."""
    modules = sorted(p.stem for p in (PACKAGE / "levels").glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, sys\n"
        "importlib.import_module('gossipcomp.levels.' + sys.argv[1])\n"
        "print(' '.join(m.removeprefix('gossipcomp.') for m in sys.modules "
        "if m.startswith('gossipcomp.') and not m.startswith('gossipcomp.proto')))"
    )
    above = {}
    for name in modules:
        module = f"levels.{name}"
        out = subprocess.run(
            [sys.executable, "-c", code, name], capture_output=True, text=True, check=True
        )
        above[module] = [m for m in out.stdout.split() if _layer(m) > _layer(module)]
    assert set(above) >= {"levels.ladder", "levels.notices", "levels.codecs"}
    assert not any(above.values()), above


def test_the_old_public_import_paths_still_work():
    """The reshaping moved modules into packages; the paths users were shown keep working."""
    code = (
        "from gossipcomp.peer import Peer, PeerStats, GossipStalled\n"
        "from gossipcomp.topology import build_topology, load_topology\n"
        "from gossipcomp.data import load_digits_split, load_split, parse_partition\n"
        "from gossipcomp.models import build_mlp, build_model\n"
        "from gossipcomp.training import BatchStream, evaluate_accuracy, local_step\n"
        "from gossipcomp.experiment import PeerTrainer, TrainConfig\n"
        "from gossipcomp.coordinator import Coordinator\n"
        "from gossipcomp.compress import parse_spec\n"
        "from gossipcomp.gossip import DPSGD, PowerGossip, Choco, DEFATC\n"
        "from gossipcomp.allreduce import register, MergedSync, MarsitSync, SSDSGD\n"
        "import gossipcomp.workload.data as new\n"
        "assert load_split is new.load_split and Peer.__name__ == 'Peer'\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
