"""The storage client against real chunk servers and mgmtd on loopback, replication 3."""

from __future__ import annotations

import errno
import functools
import os
import random
import re
import signal
import socket
import sqlite3
from pathlib import Path

import pytest
import trio
from crc32c import crc32c
from harness import TOKEN, Cluster, authenticated, tear_unsynced, write_config

from kvfs.chunkserver import protocol as p
from kvfs.chunkserver.client import StorageClient
from kvfs.craq.messages import ChunkId, TargetState, WriteReq
from kvfs.craq.client import CREATE_CHAINS, STATUS, CreateChains, MgmtdClient
from kvfs.errors import KvfsError, StaleRouting
from kvfs.fuse.writes import Handle, InodeState, WriteBack
from kvfs.rpc import RpcClient
from kvfs import wire
from kvfs.wire import Empty, Limits
from kvfs.meta.types import Layout

LAYOUT = Layout(chunk_size=1 << 20, stripe=4, seed=7)


async def wait_all_serving(mgmtd: MgmtdClient, chains: int, timeout: float = 20.0):
    status = None
    with trio.move_on_after(timeout):
        while True:
            status = await mgmtd.call(STATUS, Empty())
            states = [t.state for c in status.routing.chains for t in c.targets]
            if len(status.routing.chains) == chains and all(s is TargetState.SERVING for s in states):
                return status
            await trio.sleep(0.1)
    raise AssertionError(f"targets not all serving after {timeout}s: {status}")


async def start_cluster(processes, tmp_path, nodes: int = 3, **config) -> Cluster:
    """mgmtd and ``nodes`` chunk servers of one target each, in chains of three (``nodes // 3`` of them)."""
    c = Cluster(processes, tmp_path, write_config(tmp_path / "kvfs.toml", **config))
    c.start_mgmtd()
    for node in range(1, nodes + 1):
        c.start_chunkserver(node)
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        mgmtd = MgmtdClient(rpc, c.mgmtd)
        with trio.fail_after(20):
            while True:  # chunk servers register asynchronously
                status = await mgmtd.call(STATUS, Empty())
                if len(status.nodes) == nodes:
                    break
                await trio.sleep(0.1)
        await mgmtd.call(CREATE_CHAINS, CreateChains(replicas=3))
        await wait_all_serving(mgmtd, nodes // 3)
    return c



def test_updates_are_batched_within_a_frames_bounds() -> None:
    """Small updates travel together, large ones alone, and no batch outgrows a frame: a member that resends
    every pending update of a chain at once (the tail was killed under a copy of 4 MiB chunks) sent them all in
    one frame past CHUNK_LIMITS, which the successor refused at every retransmit, and the copy hung."""
    mib = 1 << 20
    assert p.batches([4 * mib] * 40, int) == [[4 * mib]] * 40
    assert p.batches([4096], int) == [[4096]]
    small = [64 << 10] * 300
    groups = p.batches(small + [mib], int)
    assert [mib] in groups and sorted(x for g in groups for x in g) == sorted(small + [mib])
    assert all(len(g) <= p.BATCH_WRITES and sum(g) <= p.BATCH_BYTES for g in groups)
    assert max(sum(g) for g in groups) <= p.CHUNK_LIMITS.max_data


def test_a_whole_cluster_call_leaves_out_only_servers_taken_out_of_chains_that_still_serve() -> None:
    """_may_be_left_out: every target of the server offline, and each of their chains with a serving target left
    (whose resync of the server on its return drops what it missed); one address may host several nodes."""
    from kvfs.chunkserver.client import _may_be_left_out
    from kvfs.craq.cluster import RoutingSnapshot
    from kvfs.craq.messages import ChainConfig, ChainTarget

    S, O, L = TargetState.SERVING, TargetState.OFFLINE, TargetState.LASTSRV

    def routing(*chains: tuple[tuple[int, TargetState], ...], addresses: dict[int, str] | None = None):
        return RoutingSnapshot(tuple(ChainConfig(i, 1, tuple(ChainTarget(n * 10 + i, n, st) for n, st in targets))
                                     for i, targets in enumerate(chains, start=1)),
                               addresses or {1: "a:1", 2: "a:2", 3: "a:3"})

    assert _may_be_left_out(routing(((1, S), (2, S), (3, O))), "a:3")
    assert not _may_be_left_out(routing(((1, S), (2, S), (3, S))), "a:3")  # still counted: wait for mgmtd
    assert not _may_be_left_out(routing(((1, S), (2, S), (3, O)), ((3, S), (1, S), (2, S))), "a:3")  # serves one
    assert not _may_be_left_out(routing(((3, L), (1, O), (2, O))), "a:3")  # the last serving one: it must hear
    assert not _may_be_left_out(routing(((1, O), (2, O), (3, O))), "a:3")  # nobody left to resync it
    shared = {1: "a:1", 2: "a:2", 3: "a:2"}  # two nodes at one address: both must be out
    assert not _may_be_left_out(routing(((1, S), (2, O), (3, S)), addresses=shared), "a:2")
    assert _may_be_left_out(routing(((1, S), (2, O), (3, O)), addresses=shared), "a:2")


@pytest.fixture
async def cluster(processes, tmp_path):
    return await start_cluster(processes, tmp_path)


async def test_write_read_round_trip(cluster):
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        storage = StorageClient(rpc, MgmtdClient(rpc, cluster.mgmtd))
        data = os.urandom(5 * (1 << 20) + 12345)
        await storage.write(42, LAYOUT, 1000, data)
        out = bytearray(len(data) + 2000)
        await storage.read(42, LAYOUT, 0, memoryview(out))
        assert out[:1000] == bytes(1000)  # a hole before the write
        assert out[1000 : 1000 + len(data)] == data
        assert out[1000 + len(data) :] == bytes(1000)
        # overwrite in the middle, across a chunk boundary
        patch = os.urandom(300_000)
        await storage.write(42, LAYOUT, (1 << 20) - 100_000, patch)
        expected = bytearray(out)
        expected[(1 << 20) - 100_000 : (1 << 20) + 200_000] = patch
        await storage.read(42, LAYOUT, 0, memoryview(out))
        assert out == expected
        await storage.truncate(42, LAYOUT, 1000 + len(data), 1_500_000)
        back = bytearray(3 << 20)
        await storage.read(42, LAYOUT, 0, memoryview(back))
        assert back[:1_500_000] == expected[:1_500_000] and back[1_500_000:] == bytes(len(back) - 1_500_000)
        total, free = await storage.capacity()
        assert total > 0 and free > 0


async def test_a_slow_reader_gets_the_version_it_asked_for_while_overwrites_go_on(cluster):
    """Reads of 256 KiB and more leave a chunk server straight from its slot file's mapping. A reader that takes
    its reply slowly keeps the server sending from that mapping while newer versions commit and free slots: the
    version being sent must stay out of reuse until all of it is out, or the reader gets two versions' bytes."""
    layout = Layout(chunk_size=8 << 20, stripe=1, seed=3)  # a reply larger than the sockets' buffers
    size = layout.chunk_size
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        storage = StorageClient(rpc, MgmtdClient(rpc, cluster.mgmtd))
        await storage.write(9, layout, 0, bytes([1]) * size)
        routing = await storage.routing()
        (chain,) = routing.chains
        host, port = routing.addresses[chain.targets[0].node_id].rsplit(":", 1)
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)  # takes the reply a little at a time
        sock, signer = await authenticated(f"{host}:{port}", TOKEN, sock)
        request = p.ReadBatch([p.ReadRange(chain.chain_id, chain.chain_version, ChunkId(9, 0), 0, size)])
        await sock.send(signer.seal(wire.encode_frame(wire.FrameType.REQUEST, 1, p.READ.id,
                                                      wire.encode_body(request))))
        await trio.sleep(0.3)  # the server is sending, blocked on the full socket
        for version in range(2, 12):  # each commit frees the slot of the version before
            await storage.write(9, layout, 0, bytes([version]) * size)
        reply = bytearray()
        with trio.fail_after(30):
            while len(reply) < wire.HEADER_SIZE or len(reply) < wire.HEADER_SIZE + header.body_len + header.data_len:
                chunk = await sock.recv(1 << 20)
                assert chunk, "the server closed the connection"
                reply += chunk
                if len(reply) >= wire.HEADER_SIZE:
                    header = wire.decode_header(reply[: wire.HEADER_SIZE], Limits(max_data=1 << 30))
        sock.close()
        assert header.data_len == size
        assert reply[-size:] == bytes([1]) * size, "the reply mixed versions"


