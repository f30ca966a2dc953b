"""How long a reply may be kept (fuse/coherence.py); the invalidations themselves run on real mounts
(tests/test_up_lifecycle.py)."""

from __future__ import annotations

import errno

import pyfuse3
import pytest

from kvfs.fuse.coherence import STARTED, UNKNOWN, Coherence
from kvfs.meta.types import Attr, Change, ChangePage, DirPage, Entry


def test_long_timeouts_only_while_live_and_only_for_replies_no_change_overtook():
    c = Coherence(60.0)
    STARTED.set(c.applied)
    assert c.timeout(1.0) == 1.0  # not following the feed yet
    c.live = True
    assert c.timeout(1.0) == 60.0
    c.applied += 1  # another client's change was applied while this handler waited on meta
    assert c.timeout(1.0) == 1.0
    STARTED.set(c.applied)  # a handler that started after it
    assert c.timeout(1.0) == 60.0
    short_long = Coherence(0.5)
    short_long.live = True
    STARTED.set(short_long.applied)
    assert short_long.timeout(1.0) == 1.0  # never shorter than the short timeout


def test_a_lapse_forgets_what_the_kernel_was_given_and_goes_short():
    c = Coherence(60.0)
    c.live = True
    STARTED.set(c.applied)
    c.handed(5)  # attributes only: nothing to invalidate by name
    c._lapse()  # the kernel does not hold inode 5 here (no mount): the invalidation is a no-op
    assert not c.live and c.timeout(1.0) == 1.0
    assert not c._inodes and not c._names


def test_security_xattr_answers_are_kept_while_live_and_dropped_by_any_change():
    c = Coherence(60.0)
    STARTED.set(c.applied)
    c.keep_xattr(7, b"security.capability", None, c.xattr_changes)
    assert c.xattr(7, b"security.capability") is UNKNOWN  # not following the feed: nothing is kept
    c.live = True
    c.keep_xattr(7, b"security.capability", None, c.xattr_changes)
    c.keep_xattr(7, b"security.selinux", b"label", c.xattr_changes)
    c.keep_xattr(7, b"user.note", b"per caller", c.xattr_changes)  # user.* depends on the caller's access
    assert c.xattr(7, b"security.capability") is None and c.xattr(7, b"security.selinux") == b"label"
    assert c.xattr(7, b"user.note") is UNKNOWN
    c.apply(ChangePage(b"c1", [Change(b"other", 0, [7], [])], False, False))  # another client touched inode 7
    assert c.xattr(7, b"security.capability") is UNKNOWN
    STARTED.set(c.applied)
    asked_at = c.xattr_changes
    c.drop_xattrs(7)  # this mount's own setxattr ended while the answer was on its way
    c.keep_xattr(7, b"security.capability", None, asked_at)
    assert c.xattr(7, b"security.capability") is UNKNOWN
    before_foreign = c.applied
    c.keep_xattr(7, b"security.capability", None, c.xattr_changes)
    c._lapse()
    assert c.xattr(7, b"security.capability") is UNKNOWN
    c.live = True
    STARTED.set(before_foreign)  # a handler that started before a foreign change was applied
    c.keep_xattr(8, b"security.capability", None, c.xattr_changes)
    assert c.xattr(8, b"security.capability") is UNKNOWN


def test_only_failures_that_may_have_run_count_as_unknown_outcomes():
    from kvfs.fuse.ops import _outcome_unknown
    from kvfs.errors import ConnectionLost, KvfsError, RpcTimeout, ServiceUnavailable

    assert not _outcome_unknown(KvfsError("exists", errno.EEXIST))  # meta refused: nothing changed
    assert not _outcome_unknown(pyfuse3.FUSEError(errno.EACCES))
    for lost in (RpcTimeout("slow"), ConnectionLost("gone"), ServiceUnavailable("down"), KvfsError("io"),
                 KeyboardInterrupt(), RuntimeError("bug")):  # cancellation is a BaseException too
        assert _outcome_unknown(lost), lost


