"""The metadata service over RPC, as real ``kvfs meta`` processes sharing one SQLite store."""

from __future__ import annotations

import errno
import stat
import time

import msgspec

import pytest
import trio

from kvfs.errors import KvfsError
from kvfs.rpc import RpcClient
from kvfs.meta.client import RemoteMeta
from kvfs.meta.types import ROOT, Caller, CreateOp

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


async def test_two_meta_processes_race_on_the_same_names(meta_addresses, tmp_path, processes):
    """Clients of two ``kvfs meta`` instances on one SQLite file create, rename and unlink the same few names."""
    import random

    from kvfs.meta.fsck import check
    from kvfs.kv import open_database

    names = [f"n{i}".encode() for i in range(4)]
    counts = {"ok": 0, "refused": 0}

    async def racer(meta: RemoteMeta, seed: int, parent: int) -> None:
        rng = random.Random(seed)
        deadline = trio.current_time() + 2.0
        while trio.current_time() < deadline:
            op = rng.choice(("create", "mkdir", "rename", "unlink", "link"))
            a, b = rng.choice(names), rng.choice(names)
            try:
                if op == "create":
                    opened = await meta.create(ROOT, parent, a, 0o644)
                    await meta.close(ROOT, opened.attr.ino, opened.session)
                elif op == "mkdir":
                    await meta.mkdir(ROOT, parent, a, 0o755)
                elif op == "rename":
                    await meta.rename(ROOT, parent, a, parent, b)
                elif op == "unlink":
                    await meta.unlink(ROOT, parent, a)
                else:
                    await meta.link(ROOT, (await meta.lookup(ROOT, parent, a)).ino, parent, b)
                counts["ok"] += 1
            except KvfsError as exc:  # the POSIX refusals a race produces; anything else fails the test
                assert exc.errno in (errno.EEXIST, errno.ENOENT, errno.EISDIR, errno.ENOTDIR, errno.ENOTEMPTY,
                                     errno.EPERM), exc
                counts["refused"] += 1

    async with RpcClient(TOKEN) as client:
        first, second = RemoteMeta(client, meta_addresses[:1]), RemoteMeta(client, meta_addresses[1:])
        parent = (await first.mkdir(ROOT, 1, b"race", 0o755)).ino
        async with trio.open_nursery() as nursery:
            for seed, meta in enumerate((first, second, first, second)):
                nursery.start_soon(racer, meta, seed, parent)
    assert counts["ok"] > 50 and counts["refused"] > 0
    processes.stop_all()
    db = open_database(f"sqlite:///{tmp_path / 'meta.db'}")
    try:
        assert check(db) == []  # no duplicate or dangling entries, right nlinks, no orphaned inodes
    finally:
        db.close()


async def test_a_retried_non_idempotent_call_runs_once_and_gets_the_first_answer(meta_addresses):
    """The case a crash leaves: the call ran, its answer was lost, the client sends it again (to any
    instance) with the same op id. Without the recorded answer the retry would say EEXIST / ENOENT."""
    from kvfs.meta.rpc import OPS

    async with RpcClient(TOKEN) as client:
        first, second = meta_addresses
        meta = RemoteMeta(client, [first])
        d = await meta.mkdir(ROOT, 1, b"once", 0o755)
        create = OPS["create"]
        request = create.request(ROOT, (d.ino, b"f", 0o644), {}, b"op-1")
        answer = await client.call(first, create.method, request)
        request = msgspec.structs.replace(request, op_retry=True)
        again = await client.call(second, create.method, request)  # the retry, at the other instance
        assert again.value.attr == answer.value.attr and again.value.session == answer.value.session
        unlink = OPS["unlink"]
        request = unlink.request(ROOT, (d.ino, b"f"), {}, b"op-2")
        assert (await client.call(first, unlink.method, request)).value.ino == d.ino
        request = msgspec.structs.replace(request, op_retry=True)
        assert (await client.call(first, unlink.method, request)).value.ino == d.ino  # not ENOENT
        # a new op id is a new call: this one really finds the name gone
        with pytest.raises(KvfsError) as info:
            await client.call(first, unlink.method, unlink.request(ROOT, (d.ino, b"f"), {}, b"op-3"))
        assert info.value.errno == errno.ENOENT
        # a failed call records nothing, so its retry runs (and now succeeds)
        mkdir = OPS["mkdir"]
        request = msgspec.structs.replace(mkdir.request(ROOT, (d.ino, b"sub", 0o755), {}, b"op-4"), op_retry=True)
        with pytest.raises(KvfsError):
            await client.call(first, mkdir.method, mkdir.request(Caller(1000, 1000), (d.ino, b"sub", 0o755), {}, b"op-4"))
        assert (await client.call(first, mkdir.method, request)).value.ino > 0