def replica_contents(workdir, nodes) -> list[dict]:
    """Every committed chunk of every target, read straight from the engines (servers must be stopped)."""
    from kvfs.chunkserver.engine import ChunkEngine

    contents = []
    for node in nodes:
        with ChunkEngine(workdir / f"cs{node}", fsync=False) as engine:
            contents.append({m.chunk_id: bytes(engine.read(m.chunk_id, 0, 1 << 26)[0])
                             for m in engine.list_chunks() if m.version})
    return contents


async def test_kill_chunkserver_during_writes_then_resync(cluster, processes, tmp_path):
    acked: dict[tuple[int, int], bytes] = {}
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        mgmtd = MgmtdClient(rpc, cluster.mgmtd)
        storage = StorageClient(rpc, mgmtd, retry_for=60)
        stop = trio.Event()

        async def writer(ino: int) -> None:
            offset = 0
            while not stop.is_set():
                data = os.urandom(96 * 1024)
                await storage.write(ino, LAYOUT, offset, data)
                acked[(ino, offset)] = data
                offset += len(data)

        async with trio.open_nursery() as nursery:
            for ino in (100, 101, 102):
                nursery.start_soon(writer, ino)
            await trio.sleep(1.0)
            cluster.kill_chunkserver(2)
            await trio.sleep(2.5)  # writes go on with two replicas once mgmtd notices
            during_outage = len(acked)
            cluster.start_chunkserver(2, cluster.chunkservers[2][0])
            await trio.sleep(1.0)
            stop.set()
        assert during_outage > 0
        try:  # the returning target resynced and serves again
            await wait_all_serving(mgmtd, 1, timeout=60)
        except AssertionError as exc:
            logs = "\n".join(f"--- {name}\n{processes.log(name)[-3000:]}" for name in ("mgmtd0", "cs1", "cs2", "cs3"))
            raise AssertionError(f"{exc}\n{logs}") from None

        for (ino, offset), data in acked.items():
            out = bytearray(len(data))
            await storage.read(ino, LAYOUT, offset, memoryview(out))
            assert out == data, f"acknowledged write at inode {ino} offset {offset} lost"
    processes.stop_all()
    first, *others = replica_contents(tmp_path, (1, 2, 3))
    assert first and all(other == first for other in others)


