"""Fixtures shared by the suite: real kvfs processes on loopback, always stopped afterwards."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Processes

from kvfs.kv import SqliteDatabase


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


@pytest.fixture
def db(tmp_path: Path) -> Iterator[SqliteDatabase]:
    """A metadata KV store (SQLite) of the test's own."""
    database = SqliteDatabase(str(tmp_path / "meta.db"))
    yield database
    database.close()


@pytest.fixture
def local_dir() -> Iterator[Path]:
    """A world-searchable directory on local disk, to run the same calls on as on a mount (pytest's tmp dirs are
    0700: no use for another uid)."""
    path = Path(tempfile.mkdtemp(prefix="kvfs-local-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
