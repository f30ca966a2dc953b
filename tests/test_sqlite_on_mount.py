"""A SQLite database on a real mount survives kill -9 (issue 25): of a chunk server in the middle of a
write-heavy run, and of the program that writes it in the middle of a transaction.

The workload runs in a process of its own: transactions of random sizes that insert, update and delete rows
and keep two invariants a torn or half-applied transaction would break (a totals row that matches the table, a
CRC beside every value). It prints ``committed T`` once COMMIT has returned, so the test knows every
transaction SQLite promised was durable. Afterwards ``PRAGMA integrity_check`` must say ``ok``, every printed
transaction must be there, and nothing of a transaction that did not commit may be visible.
"""

from __future__ import annotations

import os
import random
import sqlite3
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest

pytest.register_assert_rewrite("cluster_fixtures")
from cluster_fixtures import NEEDS_FUSE, started, wait_until  # noqa: E402

pytest_plugins = ["cluster_fixtures"]
pytestmark = NEEDS_FUSE
JOURNAL_MODES = ["delete", "wal", "truncate"]

WORKLOAD = r"""
import os, random, signal, sqlite3, sys, zlib
path, journal_mode, seed, stop, kill_self_in = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
rng = random.Random(seed)
con = sqlite3.connect(path, isolation_level=None, timeout=60)
assert con.execute(f"PRAGMA journal_mode={journal_mode}").fetchone()[0] == journal_mode
con.execute("PRAGMA synchronous=FULL")
con.execute("CREATE TABLE IF NOT EXISTS txns (id INTEGER PRIMARY KEY, inserted INTEGER, deleted INTEGER)")
con.execute("CREATE TABLE IF NOT EXISTS items (id INTEGER PRIMARY KEY, txn INTEGER, touched INTEGER, v BLOB, crc INTEGER)")
con.execute("CREATE TABLE IF NOT EXISTS totals (one INTEGER PRIMARY KEY CHECK (one = 1), rows INTEGER)")
con.execute("INSERT OR IGNORE INTO totals VALUES (1, 0)")
t = con.execute("SELECT coalesce(max(id), 0) FROM txns").fetchone()[0]

def values(n):
    out = []
    for _ in range(n):
        v = rng.randbytes(rng.choice((16, 200, 1500)))
        out.append((v, zlib.crc32(v)))
    return out

while not os.path.exists(stop):
    t += 1
    big = t == kill_self_in
    n = 6000 if big else rng.choice((1, 3, 10, 40, 200))  # the big one outgrows the 2 MiB cache: it spills
    con.execute("BEGIN IMMEDIATE")
    con.executemany("INSERT INTO items (txn, touched, v, crc) VALUES (?, ?, ?, ?)", [(t, t, v, c) for v, c in values(n // 2)])
    print(f"open {t}", flush=True)
    con.executemany("INSERT INTO items (txn, touched, v, crc) VALUES (?, ?, ?, ?)", [(t, t, v, c) for v, c in values(n - n // 2)])
    top = con.execute("SELECT max(id) FROM items").fetchone()[0]
    ids = [rng.randrange(1, top + 1) for _ in range(rng.randrange(0, 50))]
    con.executemany("UPDATE items SET touched = ?, v = ?, crc = ? WHERE id = ?", [(t, v, c, i) for (v, c), i in zip(values(len(ids)), ids)])
    gone = con.execute("DELETE FROM items WHERE id IN (%s)" % ",".join("?" * 10), [rng.randrange(1, top + 1) for _ in range(10)]).rowcount
    con.execute("UPDATE totals SET rows = rows + ? WHERE one = 1", (n - gone,))
    con.execute("INSERT INTO txns VALUES (?, ?, ?)", (t, n, gone))
    if big:
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9 with the transaction's pages spilled, before COMMIT
    con.execute("COMMIT")
    print(f"committed {t}", flush=True)
con.close()
"""


