"""Crash-safe, self-verifying checkpoint files for one peer.

A peer that crashes must restart from the last state it fully wrote, never from half a file, and
must notice a damaged file instead of training on garbage. So each checkpoint is written to a
temporary file, fsynced and renamed into place (a crash leaves either the old files or the new
one, plus at most a stray `.tmp` file that is ignored and later removed), and each file starts
with a header line holding a format tag, the payload's length and its sha256 digest:

    gossipcomp-checkpoint v1 <payload bytes> <sha256 hex>\\n<payload: torch.save of the state>

Reading trusts nothing in the file before it is checked, in this order: only a regular file is
opened (never a link, FIFO or device); its size, the header's payload length and (when the caller
knows one) a bound from the model's own size must agree before any payload byte is read; then the
digest; then the zip archive that torch.save writes must hold only stored (uncompressed) entries
no bigger than the payload, so torch.load expands nothing; it loads with `weights_only=True`, so
a file can only yield tensors and plain Python values; and every loaded tensor must fit the bytes
its storage holds (no broadcast views), with a bounded nesting and number of values. `load_latest`
falls back to the newest file that passes these checks and the caller's own (`accept`), logging
one warning per file skipped. Several peers may share a directory: files are named per rank. One
store (one process) writes a rank's files at a time.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gossipcomp.inputs.atomic_files import write_atomically
from gossipcomp.inputs.files import FileRefused, open_regular_file
from gossipcomp.inputs.text import quoted

log = logging.getLogger("gossipcomp.checkpoint")  # the name it had before it moved here

MAGIC = b"gossipcomp-checkpoint"
VERSION = b"v1"
_HEADER_LIMIT = 256  # bytes; a real header is about 100
_MAX_DEPTH = 32  # nesting of a checkpoint's values; a PeerTrainer's is about 8
_NAME = re.compile(r"rank(\d+)-round(\d+)\.ckpt")
_SCALARS = (int, float, str, bool, type(None), torch.dtype, torch.device)
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format: a zip archive


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: names the file and what is wrong."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: Path
    round: int
    state: dict[str, Any]


class _ValueCheck:
    """One walk over a checkpoint's values: only what `torch.load(weights_only=True)` gives back,
    nested at most `_MAX_DEPTH` deep, each tensor a plain strided one no bigger than its storage
    (a broadcast view of a few bytes can claim terabytes), and, when loading, at most
    `max_values` values visited: a pickle can share one list many times over, and a walk (or an
    error message) over the tree it stands for must stay as small as the file."""

    def __init__(self, max_values: int | None = None) -> None:
        self.left = max_values

    def check(self, value: Any, where: str, depth: int = 0) -> None:
        """Raise TypeError for a type that cannot be saved, ValueError for any other problem."""
        if self.left is not None:
            self.left -= 1
            if self.left < 0:
                raise ValueError(
                    f"{where}: more values than the file has bytes (shared many times?)"
                )
        if depth > _MAX_DEPTH:
            raise ValueError(f"{where}: nested more than {_MAX_DEPTH} deep")
        kind = type(value)
        if kind in (torch.Tensor, torch.nn.Parameter):
            _check_tensor(value, where)
        elif kind in (dict, OrderedDict):
            for key, item in value.items():
                self.check(key, f"{where} (a key)", depth + 1)  # checked before shown
                self.check(item, f"{where}[{quoted(key)}]", depth + 1)
        elif kind in (list, tuple, torch.Size):
            for index, item in enumerate(value):
                self.check(item, f"{where}[{index}]", depth + 1)
        elif kind not in _SCALARS:
            raise TypeError(
                f"{where}: {kind.__module__}.{kind.__qualname__} cannot be checkpointed "
                "(only tensors, numbers, str, bool, None and dicts/lists/tuples of them)"
            )


def _check_tensor(tensor: torch.Tensor, where: str) -> None:
    """Raise ValueError unless `tensor` is a dense strided tensor whose elements fit its storage."""
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise ValueError(f"{where}: a {tensor.layout} tensor; only dense tensors are checkpointed")
    size = tensor.numel() * tensor.element_size()
    held = tensor.untyped_storage().nbytes()
    if size > held:
        raise ValueError(
            f"{where}: tensor of shape {quoted(tuple(tensor.shape))} ({size} bytes) views "
            f"{held} bytes of storage (an expanded view; save a contiguous copy)"
        )


class CheckpointStore:
    """One rank's checkpoints in a directory: atomic saves, verified loads, the newest `keep`."""

    def __init__(self, directory: str | Path, rank: int, keep: int = 3) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.rank = rank
        self.keep = keep
        self.directory.mkdir(parents=True, exist_ok=True)

    def path_for(self, round: int) -> Path:
        """Where this rank's checkpoint of `round` lives."""
        return self.directory / f"rank{self.rank}-round{round:09d}.ckpt"

    def save(self, round: int, state: Mapping[str, Any]) -> Path:
        """Write `state` as the checkpoint of `round` atomically; return its path.

        Then remove this rank's stale temporary files, checkpoints beyond the newest `keep`, and
        any of a higher round (left by a run this one replaced), so `load_latest` returns it.
        """
        if round < 0:
            raise ValueError(f"round must be >= 0, got {round}")
        if not isinstance(state, Mapping):
            raise TypeError(f"checkpoint state must be a mapping, got {type(state).__name__}")
        state = dict(state)
        _ValueCheck().check(state, "state")
        buffer = io.BytesIO()
        torch.save({"rank": self.rank, "round": round, "state": state}, buffer)
        payload = buffer.getbuffer()
        digest = hashlib.sha256(payload).hexdigest()
        header = b" ".join([MAGIC, VERSION, b"%d" % len(payload), digest.encode()]) + b"\n"

        self._remove_stale_temporaries()
        final = self.path_for(round)
        write_atomically(final, f".{final.stem}-", header, payload)
        log.debug("rank %d: saved round %d to %s (%d bytes)", self.rank, round, final, len(payload))
        self._prune(round)
        return final

    def paths(self) -> list[Path]:
        """This rank's checkpoint files, newest (highest round) first."""
        return [path for _, path in self._indexed()]

    def _indexed(self) -> list[tuple[int, Path]]:
        """(round, path) of this rank's checkpoint files, newest first."""
        found = []
        for path in self.directory.glob(f"rank{self.rank}-round*.ckpt"):
            match = _NAME.fullmatch(path.name)
            if match and int(match[1]) == self.rank:
                found.append((int(match[2]), path))
        return sorted(found, reverse=True)

    def read(self, path: Path, max_payload: int | None = None) -> LoadedCheckpoint:
        """Verify and load one checkpoint file; raise CheckpointError if it cannot be used.

        `max_payload`: the most payload bytes a checkpoint of this peer can hold (PeerTrainer
        derives it from its model); a bigger file is refused before anything is read. Without
        it, nothing larger than the file itself is read or expanded.
        """
        path = Path(path)
        try:
            with open_regular_file(
                path, "checkpoint", "a checkpoint file written by gossipcomp", follow_links=False
            ) as (file, size):
                if max_payload is not None and size > max_payload + _HEADER_LIMIT:
                    raise CheckpointError(
                        path,
                        f"file size: {size} bytes, more than a checkpoint of this model can take "
                        f"({max_payload} payload bytes and a header)",
                    )
                header = file.readline(_HEADER_LIMIT)
                length, digest = self._parse_header(path, header)
                _check_length(path, length, size - len(header), max_payload)
                payload = file.read(length + 1)
        except FileRefused as error:
            raise CheckpointError(path, f"file type: {error.problem}") from None
        except OSError as error:
            raise CheckpointError(path, f"cannot be read: {error}") from error
        if len(payload) != length:  # the file changed since fstat
            raise CheckpointError(path, f"changed while being read: expected {length} bytes")
        actual = hashlib.sha256(payload).hexdigest()
        if actual != digest:
            raise CheckpointError(path, f"digest mismatch: expected {digest}, got {actual}")
        _check_archive(path, payload)
        try:
            content = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
        except Exception as error:  # the digest matched, so the file was written like this
            raise CheckpointError(path, f"payload cannot be loaded safely: {error}") from error
        try:
            _ValueCheck(max_values=length).check(content, "payload")
        except (TypeError, ValueError) as error:
            raise CheckpointError(path, str(error)) from error
        return self._checked(path, content)

    def load_latest(
        self,
        accept: Callable[[LoadedCheckpoint], None] | None = None,
        *,
        max_payload: int | None = None,
    ) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies and that `accept` takes, skipping (and logging,
        one warning each) unusable newer ones.

        `accept` is called on each verified checkpoint, newest first: it raises CheckpointError
        to reject the file (the next older one is tried); anything else it raises propagates.
        `max_payload`: see `read`. None when this rank has no checkpoint; CheckpointError when
        it has some but none is usable.
        """
        failures: list[CheckpointError] = []
        for path in self.paths():
            try:
                loaded = self.read(path, max_payload)
                if accept is not None:
                    accept(loaded)
            except CheckpointError as error:
                log.warning("rank %d: skipping unusable checkpoint %s", self.rank, error)
                failures.append(error)
                continue
            log.info(
                "rank %d: loaded checkpoint of round %d from %s", self.rank, loaded.round, path
            )
            return loaded
        if failures:
            listing = "; ".join(str(error) for error in failures)
            raise CheckpointError(
                self.directory, f"no usable checkpoint for rank {self.rank}: {listing}"
            )
        return None

    @staticmethod
    def _parse_header(path: Path, header: bytes) -> tuple[int, str]:
        """The payload length and sha256 hex digest a header line announces."""
        fields = header.split(b" ")
        if not header.endswith(b"\n") or fields[0] != MAGIC:
            raise CheckpointError(path, f"not a gossipcomp checkpoint (starts {header[:32]!r})")
        if len(fields) != 4 or fields[1] != VERSION:
            raise CheckpointError(path, f"unsupported checkpoint header {header!r}")
        length, digest = fields[2], fields[3].rstrip(b"\n")
        if not length.isdigit() or not re.fullmatch(rb"[0-9a-f]{64}", digest):
            raise CheckpointError(path, f"malformed checkpoint header {header!r}")
        return int(length), digest.decode()

    @staticmethod
    def _checked(path: Path, content: Any) -> LoadedCheckpoint:
        """Check the loaded payload's layout and that it agrees with the file's name."""
        if not isinstance(content, dict) or set(content) != {"rank", "round", "state"}:
            raise CheckpointError(path, "payload is not a checkpoint record")
        for field in ("rank", "round"):
            value = content[field]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointError(
                    path, f"{field}: expected an integer >= 0, got {quoted(value)}"
                )
        if not isinstance(content["state"], dict):
            raise CheckpointError(
                path, f"state: expected a dict, got {type(content['state']).__name__}"
            )
        match = _NAME.fullmatch(path.name)
        if match and (int(match[1]), int(match[2])) != (content["rank"], content["round"]):
            raise CheckpointError(
                path,
                f"rank {content['rank']} round {content['round']} in file differs from name",
            )
        return LoadedCheckpoint(path=path, round=content["round"], state=content["state"])

    def _remove_stale_temporaries(self) -> None:
        """Delete this rank's temporary files left by a save that crashed."""
        for path in self.directory.glob(f".rank{self.rank}-round*.tmp"):
            log.info("rank %d: removing stale temporary file %s", self.rank, path)
            path.unlink(missing_ok=True)

    def _prune(self, saved_round: int) -> None:
        """Keep the newest `keep` checkpoints up to `saved_round`; drop all beyond it."""
        kept = 0
        for round, path in self._indexed():
            if round > saved_round:
                log.warning(
                    "rank %d: removing %s, newer than the round %d just saved",
                    self.rank,
                    path,
                    saved_round,
                )
            elif kept < self.keep:
                kept += 1
                continue
            path.unlink(missing_ok=True)


