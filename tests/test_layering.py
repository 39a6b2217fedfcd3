"""Who may import whom (docs/architecture.md), checked statically from the source with `ast`:
nothing is imported, so a violation is found even in a module no test loads.

Rules, each applying to every `import` / `from ... import` in the package's files:

* protocols/ (sans-IO cores) never imports trio or libp2p, nor anything of node/, p2p/,
  cli/ or testnet/;
* p2p/ (the networking substrate) never imports torch or protocols/, nor node/, cli/ or
  testnet/;
* node/ never imports cli/ or testnet/;
* node/ml/ (the pure-torch layer) never imports trio, libp2p, asyncio, aiortc or p2p/, nor
  any of node/ outside node/ml/: models, optimizers and stages read and test as plain torch;
* testnet/ never imports cli/;
* no import cycle between the project's modules.

Which imports count. For the layer rules: all of them, at module level, deferred inside a
function, or under `if TYPE_CHECKING:`: a deferred import is still a dependency, only a
later one. For cycles: module-level and deferred (function-level) imports both count; a
deferred import breaks the cycle at import time, but the two modules still cannot be
understood, tested or moved apart (cli/main.py <-> cli/ckpt_cmd.py was one). Imports under
`if TYPE_CHECKING:` never run and are left out of the cycle check. An edge goes to the
module named: `from pkg import mod` to pkg.mod when that is a module of ours, else to pkg
(its __init__); the parent packages that Python also initialises are not edges.

A failure prints each import that broke a rule (file:line, the statement's module and the
rule) and each cycle as a chain of such imports.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("p2p", "protocols", "node", "cli", "testnet")

# layer -> (what it must not import, why)
RULES: dict[str, list[tuple[str, str]]] = {
    "protocols": [
        *((m, "protocols/ is sans-IO: bytes in, events out, no I/O library")
          for m in ("trio", "libp2p", "asyncio", "aiortc", "aioice")),
        *((m, "protocols/ is a foundation: it knows no other layer of ours")
          for m in ("node", "p2p", "cli", "testnet")),
    ],
    "p2p": [
        ("torch", "p2p/ moves bytes: never torch"),
        ("protocols", "p2p/ and protocols/ are foundations that do not know each other"),
        *((m, "p2p/ is a foundation: it knows no layer above it")
          for m in ("node", "cli", "testnet")),
    ],
    "node": [(m, "node/ is the composition root: the faces (cli/, testnet/) use it, "
                 "not the other way") for m in ("cli", "testnet")],
    "testnet": [("cli", "testnet/ and cli/ are two faces: testnet/ never imports cli/")],
    "node.ml": [
        *((m, "node/ml/ is plain torch: no I/O library")
          for m in ("trio", "libp2p", "asyncio", "aiortc", "aioice", "p2p")),
        ("node", "node/ml/ is plain torch: the services drive it, it never calls them"),
    ],
}
#: What a banned prefix still lets through: node/ml/ may import itself.
ALLOWED: dict[str, tuple[str, ...]] = {"node.ml": ("node.ml",)}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name of the importing file
    path: str  # the file, relative to the root
    line: int
    target: str  # the module imported, resolved (absolute, dotted)
    deferred: bool  # inside a function
    type_only: bool  # under `if TYPE_CHECKING:`

    def where(self) -> str:
        kind = " (deferred)" if self.deferred else " (TYPE_CHECKING)" if self.type_only else ""
        return f"{self.path}:{self.line} imports {self.target}{kind}"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path) -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "node_modules" not in path.parts:
                out[module_name(root, path)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(root: Path, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import in `path`, resolved to absolute dotted names."""
    me = module_name(root, path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    rel = str(path.relative_to(root))
    found: list[Import] = []

    def add(node: ast.AST, target: str, deferred: bool, type_only: bool) -> None:
        found.append(Import(me, rel, node.lineno, target, deferred, type_only))

    def visit(node: ast.AST, deferred: bool, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node, alias.name, deferred, type_only)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                add(node, sub if sub in modules else origin, deferred, type_only)
        for child in ast.iter_child_nodes(node):
            if isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body:
                visit(child, deferred, True)
            else:
                visit(child, deferred or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef
                                                    | ast.Lambda), type_only)

    visit(ast.parse(path.read_text(), filename=rel), False, False)
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_violations(imports: list[Import]) -> list[str]:
    out = []
    for imp in imports:
        for layer, rules in RULES.items():
            if not _within(imp.importer, layer):
                continue
            if any(_within(imp.target, ok) for ok in ALLOWED.get(layer, ())):
                continue
            for banned, why in rules:
                if _within(imp.target, banned):
                    shown = layer.replace(".", "/")
                    out.append(f"{imp.where()}: {shown}/ must not import {banned} ({why})")
    return out


