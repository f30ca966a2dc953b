"""Choosing a KV engine from the configured URL."""

from __future__ import annotations

import errno

import pytest

from kvfs.errors import KvfsError
from kvfs.kv import SqliteDatabase, open_database


def test_sqlite_url(tmp_path):
    db = open_database(f"sqlite:///{tmp_path / 'x.db'}")
    try:
        assert isinstance(db, SqliteDatabase)
    finally:
        db.close()


@pytest.mark.parametrize("url", ["meta.db", "sqlite://", "redis://x", "fdb:///c?api_version=seven", "fdb://?apiv=7"])
def test_bad_urls_are_refused_with_einval(url):
    with pytest.raises(KvfsError) as info:
        open_database(url)
    assert info.value.errno == errno.EINVAL


def test_fdb_url_names_what_is_missing(tmp_path):
    try:
        import fdb

        fdb.api_version(710)
    except Exception:
        pass
    else:
        pytest.skip("libfdb_c is installed here; this test is about hosts without it")
    with pytest.raises(KvfsError, match="libfdb_c"):
        open_database(f"fdb:///{tmp_path / 'fdb.cluster'}?api_version=710")