def _check_length(path: Path, length: int, available: int, max_payload: int | None) -> None:
    """The header's payload length must be within the bound and match the bytes that follow."""
    if max_payload is not None and length > max_payload:
        raise CheckpointError(
            path,
            f"header payload length: {length} bytes, more than a checkpoint of this model can "
            f"take ({max_payload})",
        )
    if length > available:
        raise CheckpointError(path, f"truncated: expected {length} bytes, got {available}")
    if length < available:
        raise CheckpointError(
            path, f"trailing data after payload: expected {length} bytes, got {available}"
        )


def _check_archive(path: Path, payload: bytes) -> None:
    """Refuse a payload that torch.load could expand beyond its own size.

    torch.save writes a zip archive of stored (uncompressed) entries, so a compressed entry
    (a few bytes of deflate can stand for gigabytes), an entry whose declared size differs from
    the bytes it holds, a name given twice (two readers could take different ones) or entries
    adding up to more than the payload were not written by it, and are refused before
    torch.load looks at the archive. Whatever torch then allocates is at most the payload.
    """
    if not payload.startswith(_ZIP_MAGIC):
        raise CheckpointError(path, f"payload: not a zip archive (starts {payload[:8]!r})")
    try:
        with zipfile.ZipFile(io.BytesIO(payload)) as archive:
            entries = archive.infolist()
    except Exception as error:  # a hostile archive can trip any part of the parser
        raise CheckpointError(path, f"payload: not a readable zip archive: {error}") from error
    names: set[str] = set()
    total = 0
    for entry in entries:
        where = f"payload entry {quoted(entry.filename)}"
        if entry.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(
                path,
                f"{where}: compressed (method {entry.compress_type}, {entry.compress_size} bytes "
                f"declared to expand to {entry.file_size}); torch.save stores entries uncompressed",
            )
        if entry.file_size != entry.compress_size:
            raise CheckpointError(
                path,
                f"{where}: declares {entry.file_size} bytes but holds {entry.compress_size}",
            )
        if entry.filename in names:
            raise CheckpointError(path, f"{where}: appears twice")
        names.add(entry.filename)
        total += entry.file_size
    if total > len(payload):
        raise CheckpointError(
            path, f"payload: entries declare {total} bytes, more than the {len(payload)} it holds"
        )