async def test_a_resync_after_a_few_small_writes_sends_only_their_blocks(cluster, processes, tmp_path):
    """A replica down while 4 KiB writes change a few blocks of large chunks comes back holding the old versions:
    its predecessor sends only the 64 KiB blocks that differ (the resync's log line counts the bytes), and every
    replica then serves the new bytes."""
    layout = Layout(chunk_size=4 << 20, stripe=1, seed=7)
    model = bytearray(os.urandom(12 << 20))  # three chunks
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        mgmtd = MgmtdClient(rpc, cluster.mgmtd)
        storage = StorageClient(rpc, mgmtd, retry_for=60)
        await storage.write(55, layout, 0, model)
        await storage.flush(55)
        cluster.kill_chunkserver(2)
        await _wait_for_state(mgmtd, 200, TargetState.OFFLINE)
        rng = random.Random(3)
        for _ in range(5):
            at = rng.randrange(0, len(model) - 4096)
            model[at : at + 4096] = data = os.urandom(4096)
            await storage.write(55, layout, at, data)
        cluster.start_chunkserver(2, cluster.chunkservers[2][0])
        status = await wait_all_serving(mgmtd, 1, timeout=60)
        done = [line for node in (1, 3) for line in processes.log(f"cs{node}").splitlines()
                if "resync of target 200 done" in line]
        assert done, "no resync logged"
        sent, as_blocks, whole = map(int, re.search(r"(\d+) bytes sent, (\d+) chunks as changed blocks, (\d+) whole",
                                                    done[-1]).groups())
        assert whole == 0 and 1 <= as_blocks <= 3 and sent <= 10 * 64 * 1024  # at most 2 blocks per 4 KiB write
        (chain,) = status.routing.chains
        for target in chain.targets:  # every replica itself, the resynced one included
            for index in range(3):
                request = p.ReadBatch([p.ReadRange(chain.chain_id, chain.chain_version, ChunkId(55, index), 0,
                                                   layout.chunk_size)])
                with trio.fail_after(10):
                    while True:  # until the replica's own heartbeat brought it the chain version we read under
                        reply, got = await rpc.call_with_data(status.routing.addresses[target.node_id], p.READ,
                                                              request)
                        if reply.results[0].errno != errno.ESTALE:
                            break
                        await trio.sleep(0.1)
                assert reply.results[0].errno == 0
                assert bytes(got) == model[index * layout.chunk_size : (index + 1) * layout.chunk_size]
    processes.stop_all()
    first, *others = replica_contents(tmp_path, (1, 2, 3))
    assert all(other == first for other in others)


async def test_runs_of_a_chunk_are_one_version_on_every_replica(cluster, processes, tmp_path):
    """write_runs: a mount's gathered scattered writes go down the chain as one update, so the chunk's version
    moves by one; the bytes between the runs stay, and every replica holds the same chunk."""
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        storage = StorageClient(rpc, MgmtdClient(rpc, cluster.mgmtd))
        chunk = LAYOUT.chunk_size
        model = bytearray(os.urandom(chunk))
        await storage.write(77, LAYOUT, chunk, model)  # chunk 1, version 1
        rng = random.Random(5)
        for _ in range(3):
            starts = sorted(rng.sample(range(0, chunk - 8192, 8192), 40))
            runs = [(chunk + start + rng.randrange(0, 100), os.urandom(rng.choice((1, 512, 4096)))) for start in starts]
            await storage.write_runs(77, LAYOUT, runs)
            for offset, data in runs:
                model[offset - chunk:offset - chunk + len(data)] = data
        out = bytearray(chunk)
        await storage.read(77, LAYOUT, chunk, memoryview(out))
        assert out == model
        routing = await storage.routing()
        (chain,) = routing.chains
        stats = [await rpc.call(routing.addresses[t.node_id], p.CHUNK_STAT, p.ChunkStatQuery(t.target_id, ChunkId(77, 1)))
                 for t in chain.targets]
        assert {s.version for s in stats} == {4}  # one version per call, not one per run
    processes.stop_all()
    first, *others = replica_contents(tmp_path, (1, 2, 3))
    assert first[ChunkId(77, 1)] == model and all(other == first for other in others)


async def test_corrupt_replica_is_served_from_a_peer_and_repaired(cluster, processes, tmp_path):
    data = os.urandom(300_000)
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        storage = StorageClient(rpc, MgmtdClient(rpc, cluster.mgmtd))
        await storage.write(7, LAYOUT, 0, data)
        for slot_file in (tmp_path / "cs2" / "data").glob("*.dat"):  # flip bits in one replica's data
            raw = bytearray(slot_file.read_bytes())
            for i in range(0, len(raw), 4096):
                raw[i] ^= 0xFF
            slot_file.write_bytes(raw)
        routing = await storage.routing()
        (chain,) = routing.chains
        for target in chain.targets:  # ask every replica itself, the corrupt one included
            request = p.ReadBatch([p.ReadRange(chain.chain_id, chain.chain_version, ChunkId(7, 0), 0, len(data))])
            reply, got = await rpc.call_with_data(routing.addresses[target.node_id], p.READ, request)
            assert reply.results[0].errno == 0 and bytes(got) == data
    processes.stop_all()
    first, *others = replica_contents(tmp_path, (1, 2, 3))
    assert all(other == first for other in others)  # the corrupt copy was repaired


async def test_a_replica_with_one_bad_block_fetches_only_that_block(cluster, processes, tmp_path):
    data = os.urandom(LAYOUT.chunk_size)  # one chunk of 16 blocks, in the first slot of its class's file
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        storage = StorageClient(rpc, MgmtdClient(rpc, cluster.mgmtd))
        await storage.write(8, LAYOUT, 0, data)
        with open(tmp_path / "cs2" / "data" / "20.dat", "r+b") as f:  # 1 MiB slots: flip a byte of block 3
            f.seek(3 * 65536 + 5)
            f.write(bytes([data[3 * 65536 + 5] ^ 0xFF]))
        routing = await storage.routing()
        (chain,) = routing.chains
        request = p.ReadBatch([p.ReadRange(chain.chain_id, chain.chain_version, ChunkId(8, 0), 0, len(data))])
        reply, got = await rpc.call_with_data(routing.addresses[2], p.READ, request)
        assert reply.results[0].errno == 0 and bytes(got) == data
        assert "chunk ChunkId(inode=8, index=0): blocks [3] repaired from target" in processes.log("cs2")
        with pytest.raises(KvfsError) as refused:  # a block past the chunk's end is refused, nothing sent
            await rpc.call_with_data(routing.addresses[1], p.FETCH, p.FetchChunk(100, ChunkId(8, 0), [16], 1))
        assert refused.value.errno == errno.EINVAL
    processes.stop_all()
    first, *others = replica_contents(tmp_path, (1, 2, 3))
    assert first[ChunkId(8, 0)] == data and all(other == first for other in others)


