#!/usr/bin/env python3
"""The floor under kvfs's metadata figures: an in-memory filesystem on pyfuse3 and trio, like the kvfs mount.

    python benchmarks/memfs.py MOUNTPOINT      # foreground; SIGTERM/SIGINT unmount

It keeps names and attributes in dicts and answers every request at once, with the kvfs mount's options
(``default_permissions``, ``allow_other``) and its kernel cache timeouts while it follows meta's feed (60 s), so a
metadata loop on it measures what FUSE, pyfuse3 and trio alone cost per operation on this machine: no metadata
service, no network. ``benchmarks/fs_compare.py`` runs its metadata loop here as the ``pyfuse3`` column. Only what
that loop and ``rm -rf`` need is implemented (no file data).
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys
import time

import pyfuse3
import trio

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kvfs.fuse.mount import mount_options  # noqa: E402  (the kvfs mount's own options)

TIMEOUT = 60.0  # what the kvfs mount gives the kernel while it follows meta's change feed


class MemFs(pyfuse3.Operations):
    def __init__(self) -> None:
        super().__init__()
        now = time.time_ns()
        self.attrs: dict[int, list[int]] = {pyfuse3.ROOT_INODE: [stat.S_IFDIR | 0o777, 2, 0, 0, now]}
        self.entries: dict[int, dict[bytes, int]] = {pyfuse3.ROOT_INODE: {}}
        self.next_ino = pyfuse3.ROOT_INODE + 1

    def _entry(self, ino: int) -> pyfuse3.EntryAttributes:
        mode, nlink, uid, gid, t = self.attrs[ino]
        e = pyfuse3.EntryAttributes()
        e.st_ino, e.st_mode, e.st_nlink, e.st_uid, e.st_gid = ino, mode, nlink, uid, gid
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = t
        e.st_blksize = 4096
        e.entry_timeout = e.attr_timeout = TIMEOUT
        return e

    def _make(self, parent: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext) -> int:
        if name in self.entries[parent]:
            raise pyfuse3.FUSEError(errno.EEXIST)
        ino, self.next_ino = self.next_ino, self.next_ino + 1
        now = time.time_ns()
        self.attrs[ino] = [mode, 2 if stat.S_ISDIR(mode) else 1, ctx.uid, ctx.gid, now]
        self.entries[parent][name] = ino
        self.attrs[parent][4] = now
        if stat.S_ISDIR(mode):
            self.entries[ino] = {}
            self.attrs[parent][1] += 1
        return ino

    def _remove(self, parent: int, name: bytes) -> int:
        ino = self.entries[parent].pop(name, None)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        self.attrs[parent][4] = time.time_ns()
        return ino

    async def lookup(self, parent_inode, name, ctx):
        ino = self.entries[parent_inode].get(name)
        if ino is None:
            e = pyfuse3.EntryAttributes()
            e.st_ino, e.entry_timeout = 0, TIMEOUT
            return e
        return self._entry(ino)

    async def getattr(self, inode, ctx):
        return self._entry(inode)

    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._entry(self._make(parent_inode, name, stat.S_IFDIR | mode, ctx))

    async def create(self, parent_inode, name, mode, flags, ctx):
        ino = self._make(parent_inode, name, stat.S_IFREG | (mode & 0o7777), ctx)
        return pyfuse3.FileInfo(fh=ino), self._entry(ino)

    async def open(self, inode, flags, ctx):
        return pyfuse3.FileInfo(fh=inode)

    async def flush(self, fh):
        pass

    async def release(self, fh):
        pass

    async def unlink(self, parent_inode, name, ctx):
        ino = self._remove(parent_inode, name)
        self.attrs[ino][1] -= 1

    async def rmdir(self, parent_inode, name, ctx):
        ino = self.entries[parent_inode].get(name)
        if ino is not None and self.entries.get(ino):
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        self._remove(parent_inode, name)
        self.attrs[parent_inode][1] -= 1
        del self.entries[ino], self.attrs[ino]

    async def forget(self, inode_list):
        for ino, _ in inode_list:
            if ino in self.attrs and self.attrs[ino][1] == 0:
                del self.attrs[ino]

    async def opendir(self, inode, ctx):
        return inode

    async def readdir(self, fh, start_id, token):
        for i, (name, ino) in enumerate(sorted(self.entries[fh].items())[start_id:], start_id + 1):
            if not pyfuse3.readdir_reply(token, name, self._entry(ino), i):
                return

    async def releasedir(self, fh):
        pass

    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_namemax = 255
        return s

    async def getxattr(self, inode, name, ctx):
        raise pyfuse3.FUSEError(errno.ENODATA)


def main() -> None:
    mountpoint = sys.argv[1]
    options = mount_options(allow_other=True) - {"fsname=kvfs", "subtype=kvfs"} | {"fsname=memfs"}
    pyfuse3.init(MemFs(), mountpoint, options)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            async def on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        pyfuse3.terminate()
                        return

            nursery.start_soon(on_signal)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()

    try:
        trio.run(serve)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