class Workload:
    """The workload process; a thread follows its output: the last committed transaction and everything it
    printed (a traceback, if SQLite got an error)."""

    def __init__(self, db: Path, journal_mode: str, seed: int, stop: Path, kill_self_in: int = 0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", WORKLOAD, str(db), journal_mode, str(seed), str(stop),
                                      str(kill_self_in)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.committed = 0
        self.opened = 0
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._follow, daemon=True)
        self._reader.start()

    def _follow(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            word, _, number = line.partition(" ")
            if word == "committed":
                self.committed = int(number)
            elif word == "open":
                self.opened = int(number)

    def output(self) -> str:
        return "".join(self.lines[-40:])

    def wait_for(self, committed: int, timeout: float = 60) -> None:
        wait_until(lambda: self.proc.poll() is not None or self.committed >= committed, timeout,
                   f"transaction {committed} to commit (at {self.committed})")
        assert self.proc.poll() is None, f"the workload exited {self.proc.returncode}:\n{self.output()}"

    def finish(self, timeout: float = 60) -> int:
        """Wait for the exit and the last line; the exit status."""
        try:
            rc = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        return rc


def check(db: Path, committed: int) -> None:
    """integrity_check is ok; transactions 1..``committed`` are all there and nothing of a later one shows."""
    con = sqlite3.connect(db)
    try:
        con.create_function("crc32", 1, zlib.crc32, deterministic=True)
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        count, last, inserted, deleted = con.execute(
            "SELECT count(*), coalesce(max(id), 0), coalesce(sum(inserted), 0), coalesce(sum(deleted), 0) FROM txns"
        ).fetchone()
        assert count == last, f"transactions 1..{last} are not all there ({count} of them)"
        assert last == committed, f"the workload saw {committed} commits, the database has {last}"
        rows = con.execute("SELECT count(*) FROM items").fetchone()[0]
        assert con.execute("SELECT rows FROM totals").fetchone()[0] == rows == inserted - deleted
        assert con.execute("SELECT count(*) FROM items WHERE txn > ? OR touched > ?", (last, last)).fetchone()[0] == 0
        assert con.execute("SELECT count(*) FROM items WHERE crc32(v) != crc").fetchone()[0] == 0
    finally:
        con.close()


@pytest.mark.parametrize("journal_mode", JOURNAL_MODES)
def test_kill_9_of_chunk_servers_in_the_middle_of_a_write_heavy_run(journal_mode, tmp_path):
    """Kill one chunk server at a random commit, go on with the chain of two, bring it back (resync under the
    running workload), then kill another: SQLite never sees an error and the database holds every commit."""
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    first, second = rng.sample(["cs1", "cs2", "cs3"], 2)
    stop = tmp_path / "stop"
    with started("kvfs-sqlite-cs-") as c:
        db = c.mount / "db.sqlite"
        work = Workload(db, journal_mode, seed, stop)
        plan = f"seed {seed}, kill {first} then {second}"
        print(plan)  # shown with a failure: the run to reproduce
        try:
            work.wait_for(rng.randrange(10, 40))
            c.kill(first)
            work.wait_for(work.committed + 40)  # the chain goes on without it
            up = c.up()  # restarts it and waits until it serves again: resynced while SQLite writes
            assert f"started {first}" in up.stdout, plan
            work.wait_for(work.committed + 20)
            c.kill(second)
            work.wait_for(work.committed + 20)
            stop.touch()
            rc = work.finish()
        finally:
            if work.proc.poll() is None:
                work.proc.kill()
        assert rc == 0, f"{plan}: the workload failed (exit {rc}):\n{work.output()}\n{c.log_tails()}"
        check(db, work.committed)


@pytest.mark.parametrize("journal_mode", JOURNAL_MODES)
def test_kill_9_of_the_writer_in_the_middle_of_a_transaction(journal_mode, mnt_dir, tmp_path):
    """The writer dies with a transaction's pages spilled to the file (a hot journal, or uncommitted WAL
    frames); the mount stays. Opening the database again rolls it back, and writing goes on."""
    db = mnt_dir / "db.sqlite"
    seed = random.randrange(1 << 30)
    victim = random.randrange(5, 30)
    print(f"seed {seed}, killed in transaction {victim}")
    work = Workload(db, journal_mode, seed, tmp_path / "stop", kill_self_in=victim)
    assert work.finish() == -9, f"seed {seed}: the workload did not die by SIGKILL:\n{work.output()}"
    assert work.opened == victim and work.committed == victim - 1, work.output()
    if journal_mode == "delete":
        assert os.path.getsize(f"{db}-journal") > 0  # hot: the killed transaction had written into the database
    check(db, victim - 1)

    again = Workload(db, journal_mode, seed + 1, tmp_path / "stop")  # and it goes on from there
    try:
        again.wait_for(victim + 5)
        (tmp_path / "stop").touch()
        assert again.finish() == 0, again.output()
    finally:
        if again.proc.poll() is None:
            again.proc.kill()
    check(db, again.committed)
