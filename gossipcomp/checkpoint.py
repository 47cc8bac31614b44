"""Crash-safe, self-verifying checkpoint files for one peer.

A peer that crashes must restart from the last state it fully wrote, never from half a file, and
must notice a damaged file instead of training on garbage. So each checkpoint is written to a
temporary file, fsynced and renamed into place (a crash leaves either the old files or the new
one, plus at most a stray `.tmp` file that is ignored and later removed), and each file starts
with a header line holding a format tag, the payload's length and its sha256 digest:

    gossipcomp-checkpoint v1 <payload bytes> <sha256 hex>\\n<payload: torch.save of the state>

Reading checks the header, the length and the digest before unpickling anything, then loads with
`weights_only=True`, so a file can only yield tensors and plain Python values. `load_latest`
falls back to the newest file that verifies. Several peers may share a directory: files are named
per rank. One store (one process) writes a rank's files at a time.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import tempfile
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

MAGIC = b"gossipcomp-checkpoint"
VERSION = b"v1"
_HEADER_LIMIT = 256  # bytes; a real header is about 100
_NAME = re.compile(r"rank(\d+)-round(\d+)\.ckpt")
_SCALARS = (int, float, str, bool, type(None), torch.dtype, torch.device)


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


def _check_value(value: Any, where: str) -> None:
    """Raise TypeError unless `value` is something `torch.load(weights_only=True)` gives back."""
    kind = type(value)
    if kind in (torch.Tensor, torch.nn.Parameter) or kind in _SCALARS:
        return
    if kind in (dict, OrderedDict):
        for key, item in value.items():
            _check_value(key, f"{where} key {key!r}")
            _check_value(item, f"{where}[{key!r}]")
        return
    if kind in (list, tuple, torch.Size):
        for index, item in enumerate(value):
            _check_value(item, f"{where}[{index}]")
        return
    raise TypeError(
        f"checkpoint state{where}: {kind.__module__}.{kind.__qualname__} cannot be saved "
        "(only tensors, numbers, str, bool, None and dicts/lists/tuples of them)"
    )


def _fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        _check_value(state, "")
        buffer = io.BytesIO()
        torch.save({"rank": self.rank, "round": round, "state": state}, buffer)
        payload = buffer.getbuffer()
        digest = hashlib.sha256(payload).hexdigest()
        header = b" ".join([MAGIC, VERSION, b"%d" % len(payload), digest.encode()]) + b"\n"

        self._remove_stale_temporaries()
        final = self.path_for(round)
        fd, temporary = tempfile.mkstemp(
            dir=self.directory, prefix=f".{final.stem}-", suffix=".tmp"
        )
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(header)
                file.write(payload)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, final)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        _fsync_directory(self.directory)
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

    def read(self, path: Path) -> LoadedCheckpoint:
        """Verify and load one checkpoint file; raise CheckpointError if it cannot be used."""
        path = Path(path)
        try:
            with path.open("rb") as file:
                header = file.readline(_HEADER_LIMIT)
                length, digest = self._parse_header(path, header)
                payload = file.read(length + 1)
        except OSError as error:
            raise CheckpointError(path, f"cannot be read: {error}") from error
        if len(payload) != length:
            problem = "truncated" if len(payload) < length else "trailing data after payload"
            got = len(payload) if len(payload) < length else f"more than {length}"
            raise CheckpointError(path, f"{problem}: expected {length} bytes, got {got}")
        actual = hashlib.sha256(payload).hexdigest()
        if actual != digest:
            raise CheckpointError(path, f"digest mismatch: expected {digest}, got {actual}")
        try:
            content = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
        except Exception as error:  # the digest matched, so the file was written like this
            raise CheckpointError(path, f"payload cannot be loaded safely: {error}") from error
        return self._checked(path, content)

    def load_latest(self) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies, skipping (and logging) corrupt newer ones.

        None when this rank has no checkpoint; CheckpointError when it has some but none is usable.
        """
        failures: list[CheckpointError] = []
        for path in self.paths():
            try:
                loaded = self.read(path)
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
        if (
            not isinstance(content, dict)
            or set(content) != {"rank", "round", "state"}
            or not isinstance(content["round"], int)
            or not isinstance(content["state"], dict)
        ):
            raise CheckpointError(path, "payload is not a checkpoint record")
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
