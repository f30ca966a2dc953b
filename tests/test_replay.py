"""A recorded frame replayed against a real ``kvfs meta`` (issue 28, item 1).

A recording TCP proxy sits between a real client and the metadata service and keeps every byte the client sent.
The client's ``unlink`` is cut out of the recording, the file is created again, and the unlink is replayed: on the
connection it was recorded on, on a new connection by someone without the token (the whole recorded stream,
handshake included), and on a new connection by someone who completed a handshake of their own. Every replay is
refused and logged with the peer's address, the file stays, and the service keeps serving.
"""

from __future__ import annotations

import os

import pytest
import trio

from kvfs import auth
from kvfs.meta.client import RemoteMeta
from kvfs.meta.rpc import OPS
from kvfs.meta.types import ROOT
from kvfs.rpc import RpcClient, send_all

from harness import TOKEN, RecordingProxy, authenticated, frames, free_port, wait_for_port

UNLINK = OPS["unlink"].method


async def make_file(meta: RemoteMeta, name: bytes) -> None:
    opened = await meta.create(ROOT, 1, name, 0o644)
    await meta.close(ROOT, opened.attr.ino, opened.session)


async def exists(meta: RemoteMeta, name: bytes) -> bool:
    page = await meta.readdir(ROOT, 1)
    return name in [entry.name for entry in page.entries]


def refusals(processes, port: int) -> list[str]:
    return [line for line in processes.log("meta").splitlines() if f"refusing 127.0.0.1:{port}:" in line]


async def wait_for_refusal(processes, port: int) -> str:
    with trio.fail_after(10):
        while not (lines := refusals(processes, port)):
            await trio.sleep(0.05)
    await trio.sleep(0.2)  # time for a second line, if the server were to say it twice
    assert len(lines := refusals(processes, port)) == 1, lines
    return lines[0]


@pytest.fixture
def meta_address(processes, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    proc = processes.start("meta", "--listen", address, "--kv-url", f"sqlite:///{tmp_path / 'meta.db'}", name="meta")
    wait_for_port(address, proc)
    yield address
    assert proc.poll() is None, "meta died\n" + processes.log("meta")


async def test_a_recorded_unlink_replayed_on_the_same_or_another_connection_is_refused(
        meta_address, processes, nursery):
    proxy = RecordingProxy(meta_address)
    via_proxy_address = await nursery.start(proxy.serve)
    async with RpcClient(TOKEN, retries=0) as rpc:
        meta = RemoteMeta(rpc, [meta_address])
        recorded_meta = RemoteMeta(rpc, [via_proxy_address])
        await make_file(recorded_meta, b"victim")
        await recorded_meta.unlink(ROOT, 1, b"victim")
        recording = bytes(proxy.recorded[0])
        (unlink,) = [raw for header, raw in frames(recording) if header.method == UNLINK.id]
        assert [h.method for h, _ in frames(recording)][:2] == [auth.AUTH_HELLO.id, auth.AUTH_PROVE.id]
        await make_file(meta, b"victim")  # after the capture: the replayed unlink would remove it

        # 1. on the connection it was recorded on, as the next frame
        await send_all(proxy.upstream_sockets[0], unlink)
        line = await wait_for_refusal(processes, proxy.upstream_sockets[0].getsockname()[1])
        assert "does not match this connection's key and sequence" in line
        assert await exists(meta, b"victim")

        # 2. on a new connection, by someone without the token: everything the client sent, handshake included
        stranger = trio.socket.socket()
        await stranger.connect(("127.0.0.1", int(meta_address.rsplit(":", 1)[1])))
        await send_all(stranger, recording)
        line = await wait_for_refusal(processes, stranger.getsockname()[1])
        assert "handshake proof does not match the cluster token" in line
        stranger.close()
        assert await exists(meta, b"victim")

        # 3. on a new connection by a token holder (its own handshake, so its own keys), the recorded frame
        insider, _ = await authenticated(meta_address)
        await send_all(insider, unlink)
        line = await wait_for_refusal(processes, insider.getsockname()[1])
        assert "does not match this connection's key and sequence" in line
        insider.close()
        assert await exists(meta, b"victim")

        # the service is up and serving, and the file goes when its owner really unlinks it
        await meta.unlink(ROOT, 1, b"victim")
        assert not await exists(meta, b"victim")
    assert os.path.exists(f"/proc/{processes.procs[0].pid}")
