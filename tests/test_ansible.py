"""The Ansible rollout (ansible/), run for real: ansible-playbook over ssh into five namespace hosts.

Hosts (tests/netns_hosts.py: network namespaces on a bridge of the test's own, each with its own sshd):

    kvfs1  mgmtd, meta (SQLite), client mount
    kvfs2  chunk server, two targets          \
    kvfs3  chunk server, two targets           > replication 3: two chains
    kvfs4  chunk server, two targets          /
    kvfs5  client mount
    kvfs6  joins as a fourth chunk server through add_chunkserver.yml

Services run under start-stop-daemon (this machine has no systemd), with the same command lines the systemd
units get; the units are rendered and checked by ``systemd-analyze verify`` in a test of their own. The hosts
share this machine's /etc and package database, so packages and the service user are managed from kvfs1 only
(kvfs_manage_packages / kvfs_manage_user false elsewhere): apt or useradd on several of them at once would race
on the same files. Shared memory between mount and chunk servers is off, so bulk data crosses the bridge as it
would between real hosts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns_hosts import Host, Lab, missing_tools

REPO = Path(__file__).resolve().parent.parent
ANSIBLE = REPO / "ansible"
BIN = Path(sys.executable).parent
SERVICE_USER = "kvfstest"  # not "kvfs": the test creates and removes it, and must not touch a real one

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="namespaces, sshd and FUSE mounts need root"),
    pytest.mark.skipif(not (BIN / "ansible-playbook").exists(),
                       reason="ansible-core is not installed (pip install -e '.[test]')"),
]


def _tool(name: str) -> str:
    return str(BIN / name)


# ------------------------------------------------------------------------------------------------ lint and render


def test_ansible_lint_passes() -> None:
    """ansible-lint (production profile) on every playbook, role and inventory file."""
    if not (BIN / "ansible-lint").exists():
        pytest.fail("ansible-lint is not installed (it is in the test extra: pip install -e '.[test]')")
    env = {**os.environ, "ANSIBLE_HOME": str(REPO / ".pytest_cache" / "ansible-home"), "NO_COLOR": "1",
           "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    result = subprocess.run([_tool("ansible-lint"), "--offline", "--profile", "production", "--nocolor"],
                            cwd=ANSIBLE, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Passed" in result.stdout + result.stderr


RENDER_PLAYBOOK = """
- name: Render the kvfs templates as a host would get them
  hosts: render
  gather_facts: false
  vars:
    ansible_facts: {service_mgr: systemd}
  tasks:
    - name: Render the FoundationDB cluster file and server config
      ansible.builtin.template:
        src: "{{ repo }}/ansible/roles/foundationdb/templates/{{ item }}.j2"
        dest: "{{ out }}/{{ item }}"
        mode: "0644"
      loop: [fdb.cluster, foundationdb.conf]
      vars:
        kvfs_fdb_cluster_id: a1b2c3d4
    - name: Render every service's config and systemd unit
      ansible.builtin.include_tasks: "{{ out }}/one_unit.yml"
      loop: [mgmtd, meta, chunkserver, client]
      loop_control:
        loop_var: role
"""

RENDER_ONE = """
- name: Load the role's service description
  ansible.builtin.include_vars:
    file: "{{ repo }}/ansible/roles/{{ role }}/vars/main.yml"
- name: Render the config
  ansible.builtin.template:
    src: "{{ repo }}/ansible/templates/kvfs.toml.j2"
    dest: "{{ out }}/{{ role }}.toml"
    mode: "0644"
  vars:
    kvfs_config_role: "{{ role }}"
- name: Render the unit
  ansible.builtin.template:
    src: "{{ repo }}/ansible/templates/kvfs.service.j2"
    dest: "{{ out }}/{{ lookup('vars', role ~ '_unit').name }}.service"
    mode: "0644"
  vars:
    common_unit: "{{ lookup('vars', role ~ '_unit') }}"
