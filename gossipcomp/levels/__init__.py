"""Compression levels: one package for bandwidth-adaptive compression, from the ladder to the wire.

A level is a position on a ladder of one compressor family's settings (1: most compressed, the
top: none); levels change per link (PowerGossip's rank) or per sender (Choco, DEF-ATC) as the
links' speed changes. The modules, from the bottom up:

- `ladder`: a compressor's ladder for one model (compressors only; layer of compress/);
- `notices`: a level notice in an envelope header, its wire form and the checks a receiver
  makes before taking it (the transport's inbox calls them; layer of transport/);
- `rate`: the link estimate and the rate controller, pure arithmetic (layer of schedule/: a
  coordinator's schedules and the peers' own decisions both use it);
- `edges` and `senders`: who decides and how it is announced without a coordinator, the
  lower-ranked end of each edge for its link's level, each broadcasting sender for its own
  (layer of schedule/);
- `codecs`: a broadcasting algorithm's codecs per level (layer of gossip/);
- `peer`: `CompressionLevels`, the one object a Peer calls (layer of peer.py: it takes edges
  down through links.py).

The modules sit at the layers of what they use (tests/test_layers.py names each), so this
package's `__init__` imports nothing: importing a low module (the transport importing
`notices`) never loads a high one. The notice rules live here, not in transport/, because
they are the levels' protocol (who may announce, how far ahead, the resume exchange's own
rule), which the transport only applies while it checks a header; the `LevelNotice` and
`NoticeRules` values it carries stay in transport/base.py with the rest of the transport's
interface.
"""
