"""Records meta stores and returns; msgspec Structs so they go over the wire (msgpack) as they are."""

from __future__ import annotations

from typing import Literal

import msgspec

MIB = 1 << 20
#: Inode ids are handed out in blocks of ID_BLOCK from ID_SHARDS counters (fixed forever: together they define
#: which ids a shard owns); a client answering creates in a delegated directory is granted whole blocks.
ID_SHARDS = 16
ID_BLOCK = 1024


class Caller(msgspec.Struct, frozen=True):
    """Who asks: the credentials every permission check uses (``gids``: supplementary groups)."""

    uid: int
    gid: int
    gids: tuple[int, ...] = ()
    pid: int = 0
    client: bytes = b""  # the mount or library the call comes from: its write sessions end if it stops renewing

    def in_group(self, gid: int) -> bool:
        return gid == self.gid or gid in self.gids


ROOT = Caller(0, 0)


class Layout(msgspec.Struct, frozen=True):
    """Where a file's chunks live: see :func:`kvfs.chunkserver.placement.chunk_chain`.

    chunk_size is a power of two in [64 KiB, 64 MiB]. The 4 MiB default:
    every chunk write costs the chunk servers a chain round and two SQLite commits whatever its size (and two
    fsyncs with write-through chunk servers), so 4 MiB chunks halve their CPU per written byte against 1 MiB;
    larger ones gain little more, while each small overwrite copies its whole chunk (copy-on-write) and so
    costs more the larger the chunk.
    """

    chain_table: int = 1
    chunk_size: int = 4 * MIB
    stripe: int = 1
    seed: int = 0

    def describe(self, *, with_seed: bool) -> bytes:
        """The ``kvfs.layout`` xattr value: ``key=value`` pairs (a file also shows its placement seed)."""
        fields = f"chain_table={self.chain_table} chunk_size={self.chunk_size} stripe={self.stripe}"
        return (fields + f" seed={self.seed}" if with_seed else fields).encode()

    def changed_by(self, text: bytes | str) -> Layout:
        """This layout with the ``key=value`` pairs of ``text`` applied (``chunk_size=1M stripe=8``; sizes take
        K/M/G suffixes). Keys left out keep their values. The seed is per file; the chain table is not settable
        here (meta cannot check that it exists). ValueError names what is wrong; ranges are checked by
        :meth:`kvfs.meta.store.MetaStore.set_layout`."""
        raw = text.decode() if isinstance(text, bytes) else text
        changes: dict[str, int] = {}
        for pair in raw.replace(",", " ").split():
            key, sep, value = pair.partition("=")
            if not sep or key not in _SETTABLE_LAYOUT_FIELDS:
                raise ValueError(f"{pair!r}: expected one of {', '.join(_SETTABLE_LAYOUT_FIELDS)} as key=value")
            scale = _SIZE_SUFFIXES.get(value[-1:].upper(), 1)
            digits = value[:-1] if scale != 1 else value
            if not digits.isdigit():
                raise ValueError(f"{pair!r}: not a non-negative integer")
            changes[key] = int(digits) * scale
        if not changes:
            raise ValueError("no key=value pairs")
        return msgspec.structs.replace(self, **changes)


_SETTABLE_LAYOUT_FIELDS = ("chunk_size", "stripe")
_SIZE_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class Attr(msgspec.Struct):
    ino: int
    mode: int  # type bits included
    nlink: int
    uid: int
    gid: int
    size: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    rdev: int = 0
    blksize: int = MIB
    blocks: int = 0  # 512-byte units, computed from size (chunks are allocated as written)
    generation: int = 0


class Inode(msgspec.Struct):
    """The stored inode record (key ``("meta", "i", ino)``)."""

    attr: Attr
    parent: int = 0  # directories only: the one directory holding them, for ".." and rename's walk
    layout: Layout | None = None  # files: their own; directories: what new children copy
    target: bytes | None = None  # symlinks
    written: bool = True  # False: no write session was ever opened on it, so no chunk of it exists anywhere
    grant: int = 0  # the epoch of the delegation its creator made it under (0: none): see meta/delegation.py, rule 5


class DirEntry(msgspec.Struct, array_like=True):
    """The stored directory entry (key ``("meta", "d", parent, name)``)."""

    ino: int
    type: int  # S_IFMT bits, so a listing knows types without reading inodes


class Entry(msgspec.Struct):
    name: bytes
    attr: Attr


class DirPage(msgspec.Struct):
    """One readdir page; pass ``cookie`` back to continue.  ``eof`` means nothing follows."""

    entries: list[Entry]
    cookie: bytes
    eof: bool


