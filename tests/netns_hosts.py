"""Test hosts made of network namespaces, each with its own address and its own sshd, for the Ansible tests.

The lab is one controller namespace holding a bridge, and N host namespaces, each joined to the bridge by a veth
pair and serving ssh on its own address (key-only, its own host key, pid file and HOME). Nothing is added to the
namespace the test runs in: the bridge lives in the controller namespace, no namespace has a default route, so
every packet stays between the lab's own namespaces. ansible-playbook and ssh run in the controller namespace
(``nsenter --net``); whatever a host's sshd starts (the services Ansible starts included) inherits the host's
namespace.

Only the network is separate: the namespaces share the file system, ``/etc``, users and the package database,
and the mount namespace (``nsenter --net`` keeps it, so the test can see and always remove FUSE mounts). So each
host gets its own root directory, and the caller must not change packages or users from several hosts at once.

``Lab.close`` removes everything even after a failure: FUSE mounts under the lab's directory, every process in
its namespaces (sshd, what Ansible started, ssh control masters), the namespaces (their veths and the bridge go
with them), and the lab's directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.77.0"
CONTROLLER_ADDRESS = f"{SUBNET}.1"


def missing_tools() -> list[str]:
    """Programs the lab needs that this machine lacks (a test skips with their names)."""
    need = ["ip", "nsenter", "ssh", "ssh-keygen", "fusermount3"]
    missing = [tool for tool in need if shutil.which(tool) is None]
    if not Path("/usr/sbin/sshd").exists():
        missing.append("/usr/sbin/sshd (Debian package openssh-server)")
    return missing


def _run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=True, text=True, capture_output=True, **kwargs)  # type: ignore[call-overload]


@dataclass
class Host:
    name: str
    netns: str
    address: str
    root: Path  # everything of this host: its sshd's files, its HOME, and the kvfs_root Ansible installs into

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def ssh_dir(self) -> Path:
        return self.root / "sshd"

    @property
    def kvfs_root(self) -> Path:
        return self.root / "kvfs"


@dataclass
class Lab:
    """``count`` hosts named ``<prefix>1`` ... on ``10.77.0.0/24``; use as a context manager."""

    count: int
    prefix: str = "kvfs"
    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvfst", dir="/tmp")))
    hosts: list[Host] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.base.chmod(0o755)  # the hosts' service user must reach its directories under it
        tag = f"kvfst{os.getpid() % 100000}"
        self.controller_ns = f"{tag}-ctl"
        self.hosts = [Host(f"{self.prefix}{i}", f"{tag}-h{i}", f"{SUBNET}.{10 + i}", self.base / f"{self.prefix}{i}")
                      for i in range(1, self.count + 1)]
        self.key = self.base / "id_ed25519"
        self.known_hosts = self.base / "known_hosts"
        self.control_dir = self.base / "cp"  # short: a unix socket path must fit in 108 bytes
        self._made_run_sshd = False

    # ---------------------------------------------------------------------------------- set up

    def __enter__(self) -> Lab:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.control_dir.mkdir(mode=0o700)
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kvfs-lab-controller", "-f", str(self.key)])
        _run(["ip", "netns", "add", self.controller_ns])
        ctl = ["ip", "-n", self.controller_ns]
        _run([*ctl, "link", "set", "lo", "up"])
        _run([*ctl, "link", "add", "br0", "type", "bridge"])
        _run([*ctl, "addr", "add", f"{CONTROLLER_ADDRESS}/24", "dev", "br0"])
        _run([*ctl, "link", "set", "br0", "up"])
        if not Path("/run/sshd").exists():  # sshd's privilege separation directory
            Path("/run/sshd").mkdir(mode=0o755)
            self._made_run_sshd = True
        known = []
        for i, host in enumerate(self.hosts, 1):
            _run(["ip", "netns", "add", host.netns])
            # Both ends are made inside the lab's namespaces: nothing appears in the test's own namespace.
            _run([*ctl, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", host.netns])
            _run([*ctl, "link", "set", f"v{i}", "master", "br0", "up"])
            h = ["ip", "-n", host.netns]
            _run([*h, "link", "set", "lo", "up"])
            _run([*h, "addr", "add", f"{host.address}/24", "dev", "eth0"])
            _run([*h, "link", "set", "eth0", "up"])
            known.append(self._start_sshd(host))
        self.known_hosts.write_text("".join(known))
        for host in self.hosts:
            self._wait_ssh(host)

    def _start_sshd(self, host: Host) -> str:
        for d in (host.root, host.home, host.ssh_dir, host.kvfs_root):
            d.mkdir(mode=0o755, exist_ok=True)
        key = host.ssh_dir / "host_ed25519_key"
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{host.name}-host", "-f", str(key)])
        authorized = host.ssh_dir / "authorized_keys"
        authorized.write_text(Path(f"{self.key}.pub").read_text())
        authorized.chmod(0o600)
        config = host.ssh_dir / "sshd_config"
        config.write_text("\n".join([
            f"ListenAddress {host.address}",
            "Port 22",
            f"HostKey {key}",
            f"PidFile {host.ssh_dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {authorized}",
            "AuthenticationMethods publickey",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "StrictModes no",  # the keys live under /tmp (mode 1777), which strict modes refuse
            "PrintMotd no",
            "MaxSessions 50",
            "MaxStartups 50:30:100",
            f"SetEnv HOME={host.home}",  # each host its own HOME (root's is shared by every namespace)
            "Subsystem sftp internal-sftp",
            "",
        ]))
        _run(["nsenter", f"--net=/run/netns/{host.netns}", "/usr/sbin/sshd", "-f", str(config),
              "-E", str(host.ssh_dir / "sshd.log")])
        return f"{host.address} {Path(f'{key}.pub').read_text().split(' ')[0]} " \
               f"{Path(f'{key}.pub').read_text().split(' ')[1]}\n"

    def _wait_ssh(self, host: Host, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            result = self.ssh(host, "true", check=False, timeout=10)
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                log = (host.ssh_dir / "sshd.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"ssh to {host.name} ({host.address}) failed: {result.stderr}\nsshd log:\n{log}")
            time.sleep(0.2)

    # ---------------------------------------------------------------------------------- use

    def ssh_options(self) -> list[str]:
        """The client options Ansible and the test share: key-only, strict host keys, one persistent master."""
        return [
            "-o", "BatchMode=yes",
            "-o", "IdentitiesOnly=yes",
            "-o", f"IdentityFile={self.key}",
            "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts}",
            "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "ControlMaster=auto",
            "-o", "ControlPersist=120s",
            "-o", f"ControlPath={self.control_dir}/%C",
            "-o", "ConnectTimeout=10",
        ]

    def in_controller(self, argv: list[str]) -> list[str]:
        """``argv`` run in the controller namespace, the only one with a route to the hosts."""
        return ["nsenter", f"--net=/run/netns/{self.controller_ns}", *argv]

    def ssh_argv(self, host: Host, command: str) -> list[str]:
        return self.in_controller(["ssh", "-F", "/dev/null", *self.ssh_options(), f"root@{host.address}", command])

    def ssh(self, host: Host, command: str, *, check: bool = True, timeout: float = 120,
            input: str | bytes | None = None) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(self.ssh_argv(host, command), capture_output=True, timeout=timeout,
                                text=not isinstance(input, bytes), input=input)
        if check and result.returncode != 0:
            raise AssertionError(f"ssh {host.name} {command!r} exited {result.returncode}:\n"
                                 f"{result.stdout}\n{result.stderr}")
        return result

    def pids(self, host: Host) -> list[int]:
        """Every process in the host's namespace (sshd, its sessions and what they started)."""
        out = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def mounts(self) -> list[str]:
        """Mount points under the lab's directory (the FUSE mounts clients made)."""
        prefix = str(self.base) + "/"
        found = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                point = line.split()[4].replace("\\040", " ")
                if point.startswith(prefix):
                    found.append(point)
        return found

    # ---------------------------------------------------------------------------------- tear down

    def close(self) -> None:
        """Remove everything the lab made; safe to call twice and after a failed start."""
        for point in reversed(self.mounts()):  # lazily: a daemon already gone leaves a dead mount point
            subprocess.run(["fusermount3", "-u", "-z", point], capture_output=True)
            subprocess.run(["umount", "-l", point], capture_output=True)
        namespaces = [h.netns for h in self.hosts] + [self.controller_ns]
        existing = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
        namespaces = [ns for ns in namespaces if ns in existing]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = {int(p) for ns in namespaces
                    for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()}
            pids.discard(os.getpid())
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 10
            while pids and time.monotonic() < deadline:
                pids = {p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)}
                time.sleep(0.1)
            if not pids:
                break
        for point in reversed(self.mounts()):
            subprocess.run(["umount", "-l", point], capture_output=True)
        for ns in namespaces:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        if self._made_run_sshd:
            with contextlib.suppress(OSError):
                Path("/run/sshd").rmdir()
        shutil.rmtree(self.base, ignore_errors=True)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True