async def test_a_retried_batch_put_begins_and_commits_once(meta_addresses):
    """kvclient's two batch calls over RPC, each sent again after a lost answer (to the other instance): the
    retries return the first answers instead of creating a second temporary file or reporting EEXIST."""
    from kvfs.meta.rpc import OPS
    from kvfs.meta.types import Commit

    async with RpcClient(TOKEN) as client:
        first, second = meta_addresses
        meta = RemoteMeta(client, [first])
        d = await meta.mkdir(ROOT, 1, b"batch", 0o755)
        begin, commit = OPS["begin_puts"], OPS["commit_puts"]
        request = begin.request(ROOT, (d.ino, [(b"a", b".put-a"), (b"b", b".put-b")], 0o644), {}, b"op-b1")
        opened = (await client.call(first, begin.method, request)).value
        again = (await client.call(second, begin.method, msgspec.structs.replace(request, op_retry=True))).value
        assert [o.attr.ino for o in again] == [o.attr.ino for o in opened]
        commits = [Commit(b".put-" + k, k, o.attr.ino, o.session, 5) for k, o in zip((b"a", b"b"), opened)]
        request = commit.request(ROOT, (d.ino, commits), {}, b"op-c1")
        assert (await client.call(first, commit.method, request)).value == [0, 0]
        retried = await client.call(second, commit.method, msgspec.structs.replace(request, op_retry=True))
        assert retried.value == [0, 0]  # not EEXIST: the first answer
        found = await meta.batch_lookup(ROOT, d.ino, [b"a", b"b", b".put-a"])
        assert [f and f.attr.size for f in found] == [5, 5, None]
        assert [e.name for e in (await meta.readdir(ROOT, d.ino)).entries] == [b"a", b"b"]


async def test_watch_wakes_at_another_clients_change_on_either_instance(meta_addresses):
    """The feed's long poll: a change through the same instance wakes the watcher at once, one through the other
    instance within its poll; the watcher's own changes never wake it; an idle watch ends empty at its wait."""
    me, other = Caller(0, 0, client=b"watcher"), Caller(0, 0, client=b"other")
    async with RpcClient(TOKEN) as client:
        near, far = RemoteMeta(client, meta_addresses[:1]), RemoteMeta(client, meta_addresses[1:])
        cursor = (await near.watch(me, b"", wait=5)).cursor  # an empty cursor: the head, at once
        await near.mkdir(me, 1, b"mine", 0o755)
        started = trio.current_time()
        page = await near.watch(me, cursor, wait=0.5)
        assert page.changes == [] and trio.current_time() - started >= 0.5  # only our own change: no wake-up
        cursor = page.cursor
        for via in (near, far):
            async with trio.open_nursery() as nursery:
                got = []

                async def watch() -> None:
                    got.append(await near.watch(me, cursor, wait=10))

                nursery.start_soon(watch)
                await trio.sleep(0.2)
                started = trio.current_time()
                made = await via.mkdir(other, 1, f"theirs-{len(meta_addresses)}-{id(via)}".encode(), 0o755)
            assert trio.current_time() - started < 2
            (change,) = got[0].changes
            assert change.client == b"other" and made.ino in change.inodes
            cursor = got[0].cursor


async def test_a_call_into_a_delegated_directory_waits_for_the_holder_through_either_instance(meta_addresses):
    """Over real processes: the holder (on one instance) answers creates itself; another client's listing through the
    other instance makes that instance publish a recall and answer EAGAIN, which the client retries; the holder, which
    follows the feed, applies what it queued and gives the directory back, and the retried listing shows it all."""
    holder, other = Caller(0, 0, client=b"holder"), Caller(0, 0, client=b"other")
    async with RpcClient(TOKEN) as client:
        near, far = RemoteMeta(client, meta_addresses[:1]), RemoteMeta(client, meta_addresses[1:])
        d = await near.mkdir(holder, 1, b"held", 0o755)
        grant = await near.delegate(holder, d.ino)
        assert grant.granted and grant.names == []
        layout = msgspec.structs.replace(grant.layout, seed=7)
        queued = [CreateOp(holder, f"f{i}".encode(), grant.ids + i, 0o644, 0, time.time_ns(), layout, None)
                  for i in range(3)]
        cursor = (await near.watch(holder, b"", wait=1)).cursor

        async def follow_the_feed() -> None:
            nonlocal cursor
            while True:
                page = await near.watch(holder, cursor, wait=5)
                cursor = page.cursor
                if any(d.ino in change.recalls for change in page.changes):
                    assert await near.apply_delegated(holder, d.ino, grant.epoch, queued) == [0, 0, 0]
                    assert await near.undelegate(holder, [d.ino]) == 1
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow_the_feed)
            started = trio.current_time()
            page = await far.readdir(other, d.ino)
        assert [e.name for e in page.entries] == [b"f0", b"f1", b"f2"]
        assert trio.current_time() - started < 3  # the other instance's feed poll, not a lapsed grant
        assert not (await near.delegate(holder, d.ino, grant.epoch)).granted  # given back: renewal refused