class Opened(msgspec.Struct):
    """Result of create/open: the attributes, the write session id when opened for writing, the file's
    layout (a client needs it for any I/O; returning it here saves a round trip per newly seen file), after a
    create the parent directory's new attributes (the kernel asks for them right after), and the hold session id
    of a read-only open that asked for one (``MetaStore.open(..., hold=True)``)."""

    attr: Attr
    session: int | None = None
    layout: Layout | None = None
    parent: Attr | None = None
    hold: int | None = None


class Found(msgspec.Struct):
    """A name :meth:`~kvfs.meta.api.MetaApi.batch_lookup` found: its attributes and, for a file, its layout (so
    a reader needs no further round trip before its chunk I/O)."""

    attr: Attr
    layout: Layout | None = None


class Commit(msgspec.Struct, array_like=True):
    """One put for :meth:`~kvfs.meta.api.MetaApi.commit_puts`: temporary file ``temp`` (inode ``ino``, written
    under write session ``session``) holds all ``length`` bytes and becomes ``name``."""

    temp: bytes
    name: bytes
    ino: int
    session: int
    length: int


class Session(msgspec.Struct):
    """An open session (key ``("meta", "s", ino, session)``): a write-open's, or a read-only open's hold, which
    only keeps the file (and its chunks) from garbage collection once its last name is gone."""

    uid: int
    pid: int
    opened_ns: int
    client: bytes = b""  # empty: a client without a lease (in-process), whose sessions never expire
    hold: bool = False  # a read-only open's: it may not report lengths


class StatFs(msgspec.Struct):
    bsize: int
    frsize: int
    blocks: int
    bfree: int
    bavail: int
    files: int
    ffree: int
    namemax: int = 255


TimeSpec = int | Literal["now"] | None  # nanoseconds, the current time, or leave unchanged


class Change(msgspec.Struct, array_like=True):
    """One committed transaction's footprint in the change feed: whose attributes changed, which directory
    entries appeared or went, and the client that made it (empty: one without a client id, such as GC)."""

    client: bytes
    time_ns: int
    inodes: list[int]
    entries: list[tuple[int, bytes]]  # (parent inode, name)
    recalls: list[int] = []  # directories whose delegation another client is waiting for (meta/delegation.py)


class ChangePage(msgspec.Struct):
    """What :meth:`kvfs.meta.store.MetaStore.changes` returns: the changes after the caller's cursor, in commit order.

    ``cursor`` is where to continue. ``gap``: the records after the caller's cursor were trimmed, so it has
    missed changes it cannot learn (it must drop everything it caches); ``cursor`` is then the feed's head.
    ``more``: the page is full, call again at once."""

    cursor: bytes
    changes: list[Change]
    gap: bool = False
    more: bool = False


class Delegation(msgspec.Struct, array_like=True):
    """The stored delegation of a directory (key ``("meta", "L", dir)``): which client may create and remove
    names there without asking first, under which epoch, until when (meta's clock), the inode-id blocks
    it was handed for its creates (the last few), and whether its holder may remove any non-directory's name
    (``removes``: then no other client removes names there without a recall; meta/delegation.py, rule 5)."""

    client: bytes
    epoch: int
    expires_ns: int
    blocks: list[int]
    removes: bool = False


class Delegated(msgspec.Struct):
    """What :meth:`kvfs.meta.store.MetaStore.delegate` answers. ``granted`` False: another client holds the directory,
    the listing is too large, or a renewal came after the delegation had lapsed. A new grant carries the
    directory's attributes, the layout its children get, and every name in it (a grant for removals, with
    ``entries``, each name's inode and type, in the order of ``names``); every grant and renewal carries ``ids``,
    the first of ``kvfs.meta.types.ID_BLOCK`` fresh inode ids for the holder's creates."""

    granted: bool
    epoch: int = 0
    lease: float = 0.0
    ids: int = 0
    attr: Attr | None = None
    layout: Layout | None = None
    names: list[bytes] | None = None
    entries: list[DirEntry] | None = None


class CreateOp(msgspec.Struct, tag="create", array_like=True):
    """A create the holder of a directory's delegation already answered (see :class:`Delegated`): everything the
    answer showed (inode id, times, placement seed, write session) was chosen by the holder."""

    who: Caller
    name: bytes
    ino: int
    mode: int
    flags: int
    time_ns: int
    layout: Layout  # the directory's, with the file's own seed: meta refuses a create whose directory differs
    session: int | None


class UnlinkOp(msgspec.Struct, tag="unlink", array_like=True):
    """A removal the holder already answered; ``ino`` is the inode the name had (the holder created it)."""

    who: Caller
    name: bytes
    ino: int
    time_ns: int


DirOp = CreateOp | UnlinkOp