- name: Keep the command line
  ansible.builtin.copy:
    content: "{{ lookup('vars', role ~ '_unit').argv | to_json }}"
    dest: "{{ out }}/{{ role }}.argv.json"
    mode: "0644"
"""


def test_templates_render(tmp_path: Path) -> None:
    """The FoundationDB role's templates, each service's config and systemd unit, rendered by Ansible itself for an
    FDB cluster of three servers. The configs load with kvfs's own loader, each unit's ExecStart is the command line
    start-stop-daemon runs, and systemd-analyze accepts the units."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "one_unit.yml").write_text(RENDER_ONE)
    (tmp_path / "render.yml").write_text(RENDER_PLAYBOOK)
    inventory = tmp_path / "inventory"
    (inventory / "group_vars").mkdir(parents=True)
    (inventory / "hosts.yml").write_text(textwrap.dedent("""
        kvfs:
          children:
            render: {hosts: {fdb1: {ansible_host: 10.1.0.1, kvfs_node_id: 7,
                                    kvfs_chunkserver_targets: [/srv/kvfs/disk0, /srv/kvfs/disk1]}}}
            mgmtd: {hosts: {fdb1: {}, fdb2: {ansible_host: 10.1.0.2}}}
            meta: {hosts: {fdb1: {}, fdb2: {}}}
            chunkserver: {hosts: {fdb1: {}}}
            foundationdb: {hosts: {fdb1: {}, fdb2: {}, fdb3: {ansible_host: 10.1.0.3}}}
        """))
    venv = REPO / ".venv"
    (inventory / "group_vars" / "kvfs.yml").write_text(textwrap.dedent(f"""
        ansible_connection: local
        ansible_python_interpreter: {sys.executable}
        kvfs_kv_engine: fdb
        kvfs_fdb_processes: 2
        kvfs_venv_dir: {venv if (venv / 'bin' / 'kvfs').exists() else BIN.parent}
        kvfs_mount_options: [--read-cache-mb, "512"]
        kvfs_timeouts: {{heartbeat_interval: 0.5, heartbeat_timeout: 3}}
        """))
    playbook = ANSIBLE / f".render-{os.getpid()}.yml"  # beside the playbooks, so group_vars/all.yml applies
    shutil.copy(tmp_path / "render.yml", playbook)
    try:
        result = subprocess.run(
            [_tool("ansible-playbook"), "-i", str(inventory / "hosts.yml"), str(playbook),
             "-e", f"repo={REPO} out={out}"],
            env={**os.environ, "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"),
                 "ANSIBLE_HOME": str(tmp_path / "ansible-home"), "ANSIBLE_NOCOLOR": "1", "KVFS_TOKEN": "t0ken"},
            capture_output=True, text=True, timeout=300, cwd=ANSIBLE)
    finally:
        playbook.unlink()
    assert result.returncode == 0, result.stdout + result.stderr

    assert (out / "fdb.cluster").read_text() == "kvfs:a1b2c3d4@10.1.0.1:4500,10.1.0.2:4500,10.1.0.3:4500\n"
    conf = (out / "foundationdb.conf").read_text()
    assert "public-address = 10.1.0.1:$ID" in conf
    assert "[fdbserver.4500]" in conf and "[fdbserver.4501]" in conf and "[fdbserver.4502]" not in conf
    assert "cluster-file = /etc/foundationdb/fdb.cluster" in conf

    import tomllib

    for role in ("mgmtd", "meta", "chunkserver", "client"):
        config = tomllib.loads((out / f"{role}.toml").read_text())
        assert config["kv_url"] == "fdb:///etc/foundationdb/fdb.cluster?api_version=710"
        assert config["mgmtd"] == ["10.1.0.1:7100", "10.1.0.2:7100"]
        assert config["meta"] == ["10.1.0.1:7200", "10.1.0.2:7200"]
        assert config["timeouts"] == {"heartbeat_interval": 0.5, "heartbeat_timeout": 3.0}
        assert config["chunkserver"]["targets"] == ["/srv/kvfs/disk0", "/srv/kvfs/disk1"]
        checked = subprocess.run([sys.executable, "-c", "import sys; from kvfs.config import load_config; "
                                  "load_config(sys.argv[1])", str(out / f"{role}.toml")], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr

    units = {}
    for role, name in (("mgmtd", "kvfs-mgmtd"), ("meta", "kvfs-meta"), ("chunkserver", "kvfs-chunkserver"),
                       ("client", "kvfs-mount")):
        unit = (out / f"{name}.service").read_text()
        argv = json.loads((out / f"{role}.argv.json").read_text())
        exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
        assert exec_start == "ExecStart=" + " ".join(argv)  # no argument here needs quoting
        units[name] = out / f"{name}.service"
    assert "--target=/srv/kvfs/disk1" in (out / "chunkserver.argv.json").read_text()
    assert "ExecStop=-/bin/fusermount3 -u /mnt/kvfs" in units["kvfs-mount"].read_text()
    if shutil.which("systemd-analyze"):  # offline: it reads the unit files, it needs no running systemd
        verify = subprocess.run(["systemd-analyze", "verify", *map(str, units.values())], capture_output=True,
                                text=True, timeout=60)
        assert verify.returncode == 0, verify.stdout + verify.stderr


def test_foundationdb_install() -> None:
    pytest.skip("the foundationdb role's install step needs FoundationDB packages, and no FoundationDB server "
                "package can be installed on these machines; the role is linted and its templates rendered above")


def test_kvclient_reads_rolled_out_file() -> None:
    pytest.skip("kvclient's issue (#23) has not landed: its first slice exists, but the rollout does not yet read a "
                "file back through it on a third host")


# ------------------------------------------------------------------------------------------------ the rollout

MANAGERS = "kvfs1"
CHUNKSERVERS = {"kvfs2": 1, "kvfs3": 2, "kvfs4": 3}
CLIENTS = ("kvfs1", "kvfs5")
CHUNK_SIZE = 256 << 10

WRITER = r"""
import hashlib, os, sys, time
mnt, manifest, stop = sys.argv[1:4]
os.makedirs(f"{mnt}/rolling", exist_ok=True)
journal, journal_hash, i = f"{mnt}/rolling/journal", hashlib.sha256(), 0
with open(manifest, "w") as log:
    while not os.path.exists(stop):
        data = os.urandom(3 * (128 << 10) + 4096 * (i % 7))  # crosses 256 KiB chunks, so several chains
        path, started = f"{mnt}/rolling/f{i:05d}", time.time()
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        record = os.urandom(65536)  # one file written to all along, across every restart
        with open(journal, "ab") as f:
            f.write(record)
            os.fsync(f.fileno())
        journal_hash.update(record)
        log.write(f"{path} {hashlib.sha256(data).hexdigest()} {started:.3f} {time.time():.3f}\n")
        log.flush()
        i += 1
        time.sleep(0.05)
    log.write(f"{journal} {journal_hash.hexdigest()} 0 0\n")
"""

VERIFY = r"""
import hashlib, sys
bad = 0
for line in open(sys.argv[1]):
    path, digest = line.split()[:2]
    with open(path, "rb") as f:
        if hashlib.sha256(f.read()).hexdigest() != digest:
            print("MISMATCH", path)
            bad += 1
print("checked", sum(1 for _ in open(sys.argv[1])), "bad", bad)
sys.exit(1 if bad else 0)
"""


class Rollout:
    """The lab, its inventory and ansible-playbook run from the controller namespace."""

    def __init__(self, lab: Lab, wheelhouse: Path) -> None:
        self.lab = lab
        self.hosts = {h.name: h for h in lab.hosts}
        self.inventory = lab.base / "inventory"
        self.ansible_home = lab.base / "ansible-home"
        self.token = os.urandom(24).hex()
        self.wheelhouse = wheelhouse
        self.runs = 0
        self.write_inventory()

    def write_inventory(self, chunkservers: dict[str, int] = CHUNKSERVERS) -> None:
        (self.inventory / "group_vars").mkdir(parents=True, exist_ok=True)
        (self.inventory / "host_vars").mkdir(exist_ok=True)
        hosts = {
            "kvfs": {"children": {
                "mgmtd": {"hosts": {MANAGERS: None}},
                "meta": {"hosts": {MANAGERS: None}},
                "chunkserver": {"hosts": {name: {"kvfs_node_id": node} for name, node in chunkservers.items()}},
                "client": {"hosts": {name: None for name in CLIENTS}},
                "foundationdb": {"hosts": {}},
            }},
        }
        (self.inventory / "hosts.yml").write_text(json.dumps(hosts, indent=2))  # JSON is YAML
        group = {
            "kvfs_service_manager": "start-stop-daemon",
            "kvfs_install_source": "wheelhouse",
            "kvfs_wheelhouse": str(self.wheelhouse),
            "kvfs_user": SERVICE_USER,
            "kvfs_group": SERVICE_USER,
            "kvfs_replicas": 3,
            "kvfs_chunk_size": CHUNK_SIZE,
            "kvfs_stripe": 2,
            "kvfs_shared_memory": False,
            "kvfs_transport": "tcp",
            # kvfs up's figures: failover in seconds, not the production defaults' five.
            "kvfs_timeouts": {"heartbeat_interval": 0.5, "heartbeat_timeout": 3.0, "lease": 3.0},
            "kvfs_start_timeout": 60,
            "kvfs_serving_timeout": 120,
        }
        (self.inventory / "group_vars" / "kvfs.yml").write_text(json.dumps(group, indent=2))
        for host in self.lab.hosts:
            first = host.name == "kvfs1"
            host_vars = {
                "ansible_host": host.address,
                "ansible_user": "root",
                "ansible_python_interpreter": "/usr/bin/python3",
                "ansible_remote_tmp": f"{host.home}/.ansible/tmp",
                "kvfs_root": str(host.kvfs_root),
                "kvfs_chunkserver_targets": [f"{host.kvfs_root}/srv/disk0", f"{host.kvfs_root}/srv/disk1"],
                # One /etc and one package database for all namespaces: manage them from one host only.
                "kvfs_manage_packages": first,
                "kvfs_manage_user": first,
            }
            (self.inventory / "host_vars" / f"{host.name}.yml").write_text(json.dumps(host_vars, indent=2))

    def env(self) -> dict[str, str]:
        options = self.lab.ssh_options()  # pairs of "-o", "Name=value"; Ansible sets the control path itself
        ssh_args = " ".join(f"-o {value}" for value in options[1::2] if not value.startswith("ControlPath="))
        return {
            **os.environ,
            "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"),
            "ANSIBLE_HOME": str(self.ansible_home),
            "ANSIBLE_LOCAL_TEMP": str(self.ansible_home / "tmp"),
            "ANSIBLE_SSH_ARGS": ssh_args,
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(self.lab.control_dir),
            "ANSIBLE_PIPELINING": "True",
            "ANSIBLE_HOST_KEY_CHECKING": "True",
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORKS": "10",
            "KVFS_TOKEN": self.token,
        }

    def playbook(self, name: str, *extra: str, timeout: float = 600) -> tuple[str, dict[str, dict[str, int]]]:
        """Run a playbook; return its output and the recap's counts per host."""
        argv = self.lab.in_controller([_tool("ansible-playbook"), "-i", str(self.inventory / "hosts.yml"),
                                       str(ANSIBLE / name), *extra])
        started = time.monotonic()
        result = subprocess.run(argv, env=self.env(), cwd=ANSIBLE, capture_output=True, text=True, timeout=timeout)
        output = result.stdout + result.stderr
        if os.environ.get("KVFS_ANSIBLE_LOG_DIR"):  # keep every playbook's output for a look afterwards
            self.runs += 1
            log = Path(os.environ["KVFS_ANSIBLE_LOG_DIR"]) / f"{self.runs:02d}-{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(output)
        assert result.returncode == 0, f"{name} failed after {time.monotonic() - started:.0f}s:\n{output[-12000:]}"
        recap = {m.group(1): {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
                 for m in re.finditer(r"^(\S+)\s+:\s+(ok=.*)$", output, re.M)}
        return output, recap

    def ssh(self, host: str, command: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return self.lab.ssh(self.hosts[host], command, **kwargs)  # type: ignore[arg-type]

    def mount_point(self, host: str) -> str:
        return f"{self.hosts[host].kvfs_root}/mnt/kvfs"

    def kvfs_processes(self, host: Host) -> list[str]:
        """Command lines of the kvfs processes running in a host's namespace."""
        found = []
        for pid in self.lab.pids(host):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            if "/bin/kvfs " in cmdline:
                found.append(cmdline)
        return found


@pytest.fixture
def rollout() -> Iterator[Rollout]:
    problems = missing_tools()
    if problems:
        pytest.skip(f"missing: {', '.join(problems)}")
    user_existed = subprocess.run(["id", SERVICE_USER], capture_output=True).returncode == 0
    with Lab(6) as lab:
        try:
            wheelhouse = lab.base / "wheelhouse"
            build_wheelhouse(wheelhouse)
            yield Rollout(lab, wheelhouse)
        finally:
            lab.close()  # processes and mounts first: the user cannot be removed while its processes run
            if not user_existed:
                subprocess.run(["userdel", SERVICE_USER], capture_output=True)
                subprocess.run(["groupdel", SERVICE_USER], capture_output=True)


def build_wheelhouse(out: Path) -> None:
    """kvfs and its dependencies as wheels, at the versions this test's own environment runs (the hosts cannot
    reach a package index: the roles install from these, copied over by Ansible)."""
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True,
                            text=True, check=True).stdout
    constraints = out.parent / "constraints.txt"
    constraints.write_text("".join(line + "\n" for line in freeze.splitlines() if "==" in line))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(out),
                             "--constraint", str(constraints), str(REPO)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_rollout_restart_teardown(rollout: Rollout, capsys: pytest.CaptureFixture[str]) -> None:
    """site.yml rolls out a cluster over ssh; a file written on one client reads back on the other; a second
    site.yml changes nothing; rolling_restart.yml restarts every server host while a client writes, with no
    failed write and no lost byte; teardown.yml leaves no process and no mount behind."""
    timings: dict[str, float] = {}
    t0 = time.monotonic()

    # ---- site.yml
    started = time.monotonic()
    output, recap = rollout.playbook("site.yml")
    timings["site.yml"] = time.monotonic() - started
    assert set(recap) == {h.name for h in rollout.lab.hosts} - {"kvfs6"}, output[-3000:]
    assert all(counts["failed"] == 0 and counts["unreachable"] == 0 for counts in recap.values()), recap
    roles = {h.name: " ".join(rollout.kvfs_processes(h)) for h in rollout.lab.hosts}
    assert " mgmtd " in roles["kvfs1"] and " meta " in roles["kvfs1"] and " mount " in roles["kvfs1"]
    for name, node in CHUNKSERVERS.items():
        assert f"chunkserver --config {rollout.hosts[name].kvfs_root}/etc/kvfs/chunkserver.toml --node-id {node}" \
               in roles[name], roles[name]
        assert " mount " not in roles[name] and " mgmtd " not in roles[name]
    assert " mount " in roles["kvfs5"] and " chunkserver " not in roles["kvfs5"]
    assert roles["kvfs6"] == ""
    mounted = rollout.lab.mounts()
    assert sorted(mounted) == sorted(rollout.mount_point(h) for h in CLIENTS), mounted

    # Every service runs as the service user, the mounts as root.
    for host in rollout.lab.hosts:
        for pid in rollout.lab.pids(host):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                uid = Path(f"/proc/{pid}/status").read_text().split("\nUid:")[1].split()[0]
            except (OSError, IndexError):
                continue
            if b"/bin/kvfs\0" in cmdline:
                user = "root" if b"\0mount\0" in cmdline else SERVICE_USER
                assert int(uid) == int(subprocess.run(["id", "-u", user], capture_output=True, text=True).stdout)

    status = json.loads(rollout.ssh("kvfs1", f"{rollout.hosts['kvfs1'].kvfs_root}/opt/kvfs/venv/bin/kvfs admin status "
                                    f"--json --config {rollout.hosts['kvfs1'].kvfs_root}/etc/kvfs/mgmtd.toml").stdout)
    assert sorted(n["node_id"] for n in status["nodes"] if n["alive"]) == [1, 2, 3]
    assert len(status["routing"]["chains"]) == 2  # six targets, replication 3
    assert {t["state"] for c in status["routing"]["chains"] for t in c["targets"]} == {"serving"}
    assert {rollout.hosts[name].address for name in CHUNKSERVERS} == \
           {n["address"].rsplit(":", 1)[0] for n in status["nodes"]}

    # ---- a file written through the mount on one host reads back byte-exact through the mount on another
    payload = os.urandom(5 * CHUNK_SIZE + 12345)
    digest = hashlib.sha256(payload).hexdigest()
    rollout.ssh("kvfs1", f"cat > {rollout.mount_point('kvfs1')}/hello.bin && sync", input=payload)
    readback = rollout.ssh("kvfs5", f"sha256sum {rollout.mount_point('kvfs5')}/hello.bin").stdout.split()[0]
    assert readback == digest
    layout = rollout.ssh("kvfs5", f"python3 -c 'import os; print(os.getxattr(\"{rollout.mount_point('kvfs5')}/hello.bin\", "
                                  f"\"kvfs.layout\").decode())'").stdout
    assert f"chunk_size={CHUNK_SIZE} stripe=2" in layout, layout

    # ---- a second site.yml changes nothing
    started = time.monotonic()
    output, recap = rollout.playbook("site.yml")
    timings["site.yml again"] = time.monotonic() - started
    changed = {host: counts["changed"] for host, counts in recap.items() if counts["changed"]}
    assert not changed, f"second site.yml changed {changed}:\n" + "\n".join(
        line for line in output.splitlines() if line.startswith("changed:"))

    # ---- rolling_restart.yml while kvfs5 writes through its mount
    home = rollout.hosts["kvfs5"].home
    (home / "writer.py").write_text(WRITER)
    (home / "verify.py").write_text(VERIFY)
    manifest, stop = home / "manifest", home / "stop"
    writer = subprocess.Popen(rollout.lab.ssh_argv(rollout.hosts["kvfs5"], f"python3 {home}/writer.py "
                                                   f"{rollout.mount_point('kvfs5')} {manifest} {stop}"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2)
        started = time.monotonic()
        restart_began = time.time()
        output, recap = rollout.playbook("rolling_restart.yml")
        timings["rolling_restart.yml"] = time.monotonic() - started
        restart_ended = time.time()
        time.sleep(1)
    finally:
        stop.touch()
        out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, f"the writer failed during the rolling restart:\n{out}\n{err}"
    restarted = re.findall(r"^TASK \[(?:\w+ : )?Restart kvfs-(\w+)\]", output, re.M)
    assert sorted(set(restarted)) == ["chunkserver", "meta", "mgmtd"], restarted
    lines = manifest.read_text().splitlines()
    writes = [(float(a), float(b)) for _, _, a, b in (line.split() for line in lines[:-1])]
    during = [w for w in writes if restart_began <= w[0] and w[1] <= restart_ended]
    slowest = max(b - a for a, b in writes)
    assert len(during) >= 10, f"only {len(during)} writes happened during the rolling restart"
    # Every file (and the journal written all along) reads back byte-exact through the other host's mount.
    shutil.copy(manifest, rollout.hosts["kvfs1"].home / "manifest")
    shutil.copy(home / "verify.py", rollout.hosts["kvfs1"].home / "verify.py")
    listing = (rollout.hosts["kvfs1"].home / "manifest")
    listing.write_text(listing.read_text().replace(rollout.mount_point("kvfs5"), rollout.mount_point("kvfs1")))
    verified = rollout.ssh("kvfs1", f"python3 {listing.parent}/verify.py {listing}", check=False)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    check = rollout.ssh("kvfs1", f"{rollout.hosts['kvfs1'].kvfs_root}/opt/kvfs/venv/bin/kvfs admin check-file "
                        f"--config {rollout.hosts['kvfs1'].kvfs_root}/etc/kvfs/mgmtd.toml /rolling/journal",
                        check=False)
    assert check.returncode == 0 and " 0 inconsistent" in check.stdout, check.stdout + check.stderr

    if os.environ.get("KVFS_ANSIBLE_LOG_DIR"):  # the writer's timings and every service's log, for a look
        keep = Path(os.environ["KVFS_ANSIBLE_LOG_DIR"])
        shutil.copy(manifest, keep / "writer-manifest")
        for host in rollout.lab.hosts:
            if (host.kvfs_root / "var" / "log" / "kvfs").exists():
                shutil.copytree(host.kvfs_root / "var" / "log" / "kvfs", keep / host.name, dirs_exist_ok=True)

    # ---- add_chunkserver.yml: kvfs6 joins; the running chunk servers are left as they are
    rollout.write_inventory({**CHUNKSERVERS, "kvfs6": 4})
    started = time.monotonic()
    output, recap = rollout.playbook("add_chunkserver.yml")
    timings["add_chunkserver.yml"] = time.monotonic() - started
    assert recap["kvfs6"]["changed"] > 0 and not any(recap[name]["changed"] for name in CHUNKSERVERS), recap
    assert "chunkserver --config" in " ".join(rollout.kvfs_processes(rollout.hosts["kvfs6"]))
    status = json.loads(rollout.ssh("kvfs1", f"{rollout.hosts['kvfs1'].kvfs_root}/opt/kvfs/venv/bin/kvfs admin status "
                                    f"--json --config {rollout.hosts['kvfs1'].kvfs_root}/etc/kvfs/mgmtd.toml").stdout)
    assert {n["node_id"]: sorted(n["targets"]) for n in status["nodes"] if n["alive"]}[4] == [400, 401]
    # Two targets on one server cannot make a chain of three: they wait, and the playbook says so.
    assert len(status["routing"]["chains"]) == 2 and "Targets 400, 401 are in no chain yet" in output

    # ---- teardown.yml leaves nothing behind
    started = time.monotonic()
    rollout.playbook("teardown.yml", "-e", "kvfs_teardown_purge=true")
    timings["teardown.yml"] = time.monotonic() - started
    left = {h.name: rollout.kvfs_processes(h) for h in rollout.lab.hosts}
    assert not any(left.values()), left
    assert rollout.lab.mounts() == []
    for host in rollout.lab.hosts:
        assert not (host.kvfs_root / "var" / "lib" / "kvfs").exists()
        assert not (host.kvfs_root / "opt" / "kvfs" / "venv").exists()
    assert subprocess.run(["id", SERVICE_USER], capture_output=True).returncode != 0
    timings["whole test"] = time.monotonic() - t0

    with capsys.disabled():
        print(f"\nAnsible rollout ({len(rollout.lab.hosts)} namespace hosts): "
              + ", ".join(f"{name} {seconds:.1f}s" for name, seconds in timings.items())
              + f"; {len(writes)} writes by the writer, {len(during)} during the rolling restart, "
              f"slowest {slowest:.2f}s")