async def test_removing_a_file_frees_its_chunks_on_every_replica(cluster):
    from kvfs.meta.client import RemoteMeta
    from kvfs.meta.types import ROOT

    cluster.start_meta()
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        meta = RemoteMeta(rpc, cluster.meta)
        storage = StorageClient(rpc, MgmtdClient(rpc, cluster.mgmtd))
        opened = await meta.create(ROOT, 1, b"doomed", 0o644)
        ino = opened.attr.ino
        layout = await meta.get_layout(ROOT, ino)
        await storage.write(ino, layout, 0, os.urandom(3 * layout.chunk_size + 5))
        await meta.close(ROOT, ino, opened.session, 3 * layout.chunk_size + 5)
        assert (await storage.last_chunk(ino))[0] == 3
        await meta.unlink(ROOT, 1, b"doomed")
        with trio.fail_after(15):  # the meta service's collector removes the chunks everywhere
            while (await storage.last_chunk(ino))[0] != -1:
                await trio.sleep(0.1)


def unsynced_rows(target: Path) -> int:
    """Versions a target acknowledged but has not made durable, read beside the running chunk server."""
    db = sqlite3.connect(target / "chunks.sqlite")
    try:
        return db.execute("SELECT count(*) FROM unsynced").fetchone()[0]
    finally:
        db.close()


async def test_a_client_sync_makes_its_writes_durable_on_every_replica(processes, tmp_path):
    """Write-back chunk servers acknowledge from the page cache; the client's sync (a file's fsync) flushes every
    replica of the chains the file's writes reached, and only when there is something to flush."""
    cluster = await start_cluster(processes, tmp_path, sync_interval=0)
    targets = [tmp_path / f"cs{node}" for node in (1, 2, 3)]
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        storage = StorageClient(rpc, MgmtdClient(rpc, cluster.mgmtd))
        await storage.flush(7)  # nothing written: no call
        data = os.urandom(3 << 20)
        await storage.write(7, LAYOUT, 0, data)
        assert [unsynced_rows(t) for t in targets] == [3, 3, 3]
        await storage.flush(7)
        assert [unsynced_rows(t) for t in targets] == [0, 0, 0]
        out = bytearray(len(data))
        await storage.read(7, LAYOUT, 0, memoryview(out))
        assert out == data
        with pytest.raises(StaleRouting):  # a target this server does not hold
            await rpc.call(cluster.chunkservers[1][0], p.FLUSH, p.FlushTargets([99_999]))


async def test_write_back_chunk_servers_flush_on_their_own(processes, tmp_path):
    cluster = await start_cluster(processes, tmp_path, sync_interval=0.2)
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        storage = StorageClient(rpc, MgmtdClient(rpc, cluster.mgmtd))
        await storage.write(8, LAYOUT, 0, os.urandom(2 << 20))
        with trio.fail_after(10):
            while any(unsynced_rows(tmp_path / f"cs{node}") for node in (1, 2, 3)):
                await trio.sleep(0.1)


async def _write_synced_then_newer(storage: StorageClient) -> bytes:
    """Inode 9: three chunks synced on every replica, then overwritten without a sync; returns the newest data."""
    await storage.write(9, LAYOUT, 0, os.urandom(3 << 20))
    await storage.flush(9)
    newest = os.urandom(3 << 20)
    await storage.write(9, LAYOUT, 0, newest)
    return newest


async def _all_serving_with(mgmtd: MgmtdClient, storage: StorageClient, newest: bytes) -> None:
    """Wait until every target serves again; then inode 9 must read as ``newest``."""
    await wait_all_serving(mgmtd, 1, timeout=60)
    out = bytearray(len(newest))
    await storage.read(9, LAYOUT, 0, memoryview(out))
    assert out == newest


@pytest.mark.parametrize("loss", ["power", "kill"], ids=["power-loss", "kill-with-held-writes"])
async def test_a_replica_whose_host_lost_power_falls_back_to_its_last_sync_and_is_resynced(processes, tmp_path, loss):
    """A chunk server dies with writes it acknowledged but never flushed, and its disk lacks their data (a power
    loss of its host; or a kill -9 alone, since whole-chunk writes wait in memory for a sync): it reopens at the
    versions its last sync made durable, the chain resyncs it, and every replica ends up with the newest data."""
    cluster = await start_cluster(processes, tmp_path, sync_interval=0)
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        mgmtd = MgmtdClient(rpc, cluster.mgmtd)
        storage = StorageClient(rpc, mgmtd, retry_for=60)
        newest = await _write_synced_then_newer(storage)
        cluster.kill_chunkserver(3)
        if loss == "power":
            assert tear_unsynced(tmp_path / "cs3", random.Random(0), share=1.0) == 3
        else:  # the three chunks were held in memory: they died with the process, and the replica falls back
            assert unsynced_rows(tmp_path / "cs3") == 3
            assert b"".join(replica_contents(tmp_path, (3,))[0][(9, i)] for i in range(3)) != newest
        with trio.fail_after(20):  # mgmtd takes the dead target out before it comes back
            while (await mgmtd.call(STATUS, Empty())).routing.chains[0].state_of(300) is TargetState.SERVING:
                await trio.sleep(0.1)
        cluster.start_chunkserver(3, cluster.chunkservers[3][0])
        await _all_serving_with(mgmtd, storage, newest)
    processes.stop_all()
    replicas = replica_contents(tmp_path, (1, 2, 3))
    assert all(replica == replicas[0] for replica in replicas)
    assert b"".join(replicas[2][(9, i)] for i in range(3)) == newest



