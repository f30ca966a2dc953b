"""The package's shape: one import namespace, layers that only point down, clients that load no server code.

kvclient is loaded inside inference engines' environments, so what ``pip install`` puts at the top level of
site-packages and what importing a client drags in are part of the product (../shared/DESIGN.md, "Layers").
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: The repository folder each part of the namespace comes from (pyproject.toml's package-dir).
SOURCES = {"kvfs": "kvfs", "kvfs/meta": "meta", "kvfs/craq": "craq", "kvfs/chunkserver": "chunkserver",
           "kvfs/fuse": "fuse", "kvfs/kvclient": "kvclient"}
#: What a client must never load: servers, the chunk engine, the KV engines.
SERVER_MODULES = ("kvfs.chunkserver.engine", "kvfs.chunkserver.service", "kvfs.chunkserver.server",
                  "kvfs.meta.store", "kvfs.meta.service", "kvfs.meta.server", "kvfs.kv", "kvfs.craq.mgmtd")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(REPO)], check=True, capture_output=True)
    (built,) = out.glob("kvfs-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel unpacked as pip would lay it out in site-packages."""
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def test_the_wheel_installs_kvfs_alone_at_the_top_level(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"kvfs"}


def test_the_wheel_holds_every_module_of_every_component(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    expected = set()
    for installed_as, folder in SOURCES.items():
        for path in (REPO / folder).rglob("*.py"):
            relative = path.relative_to(REPO / folder)
            if installed_as == "kvfs" and relative.parts[0] in {f for f in SOURCES.values() if f != "kvfs"}:
                continue
            expected.add(f"{installed_as}/{relative.as_posix()}")
    assert expected - names == set()


def test_import_contracts_hold(installed: Path) -> None:
    """The contracts in pyproject.toml ([tool.importlinter]) over the installed layout, where every component
    sits under kvfs/ as users import it."""
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache", str(REPO / "pyproject.toml")], cwd=installed,
                            env=dict(os.environ, PYTHONPATH=str(installed)), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


@pytest.mark.parametrize("entry", ["kvfs.fuse.main", "kvfs.chunkserver.client", "kvfs.meta.client", "kvfs.kvclient"])
def test_a_client_loads_no_server_code(entry: str) -> None:
    """A fresh interpreter importing a client's entry module: no server module, chunk engine or KV engine."""
    probe = f"import sys, {entry}; print('\\n'.join(sorted(m for m in sys.modules if m.startswith('kvfs'))))"
    loaded = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout.split()
    assert entry in loaded
    assert [m for m in loaded if m in SERVER_MODULES or m.startswith(tuple(s + "." for s in SERVER_MODULES))] == []