def cycles(imports: list[Import], modules: dict[str, Path]) -> list[str]:
    """Each strongly connected group of modules, shown as one cycle of imports in it."""
    edges: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for imp in imports:
        if imp.type_only or imp.target not in modules or imp.target == imp.importer:
            continue
        edges[imp.importer].setdefault(imp.target, imp)
    # Tarjan's strongly connected components (iterative: no recursion limit to meet).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    out = []
    for group in groups:
        members = set(group)
        # A shortest way back to the first module, through the group only (BFS).
        first = group[0]
        came: dict[str, Import] = {}
        frontier = [first]
        while frontier and first not in came:
            nxt = []
            for v in frontier:
                for w, imp in sorted(edges[v].items()):
                    if w in members and w not in came:
                        came[w] = imp
                        nxt.append(w)
            frontier = nxt
        chain, at = [], first
        while True:
            imp = came[at]
            chain.append(imp.where())
            at = imp.importer
            if at == first:
                break
        out.append(f"import cycle among {', '.join(group)}:\n    "
                   + "\n    ".join(reversed(chain)))
    return out


def check(root: Path) -> list[str]:
    modules = project_modules(root)
    imports = [imp for path in modules.values() for imp in imports_of(root, path, modules)]
    return layer_violations(imports) + cycles(imports, modules)


def test_layers_and_no_import_cycles():
    problems = check(REPO)
    for p in problems:
        print(p)
    assert not problems, "import rules broken:\n" + "\n".join(problems)


def test_the_checker_sees_what_it_must(tmp_path: Path):
    """The checker itself, on a small tree that breaks every rule once."""
    files = {
        "protocols/__init__.py": "",
        "protocols/wire.py": "import trio\nfrom libp2p.peer.id import ID\n",
        "protocols/codec.py": "def f():\n    from node import config\n",
        "p2p/__init__.py": "",
        "p2p/host.py": "import torch\nfrom protocols import wire\n",
        "node/__init__.py": "",
        "node/ml/__init__.py": "",
        "node/ml/loop.py": "import torch\nfrom node.ml import __doc__\nfrom node import config\n"
                           "def f():\n    import trio\n",
        "node/config.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                          "    from cli import main\n",
        "cli/__init__.py": "",
        "cli/main.py": "from cli import sub\n",
        "cli/sub.py": "def g():\n    from .main import app\n",
        "cli/ok.py": "from . import sub\n",
        "testnet/__init__.py": "",
        "testnet/launcher.py": "import cli.main\nimport numpy\nfrom node import config\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    problems = check(tmp_path)
    expected = [
        "protocols/wire.py:1 imports trio: protocols/ must not import trio",
        "protocols/wire.py:2 imports libp2p.peer.id: protocols/ must not import libp2p",
        "protocols/codec.py:2 imports node.config (deferred): protocols/ must not import node",
        "p2p/host.py:1 imports torch: p2p/ must not import torch",
        "p2p/host.py:2 imports protocols.wire: p2p/ must not import protocols",
        "node/config.py:3 imports cli.main (TYPE_CHECKING): node/ must not import cli",
        "testnet/launcher.py:1 imports cli.main: testnet/ must not import cli",
        "node/ml/loop.py:3 imports node.config: node/ml/ must not import node",
        "node/ml/loop.py:5 imports trio (deferred): node/ml/ must not import trio",
    ]
    for e in expected:
        assert any(p.startswith(e) for p in problems), (e, problems)
    cycle = [p for p in problems if p.startswith("import cycle")]
    assert len(cycle) == 1 and "cli.main, cli.sub" in cycle[0], problems
    assert "cli/sub.py:2 imports cli.main (deferred)" in cycle[0]
    assert "cli/main.py:1 imports cli.sub" in cycle[0]
    assert len(problems) == len(expected) + 1, problems


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_is_seen(package: str):
    assert any(m.split(".")[0] == package for m in project_modules(REPO))
