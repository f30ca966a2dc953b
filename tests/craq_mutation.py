"""Mutation testing of the CRAQ core: plant one small bug at a time in ``craq/member.py`` and run the CRAQ tests.

A mutant the tests fail on (or time out on) is killed; one they pass is a survivor: either a test is missing or
the mutant is equivalent (behaves the same). Survivors are listed, with their line, for a person to judge.

    nice -n 15 .venv/bin/python tests/craq_mutation.py                  # every mutant, 2 at a time
    nice -n 15 .venv/bin/python tests/craq_mutation.py --only 17,42     # replay some by number
    .venv/bin/python tests/craq_mutation.py --list                      # what would be planted

Operators (a small AST mutator rather than mutmut, whose copy of the tree does not follow this repo's
``package-dir`` mapping): flip a comparison, swap ``and``/``or``, drop a ``not``, add one to an integer
constant, swap ``+``/``-``, drop a statement, and make a function returning effects return none. The mutant
module replaces ``kvfs.craq.member`` in a pytest child process (nothing is written into the source tree).
The simulator runs ``--seeds`` seeds per profile so that a survivor costs tens of seconds, not minutes.
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "craq" / "member.py"
TESTS = ["tests/test_craq_member.py", "tests/test_craq_linearizable.py", "tests/test_craq_sim.py"]

_FLIP = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt,
         ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}

# Loaded by the pytest child before any test module: the mutant becomes kvfs.craq.member.
_LOADER = '''
import importlib.util, os, sys
import kvfs.craq
spec = importlib.util.spec_from_file_location("kvfs.craq.member", os.environ["KVFS_MUTANT"])
module = importlib.util.module_from_spec(spec)
sys.modules["kvfs.craq.member"] = module
spec.loader.exec_module(module)
kvfs.craq.member = module
'''


@dataclass
class Mutant:
    number: int
    line: int
    what: str
    source: str = ""
    status: str = ""  # killed / survived / timeout
    seconds: float = 0.0


class _Planter(ast.NodeTransformer):
    """Walks the module; at site number ``target`` applies its mutation (``target`` -1: only count sites)."""

    def __init__(self, target: int = -1) -> None:
        self.target = target
        self.sites: list[tuple[int, str]] = []
        self.returns_list = False

    def _site(self, node: ast.AST, what: str) -> bool:
        self.sites.append((node.lineno, what))
        return len(self.sites) - 1 == self.target

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        outer = self.returns_list
        self.returns_list = node.returns is not None and "list" in ast.unparse(node.returns)
        body = node.body[1:] if ast.get_docstring(node) else node.body
        start = len(node.body) - len(body)
        for i, stmt in enumerate(body):
            if not isinstance(stmt, ast.Raise) and self._site(stmt, f"drop `{ast.unparse(stmt).splitlines()[0]}`"):
                node.body[start + i] = ast.copy_location(ast.Pass(), stmt)
        self.generic_visit(node)
        self.returns_list = outer
        return node

    def visit_If(self, node: ast.If) -> ast.AST:
        for i, stmt in enumerate(node.body + node.orelse):
            if isinstance(stmt, (ast.Raise, ast.If)):
                continue
            if self._site(stmt, f"drop `{ast.unparse(stmt).splitlines()[0]}`"):
                block, j = (node.body, i) if i < len(node.body) else (node.orelse, i - len(node.body))
                block[j] = ast.copy_location(ast.Pass(), stmt)
        self.generic_visit(node)
        return node

    def visit_Return(self, node: ast.Return) -> ast.AST:
        self.generic_visit(node)
        if self.returns_list and node.value is not None and not (isinstance(node.value, ast.List) and not node.value.elts):
            if self._site(node, f"`{ast.unparse(node)}` -> `return []`"):
                return ast.copy_location(ast.Return(ast.List([], ast.Load())), node)
        return node

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        for i, op in enumerate(node.ops):
            flipped = _FLIP.get(type(op))
            if flipped and self._site(node, f"flip `{ast.unparse(node)}`"):
                node.ops[i] = flipped()
        return node

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        self.generic_visit(node)
        if self._site(node, f"and/or in `{ast.unparse(node)}`"):
            node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        return node

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.op, ast.Not) and self._site(node, f"drop not in `{ast.unparse(node)}`"):
            return node.operand
        return node

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.op, (ast.Add, ast.Sub)) and self._site(node, f"+/- in `{ast.unparse(node)}`"):
            node.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if type(node.value) is int and self._site(node, f"{node.value} -> {node.value + 1}"):
            return ast.copy_location(ast.Constant(node.value + 1), node)
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        # only behaviour: the member and its chunk bookkeeping, not the event/effect record declarations
        return self.generic_visit(node) if node.name in ("ChainMember", "_Chunk") else node


def plant(tree: ast.Module, number: int) -> tuple[str, list[tuple[int, str]]]:
    planter = _Planter(number)
    mutated = planter.visit(copy.deepcopy(tree))
    return ast.unparse(ast.fix_missing_locations(mutated)), planter.sites


def run_mutant(m: Mutant, seeds: int, timeout: float, workdir: Path) -> Mutant:
    path = workdir / f"member_{m.number}.py"
    path.write_text(m.source)
    env = dict(os.environ, KVFS_MUTANT=str(path), KVFS_SIM_SEEDS=str(seeds),
               PYTHONPATH=os.pathsep.join([str(workdir), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                               "-p", "mutant_loader", *TESTS], cwd=ROOT, env=env, capture_output=True, timeout=timeout)
        m.status = "survived" if proc.returncode == 0 else "killed"
    except subprocess.TimeoutExpired:
        m.status = "timeout"
    m.seconds = time.monotonic() - start
    path.unlink()
    return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated mutant numbers")
    ap.add_argument("--seeds", type=int, default=60, help="simulator seeds per run (default profile; a third each other)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds before a mutant counts as killed (a hang)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args()
    tree = ast.parse(TARGET.read_text())
    _, sites = plant(tree, -1)
    numbers = [int(n) for n in args.only.split(",")] if args.only else range(len(sites))
    mutants = [Mutant(n, *sites[n]) for n in numbers]
    if args.list:
        for m in mutants:
            print(f"#{m.number} line {m.line}: {m.what}")
        return 0
    for m in mutants:
        m.source = plant(tree, m.number)[0]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "mutant_loader.py").write_text(_LOADER)
        with ThreadPoolExecutor(args.jobs) as pool:
            for m in pool.map(lambda m: run_mutant(m, args.seeds, args.timeout, workdir), mutants):
                print(f"#{m.number} line {m.line} {m.status} ({m.seconds:.0f} s): {m.what}", flush=True)
    survivors = [m for m in mutants if m.status == "survived"]
    print(f"\n{len(mutants)} mutants, {len(survivors)} survived:")
    for m in survivors:
        print(f"  #{m.number} line {m.line}: {m.what}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
