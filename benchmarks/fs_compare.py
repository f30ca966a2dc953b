#!/usr/bin/env python3
"""Compare kvfs with MooseFS and a plain local directory: the same fio jobs and metadata loop on all three, and
the metadata loop on an in-memory pyfuse3 filesystem (the floor under kvfs's metadata rows).

    sudo .venv/bin/python benchmarks/fs_compare.py [--size 256M] [--runtime 12] [--files 5000] [--cold-size 1G]
                                                    [--only ROW,ROW]
                                                    [--meta-rounds 3] [--no-kvfs-fsync | --kvfs-write-through]
                                                    [--skip-kvfs] [--skip-moosefs] [--skip-local] [--skip-pyfuse3]
                                                    [--repeat 1] [--install] [--keep] [--json-out FILE]

Targets, one after the other (each is set up, measured and torn down before the next starts, so idle
daemons of one do not steal CPU from another on a small machine). ``--repeat N`` runs them all N times, in
the listed order on odd passes and in reverse on even ones, each pass on freshly set-up targets: the tables
then show each figure's median over the passes, and a third table kvfs/MooseFS in every pass, since on a
shared VM the machine itself speeds up and slows down by tens of percent from one minute to the next.

* ``local``   a directory under the work dir (same disk as the other two targets' data);
* ``pyfuse3`` ``benchmarks/memfs.py``: an in-memory filesystem on pyfuse3 and trio with the kvfs mount's options
  and kernel timeouts, metadata loop only: what FUSE, pyfuse3 and trio alone cost per operation, the floor
  under kvfs's metadata rows (no fio: it keeps no data);
* ``kvfs``    ``kvfs up`` on a temp data dir: mgmtd, meta, 3 chunk servers, chains of 3 replicas, FUSE mount;
* ``moosefs`` Debian's moosefs packages: mfsmaster and 3 mfschunkserver (goal 3, trash time 0), in a
  network namespace of this script's own (``kvfsbench-mfs``; a veth pair 10.231.0.1/24 on the host side,
  10.231.0.2/24 inside; MooseFS chunk servers refuse a master on 127.0.0.0/8), mounted on the host with
  mfsmount.  The daemons run at nice 0 like kvfs's (MooseFS defaults to -19) and the veth MTU is 65535
  like loopback's, so neither system gets a head start from the set-up.

fio jobs (``--output-format=json``, psync, direct=0, one job, fallocate=none):

* ``seqwrite``       1 MiB sequential writes over a SIZE file, time based (RUNTIME s, wrapping around);
* ``seqwrite+fsync`` the same with ``end_fsync=1`` (the final flush is part of the time);
* ``seqread``        1 MiB sequential reads of that file for RUNTIME s, every pass cold: ``loops`` with
  ``invalidate=1`` makes fio reopen the file and drop its cached pages before each pass (``time_based``
  would wrap within one open and, after the first pass, measure the page cache);
* ``randread``       4 KiB random reads for RUNTIME s, the same way: each pass reads every block once, in
  random order, from a cold page cache; fio advises the kernel the access is random (no readahead);
* ``randread_cold``  the same over a file of ``--cold-size`` (1 GiB: four times the kvfs mount's read cache,
  more than the chunk servers hold in memory), laid out first, then every kernel cache dropped
  (``sync; echo 3 > /proc/sys/vm/drop_caches``): the random reads of a dataset larger than the caches;
* ``randwrite``      4 KiB random writes over a 64 MiB file for RUNTIME s (a database, a log, a build tree);
  ``randwrite_fsync32`` and ``randwrite_fsync1`` the same with an fsync every 32 writes and after every write.

What stays warm: the servers' own caches (MooseFS's chunk files in the host page cache; kvfs's chunk servers
write, and read large ranges, around it with O_DIRECT, so their 1 MiB reads come from the disk) and each
client's own read cache (mfsmount's; the kvfs mount's 64 KiB block cache, ``--read-cache-mb``, 256 MiB by
default), which fadvise cannot drop: random 4 KiB reads of a file that fits in them are mostly answered by the
client.

The metadata loop (``--files`` N, a child Python process with os calls, so a hung mount cannot hang the
script): create (open O_CREAT|O_EXCL + close), stat, unlink, each phase timed on its own, in a fresh dir;
``--meta-rounds`` times (3), and the table shows each phase's median round. The cold metadata rows: the
files are created through the mount, every kernel cache is dropped, and then each is stat-ed and unlinked
through a second mount of the same file system (a second ``kvfs mount`` or ``mfsmount``; the local directory
itself), which has looked at nothing yet, as a second host or a fresh mount meets them; their p50 and p99
latencies are printed beside the cold random reads'. ``--only ROWS`` measures some rows alone.

A second table gives the machine's busy CPU (``/proc/stat``: user, nice, system, irq, softirq) per GiB, per
random read or per metadata operation: every process and kernel thread of the target (its daemons, the
mount, fio, page-cache writeback) while the job ran. It tells a system that is CPU-bound apart from one that
waits (on the disk, or on wake-ups between processes), and how much CPU the other one needs for the same work.
``/proc/stat`` counts in clock ticks (10 ms): a phase that ends within a few tenths of a second (kvfs's stat
loop) gets a coarse figure.

One run at a time: a second run waits for the first's lock (``/run/lock/kvfs-fs_compare.lock``), so runs
never measure each other and the clean-up of a killed run's leftovers never touches a live run's daemons.
Every subprocess has a timeout; mounts are checked (mountinfo type and source, and a statfs that answers)
before they are used; everything started is torn down in a ``finally`` - unmount, stop daemons, delete the
namespace and veth pair - also on Ctrl-C, SIGTERM and SIGHUP (further signals during tear-down are
ignored with a note; every tear-down step is bounded).  Needs root (namespaces, FUSE mounts).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]

NETNS = "kvfsbench-mfs"
LOCK_PATH = "/run/lock/kvfs-fs_compare.lock" if os.path.isdir("/run/lock") else "/tmp/kvfs-fs_compare.lock"
VETH_HOST, VETH_NS = "kvfsb-h", "kvfsb-n"
HOST_IP, NS_IP, PREFIX = "10.231.0.1", "10.231.0.2", 24
MFS_MASTER_PORTS = {"ml": 9419, "cs": 9420, "cl": 9421}
MFS_CS_PORT0 = 9422
COLD_LOOPS = 1_000_000  # "until runtime ends" for the read jobs
MFS_PACKAGES = ["moosefs-master", "moosefs-chunkserver", "moosefs-client"]
MFS_TOOLS = ["mfsmaster", "mfschunkserver", "mfsmount", "mfssetgoal", "mfsgetgoal", "mfssettrashtime",
             "mfscheckfile"]

# (key, label, unit)
METRICS = [
    ("seqwrite", "seq write 1M", "MB/s"),
    ("seqwrite_fsync", "seq write 1M, end_fsync=1", "MB/s"),
    ("seqread", "seq read 1M (cold page cache)", "MB/s"),
    ("randread", "rand read 4K (cold page cache)", "IOPS"),
    ("randread_cold", "rand read 4K, all caches cold", "IOPS"),
    ("randwrite", "rand write 4K", "IOPS"),
    ("randwrite_fsync32", "rand write 4K, fsync=32", "IOPS"),
    ("randwrite_fsync1", "rand write 4K, fsync=1", "IOPS"),
    ("create", "create", "ops/s"),
    ("stat", "stat", "ops/s"),
    ("unlink", "unlink", "ops/s"),
    ("stat_cold", "stat, cold (second mount)", "ops/s"),
    ("unlink_cold", "unlink after it, cold", "ops/s"),
]
FIO_KEYS = ["seqwrite", "seqwrite_fsync", "seqread", "randread", "randread_cold", "randwrite", "randwrite_fsync32",
            "randwrite_fsync1"]
META_KEYS = ["create", "stat", "unlink"]
COLD_META_KEYS = ["stat_cold", "unlink_cold"]

# machine CPU per unit of work, stored as figures[key + "_cpu"]: per GiB moved, per random I/O, per operation
CPU_UNITS = {"MB/s": "CPU-s/GiB", "IOPS": "CPU-us/IO", "ops/s": "CPU-us/op"}
CPU_METRICS = [(key, label, CPU_UNITS[unit]) for key, label, unit in METRICS]
# latency percentiles, stored as figures[key + "_p50"] and figures[key + "_p99"] (microseconds)
LATENCY_METRICS = [(key, label, "us") for key, label, _ in METRICS if key in ("randread_cold", "stat_cold")]
RANDWRITE_SIZE = 64 << 20  # the random-write file: a database's or a build tree's working set, not a cache's


class BenchError(Exception):
    pass


def log(msg: str) -> None:
    with contextlib.suppress(OSError):  # a closed stdout (| head) must not stop a tear-down half-way
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def busy_cpu_seconds() -> float:
    """CPU time the whole machine spent busy so far (user, nice, system, irq, softirq; not idle, iowait or steal).
    Read around each job, it counts every process the job involves (mount, servers, fio, kernel threads):
    targets run one at a time, so the delta is that target's cost."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------------------- processes


