"""Mounting: option set, the trio main loop, readahead, signals and clean unmount.

pyfuse3 keeps one session per process, so one process serves one mount.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from contextlib import nullcontext
from collections.abc import Iterable
from typing import Any

import pyfuse3
import trio

from kvfs.meta.types import Caller

from .ops import KvfsOperations

log = logging.getLogger(__name__)


def mount_options(*, allow_other: bool = True, extra: Iterable[str] = ()) -> set[str]:
    """The mount options kvfs uses.

    ``default_permissions``: the kernel checks mode bits too, with the caller's credentials. Meta checks every
    operation itself (it is the judge for kvclient, which has no kernel in the way), but only the kernel sees
    accesses that never reach the daemon — a lookup answered from the dentry cache skips the search-permission
    check of its directory, and ``fs.protected_hardlinks`` asks the kernel's own permission check. Without it the
    mount would be a way around permissions; with both, a caller must pass both.

    No ``max_read=``: libfuse refuses it unless the init handler sets the same value, which pyfuse3
    does not let us do; without it the kernel's read size is bounded only by max_pages, and libfuse
    negotiates max_write = max_pages * page size = 1 MiB by itself."""
    opts = {"fsname=kvfs", "subtype=kvfs", "default_permissions"}
    if allow_other:
        opts.add("allow_other")
    opts.update(extra)
    return opts


def _mount_dev(mountpoint: str) -> str | None:
    """'major:minor' of the FUSE mount at ``mountpoint``, from /proc/self/mountinfo (no stat: the
    filesystem may not answer yet: pass a path resolved before mounting)."""
    target = os.path.abspath(mountpoint)
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        parts = line.split()
        if len(parts) > 4 and parts[4].encode().decode("unicode_escape") == target:
            found = parts[2]  # the last one mounted there wins
    return found


def is_mounted(mountpoint: str) -> bool:
    """Whether something is mounted at ``mountpoint``, without touching it: a dead FUSE mount (its daemon
    killed) fails every stat with ENOTCONN, which makes ``os.path.ismount`` say False."""
    return _mount_dev(mountpoint) is not None


def set_read_ahead(mountpoint: str, kib: int) -> bool:
    """Raise the mount's readahead (``/sys/class/bdi/<dev>/read_ahead_kb``); False if not possible.
    ``mountpoint`` must be an absolute, resolved path (nothing here touches the mounted filesystem)."""
    dev = _mount_dev(mountpoint)
    if dev is None:
        return False
    try:
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:
            f.write(str(kib))
        return True
    except OSError as e:
        log.info("could not set read_ahead_kb for %s: %s", mountpoint, e)
        return False


FUSECTL = "/sys/fs/fuse/connections"


def fusectl_dir(mountpoint: str) -> str | None:
    """The mount's directory under fusectl (named by the kernel's device number), mounting fusectl first if no one
    did (systemd does at boot; containers often do not); None if that is not possible (not root)."""
    dev = _mount_dev(mountpoint)
    if dev is None:
        return None
    major, minor = (int(x) for x in dev.split(":"))
    path = os.path.join(FUSECTL, str(major << 20 | minor))  # the kernel's dev_t, as fs/fuse/control.c names it
    if not os.path.isdir(path) and os.path.isdir(FUSECTL) and not os.listdir(FUSECTL) and os.geteuid() == 0:
        subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
    return path if os.path.isdir(path) else None


def set_max_background(mountpoint: str, requests: int) -> bool:
    """Let the kernel keep ``requests`` asynchronous requests (readahead) in flight to the mount instead of its
    default 12 (congested at 9): a sequential reader's readahead stalls at that many 1 MiB reads while each
    waits for a chunk server's disk. Needs root (fusectl's files are root's); False if not possible."""
    path = fusectl_dir(mountpoint)
    if path is None:
        log.info("could not raise max_background for %s: no fusectl directory (not root?)", mountpoint)
        return False
    try:
        for name, value in (("max_background", requests), ("congestion_threshold", requests * 3 // 4)):
            with open(os.path.join(path, name), "w") as f:
                f.write(str(value))
        return True
    except OSError as e:
        log.info("could not raise max_background for %s: %s", mountpoint, e)
        return False


def force_unmount(path: str) -> bool:
    """Lazily unmount ``path`` (what a crashed daemon leaves behind); True if something was unmounted."""
    for cmd in (["fusermount3", "-u", "-z", path], ["fusermount", "-u", "-z", path], ["umount", "-l", path]):
        if shutil.which(cmd[0]) is None:
            continue
        r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if r.returncode == 0:
            return True
    return False


async def run_mount(
    meta: Any,
    storage: Any,
    mountpoint: str,
    *,
    allow_other: bool = True,
    read_ahead_kb: int = 4096,
    max_background: int = 64,
    extra_options: Iterable[str] = (),
    handle_signals: bool = True,
    task_status=trio.TASK_STATUS_IGNORED,
    **ops_options: Any,
) -> None:
    """Mount kvfs at ``mountpoint`` and serve until unmounted or, with ``handle_signals``, until
    SIGTERM/SIGINT (dirty buffers are written out, then the mount is removed).

    ``ops_options`` go to :class:`KvfsOperations` (entry_timeout, attr_timeout, negative_timeout,
    write_buffer, read_parallel, readdir_page, keep_cache, read_cache, coherent_timeout).
    ``task_status.started()`` is called once the mount exists, so ``await nursery.start(run_mount, ...)`` returns
    when it may be used."""
    ops = KvfsOperations(meta, storage, **ops_options)
    mountpoint = os.path.realpath(mountpoint)  # resolve now: after mounting, a stat would wait for us
    # The receiver stays open until the mount is gone: a second SIGTERM (e.g. from timeout(1) and a
    # shell both) must not fall through to the default action and kill us still mounted.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) if handle_signals else nullcontext() as signals:
        pyfuse3.init(ops, mountpoint, mount_options(allow_other=allow_other, extra=extra_options))
        try:
            async with trio.open_nursery() as nursery:
                ops.nursery = ops.writes.nursery = nursery
                if signals is not None:
                    nursery.start_soon(_on_signals, ops, signals, nursery.cancel_scope)
                if read_ahead_kb or max_background:
                    nursery.start_soon(_tune_kernel, ops, mountpoint, read_ahead_kb, max_background)
                if ops.coherence is not None:
                    follower = Caller(os.getuid(), os.getgid(), client=ops.client_id)
                    nursery.start_soon(ops.coherence.follow, meta, follower)
                if ops.dirops is not None:
                    ops.dirops.nursery = nursery
                    nursery.start_soon(ops.dirops.run)
                task_status.started(ops)
                await pyfuse3.main()
                with trio.move_on_after(10):
                    await ops.flush_all()  # background flushes still in flight
                nursery.cancel_scope.cancel()  # unmounted from outside (fusermount -u): stop the watcher
        finally:
            try:
                pyfuse3.close(unmount=True)
            except Exception:
                log.exception("pyfuse3.close")
            if ops.local is not None:
                ops.local.close()


async def _tune_kernel(ops: KvfsOperations, mountpoint: str, read_ahead_kb: int, max_background: int) -> None:
    """The kernel sets the bdi's readahead and the connection's limits from the INIT reply, so raise them only
    after INIT is done (0 leaves one as the kernel set it)."""
    with trio.move_on_after(30):
        await ops.initialized.wait()
        await trio.sleep(0.2)  # the reply is written right after init() returns
        if read_ahead_kb:
            set_read_ahead(mountpoint, read_ahead_kb)
        if max_background:  # may run mount(8) for fusectl: not in the loop that answers the kernel
            await trio.to_thread.run_sync(set_max_background, mountpoint, max_background)


async def _on_signals(ops: KvfsOperations, signals: Any, scope: trio.CancelScope) -> None:
    async for signum in signals:
        log.info("signal %d: flushing and unmounting", signum)
        with trio.move_on_after(10):
            await ops.flush_all()
        pyfuse3.terminate()
        await trio.sleep(5)  # main() normally returns at once; if a request hangs, stop anyway
        scope.cancel()
        return
