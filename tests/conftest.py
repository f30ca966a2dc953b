"""Fixtures shared by the suite: real kvfs processes on loopback, always stopped afterwards."""

from __future__ import annotations

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
