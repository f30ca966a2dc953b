"""A condition a loop meets at every retry is logged when it starts, when it changes and when it ends."""

from __future__ import annotations

import logging

import pytest

from kvfs.errors import AuthError, ServiceUnavailable
from kvfs.service import Complaint


def test_a_repeated_failure_is_said_once_until_it_changes_or_ends(caplog: pytest.LogCaptureFixture) -> None:
    complaint = Complaint(logging.getLogger("kvfs.test"), "change feed")
    with caplog.at_level(logging.INFO, "kvfs.test"):
        for _ in range(100):
            complaint.failed(AuthError("meta refused us: bad token"))
        complaint.failed(ServiceUnavailable("meta unreachable"))
        complaint.succeeded()
        complaint.succeeded()
        complaint.failed(AuthError("meta refused us: bad token"))
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [
        ("WARNING", "change feed: meta refused us: bad token (said once until it changes)"),
        ("WARNING", "change feed: meta unreachable (said once until it changes)"),
        ("INFO", "change feed: working again"),
        ("WARNING", "change feed: meta refused us: bad token (said once until it changes)"),
    ]
