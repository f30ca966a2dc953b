#!/bin/bash
# Per-hop profile of kvfs's cold paths (issue 24), on a `kvfs up` cluster of its own (3 chunk servers, 3 replicas)
# and a second mount of it that never saw the files; every kernel cache is dropped before the measured phase.
#
#   sudo benchmarks/cold_profile.sh meta [FILES]   # stat then unlink of FILES (3000) files made by the first mount
#   sudo benchmarks/cold_profile.sh read [READS]   # READS (3000) random 4 KiB preads of a 256 MiB file, from a
#                                                  # second mount without a read cache (--read-cache-mb 0)
#
# Prints rates, p50/p99 latencies and each process's CPU over the phases (from /proc/PID/stat). With PROFILE=spy
# (default) it also records py-spy (nonblocking, SPY_RATE Hz, default 250, raw collapsed stacks) of the second mount and of meta
# (meta) or the first chunk server (read); with PROFILE=strace it records `strace -c -f` of the second mount (per
# phase for meta) and of the chunk servers (read); PROFILE=none measures only. py-spy's shares of the non-idle
# samples by frame go to spy-*.top beside the raw stacks. Output stays in $OUT
# (default /tmp/kvfs-cold-profile/MODE). Needs root (dropping caches), /dev/fuse, the worktree's .venv;
# py-spy (`pip install py-spy` into .venv) for PROFILE=spy.
set -euo pipefail
MODE=${1:?usage: cold_profile.sh meta|read [COUNT]}
COUNT=${2:-3000}
PROFILE=${PROFILE:-spy}
OUT=${OUT:-/tmp/kvfs-cold-profile/$MODE}
PY=$PWD/.venv/bin/python
SPY=$PWD/.venv/bin/py-spy
rm -rf "$OUT"; mkdir -p "$OUT/mnt" "$OUT/mnt2"

