"""How long a reply may be kept (fuse/coherence.py); the invalidations themselves run on real mounts
(tests/test_up_lifecycle.py)."""

from __future__ import annotations

from fuse.coherence import STARTED, Coherence


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
