"""The one way gossipcomp writes a file it must never leave half-written (reports, checkpoints).

A crash, a full disk or Ctrl-C in the middle leaves the old file or the new one: the bytes go to
a temporary file in the target's folder, are fsynced, and the temporary file is renamed over the
target; then the folder is fsynced, so the rename itself survives a power cut. A failed write
removes its temporary file. Imports nothing from gossipcomp, so every layer may use it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(target: Path, temporary_prefix: str, *chunks: bytes | memoryview) -> None:
    """Write `chunks` one after another to `target`, atomically (see the module); the temporary
    file is named `temporary_prefix` + random + ".tmp" in the target's folder, so its owner can
    recognise (and clean up) what a killed write left."""
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=temporary_prefix, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)