async def _wait_for_state(mgmtd: MgmtdClient, target: int, state: TargetState) -> None:
    with trio.fail_after(20):
        while (await mgmtd.call(STATUS, Empty())).routing.chains[0].state_of(target) is not state:
            await trio.sleep(0.1)


async def test_a_rolled_back_last_serving_replica_pulls_the_writes_the_others_kept(processes, tmp_path):
    """Issue #26 with real processes: the other two replicas stop (cleanly: they keep the newest write) and are
    taken out, so the first is the last serving one when it dies with that write unflushed. It comes back behind;
    it must serve nothing until it has pulled the newest write from the others, rather than resync them to its
    older data."""
    cluster = await start_cluster(processes, tmp_path, sync_interval=0)
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        mgmtd = MgmtdClient(rpc, cluster.mgmtd)
        storage = StorageClient(rpc, mgmtd, retry_for=60)
        newest = await _write_synced_then_newer(storage)
        for node in (2, 3):
            processes.kill(cluster.chunkservers[node][1], signal.SIGTERM)  # a clean stop flushes
            await _wait_for_state(mgmtd, node * 100, TargetState.OFFLINE)
        cluster.kill_chunkserver(1)  # the newest write was held in memory: it dies with the process
        await _wait_for_state(mgmtd, 100, TargetState.LASTSRV)
        assert b"".join(replica_contents(tmp_path, (1,))[0][(9, i)] for i in range(3)) != newest
        cluster.start_chunkserver(1, cluster.chunkservers[1][0])
        await _wait_for_state(mgmtd, 100, TargetState.SERVING)
        assert (await mgmtd.call(STATUS, Empty())).routing.chains[0].recovering
        for node in (2, 3):
            cluster.start_chunkserver(node, cluster.chunkservers[node][0])
        await _all_serving_with(mgmtd, storage, newest)
    processes.stop_all()
    replicas = replica_contents(tmp_path, (1, 2, 3))
    assert all(replica == replicas[0] for replica in replicas)


async def test_full_disk_gives_enospc_and_keeps_stored_data(processes, tmp_path):
    from kvfs.errors import KvfsError

    import errno

    cluster = await start_cluster(processes, tmp_path, capacity_bytes=8 << 20)
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        storage = StorageClient(rpc, MgmtdClient(rpc, cluster.mgmtd), retry_for=5)
        kept = os.urandom(2 << 20)
        await storage.write(11, LAYOUT, 0, kept)
        with pytest.raises(KvfsError) as info:
            for i in range(16):  # fill the 8 MiB targets
                await storage.write(12, LAYOUT, i << 20, os.urandom(1 << 20))
        assert info.value.errno == errno.ENOSPC
        out = bytearray(len(kept))
        await storage.read(11, LAYOUT, 0, memoryview(out))
        assert out == kept
        await storage.remove_files([12])  # space comes back: writes work again
        await storage.write(12, LAYOUT, 0, kept)


@pytest.mark.parametrize("length", [4096, 1 << 20], ids=["copied", "lent"])
async def test_a_read_whose_version_went_before_the_engine_pinned_it_retries_or_reads_a_hole(tmp_path, length):
    """The chunk server checks nothing before the engine pins the version: a version that is gone by then
    (a newer one committed while the read waited for a thread) is EAGAIN for the client to retry, never
    ENOENT, and a chunk removed altogether reads as a hole."""
    from kvfs.chunkserver.engine import ChunkEngine
    from kvfs.chunkserver.service import ChunkServer
    from crc32c import crc32c
    from kvfs.errors import NotCommitted
    from kvfs.rpc import CallContext

    engine = ChunkEngine(tmp_path / "target", fsync=False)
    server = ChunkServer(1, "127.0.0.1:1", {1: engine}, None, None)  # type: ignore[arg-type]
    ctx = CallContext("test", p.READ)
    data = os.urandom(2 << 20)
    for version in (1, 2):
        engine.write_pending(ChunkId(7, 0), version, 0, data, crc32c(data), full_replace=True,
                             chunk_size=p.MAX_CHUNK_SIZE)
        engine.commit(ChunkId(7, 0), version)
    chunk = ChunkId(7, 0)
    assert bytes(await server._engine_data(engine, chunk, 0, length, 2, ctx)) == data[:length]
    with pytest.raises(NotCommitted, match="moved past v1"):
        await server._engine_data(engine, chunk, 0, length, 1, ctx)
    engine.remove_files([7])
    assert await server._engine_data(engine, chunk, 0, length, 2, ctx) == b""
    for release in ctx._after_reply:
        release()
    engine.close()


async def test_located_pins_are_released_after_their_lease_and_all_when_the_server_stops(tmp_path):
    """One task releases every locate's pins: each once its deadline (and the slack) has passed, in the order
    taken, never before, and many whose deadlines have passed at once (a busy server's) together; those left when
    the server stops go then."""
    import time
    from kvfs.chunkserver.engine import ChunkEngine
    from kvfs.chunkserver.service import ChunkServer

    engine = ChunkEngine(tmp_path / "target", fsync=False)
    server = ChunkServer(1, "127.0.0.1:1", {1: engine}, None, None)  # type: ignore[arg-type]
    released: list[str] = []
    now = time.monotonic_ns()
    burst = [f"burst{i}" for i in range(1000)]  # a second of locates, all due at the same moment
    for name, after in (("soon", 0.05), *((b, 0.05) for b in burst), ("later", 0.3), ("never", 600.0),
                        ("queued", 600.0)):
        server._located.send_nowait((now + int(after * 1e9), [functools.partial(released.append, name)]))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server._release_located)
        await trio.sleep(0.1)
        assert released == []  # the slack after a deadline: a read right at it is still covered
        await trio.sleep(0.15)
        assert released == ["soon", *burst]
        await trio.sleep(0.3)
        assert released == ["soon", *burst, "later"]
        nursery.cancel_scope.cancel()
    assert released == ["soon", *burst, "later", "never", "queued"]
    engine.close()


