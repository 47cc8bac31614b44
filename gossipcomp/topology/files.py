"""Loading a topology by file path or by the name of one shipped inside the package.

The command line's way in: files go through the hardened YAML reader of gossipcomp.inputs.yaml_files
(no aliases, bounded size, depth and node count) and then the spec reader.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import resources

from gossipcomp.inputs.yaml_files import load_yaml_file
from gossipcomp.topology.checks import TopologyError, _fail
from gossipcomp.topology.core import Topology
from gossipcomp.topology.spec import _TOP_KEYS, topology_from_dict


def shipped_topologies() -> list[str]:
    """The names of the topologies that ship inside the package (gossipcomp/topologies)."""
    folder = resources.files("gossipcomp.topologies")
    return sorted(
        f.name.removesuffix(".yaml") for f in folder.iterdir() if f.name.endswith(".yaml")
    )


def load_topology(path: str | os.PathLike[str]) -> Topology:
    """Read and validate a topology: a YAML file (schema: see ``topology_from_dict``) or, when
    no file has that name, a shipped topology by name ('ring4', 'torus16': shipped_topologies()),
    as the command line takes them. Files go through the hardened reader of
    gossipcomp.inputs.yaml_files: no aliases, bounded size, depth and node count."""
    source = os.fspath(path)
    if not os.path.lexists(source):
        names = shipped_topologies()
        if source not in names:
            problem = "no such file, and not a shipped topology"
            raise TopologyError(
                f"topology file {source}: {problem}; expected a file or one of {names}"
            )
        shipped = resources.files("gossipcomp.topologies").joinpath(f"{source}.yaml")
        with resources.as_file(shipped) as shipped_path:
            return load_topology(shipped_path)
    try:
        spec = load_yaml_file(source, "topology file", "a YAML mapping of topology keys")
    except (FileNotFoundError, ValueError) as error:
        raise TopologyError(str(error)) from None
    if not isinstance(spec, Mapping):
        problem = f"top level is {type(spec).__name__}, not a mapping"
        raise _fail(source, problem, f"a mapping with keys from {list(_TOP_KEYS)}")
    return topology_from_dict(spec, source=source)
