"""A small tmpfs of a test's own: a file system that fills up in seconds, and one that refuses ``RWF_NOWAIT``."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    """A fresh tmpfs of ``size`` (``mount -t tmpfs -o size=...``) mounted at a temp directory, unmounted (lazily if
    something still holds it) and removed afterwards; skips the test where mounting is not permitted."""
    where = Path(tempfile.mkdtemp(prefix="kvfs-tmpfs-", dir="/tmp"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): {r.stderr.strip() or r.returncode}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)
        with contextlib.suppress(OSError):
            where.rmdir()