def _killpg(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def run(cmd: list[str], timeout: float, check: bool = True, **kw: Any) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session with a timeout; kill its whole group on timeout or interruption."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, text=True, start_new_session=True, **kw)
    except OSError as e:
        raise BenchError(f"cannot run {cmd[0]}: {e}") from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _killpg(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=10)
        raise BenchError(f"timed out after {timeout:g}s: {' '.join(cmd)}") from None
    except BaseException:
        _killpg(proc)
        with contextlib.suppress(BaseException):
            proc.communicate(timeout=10)
        raise
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        tail = ((err or "") + (out or "")).strip()[-1500:]
        raise BenchError(f"exit status {proc.returncode}: {' '.join(cmd)}\n{tail}")
    return result


def stop_process(proc: subprocess.Popen | None, name: str, grace: float) -> None:
    """SIGTERM the process group, wait ``grace`` seconds, then SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    _killpg(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        log(f"  {name} ignored SIGTERM for {grace:g}s: killing it")
        _killpg(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@contextlib.contextmanager
def signals_deferred():
    """During tear-down: note further signals instead of dying half-way through."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.getsignal(s) for s in sigs}

    def note(signum: int, frame: Any) -> None:
        print(f"\n(signal {signum} ignored: tearing down, every step is time-bounded; please wait)",
              file=sys.stderr, flush=True)

    for s in sigs:
        signal.signal(s, note)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# -------------------------------------------------------------------------------------------- mounts


def mount_entry(path: Path) -> dict[str, str] | None:
    """The last mountinfo entry at ``path`` (fstype and source), or None."""
    target = os.path.abspath(path)
    found = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            parts, rparts = left.split(), right.split()
            if len(parts) > 4 and len(rparts) >= 2:
                mp = parts[4].encode().decode("unicode_escape")
                if mp == target:
                    found = {"fstype": rparts[0], "source": rparts[1].encode().decode("unicode_escape")}
    return found


def check_mounted(path: Path, fstype: str, source_prefix: str = "") -> None:
    """Raise unless a FUSE mount of the expected type/source is at ``path`` and answers statfs."""
    entry = mount_entry(path)
    if entry is None:
        raise BenchError(f"{path} is not mounted")
    if entry["fstype"] != fstype or not entry["source"].startswith(source_prefix):
        raise BenchError(f"{path} has {entry['fstype']} from {entry['source']}, expected {fstype} "
                         f"from {source_prefix or 'anything'}")
    run(["stat", "-f", str(path)], timeout=15)  # a hung daemon shows here, in a child, not in us


def lazy_unmount(path: Path) -> None:
    for cmd in (["fusermount3", "-u", "-z"], ["fusermount", "-u", "-z"], ["umount", "-l"]):
        if mount_entry(path) is None:
            return
        if shutil.which(cmd[0]):
            with contextlib.suppress(BenchError):
                run([*cmd, str(path)], timeout=20, check=False)


def unmount(path: Path, what: str) -> None:
    """Clean unmount (so data is flushed), then lazily if that failed or hung."""
    if mount_entry(path) is None:
        return
    try:
        run(["fusermount3", "-u", str(path)] if shutil.which("fusermount3") else ["umount", str(path)],
            timeout=30)
    except BenchError as e:
        log(f"  clean unmount of {what} failed ({e}); unmounting lazily")
    lazy_unmount(path)
    if mount_entry(path) is not None:
        log(f"  WARNING: {path} is still mounted")


def wait_for(pred: Callable[[], bool], timeout: float, what: str, alive: Callable[[], bool] = lambda: True,
             interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if not alive():
            raise BenchError(f"{what}: the process exited")
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: not within {timeout:g}s")
        time.sleep(interval)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie counts as gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------- benchmarks


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([kmgt]?)i?b?", text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 256M, 1G)")
    return int(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " ")


def fio_jobs(size: int, runtime: int, cold_size: int) -> list[tuple[str, list[str]]]:
    common = [f"--size={size}", f"--runtime={runtime}"]
    randwrite = ["--filename=fio-randwrite", "--rw=randwrite", "--bs=4k", f"--size={RANDWRITE_SIZE}",
                 "--time_based", f"--runtime={runtime}"]
    return [
        ("seqwrite", ["--name=seqwrite", "--filename=fio-seqwrite", "--rw=write", "--bs=1M", "--time_based",
                      "--end_fsync=0", *common]),
        ("seqwrite_fsync", ["--name=seqwrite_fsync", "--filename=fio-data", "--rw=write", "--bs=1M",
                            "--time_based", "--end_fsync=1", *common]),
        # loops + invalidate instead of time_based: fio reopens the file and drops its cached pages before
        # every pass, so each pass is cold (time_based wraps inside one open and re-reads the page cache);
        # runtime still ends the job
        ("seqread", ["--name=seqread", "--filename=fio-data", "--rw=read", "--bs=1M", "--invalidate=1",
                     f"--loops={COLD_LOOPS}", *common]),
        ("randread", ["--name=randread", "--filename=fio-data", "--rw=randread", "--bs=4k", "--invalidate=1",
                      f"--loops={COLD_LOOPS}", *common]),
        # a file several times the client's own read cache, read after every kernel cache was dropped
        # (run_fio lays it out and drops them first): what a dataset larger than the caches meets
        ("randread_cold", ["--name=randread_cold", "--filename=fio-cold", "--rw=randread", "--bs=4k",
                           "--invalidate=1", f"--loops={COLD_LOOPS}", f"--size={cold_size}",
                           f"--runtime={runtime}"]),
        ("randwrite", ["--name=randwrite", *randwrite]),
        ("randwrite_fsync32", ["--name=randwrite_fsync32", "--fsync=32", *randwrite]),
        ("randwrite_fsync1", ["--name=randwrite_fsync1", "--fsync=1", *randwrite]),
    ]


def drop_caches() -> None:
    """Write back and drop the kernel's page, dentry and inode caches (root only): what a cold start meets."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def run_fio(directory: Path, out_dir: Path, tag: str, args: argparse.Namespace, figures: dict[str, float],
            details: dict[str, Any]) -> bool:
    """The selected fio jobs on ``directory``; figures and details are filled in as each job ends.  False if a
    job timed out (the filesystem looks hung: the rest would only time out too)."""
    size, runtime = args.size, args.runtime
    fio = ["fio", "--output-format=json", "--ioengine=psync", "--direct=0", "--numjobs=1", "--fallocate=none",
           f"--directory={directory}"]
    for key, job_args in fio_jobs(size, runtime, args.cold_size):
        if key not in args.only:
            continue
        out = out_dir / f"fio-{tag}-{key}.json"
        cmd = [*fio, f"--output={out}", *job_args]
        # layout of the read file (if the write left it short) + the run + the final fsync: generous bound
        timeout = 3 * runtime + 120 + max(size, args.cold_size) / 5e6
        log(f"  fio {key} ...")
        try:
            if key == "randread_cold":
                if os.geteuid() != 0:
                    raise BenchError("needs root to drop the kernel's caches")
                log(f"    laying out a {args.cold_size / 2**20:,.0f} MiB file, then dropping every kernel cache")
                run([*fio, "--name=layout", "--filename=fio-cold", "--rw=write", "--bs=1M", "--end_fsync=1",
                     f"--size={args.cold_size}", f"--output={out_dir / f'fio-{tag}-layout.json'}"], timeout=timeout)
                drop_caches()
            cpu0 = busy_cpu_seconds()
            r = run(cmd, timeout=timeout, check=False)
            cpu = busy_cpu_seconds() - cpu0
            text = out.read_text(errors="replace") if out.exists() else ""
            try:  # fio may put notes before the JSON document
                job = json.loads(text[text.find("{"):])["jobs"][0]
            except (ValueError, KeyError, IndexError):
                raise BenchError(f"fio wrote no usable JSON (exit {r.returncode}): "
                                 f"{(r.stderr or r.stdout or text).strip()[-800:]}") from None
            if job.get("error"):
                raise BenchError(f"fio job error {job['error']}: {(r.stderr or '').strip()[-800:]}")
            side = job["write"] if "write" in key else job["read"]
            random = key.startswith("rand")
            value = side["iops"] if random else side["bw_bytes"] / 1e6
            figures[key] = value
            if side["io_bytes"]:
                figures[key + "_cpu"] = (cpu / side["total_ios"] * 1e6 if random
                                         else cpu / (side["io_bytes"] / 2**30))
            percentiles = side.get("clat_ns", {}).get("percentile", {})
            figures[key + "_p50"] = percentiles.get("50.000000", 0) / 1e3
            figures[key + "_p99"] = percentiles.get("99.000000", 0) / 1e3
            details[key] = {
                "busy_cpu_s": cpu, "io_bytes": side["io_bytes"], "runtime_ms": side["runtime"], "bw_bytes": side["bw_bytes"],
                "iops": side["iops"], "clat_mean_us": side.get("clat_ns", {}).get("mean", 0) / 1e3,
                "clat_p50_us": figures[key + "_p50"], "clat_p99_us": figures[key + "_p99"],
            }
            unit = "IOPS" if random else "MB/s"
            log(f"    {value:,.1f} {unit} ({side['io_bytes'] / 2**20:,.0f} MiB in {side['runtime'] / 1e3:.1f} s, "
                f"mean latency {details[key]['clat_mean_us']:,.0f} us, p99 {figures[key + '_p99']:,.0f} us)")
        except BenchError as e:
            log(f"    FAILED: {e}")
            details[key] = {"error": str(e)}
            if str(e).startswith("timed out"):
                log(f"    {tag} looks hung: skipping its remaining jobs")
                return False
        if key == "seqwrite":
            remove(directory / "fio-seqwrite")
    for name in ("fio-data", "fio-cold", "fio-randwrite"):
        remove(directory / name)
    return True


def remove(path: Path) -> None:
    """rm in a child with a timeout: an unlink on a hung mount must not hang the script."""
    with contextlib.suppress(BenchError):
        run(["rm", "-f", str(path)], timeout=120)


def meta_worker(directory: str, files: int) -> None:
    """Child mode: the metadata loop, one JSON line on stdout."""
    d = os.path.join(directory, f"meta-{os.getpid()}")
    os.mkdir(d)
    names = [os.path.join(d, f"f{i:05d}") for i in range(files)]
    out: dict[str, float] = {}
    phases = [
        ("create", lambda p: os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))),
        ("stat", os.stat),
        ("unlink", os.unlink),
    ]
    for phase, op in phases:
        start, cpu = time.perf_counter(), busy_cpu_seconds()
        for p in names:
            op(p)
        out[phase] = files / (time.perf_counter() - start)
        out[phase + "_cpu"] = (busy_cpu_seconds() - cpu) / files * 1e6
    os.rmdir(d)
    print(json.dumps(out))


def meta_cold_worker(create_dir: str, cold_dir: str, files: int) -> None:
    """Child mode: files created through one mount, every kernel cache dropped, then stat and unlink of each
    through ``cold_dir`` (the same directory seen by a second mount that never looked at it; for a local disk
    the same directory). One JSON line on stdout: rates, CPU per op, and stat's latency percentiles."""
    name = f"meta-cold-{os.getpid()}"
    made = os.path.join(create_dir, name)
    os.mkdir(made)
    for i in range(files):
        os.close(os.open(os.path.join(made, f"f{i:05d}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    time.sleep(1.0)  # creates a mount answered itself reach the metadata service within milliseconds
    drop_caches()
    names = [os.path.join(cold_dir, name, f"f{i:05d}") for i in range(files)]
    out: dict[str, float] = {}
    for phase, op in (("stat_cold", os.stat), ("unlink_cold", os.unlink)):
        took: list[int] = []
        start, cpu = time.perf_counter(), busy_cpu_seconds()
        for p in names:
            t0 = time.perf_counter_ns()
            op(p)
            took.append(time.perf_counter_ns() - t0)
        out[phase] = files / (time.perf_counter() - start)
        out[phase + "_cpu"] = (busy_cpu_seconds() - cpu) / files * 1e6
        took.sort()
        out[phase + "_p50"] = took[len(took) // 2] / 1e3
        out[phase + "_p99"] = took[min(len(took) - 1, len(took) * 99 // 100)] / 1e3
    os.rmdir(os.path.join(cold_dir, name))
    print(json.dumps(out))


def run_meta_cold(directory: Path, cold_dir: Path, files: int, figures: dict[str, float]) -> None:
    log(f"  cold metadata: {files:,} files created, caches dropped, stat and unlink through {cold_dir.parent.name}")
    try:
        r = run([sys.executable, os.path.abspath(__file__), "--meta-cold-worker", str(directory), str(cold_dir),
                 str(files)], timeout=max(300.0, files * 0.3))
        found = json.loads(r.stdout.strip().splitlines()[-1])
    except (BenchError, ValueError, IndexError) as e:
        log(f"    FAILED: {e}")
        return
    log("    " + ", ".join(f"{k} {found[k]:,.0f}/s (p50 {found[k + '_p50']:,.0f} us, p99 {found[k + '_p99']:,.0f} us)"
                          for k in COLD_META_KEYS))
    figures.update(found)


def run_meta(directory: Path, files: int, rounds: int, figures: dict[str, float]) -> None:
    """The metadata loop ``rounds`` times; each phase's figure is the median round (single runs on a small,
    shared machine move by a third from one to the next)."""
    log(f"  metadata loop: create/stat/unlink of {files:,} files, {rounds} round(s) ...")
    found: list[dict[str, float]] = []
    for _ in range(rounds):
        try:
            r = run([sys.executable, os.path.abspath(__file__), "--meta-worker", str(directory), str(files)],
                    timeout=max(300.0, files * 0.2))
            found.append(json.loads(r.stdout.strip().splitlines()[-1]))
        except (BenchError, ValueError, IndexError) as e:
            log(f"    FAILED: {e}")
            return
        log("    " + ", ".join(f"{k} {v:,.0f}/s ({found[-1][k + '_cpu']:,.0f} CPU-us/op)"
                              for k, v in found[-1].items() if not k.endswith("_cpu")))
    figures.update({k: statistics.median(f[k] for f in found) for k in found[0]})


# ------------------------------------------------------------------------------------------ targets


class Target:
    name = "?"
    has_data = True  # fio runs on it

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        self.work = work
        self.args = args
        self.notes: list[str] = []

    def unavailable(self) -> str | None:
        """Why this target cannot run here (with what to do about it), or None."""
        return None

    def setup(self) -> Path:
        raise NotImplementedError

    def second_view(self, directory: Path) -> Path | None:
        """``directory`` as a second client of the same file system sees it, one that has looked at nothing
        yet (for the cold metadata rows), or None where there is no such thing."""
        return None

    def teardown(self) -> None:
        pass


class LocalTarget(Target):
    name = "local"

    def setup(self) -> Path:
        d = self.work / "local"
        d.mkdir(parents=True, exist_ok=True)
        fs = run(["stat", "-f", "-c", "%T", str(d)], timeout=15).stdout.strip()
        self.notes.append(f"local dir {d} ({fs})")
        return d

    def second_view(self, directory: Path) -> Path | None:
        return directory  # one kernel: dropping its caches is as cold as a local disk gets


class KvfsTarget(Target):
    name = "kvfs"

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        super().__init__(work, args)
        self.data = work / "kvfs-data"
        self.mnt = work / "kvfs-mnt"
        self.mnt2 = work / "kvfs-mnt2"
        self.mount2: subprocess.Popen | None = None
        self.kvfs = self._kvfs_cmd()
        self.durability = ["--fsync", "--write-through"] if args.kvfs_write_through else [
            "--fsync" if args.kvfs_fsync else "--no-fsync"]

    @staticmethod
    def _kvfs_cmd() -> list[str] | None:
        venv_python = REPO / ".venv" / "bin" / "python"
        if venv_python.exists():
            return [str(venv_python), "-m", "kvfs"]
        try:
            import kvfs  # noqa: F401
            return [sys.executable, "-m", "kvfs"]
        except ImportError:
            return [exe] if (exe := shutil.which("kvfs")) else None

    def unavailable(self) -> str | None:
        if self.kvfs is None:
            return f"kvfs not found (no {REPO}/.venv, not importable, not on PATH): make the venv first"
        if not os.path.exists("/dev/fuse"):
            return "no /dev/fuse"
        return None

    def _clean_stale(self) -> None:
        """kvfs clusters of this script's earlier runs killed with SIGKILL: ``kvfs down`` each one (no other run
        is alive: main holds the run lock)."""
        stale = set()
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                m = re.search(rb"\x00(/[^\x00]*/fs_compare-[^/\x00]+/(?:pass\d+/)?kvfs-data)/cluster\.toml\x00",
                              (proc / "cmdline").read_bytes())
                if m and Path(m.group(1).decode()) != self.data:
                    stale.add(m.group(1).decode())
        for data in sorted(stale):
            log(f"  stale kvfs cluster of an earlier run at {data}: kvfs down")
            with contextlib.suppress(BenchError):
                run([*self.kvfs, "down", "--data", data], timeout=90, cwd=str(REPO))

    def setup(self) -> Path:
        self._clean_stale()
        self.mnt.mkdir(parents=True, exist_ok=True)
        log("  kvfs up (3 chunk servers, 3 replicas) ...")
        r = run([*self.kvfs, "up", "--data", str(self.data), "--mount", str(self.mnt), "--chunkservers", "3",
                 "--replicas", "3", *self.durability], timeout=180, cwd=str(REPO))
        for line in r.stdout.strip().splitlines():
            log(f"    {line}")
        check_mounted(self.mnt, "fuse.kvfs")
        d = self.mnt / "bench"
        run(["mkdir", "-p", str(d)], timeout=30)
        return d

    def second_view(self, directory: Path) -> Path | None:
        """A second ``kvfs mount`` of the cluster, as another host's client would have it."""
        assert self.kvfs is not None
        self.mnt2.mkdir(parents=True, exist_ok=True)
        with open(self.data / "logs" / "mount2.log", "ab") as out:
            self.mount2 = m = subprocess.Popen(
                [*self.kvfs, "mount", "--config", str(self.data / "client.toml"), str(self.mnt2)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, cwd=str(REPO))
        wait_for(lambda: mount_entry(self.mnt2) is not None, 60, "a second kvfs mount", alive=lambda: m.poll() is None)
        check_mounted(self.mnt2, "fuse.kvfs")
        return self.mnt2 / directory.relative_to(self.mnt)

    def teardown(self) -> None:
        if self.mount2 is not None:
            unmount(self.mnt2, "the second kvfs mount")
            stop_process(self.mount2, "the second kvfs mount", 20)
        if (self.data / "local.json").exists():
            log("  kvfs down ...")
            try:
                run([*self.kvfs, "down", "--data", str(self.data)], timeout=90, cwd=str(REPO))
            except BenchError as e:
                log(f"  kvfs down failed: {e}")
        if mount_entry(self.mnt) is not None:
            log("  kvfs mount still there after kvfs down: unmounting lazily")
            lazy_unmount(self.mnt)
        self._kill_leftovers()
        self.scan_logs()

    def _kill_leftovers(self) -> None:
        """Processes kvfs down missed: only pids from our pid files whose command line names our config."""
        config = str(self.data / "cluster.toml").encode()
        for pidfile in (self.data / "run").glob("*.pid"):
            with contextlib.suppress(OSError, ValueError):
                pid = int(pidfile.read_text())
                if config in Path(f"/proc/{pid}/cmdline").read_bytes():
                    log(f"  killing leftover kvfs process {pidfile.stem} (pid {pid})")
                    os.killpg(pid, signal.SIGKILL)

    def scan_logs(self) -> None:
        """Product-side findings: ERROR / Traceback lines in the kvfs logs, summarised into the notes."""
        errors = re.compile(r"\b(ERROR|CRITICAL|Traceback|Exception)\b")
        warnings = re.compile(r"\bWARNING\b")
        for logfile in sorted((self.data / "logs").glob("*.log")):
            with contextlib.suppress(OSError):
                lines = logfile.read_text(errors="replace").splitlines()
                errs = [ln for ln in lines if errors.search(ln)]
                warns = [ln for ln in lines if warnings.search(ln)]
                if errs or warns:
                    first = (errs or warns)[0].strip()[:300]
                    self.notes.append(f"kvfs logs/{logfile.name}: {len(errs)} ERROR/Traceback and {len(warns)} "
                                      f"WARNING lines, first: {first}")
        if not any(n.startswith("kvfs logs/") for n in self.notes):
            self.notes.append("kvfs logs: no ERROR/Traceback/WARNING lines")


class PyfuseTarget(Target):
    """benchmarks/memfs.py: the metadata rows' floor (see the module docstring)."""

    name = "pyfuse3"
    has_data = False

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        super().__init__(work, args)
        self.mnt = work / "memfs-mnt"
        self.proc: subprocess.Popen | None = None
        self.python = KvfsTarget._kvfs_cmd()

    def unavailable(self) -> str | None:
        if self.python is None:
            return "kvfs's venv not found (pyfuse3 comes with it): make the venv first"
        if not os.path.exists("/dev/fuse"):
            return "no /dev/fuse"
        return None

    def setup(self) -> Path:
        assert self.python is not None
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.proc = proc = subprocess.Popen([self.python[0], str(REPO / "benchmarks" / "memfs.py"), str(self.mnt)],
                                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, start_new_session=True)
        wait_for(lambda: mount_entry(self.mnt) is not None, 30, "memfs", alive=lambda: proc.poll() is None)
        check_mounted(self.mnt, "fuse", "memfs")
        return self.mnt

    def teardown(self) -> None:
        if self.proc is not None:
            _killpg(self.proc, signal.SIGTERM)
            stop_process(self.proc, "memfs", 10)
        if mount_entry(self.mnt) is not None:
            unmount(self.mnt, "memfs")


class MooseFSTarget(Target):
    name = "moosefs"

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        super().__init__(work, args)
        self.root = work / "moosefs"
        self.mnt = work / "moosefs-mnt"
        self.master: subprocess.Popen | None = None
        self.chunkservers: list[subprocess.Popen] = []
        self.mount_proc: subprocess.Popen | None = None
        self.mnt2 = work / "moosefs-mnt2"
        self.mount2: subprocess.Popen | None = None
        self.made_netns = False

    def unavailable(self) -> str | None:
        missing = [t for t in MFS_TOOLS if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]
        if missing:
            return (f"MooseFS tools missing ({', '.join(missing)}): apt-get install -y {' '.join(MFS_PACKAGES)} "
                    f"(or rerun with --install)")
        if shutil.which("ip") is None:
            return "iproute2 missing: apt-get install -y iproute2"
        if os.geteuid() != 0:
            return "needs root (network namespace, veth pair)"
        if not os.path.exists("/dev/fuse"):
            return "no /dev/fuse"
        return None

    # ---- namespace

    def _netns_exists(self) -> bool:
        r = run(["ip", "netns", "list"], timeout=15, check=False)
        return any(line.split()[0] == NETNS for line in r.stdout.splitlines() if line.strip())

    def _link_exists(self) -> bool:
        return run(["ip", "link", "show", VETH_HOST], timeout=15, check=False).returncode == 0

    def _remove_netns(self) -> None:
        """Kill what still runs in our namespace (ours by construction), delete it and the veth pair."""
        if self._netns_exists():
            r = run(["ip", "netns", "pids", NETNS], timeout=15, check=False)
            pids = [int(p) for p in r.stdout.split() if p.isdigit()]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    log(f"  killing pid {pid} left in netns {NETNS}")
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(BenchError):
                wait_for(lambda: not any(_alive(p) for p in pids), 10, "leftover MooseFS processes to exit")
            run(["ip", "netns", "del", NETNS], timeout=15, check=False)
        if self._link_exists():
            run(["ip", "link", "del", VETH_HOST], timeout=15, check=False)
        with contextlib.suppress(BenchError):
            wait_for(lambda: not self._link_exists(), 10, f"removal of {VETH_HOST}")

    def _clean_stale(self) -> None:
        """What a previous run of this script left behind if it was killed with SIGKILL."""
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            right = line.partition(" - ")[2].split()
            if len(right) >= 2 and right[1].encode().decode("unicode_escape").startswith(f"mfs#{NS_IP}:"):
                mp = Path(line.split()[4].encode().decode("unicode_escape"))
                log(f"  stale MooseFS mount of an earlier run at {mp}: unmounting lazily")
                lazy_unmount(mp)
        # an old mfsmount would reconnect to the new master (same address) with its old session and chunk
        # locks, and the new cluster's writes hang: kill mfsmount processes of this script's earlier runs
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError, ValueError):
                cmdline = (proc / "cmdline").read_bytes()
                mnt = rb"/fs_compare-[^/\x00]+/(?:pass\d+/)?moosefs-mnt"
                if cmdline.startswith(b"mfsmount") and re.search(mnt, cmdline):
                    log(f"  killing stale mfsmount of an earlier run (pid {proc.name})")
                    os.kill(int(proc.name), signal.SIGKILL)
        if self._netns_exists() or self._link_exists():
            log(f"  stale netns {NETNS} / {VETH_HOST} of an earlier run: removing")
            self._remove_netns()

    def _make_netns(self) -> None:
        taken = run(["ip", "-o", "addr", "show"], timeout=15).stdout
        if re.search(r"inet 10\.231\.0\.", taken):
            raise BenchError("10.231.0.0/24 is already in use on this host; not touching it")
        self.made_netns = True
        for cmd in (
            ["ip", "netns", "add", NETNS],
            ["ip", "link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NS],
            ["ip", "link", "set", VETH_NS, "netns", NETNS],
            ["ip", "addr", "add", f"{HOST_IP}/{PREFIX}", "dev", VETH_HOST],
            ["ip", "link", "set", VETH_HOST, "mtu", "65535", "up"],
            ["ip", "-n", NETNS, "addr", "add", f"{NS_IP}/{PREFIX}", "dev", VETH_NS],
            ["ip", "-n", NETNS, "link", "set", VETH_NS, "mtu", "65535", "up"],
            ["ip", "-n", NETNS, "link", "set", "lo", "up"],
        ):
            run(cmd, timeout=15)

    # ---- daemons

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        logf = open(self.root / f"{name}.log", "ab")
        try:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=str(self.root))
        finally:
            logf.close()

    def _log_tail(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.root / f"{name}.log").read_text(errors="replace")[-1200:]
        return ""

    def _write_configs(self) -> None:
        m = self.root / "master"
        m.mkdir(parents=True)
        (m / "mfsmaster.cfg").write_text("\n".join([
            "WORKING_USER = root", "WORKING_GROUP = root", f"DATA_PATH = {m}",
            f"EXPORTS_FILENAME = {m}/mfsexports.cfg", f"TOPOLOGY_FILENAME = {m}/mfstopology.cfg",
            f"MATOML_LISTEN_HOST = {NS_IP}", f"MATOML_LISTEN_PORT = {MFS_MASTER_PORTS['ml']}",
            f"MATOCS_LISTEN_HOST = {NS_IP}", f"MATOCS_LISTEN_PORT = {MFS_MASTER_PORTS['cs']}",
            f"MATOCL_LISTEN_HOST = {NS_IP}", f"MATOCL_LISTEN_PORT = {MFS_MASTER_PORTS['cl']}",
            "NICE_LEVEL = 0", "LOCK_MEMORY = 0", "",
        ]))
        (m / "mfsexports.cfg").write_text(f"{HOST_IP}/32 / rw,alldirs,admin,maproot=0:0\n")
        (m / "mfstopology.cfg").write_text("")
        empty = Path("/var/lib/mfs/metadata.mfs.empty")
        if empty.exists():
            shutil.copy(empty, m / "metadata.mfs")
        else:
            (m / "metadata.mfs").write_bytes(b"MFSM NEW")
        for i in range(1, 4):
            c = self.root / f"cs{i}"
            (c / "hdd").mkdir(parents=True)
            (c / "mfshdd.cfg").write_text(f"{c / 'hdd'}\n")
            (c / "mfschunkserver.cfg").write_text("\n".join([
                "WORKING_USER = root", "WORKING_GROUP = root", f"DATA_PATH = {c}",
                f"HDD_CONF_FILENAME = {c}/mfshdd.cfg", f"MASTER_HOST = {NS_IP}",
                f"MASTER_PORT = {MFS_MASTER_PORTS['cs']}", f"BIND_HOST = {NS_IP}",
                f"CSSERV_LISTEN_HOST = {NS_IP}", f"CSSERV_LISTEN_PORT = {MFS_CS_PORT0 + i - 1}",
                "NICE_LEVEL = 0", "LOCK_MEMORY = 0", "HDD_LEAVE_SPACE_DEFAULT = 1GiB", "",
            ]))

    def setup(self) -> Path:
        self._clean_stale()
        self.root.mkdir(parents=True, exist_ok=True)
        self._make_netns()
        self._write_configs()
        log(f"  netns {NETNS}: {HOST_IP} (host) <-> {NS_IP} (namespace); starting mfsmaster + 3 mfschunkserver")
        netns = ["ip", "netns", "exec", NETNS]
        self.master = self._spawn("master", [*netns, "mfsmaster", "-f", "-c",
                                             str(self.root / "master" / "mfsmaster.cfg"), "start"])
        master = self.master
        for port in (MFS_MASTER_PORTS["cs"], MFS_MASTER_PORTS["cl"]):
            wait_for(lambda: listening(NS_IP, port), 30, f"mfsmaster listening on {NS_IP}:{port}",
                     alive=lambda: master.poll() is None)
        for i in range(1, 4):
            cs = self._spawn(f"cs{i}", [*netns, "mfschunkserver", "-f", "-c",
                                        str(self.root / f"cs{i}" / "mfschunkserver.cfg"), "start"])
            self.chunkservers.append(cs)
            wait_for(lambda: listening(NS_IP, MFS_CS_PORT0 + i - 1), 30, f"mfschunkserver {i} listening",
                     alive=lambda: cs.poll() is None)
        ports = {MFS_CS_PORT0 + i for i in range(3)}
        wait_for(lambda: self._registered() >= ports, 60, "all 3 chunk servers registered with mfsmaster",
                 alive=lambda: master.poll() is None)
        self.mount_proc = self._mount(self.mnt, "mfsmount")
        run(["mfssetgoal", "-r", "3", str(self.mnt)], timeout=30)
        run(["mfssettrashtime", "-r", "0", str(self.mnt)], timeout=30)
        goal = run(["mfsgetgoal", str(self.mnt)], timeout=30).stdout.strip()
        if not goal.endswith(": 3"):
            raise BenchError(f"goal of the MooseFS root is not 3: {goal!r}")
        self._wait_three_copies()
        d = self.mnt / "bench"
        run(["mkdir", "-p", str(d)], timeout=30)
        return d

    def _mount(self, mnt: Path, name: str) -> subprocess.Popen:
        mnt.mkdir(parents=True, exist_ok=True)
        mp = self._spawn(name, ["mfsmount", str(mnt), "-f", "-H", NS_IP, "-P", str(MFS_MASTER_PORTS["cl"]),
                                "-o", "mfsnice=0"])
        try:
            wait_for(lambda: mount_entry(mnt) is not None, 30, name, alive=lambda: mp.poll() is None)
        except BenchError as e:
            raise BenchError(f"{e}; {name} log:\n{self._log_tail(name)}") from None
        check_mounted(mnt, "fuse", f"mfs#{NS_IP}:")
        return mp

    def second_view(self, directory: Path) -> Path | None:
        """A second mfsmount of the same master, as another host's client would have it."""
        self.mount2 = self._mount(self.mnt2, "mfsmount2")
        return self.mnt2 / directory.relative_to(self.mnt)

    def _registered(self) -> set[int]:
        """Chunk server ports the master logged a completed registration for."""
        text = ""
        with contextlib.suppress(OSError):
            text = (self.root / "master.log").read_text(errors="replace")
        return {int(p) for p in re.findall(rf"chunkserver register end .*ip: {re.escape(NS_IP)} / port: (\d+)", text)}

    def _wait_three_copies(self) -> None:
        """Until a freshly written file gets 3 valid copies: all 3 chunk servers registered, goal 3 in effect."""
        deadline = time.monotonic() + 60
        attempt = 0
        while True:
            attempt += 1
            probe = self.mnt / f".probe-{attempt}"
            run(["dd", "if=/dev/zero", f"of={probe}", "bs=64k", "count=1", "conv=fsync"], timeout=30)
            info = run(["mfscheckfile", str(probe)], timeout=30).stdout
            run(["rm", "-f", str(probe)], timeout=30)
            if re.search(r"chunks with 3 copies:\s+1\b", info):
                self.notes.append(f"MooseFS: 3 chunk servers, goal 3 verified (a probe file got 3 copies, "
                                  f"attempt {attempt})")
                return
            if time.monotonic() > deadline:
                raise BenchError(f"a MooseFS file did not get 3 copies within 60 s: {info.strip()}")
            time.sleep(1)

    def teardown(self) -> None:
        if self.mount2 is not None or mount_entry(self.mnt2) is not None:
            unmount(self.mnt2, "the second MooseFS mount")
            stop_process(self.mount2, "mfsmount2", 10)
        if self.mount_proc is not None or mount_entry(self.mnt) is not None:
            log("  unmounting MooseFS ...")
            unmount(self.mnt, "MooseFS")
            stop_process(self.mount_proc, "mfsmount", 10)
        for i, cs in enumerate(self.chunkservers, 1):
            _killpg(cs, signal.SIGTERM)
        for i, cs in enumerate(self.chunkservers, 1):
            stop_process(cs, f"mfschunkserver {i}", 20)
        if self.master is not None:
            log("  stopping MooseFS daemons ...")
            stop_process(self.master, "mfsmaster", 30)
        if self.made_netns:
            log(f"  deleting netns {NETNS} and veth {VETH_HOST}")
            self._remove_netns()
        for name in ("master", "cs1", "cs2", "cs3"):
            text = self._log_tail(name)
            errs = [ln for ln in text.splitlines() if re.search(r"error|can't|cannot|fail", ln, re.I)
                    and "open file limit" not in ln and "open files limit" not in ln]
            if errs:
                self.notes.append(f"MooseFS {name} log: {errs[-1].strip()[:200]}")


# -------------------------------------------------------------------------------------------- report


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:,.1f}"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def table(results: dict[str, dict[str, float]], metrics: list[tuple[str, str, str]] = METRICS,
          suffix: str = "", suffixes: bool = False) -> str:
    """Markdown table of ``metrics`` that some target measured; each figure is ``results[target][key + suffix]``
    (``suffixes``: the suffix is the label's last word, as in "..., p99")."""
    cols = ["kvfs", "moosefs", "local", "pyfuse3"]
    head = ["metric", "unit", "kvfs", "MooseFS", "local", "pyfuse3", "kvfs/MooseFS", "kvfs/local", "kvfs/pyfuse3"]
    rows = []
    for key, label, unit in metrics:
        vals = [results.get(c, {}).get(key + ("_" + label.rsplit(" ", 1)[1] if suffixes else suffix)) for c in cols]
        if all(v is None for v in vals):
            continue
        rows.append([label, unit, *(fmt(v) for v in vals), ratio(vals[0], vals[1]), ratio(vals[0], vals[2]),
                     ratio(vals[0], vals[3])])
    return markdown(head, rows, text_columns=2)


def markdown(head: list[str], rows: list[list[str]], text_columns: int) -> str:
    """An aligned markdown table: the first ``text_columns`` columns left-aligned, the figures right-aligned."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i < text_columns else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(r, widths))) + " |"

    sep = "|" + "|".join("-" * (w + 2) if i < text_columns else "-" * (w + 1) + ":" for i, w in enumerate(widths))
    return "\n".join([line(head), sep + "|", *map(line, rows)])


def versions() -> dict[str, str]:
    out: dict[str, str] = {}
    with contextlib.suppress(Exception):
        out["kvfs"] = run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], timeout=10).stdout.strip()
    with contextlib.suppress(Exception):
        out["fio"] = run(["fio", "--version"], timeout=10).stdout.strip()
    with contextlib.suppress(Exception):
        r = run(["dpkg-query", "-W", "-f=${Version}", "moosefs-master"], timeout=10, check=False)
        out["moosefs"] = r.stdout.strip() or "not installed"
    return out


# ---------------------------------------------------------------------------------------------- main


def measure_target(target: Target, args: argparse.Namespace, work: Path, have_fio: bool,
                   results: dict[str, dict[str, float]], details: dict[str, Any], skipped: dict[str, str],
                   notes: list[str]) -> int:
    """Set up ``target``, run the fio jobs and the metadata loop on it into ``results[target.name]``, tear it
    down; returns the exit status to merge (1 when something failed). An unavailable target is noted in
    ``skipped`` and not tried again."""
    why = target.unavailable()
    if why:
        log(f"SKIPPING {target.name}: {why}")
        skipped[target.name] = why
        return 0
    log(f"== {target.name}")
    status = 0
    try:
        try:
            directory = target.setup()
        except BenchError as e:
            log(f"SKIPPING {target.name}: set-up failed: {e}")
            skipped[target.name] = f"set-up failed: {e}"
            return 1
        figures = results[target.name] = {}
        if have_fio and target.has_data and args.only & set(FIO_KEYS):
            details[target.name] = {}
            if not run_fio(directory, work, target.name, args, figures, details[target.name]):
                return 1  # (the finally below tears it down)
        if args.only & set(META_KEYS):
            run_meta(directory, args.files, args.meta_rounds, figures)
        if args.only & set(COLD_META_KEYS):
            if os.geteuid() != 0:
                log("  cold metadata rows: skipped, dropping the kernel's caches needs root")
            elif (cold := target.second_view(directory)) is not None:
                run_meta_cold(directory, cold, args.files, figures)
    finally:
        with signals_deferred():
            log(f"  tearing down {target.name}")
            try:
                target.teardown()
            except Exception as e:  # noqa: BLE001 - report, keep tearing down the rest
                log(f"  tear-down of {target.name} failed: {e}")
                status = 1
            notes += [f"{target.name}: {n}" for n in target.notes]
    return status


def median_results(passes: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each target's figures as the median over the passes that measured them."""
    out: dict[str, dict[str, float]] = {}
    for name in {name for p in passes for name in p}:
        keys = {k for p in passes for k in p.get(name, {})}
        out[name] = {k: statistics.median(p[name][k] for p in passes if k in p.get(name, {})) for k in keys}
    return out


def pass_ratios(passes: list[dict[str, dict[str, float]]]) -> str:
    """Markdown table of kvfs/MooseFS in every pass, and in how many kvfs was at or above."""
    head = ["metric", *(f"pass {i + 1}" for i in range(len(passes))), "at or above"]
    rows = []
    for key, label, _ in METRICS:
        ratios = [p["kvfs"][key] / p["moosefs"][key] if p.get("kvfs", {}).get(key) and p.get("moosefs", {}).get(key)
                  else None for p in passes]
        known = [r for r in ratios if r is not None]
        if not known:
            continue
        rows.append([label, *(f"{r:.2f}x" if r is not None else "-" for r in ratios),
                     f"{sum(r >= 1 for r in known)} of {len(known)}"])
    return markdown(head, rows, text_columns=1)


def install(packages: list[str]) -> None:
    log(f"apt-get install -y {' '.join(packages)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "install", "-y", *packages], timeout=900, env=env, stdout=None, stderr=None)


def durability(args: argparse.Namespace) -> str:
    if args.kvfs_write_through:
        return "flush every write (write-through)"
    return ("flush at fsync and every 5 s, holding whole-chunk writes in memory until then (write-back)"
            if args.kvfs_fsync else "never flush")


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--meta-worker":
        meta_worker(sys.argv[2], int(sys.argv[3]))
        return 0
    if len(sys.argv) == 5 and sys.argv[1] == "--meta-cold-worker":
        meta_cold_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=parse_size("256M"), help="fio file size (default 256M)")
    p.add_argument("--runtime", type=int, default=12, help="seconds per fio job (default 12)")
    p.add_argument("--cold-size", type=parse_size, default=parse_size("1G"),
                   help="file of the cold random-read row: several times the clients' read caches (kvfs's is "
                        "256 MiB by default) and the chunk servers' memory (default 1G)")
    p.add_argument("--only", type=lambda s: set(s.split(",")), default=None,
                   help="comma-separated rows to measure (default all): " + ",".join(k for k, _, _ in METRICS))
    p.add_argument("--files", type=int, default=5000, help="files in the metadata loop (default 5000)")
    p.add_argument("--meta-rounds", type=int, default=3,
                   help="metadata loops per target; the table shows the median (default 3)")
    p.add_argument("--skip-kvfs", action="store_true")
    p.add_argument("--kvfs-fsync", action=argparse.BooleanOptionalAction, default=True,
                   help="kvfs chunk servers flush at fsync and every few seconds (the default, write-back); "
                        "--no-kvfs-fsync never flushes, as MooseFS's chunk servers (HDD_FSYNC_BEFORE_CLOSE = 0)")
    p.add_argument("--kvfs-write-through", action="store_true",
                   help="kvfs chunk servers flush every write before acknowledging it")
    p.add_argument("--skip-moosefs", action="store_true")
    p.add_argument("--skip-local", action="store_true")
    p.add_argument("--skip-pyfuse3", action="store_true", help="leave out the in-memory pyfuse3 floor (memfs.py)")
    p.add_argument("--install", action="store_true", help="apt-get install fio and the moosefs packages if missing")
    p.add_argument("--workdir", type=Path, default=None, help="parent for the temp dir (default: $TMPDIR or /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (data, logs, fio JSON) afterwards")
    p.add_argument("--json-out", type=Path, default=None,
                   help="also write the figures as JSON here: results (the medians), passes and details (fio's "
                        "figures per job), one entry per pass")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every target this many times, alternating the order; the tables show medians")
    args = p.parse_args()
    if args.runtime < 1 or args.files < 1 or args.meta_rounds < 1 or args.repeat < 1 or args.size < 1 << 20:
        p.error("--runtime, --files, --meta-rounds and --repeat must be positive, --size at least 1M")
    known = {k for k, _, _ in METRICS}
    if args.only is None:
        args.only = known
    elif args.only - known:
        p.error(f"--only: unknown rows {', '.join(sorted(args.only - known))}; known: {', '.join(sorted(known))}")

    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)

    if args.install:
        missing = (["fio"] if shutil.which("fio") is None else [])
        if not args.skip_moosefs and any(shutil.which(t) is None and not Path("/usr/sbin", t).exists()
                                         for t in MFS_TOOLS):
            missing += MFS_PACKAGES
        if missing:
            install(missing)
    have_fio = shutil.which("fio") is not None
    if not have_fio:
        log("fio not found: apt-get install -y fio (or rerun with --install); running the metadata loop only")

    # One run at a time per machine: runs side by side would measure each other, MooseFS's namespace has one
    # name, and the clean-up of what a killed run left behind must never take a live run's daemons for that
    lock = open(LOCK_PATH, "w")  # noqa: SIM115 - held until the process exits
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log(f"another fs_compare run holds {LOCK_PATH}: waiting for it to end")
        fcntl.flock(lock, fcntl.LOCK_EX)
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fs_compare-", dir=args.workdir))
    classes = [cls for cls, skip in [(LocalTarget, args.skip_local), (PyfuseTarget, args.skip_pyfuse3),
                                     (KvfsTarget, args.skip_kvfs), (MooseFSTarget, args.skip_moosefs)] if not skip]
    notes: list[str] = []
    skipped: dict[str, str] = {}
    status = 0
    load0 = os.getloadavg()[0]
    log(f"work dir {work}; size {args.size / 2**20:g} MiB, runtime {args.runtime} s, {args.files:,} files; "
        f"load average {os.getloadavg()[0]:.2f}")
    passes: list[dict[str, dict[str, float]]] = []
    pass_details: list[dict[str, Any]] = []
    try:
        for n in range(args.repeat):
            if args.repeat > 1:
                log(f"=== pass {n + 1} of {args.repeat}")
            pass_work = work / f"pass{n + 1}" if args.repeat > 1 else work  # fresh targets every pass
            pass_work.mkdir(exist_ok=True)
            results: dict[str, dict[str, float]] = {}
            passes.append(results)
            pass_details.append({})
            for target in [cls(pass_work, args) for cls in (classes if n % 2 == 0 else classes[::-1])]:
                if target.name not in skipped:
                    status |= measure_target(target, args, pass_work, have_fio, results, pass_details[-1], skipped,
                                             notes)
    except KeyboardInterrupt:
        log("interrupted; everything started was torn down")
        status = 130
    finally:
        with signals_deferred():
            if args.keep:
                log(f"kept {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
    results = median_results([p for p in passes if p])
    print()
    repeated = f"; the median of {len(passes)} passes, the order alternating" if len(passes) > 1 else ""
    print(f"fs_compare: size {args.size / 2**20:g} MiB, runtime {args.runtime} s per fio job, "
          f"{args.files:,} files (median of {args.meta_rounds} rounds){repeated}; psync, direct=0, 1 job; "
          f"kvfs chunk servers {durability(args)}; "
          f"MB = 10^6 bytes; ratios > 1 mean kvfs is faster; "
          f"load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end ({os.cpu_count()} CPUs)")
    print(table(results))
    print()
    print("Machine CPU per unit of work (all processes and kernel threads, busy time from /proc/stat); "
          "here ratios > 1 mean kvfs spends more CPU:")
    print(table(results, CPU_METRICS, "_cpu"))
    if args.only & {k for k, _, _ in LATENCY_METRICS}:
        print()
        print("Latency of one cold operation, microseconds; here ratios > 1 mean kvfs takes longer:")
        print(table(results, [(k, f"{label}, {q}", "us") for k, label, _ in LATENCY_METRICS for q in ("p50", "p99")],
                    suffixes=True))
    if len(passes) > 1 and all("kvfs" in p and "moosefs" in p for p in passes):
        print()
        print("kvfs/MooseFS in each pass:")
        print(pass_ratios(passes))
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    for n in notes:
        print(f"note: {n}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    if args.json_out:
        args.json_out.write_text(json.dumps({"args": {"size": args.size, "runtime": args.runtime,
                                                      "files": args.files, "meta_rounds": args.meta_rounds,
                                                      "repeat": args.repeat},
                                             "results": results, "passes": passes,
                                             "details": pass_details,
                                             "skipped": skipped,
                                             "notes": notes, "versions": versions()}, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