async def test_chunk_jobs_keep_each_chunks_order_across_batches(tmp_path, caplog):
    """Effects of a chunk run in the order they were made, a batch's after every earlier job of each of its
    chunks and before every later one, chunks of no batch go on meanwhile, and a failing job leaves no queue
    behind."""
    import functools
    from kvfs.chunkserver.engine import ChunkEngine
    from kvfs.chunkserver.service import ChunkServer

    engine = ChunkEngine(tmp_path / "target", fsync=False)
    server = ChunkServer(1, "127.0.0.1:1", {1: engine}, None, None)  # type: ignore[arg-type]
    ran: list[str] = []
    gate = trio.Event()

    async def job(name: str, wait: trio.Event | None = None) -> None:
        if wait is not None:
            await wait.wait()
        if name == "fails":
            raise KvfsError("a disk error", errno.EIO)
        ran.append(name)

    a, b, c, d = (ChunkId(7, i) for i in range(4))
    async with trio.open_nursery() as nursery:
        server._nursery = nursery
        server._in_chunks_order(1, [a, b], functools.partial(job, "ab", gate))  # nothing queued before it
        server._in_chunk_order(1, b, functools.partial(job, "b"))
        server._in_chunks_order(1, [b, c], functools.partial(job, "bc"))  # waits behind "ab" and "b"
        server._in_chunk_order(1, c, functools.partial(job, "c"))
        server._in_chunk_order(1, d, functools.partial(job, "d"))
        await trio.testing.wait_all_tasks_blocked()
        assert ran == ["d"]
        gate.set()
    assert ran == ["d", "ab", "b", "bc", "c"] and server._chunk_queues == {}
    async with trio.open_nursery() as nursery:
        server._nursery = nursery
        server._in_chunks_order(1, [a, b], functools.partial(job, "fails"))
        server._in_chunk_order(1, a, functools.partial(job, "a"))
    assert ran[-1] == "a" and server._chunk_queues == {} and "a disk error" in caplog.text
    engine.close()


class CountingRpc:
    """The client's RpcClient, counting calls by method name (what a batch costs in round trips)."""

    def __init__(self, rpc: RpcClient) -> None:
        self._rpc = rpc
        self.calls: dict[str, int] = {}

    async def call(self, address, method, *args, **kwargs):
        self.calls[method.name] = self.calls.get(method.name, 0) + 1
        return await self._rpc.call(address, method, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._rpc, name)


async def chunk_versions(rpc, storage: StorageClient, chunk_id: ChunkId) -> set[int]:
    routing = await storage.routing()
    chain = routing.chains[0]
    return {(await rpc.call(routing.addresses[t.node_id], p.CHUNK_STAT, p.ChunkStatQuery(t.target_id, chunk_id))).version
            for t in chain.targets}


async def scattered_batch(storage: StorageClient, inodes: range, chunks: int, runs: int, seed: int
                          ) -> tuple[dict[int, bytearray], list]:
    """Files of ``chunks`` chunks written whole (version 1 of each chunk), then ``runs`` small writes at random
    places of each, 8 KiB apart, applied to the files' models: the models and write_many's entries."""
    chunk, rng = LAYOUT.chunk_size, random.Random(seed)
    models = {ino: bytearray(os.urandom(chunks * chunk)) for ino in inodes}
    for ino, model in models.items():
        await storage.write(ino, LAYOUT, 0, model)
    writes = []
    for ino, model in models.items():
        scattered = [(start + rng.randrange(0, 100), os.urandom(rng.choice((1, 512, 4096))))
                     for start in sorted(rng.sample(range(0, chunks * chunk - 8192, 8192), runs))]
        for offset, data in scattered:
            model[offset:offset + len(data)] = data
        writes.append((ino, LAYOUT, scattered))
    return models, writes


async def write_and_read_back(storage: StorageClient, counting: CountingRpc, models: dict[int, bytearray],
                              writes: list, batches: int) -> None:
    """write_many of ``writes`` as ``batches`` chunk.write_batch calls and nothing else; every file reads back."""
    counting.calls.clear()
    assert await storage.write_many(writes) == [None] * len(writes)
    assert counting.calls == {"chunk.write_batch": batches}
    for ino, model in models.items():
        out = bytearray(len(model))
        await storage.read(ino, LAYOUT, 0, memoryview(out))
        assert out == model


async def test_write_many_of_several_files_is_one_batch_and_one_version_per_chunk(cluster, processes, tmp_path):
    """write_many: scattered runs of several files (three chunks each) go to the chain's head as one
    chunk.write_batch; each chunk moves by one version on every replica, and the bytes between the runs stay."""
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        counting = CountingRpc(rpc)
        storage = StorageClient(counting, MgmtdClient(rpc, cluster.mgmtd))  # type: ignore[arg-type]
        models, writes = await scattered_batch(storage, range(200, 205), chunks=3, runs=30, seed=3)
        await write_and_read_back(storage, counting, models, writes, batches=1)
        for ino in models:
            for index in range(3):
                assert await chunk_versions(rpc, storage, ChunkId(ino, index)) == {2}
    processes.stop_all()
    first, *others = replica_contents(tmp_path, (1, 2, 3))
    assert all(other == first for other in others)