def test_a_listing_read_from_meta_counts_only_if_no_other_client_touched_the_directory_meanwhile():
    c = Coherence(60.0)
    assert c.begin_listing(3) is None  # not following the feed: absent names would not stay true
    c.live = True
    token = c.begin_listing(3)
    assert token is not None and c.begin_listing(3) is None  # one read at a time
    assert c.end_listing(3, token, [b"a", b"b"])
    assert c.absent(3, b"c") and not c.absent(3, b"a")
    assert c.begin_listing(3) is None  # held already
    forced = c.begin_listing(3, force=True)  # a delegation's grant brings the listing anyway: it replaces the one held
    assert forced is not None and c.end_listing(3, forced, [b"a", b"c"]) and c.absent(3, b"b") and not c.absent(3, b"c")

    def voided(touch) -> bool:
        token = c.begin_listing(4)
        touch()
        return not c.end_listing(4, token, [b"x"]) and not c.absent(4, b"y")

    assert voided(lambda: c.apply(ChangePage(b"c", [Change(b"other", 0, [], [(4, b"z")])], False, False)))
    assert c.begin_listing(4) is None  # another client just changed it: not read again for LISTING_QUIET
    c._foreign.clear()
    token = c.begin_listing(4)
    c.named(4, b"mine")  # our own changes while the pages are read, which may or may not show them
    c.unnamed(4, b"x")
    c.named(4, b"again")
    c.unnamed(4, b"again")
    assert c.end_listing(4, token, [b"x", b"y", b"again"])  # replayed on top: our last change of a name decides
    assert c.absent(4, b"x") and c.absent(4, b"again") and not c.absent(4, b"mine") and not c.absent(4, b"y")
    c.forget_listings()
    assert voided(c.forget_listings)
    assert voided(lambda: None) is False  # untouched: kept
    c.forget_listings()
    token = c.begin_listing(5)
    assert not c.end_listing(5, token, None) and c.begin_listing(5) is not None  # a failed read keeps nothing


def test_removing_a_name_whose_inode_is_unknown_drops_the_listed_attributes_of_every_inode_with_other_names():
    """A name removed in a directory no listing holds may be another name of an inode listed elsewhere (a hard
    link): its listed nlink would be stale. Only inodes with more than one name can be such; directories (whose
    nlink counts subdirectories) and single names keep theirs, and a page on its way brings none back."""
    c = Coherence(60.0)
    c.live = True
    files = [Attr(ino=10, mode=0o100644, nlink=2, uid=0, gid=0), Attr(ino=11, mode=0o100644, nlink=1, uid=0, gid=0),
             Attr(ino=12, mode=0o40755, nlink=3, uid=0, gid=0)]
    page = DirPage([Entry(f"n{a.ino}".encode(), a) for a in files], b"", True)
    assert c.end_page(3, c.begin_listing(3), page) is not None
    c.stale_linked()
    assert c.attr(10) is None and c.attr(11) == files[1] and c.attr(12) == files[2]
    c.drop_listing(3)
    token = c.begin_listing(3)
    c.stale_linked()  # while the page is read: it may predate the removal
    assert c.end_page(3, token, page) is not None
    assert c.attr(10) is None and c.attr(11) == files[1] and c.entry(3, b"n12") == files[2]


def test_a_lookup_answer_refills_dropped_listed_attributes_unless_a_change_overtook_it():
    """After a change drops a listed name's attributes, meta's next answer for it is kept again, so a file another
    client changed costs one meta call, not one at every cold stat; an answer a change overtook is not kept, nor
    one for a name no listing holds, or one the listing names another inode with."""
    c = Coherence(60.0)
    c.live = True
    old, new = Attr(ino=10, mode=0o100644, nlink=1, uid=0, gid=0), Attr(ino=10, mode=0o100600, nlink=1, uid=0, gid=0)
    assert c.end_page(3, c.begin_listing(3), DirPage([Entry(b"f", old)], b"", True)) is not None
    STARTED.set(c.applied)
    c.stale(10)
    seen = c.changes
    c.stale(11)  # any change while the lookup was on its way
    c.keep_entry(3, b"f", new, seen)
    assert c.entry(3, b"f") is None
    c.keep_entry(3, b"f", new, c.changes)
    assert c.entry(3, b"f") == new
    c.stale(10)
    c.keep_entry(3, b"g", new, c.changes)  # not a name the listing holds
    c.keep_entry(3, b"f", Attr(ino=12, mode=0o100644, nlink=1, uid=0, gid=0), c.changes)  # another inode
    assert c.attr(10) is None and c.attr(12) is None
    c.apply(ChangePage(b"c", [Change(b"other", 0, [99], [])], False, False))  # a foreign change since it started
    c.keep_entry(3, b"f", new, c.changes)
    assert c.attr(10) is None


def test_a_name_over_name_max_is_enametoolong_even_where_a_kept_listing_answers_absent_names(tmp_path):
    """A kernel may pass names up to 1024 bytes to lookup (this one stops them itself, so the mount tests cannot
    reach this): the mount must not answer ENOENT from a complete listing, where no name that long can be."""
    import trio

    from fuse_harness import build
    from kvfs.fuse.ops import KvfsOperations

    meta, storage, engine = build(tmp_path)
    try:
        ops = KvfsOperations(meta, storage)
        assert ops.coherence is not None
        ops.coherence.live = True
        ops.coherence.listing_made(1)  # the root's listing is complete: absent names are answered here
        assert trio.run(ops.lookup, 1, b"n" * 255, None).st_ino == 0  # absent: a negative entry from the listing
        with pytest.raises(pyfuse3.FUSEError) as info:
            trio.run(ops.lookup, 1, b"n" * 256, None)
        assert info.value.errno == errno.ENAMETOOLONG
    finally:
        engine.close()