MOUNT2_OPTS=()
[ "$MODE" = read ] && MOUNT2_OPTS=(--read-cache-mb 0)
"$PY" -m kvfs up --data "$OUT/data" --mount "$OUT/mnt" --chunkservers 3 --replicas 3 > "$OUT/up.log" 2>&1
setsid "$PY" -m kvfs mount "${MOUNT2_OPTS[@]}" --config "$OUT/data/client.toml" "$OUT/mnt2" > "$OUT/mount2.log" 2>&1 &
MOUNT2=$!
cleanup() {
    fusermount -u "$OUT/mnt2" 2>/dev/null || true
    wait "$MOUNT2" 2>/dev/null || true
    "$PY" -m kvfs down --data "$OUT/data" > "$OUT/down.log" 2>&1 || true
}
trap cleanup EXIT
for _ in $(seq 120); do mountpoint -q "$OUT/mnt2" && break; sleep 0.5; done
mountpoint -q "$OUT/mnt2"
{ for f in "$OUT"/data/run/*.pid; do echo "$(basename "$f" .pid) $(cat "$f")"; done; echo "mount2 $MOUNT2"; } \
    > "$OUT/pids.txt"
pid_of() { awk -v n="$1" '$1==n {print $2}' "$OUT/pids.txt"; }
cpu_ticks() { while read -r name pid; do echo "$name $(awk '{print $14+$15}' "/proc/$pid/stat")"; done < "$OUT/pids.txt"; }

if [ "$MODE" = meta ]; then
    mkdir "$OUT/mnt/d"
    "$PY" -c 'import os, sys
for i in range(int(sys.argv[2])): os.close(os.open(f"{sys.argv[1]}/f{i:05d}", os.O_CREAT | os.O_WRONLY, 0o644))' \
        "$OUT/mnt/d" "$COUNT"
    sleep 1  # what the first mount answered itself reaches meta within milliseconds
    SERVER=$(pid_of meta)
else
    dd if=/dev/urandom of="$OUT/mnt/big" bs=1M count=256 conv=fsync status=none
    SERVER=$(pid_of cs1)
fi
sync; echo 3 > /proc/sys/vm/drop_caches

RECORDERS=()
if [ "$PROFILE" = spy ]; then
    for who in mount2 "$([ "$MODE" = meta ] && echo meta || echo cs1)"; do
        "$SPY" record --pid "$(pid_of "$who")" --format raw --nonblocking -r "${SPY_RATE:-250}" -d 120 -o "$OUT/spy-$who.txt" \
            > /dev/null 2>&1 &
        RECORDERS+=($!)
    done
    sleep 1
elif [ "$PROFILE" = strace ] && [ "$MODE" = read ]; then
    strace -c -f -p "$MOUNT2" -o "$OUT/strace-mount2.txt" & RECORDERS+=($!)
    # shellcheck disable=SC2046
    strace -c -f $(for n in cs1 cs2 cs3; do echo -p "$(pid_of $n)"; done) -o "$OUT/strace-cs.txt" & RECORDERS+=($!)
    sleep 1
fi

cpu_ticks > "$OUT/cpu0.txt"
"$PY" - "$MODE" "$OUT" "$COUNT" "$MOUNT2" "$PROFILE" <<'PYTHON'
import os, random, subprocess, sys, time

mode, out, count, mount2, profile = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]


def timed(label, unit, ops):
    strace = None
    if profile == "strace" and mode == "meta":  # one strace per phase: syscalls per stat and per unlink
        strace = subprocess.Popen(["strace", "-c", "-f", "-p", mount2, "-o", f"{out}/strace-{label}.txt"])
        time.sleep(1)
    took, start = [], time.perf_counter()
    for op in ops:
        t0 = time.perf_counter_ns()
        op()
        took.append(time.perf_counter_ns() - t0)
    rate = len(took) / (time.perf_counter() - start)
    if strace is not None:
        strace.send_signal(2)
        strace.wait()
    took.sort()
    print(f"{label} {rate:,.0f} {unit}  p50 {took[len(took) // 2] / 1e3:,.0f} us  "
          f"p99 {took[len(took) * 99 // 100] / 1e3:,.0f} us", flush=True)


if mode == "meta":
    names = [f"{out}/mnt2/d/f{i:05d}" for i in range(count)]
    timed("stat_cold", "ops/s", [lambda p=p: os.stat(p) for p in names])
    timed("unlink_cold", "ops/s", [lambda p=p: os.unlink(p) for p in names])
else:
    fd = os.open(f"{out}/mnt2/big", os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    offsets = [random.randrange(256 * 256) * 4096 for _ in range(count)]
    timed("randread_cold", "IOPS", [lambda o=o: os.pread(fd, 4096, o) for o in offsets])
PYTHON
cpu_ticks > "$OUT/cpu1.txt"
for pid in "${RECORDERS[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
for pid in "${RECORDERS[@]}"; do wait "$pid" 2>/dev/null || true; done
PHASES=$([ "$MODE" = meta ] && echo 2 || echo 1)
paste "$OUT/cpu0.txt" "$OUT/cpu1.txt" | awk -v n="$((COUNT * PHASES))" -v hz="$(getconf CLK_TCK)" \
    '{printf "%-7s %6.2f CPU-s  %5.0f CPU-us per operation\n", $1, ($4-$2)/hz, ($4-$2)/hz*1e6/n}'
if [ "$PROFILE" = spy ]; then
    # Shares of the non-idle samples by frame (py-spy --nonblocking also samples threads parked in a wait).
    for f in "$OUT"/spy-*.txt; do
        python3 - "$f" > "${f%.txt}.top" <<'PYTHON'
import collections, sys
IDLE = ("Condition.wait", "get_events", "_thread_cache.py:211", "Workers._work", "Event.wait (threading", "select (")
own, within, total = collections.Counter(), collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    frames = stack.split(";")
    if any(idle in frames[-1] for idle in IDLE):
        continue
    total += int(n)
    own[frames[-1]] += int(n)
    for frame in set(frames):
        within[frame] += int(n)
print(f"{total} non-idle samples\n-- own time")
for frame, n in own.most_common(25):
    print(f"{100 * n / total:5.1f}% {frame}")
print("-- within")
for frame, n in within.most_common(60):
    print(f"{100 * n / total:5.1f}% {frame}")
PYTHON
    done
fi
echo "profiles and logs in $OUT"