async def test_write_many_across_two_chains_is_one_batch_per_chain(processes, tmp_path):
    """A batch whose chunks lie on two chains goes to each head as one chunk.write_batch; every chunk moves by one
    version on its own chain, the bytes between the runs stay, and each chain's replicas end equal (six servers,
    two chains of three)."""
    cluster = await start_cluster(processes, tmp_path, nodes=6)
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        counting = CountingRpc(rpc)
        storage = StorageClient(counting, MgmtdClient(rpc, cluster.mgmtd))  # type: ignore[arg-type]
        models, writes = await scattered_batch(storage, range(700, 704), chunks=4, runs=24, seed=5)
        chains = {ino: [await storage._chain(LAYOUT, ino, index) for index in range(4)] for ino in models}
        assert len({c.chain_id for cs in chains.values() for c in cs}) == 2
        await write_and_read_back(storage, counting, models, writes, batches=2)
        routing = await storage.routing()
        for ino in models:
            for index, chain in enumerate(chains[ino]):
                versions = {(await rpc.call(routing.addresses[t.node_id], p.CHUNK_STAT,
                                            p.ChunkStatQuery(t.target_id, ChunkId(ino, index)))).version
                            for t in chain.targets}
                assert versions == {2}
        members = [[t.node_id for t in c.targets] for c in routing.chains]
    processes.stop_all()
    for nodes in members:
        first, *others = replica_contents(tmp_path, nodes)
        assert first and all(other == first for other in others)


async def test_removing_deleted_files_while_a_replica_is_down_goes_on_and_reaches_it_when_it_returns(
        cluster, processes, tmp_path):
    """meta's collector needs every chunk server no more: with one killed, removing a deleted file's chunks goes on
    once mgmtd has taken it out, and the server's resync drops the chunks it missed when it returns (craq/member.py,
    rule 10); another file's chunks stay."""
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        mgmtd = MgmtdClient(rpc, cluster.mgmtd)
        storage = StorageClient(rpc, mgmtd, retry_for=60)
        chunk = LAYOUT.chunk_size
        kept, deleted = os.urandom(2 * chunk), os.urandom(3 * chunk)
        await storage.write(900, LAYOUT, 0, kept)
        await storage.write(901, LAYOUT, 0, deleted)
        cluster.kill_chunkserver(2)
        with trio.fail_after(45):
            await storage.remove_files([901])
        total, _ = await storage.capacity()  # counts the servers that are up
        assert total > 0
        cluster.start_chunkserver(2, cluster.chunkservers[2][0])
        await wait_all_serving(mgmtd, 1, timeout=60)
        out = bytearray(len(kept))
        await storage.read(900, LAYOUT, 0, memoryview(out))
        assert out == kept
    processes.stop_all()
    first, *others = replica_contents(tmp_path, (1, 2, 3))
    assert {c for c in first if c.inode in (900, 901)} == {ChunkId(900, 0), ChunkId(900, 1)}
    assert all(other == first for other in others)
    assert "resync dropped" in processes.log("cs2"), "the returning server kept the chunks it missed"


async def test_a_truncation_while_a_replica_is_down_empties_chunks_through_their_chains(cluster, processes, tmp_path):
    """With a chunk server killed, a truncation goes on once mgmtd has taken it out (it failed EHOSTUNREACH until
    the server came back: SQLite's TRUNCATE journal got I/O errors): the chunks past the new end get empty versions
    through their chains, so their versions go on; the returning server is resynced to them, and a chunk the file
    grows into again reads zeros but for what was written."""
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        mgmtd = MgmtdClient(rpc, cluster.mgmtd)
        storage = StorageClient(rpc, mgmtd, retry_for=60)
        ino, chunk = 900, LAYOUT.chunk_size
        data = os.urandom(4 * chunk)
        await storage.write(ino, LAYOUT, 0, data)
        cluster.kill_chunkserver(2)
        with trio.fail_after(45):
            await storage.truncate(ino, LAYOUT, len(data), chunk + 100)  # chunk 1 cut, chunks 2 and 3 emptied
        again = os.urandom(1000)
        await storage.write(ino, LAYOUT, 2 * chunk + 5000, again)
        cluster.start_chunkserver(2, cluster.chunkservers[2][0])
        await wait_all_serving(mgmtd, 1, timeout=60)
        expected = data[: chunk + 100] + bytes(chunk - 100) + bytes(5000) + again
        out = bytearray(len(expected))
        await storage.read(ino, LAYOUT, 0, memoryview(out))
        assert out == expected
        assert await chunk_versions(rpc, storage, ChunkId(ino, 3)) == {2}  # 1, then empty: not removed, not 1 again
        assert await chunk_versions(rpc, storage, ChunkId(ino, 2)) == {3}
    processes.stop_all()
    first, *others = replica_contents(tmp_path, (1, 2, 3))
    assert first[ChunkId(ino, 3)] == b""
    assert all(other == first for other in others)


async def test_write_many_overlapping_runs_take_two_rounds_and_the_later_bytes_win(cluster):
    """A chunk is never twice in one batch: runs that overlap an earlier run of the same chunk go in a later round."""
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        storage = StorageClient(rpc, MgmtdClient(rpc, cluster.mgmtd))
        runs = [(4096, b"a" * 8192), (0, b"b" * 4096), (8192, b"c" * 100), (100_000, b"d" * 10)]
        assert await storage.write_many([(300, LAYOUT, runs), (301, LAYOUT, runs[:2])]) == [None, None]
        model = bytearray(100_010)
        for offset, data in runs:
            model[offset:offset + len(data)] = data
        out = bytearray(len(model))
        await storage.read(300, LAYOUT, 0, memoryview(out))
        assert out == model
        assert await chunk_versions(rpc, storage, ChunkId(300, 0)) == {2}


