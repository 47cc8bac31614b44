"""gossipcomp/peer/ is a package: the names users imported from the old gossipcomp/peer.py still
import from gossipcomp.peer, each the object its module defines, and the links (which the
levels glue imports) load without the node above them."""

from __future__ import annotations

import importlib

from helpers import loaded_modules

import gossipcomp.peer as package


def test_every_public_name_imports_from_gossipcomp_peer():
    for module_name, names in package._EXPORTS.items():  # noqa: SLF001
        module = importlib.import_module(module_name)
        for name in names.split():
            assert getattr(package, name) is getattr(module, name), name
    from gossipcomp.peer import GossipStalled, Peer, PeerStats

    assert Peer.__module__ == "gossipcomp.peer.node"
    assert issubclass(GossipStalled, RuntimeError) and PeerStats.__name__ == "PeerStats"


def test_an_unknown_name_is_an_attribute_error():
    try:
        package.Nothing  # noqa: B018
    except AttributeError as error:
        assert "gossipcomp.peer" in str(error) and "Nothing" in str(error)
    else:
        raise AssertionError("gossipcomp.peer.Nothing should not exist")


def test_the_links_load_without_the_node():
    loaded = loaded_modules("import gossipcomp.peer.links", "gossipcomp.peer")
    assert loaded == ["gossipcomp.peer", "gossipcomp.peer.links"]
