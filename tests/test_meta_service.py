"""The metadata service over RPC, as real ``kvfs meta`` processes sharing one SQLite store."""

from __future__ import annotations

import errno
import stat

import pytest
import trio

from kvfs.errors import KvfsError
from kvfs.rpc import RpcClient
from meta.client import RemoteMeta
from meta.types import ROOT, Caller

from harness import TOKEN, free_port, wait_for_port


@pytest.fixture
def meta_addresses(processes, tmp_path):
    db = tmp_path / "meta.db"
    addresses = []
    for i in range(2):
        address = f"127.0.0.1:{free_port()}"
        proc = processes.start("meta", "--listen", address, "--kv-url", f"sqlite:///{db}", name=f"meta{i}")
        wait_for_port(address, proc)
        addresses.append(address)
    return addresses


async def test_operations_over_rpc(meta_addresses):
    async with RpcClient(TOKEN) as client:
        meta = RemoteMeta(client, meta_addresses[:1])
        d = await meta.mkdir(ROOT, 1, b"dir", 0o755)
        opened = await meta.create(ROOT, d.ino, b"file", 0o644)
        assert stat.S_ISREG(opened.attr.mode) and opened.session is not None
        await meta.report_length(ROOT, opened.attr.ino, opened.session, 4096)
        await meta.close(ROOT, opened.attr.ino, opened.session)
        other = RemoteMeta(client, meta_addresses[1:])  # any instance sees the same namespace
        assert (await other.lookup(ROOT, d.ino, b"file")).size == 4096
        page = await other.readdir(ROOT, d.ino)
        assert [e.name for e in page.entries] == [b"file"]
        with pytest.raises(KvfsError) as info:
            await other.lookup(ROOT, d.ino, b"missing")
        assert info.value.errno == errno.ENOENT
        with pytest.raises(KvfsError) as info:
            await other.mkdir(Caller(1000, 1000), d.ino, b"sub", 0o755)
        assert info.value.errno == errno.EACCES


async def test_failover_to_another_instance(meta_addresses, processes):
    async with RpcClient(TOKEN, connect_timeout=1) as client:
        meta = RemoteMeta(client, meta_addresses)
        await meta.mkdir(ROOT, 1, b"a", 0o755)
        processes.kill(processes.procs[0])
        for i in range(20):
            await meta.mkdir(ROOT, 1, f"b{i}".encode(), 0o755)
        assert len((await meta.readdir(ROOT, 1)).entries) == 21