async def test_a_refused_chunk_of_a_batch_fails_alone_and_changes_no_stored_byte(cluster, processes, tmp_path):
    """A chunk.write_batch whose one chunk carries a wrong CRC: that chunk is refused, the others are written,
    and the refused chunk keeps its bytes on every replica."""
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        storage = StorageClient(rpc, MgmtdClient(rpc, cluster.mgmtd))
        chunk = LAYOUT.chunk_size
        old = os.urandom(3 * chunk)
        await storage.write(400, LAYOUT, 0, old)
        routing = await storage.routing()
        (chain,) = routing.chains
        head = routing.addresses[next(t.node_id for t in chain.targets if t.target_id == chain.write_chain()[0])]
        pieces = [os.urandom(4096) for _ in range(3)]
        writes = [wire_write(chain, ChunkId(400, i), 7000 + i, 4096, piece, bad_crc=i == 1)
                  for i, piece in enumerate(pieces)]
        reply = await rpc.call(head, p.WRITE_BATCH, p.WriteBatch(writes, [4096] * 3), data=pieces)
        assert [r.errno for r in reply.results] == [0, errno.EBADMSG, 0]
        model = bytearray(old)
        for i in (0, 2):
            model[i * chunk + 4096:i * chunk + 8192] = pieces[i]
        out = bytearray(3 * chunk)
        await storage.read(400, LAYOUT, 0, memoryview(out))
        assert out == model
        assert await chunk_versions(rpc, storage, ChunkId(400, 1)) == {1}
    processes.stop_all()
    for replica in replica_contents(tmp_path, (1, 2, 3)):
        assert b"".join(replica[ChunkId(400, i)] for i in range(3)) == model


def wire_write(chain, chunk_id: ChunkId, request_id: int, offset: int, data: bytes, bad_crc: bool) -> WriteReq:
    """A client's write of ``data`` to a chunk, as the storage client sends it (with a wrong CRC if ``bad_crc``)."""
    crc = crc32c(data) ^ (1 if bad_crc else 0)
    return WriteReq(chain.chain_id, chain.chain_version, chunk_id, 99, request_id, offset, crc)


async def test_kill_chunkserver_during_batched_writes_then_resync(cluster, processes, tmp_path):
    """Batches of scattered writes to several files go on while a replica dies and comes back; every acknowledged
    batch reads back, and the replicas end equal."""
    acked: list[tuple[int, int, bytes]] = []
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        mgmtd = MgmtdClient(rpc, cluster.mgmtd)
        storage = StorageClient(rpc, mgmtd, retry_for=60)
        stop = trio.Event()
        rng = random.Random(11)

        async def writer() -> None:
            while not stop.is_set():
                batch = [(ino, LAYOUT, [(rng.randrange(0, 4 * LAYOUT.chunk_size - 4096), os.urandom(4096))])
                         for ino in range(500, 508) for _ in range(4)]
                assert await storage.write_many(batch) == [None] * len(batch)
                acked.extend((ino, off, data) for ino, _, ((off, data),) in batch)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            await trio.sleep(1.0)
            cluster.kill_chunkserver(2)
            await trio.sleep(2.5)
            cluster.start_chunkserver(2, cluster.chunkservers[2][0])
            await trio.sleep(1.0)
            stop.set()
        await wait_all_serving(mgmtd, 1, timeout=60)
        model: dict[int, bytearray] = {ino: bytearray(4 * LAYOUT.chunk_size) for ino in range(500, 508)}
        for ino, off, data in acked:
            model[ino][off:off + len(data)] = data
        for ino, expected in model.items():
            out = bytearray(len(expected))
            await storage.read(ino, LAYOUT, 0, memoryview(out))
            assert out == expected, f"an acknowledged batched write of inode {ino} was lost"
    processes.stop_all()
    first, *others = replica_contents(tmp_path, (1, 2, 3))
    assert first and all(other == first for other in others)


async def test_the_mounts_flush_of_scattered_writes_is_one_batch_per_chain(cluster):
    """The mount's write path (fuse/writes.py) flushes a file's gathered runs over all its chunks as one
    write_many: one chunk.write_batch for the chain, no chunk.write, the small buffer its first write started
    included."""
    async with RpcClient(TOKEN, connect_timeout=1) as rpc:
        counting = CountingRpc(rpc)
        storage = StorageClient(counting, MgmtdClient(rpc, cluster.mgmtd))  # type: ignore[arg-type]
        state = InodeState(600, LAYOUT, 0)
        h = Handle(1, state, os.O_RDWR, None, None)  # type: ignore[arg-type]
        state.handles.add(h)
        wb = WriteBack(None, storage, write_buffer=8 << 20, flush_depth=4, write_parallel=8,
                       changed=lambda *a: None, wrote=lambda st: None, reported=lambda ino: None)
        model = bytearray(4 * LAYOUT.chunk_size)
        rng = random.Random(2)
        await storage.write(600, LAYOUT, 0, bytes(len(model)))  # and the chunk servers know their chain by now
        counting.calls.clear()
        await wb.write(h, 0, b"x")  # a first write starts the buffer; the scattered ones after it are gathered
        model[0:1] = b"x"
        for page in rng.sample(range(2, len(model) // 4096), 32):  # apart: an overlap sends the earlier ones out
            off, data = page * 4096, os.urandom(4096)
            await wb.write(h, off, data)
            model[off:off + 4096] = data
        await wb.flush_inode(state)
        assert counting.calls.get("chunk.write_batch") == 1 and "chunk.write" not in counting.calls
        out = bytearray(len(model))
        await storage.read(600, LAYOUT, 0, memoryview(out))
        assert out == model
