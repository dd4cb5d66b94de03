"""The two planes stay apart: the service loads no torch and nothing of the worker, the worker
nothing of the service, and only the composition layer (dpledger/*.py) imports both.

Each check runs in a fresh interpreter (`python -c`), because this test process has long since
imported both planes; the child prints the modules it ended up with."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPOSITION = {"cli.py", "worker_cli.py", "demo.py", "demo_story.py", "tune.py", "harness.py"}  # demo_story: the demo's verdicts
# Top-level modules that face one plane only: a silo's public names, re-exported from the trainer
# (and from the wire contract: the typed client and its errors, which the people's and auditors' commands share).
FACADES = {"silo.py": "dpledger.service"}
# The commands run from outside the ledger, over HTTP: each package imports only those after it here
# (audit's `witnessed` reads the witnesses; every command says its failures through people's `terminal`).
CLIENT = ("audit", "witness", "people")
# What of the service the client side may import: the auditor recomposes ε with the gate's own
# accounting (pure math, no database or HTTP), never with a copy of it.
CLIENT_MAY_IMPORT = ("dpledger.service.accounting",)

# Imports the given modules, then every submodule of the given packages, and prints sys.modules. A
# module that needs an optional extra (opacus: the `opacus` extra) is passed over when it is absent.
_CHILD = """
import importlib, json, pkgutil, sys
for name in {modules!r}:
    importlib.import_module(name)
for name in {packages!r}:
    package = importlib.import_module(name)
    for info in pkgutil.walk_packages(package.__path__, name + "."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as error:
            if (error.name or "").split(".")[0] not in {optional!r}:
                raise
print(json.dumps(sorted(sys.modules)))
"""
OPTIONAL = ["opacus"]


def loaded_after(*, modules: tuple[str, ...] = (), packages: tuple[str, ...] = ()) -> list[str]:
    code = _CHILD.format(modules=list(modules), packages=list(packages), optional=OPTIONAL)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    loaded: list[str] = json.loads(done.stdout.splitlines()[-1])
    return loaded


def _is(name: str, root: str) -> bool:
    return name == root or name.startswith(root + ".")


def test_the_service_app_and_every_service_module_load_no_torch_and_nothing_of_the_worker() -> None:
    # The app first, then every other module of the service and the wire contract (a superset).
    loaded = loaded_after(modules=("dpledger.service.api.app",), packages=("dpledger.service", "dpledger.wire"))
    assert {"dpledger.service.api.app", "dpledger.service.ledger.charges", "dpledger.wire.schemas"} <= set(loaded)
    assert [m for m in loaded if _is(m, "torch") or _is(m, "dpledger.trainer")] == []


def test_no_module_of_the_worker_loads_the_service() -> None:
    loaded = loaded_after(packages=("dpledger.trainer",))
    assert {"dpledger.trainer.federated", "dpledger.trainer.silo.dpsgd", "torch"} <= set(loaded)
    assert [m for m in loaded if _is(m, "dpledger.service")] == []


def test_the_typed_client_and_the_people_and_audit_commands_load_no_torch() -> None:
    """One client for the worker and the commands run from outside the ledger, so it lives in the wire
    contract: no torch, nothing of either plane. The commands load it and still nothing of either plane
    (an audit's replay loads the service's accounting only when it runs)."""
    client = loaded_after(modules=("dpledger.wire.client", "dpledger.wire.errors"))
    assert {"dpledger.wire.client", "httpx"} <= set(client)
    assert [m for m in client if _is(m, "torch") or _is(m, "dpledger.trainer") or _is(m, "dpledger.service")] == []
    commands = loaded_after(modules=tuple(f"dpledger.{room}.commands" for room in CLIENT))
    assert {"dpledger.audit.transparency", "dpledger.wire.client"} <= set(commands)
    assert [m for m in commands if _is(m, "torch") or _is(m, "dpledger.trainer") or _is(m, "dpledger.service")] == []
    # Their HTTP to the ledger goes through the client alone: none imports httpx itself (the witness's
    # fetches of checkpoints from the ledger and from other witnesses are its own).
    for path in sorted((ROOT / "dpledger" / "people").glob("*.py")) + sorted((ROOT / "dpledger" / "audit").glob("*.py")):
        if path.name != "witnessed.py":
            assert "httpx" not in _imported(path), path


def _imported(path: Path) -> set[str]:
    """Every absolute module name `path` imports, at any depth (function-level imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            names.add(node.module)
    return names


def test_only_the_composition_layer_imports_both_planes() -> None:
    """Static, so that a lazy import inside a function cannot hide a crossing: the service (and its
    migrations) import nothing of the worker or torch, the worker nothing of the service, the wire
    contract neither plane, and of the root package only the composition modules import a plane."""
    # research/ is not installed: no product module may import it.
    clients = tuple(f"dpledger.{room}" for room in CLIENT)
    rules = {
        "service": ("dpledger.trainer", "torch", "research", *clients),
        "migrations": ("dpledger.trainer", "torch", "research"),
        "trainer": ("dpledger.service", "research"),
        "dpledger": ("research",),
        "dpledger/wire": ("dpledger.service", "dpledger.trainer", "dpledger.migrations", "torch", *clients),
        **{f"dpledger/{room}": ("dpledger.trainer", "dpledger.migrations", "torch", "research") for room in CLIENT},
    }
    crossings: list[str] = []
    for folder, forbidden in rules.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            bad = sorted(n for n in _imported(path) if any(_is(n, f) for f in forbidden))
            crossings += [f"{path.relative_to(ROOT)} imports {n}" for n in bad]
    assert crossings == []
    planes = ("dpledger.service", "dpledger.trainer")
    composing = {p.name for p in (ROOT / "dpledger").glob("*.py") if any(_is(n, q) for n in _imported(p) for q in planes)}
    assert composing <= COMPOSITION | set(FACADES)
    for name, forbidden in FACADES.items():
        assert not any(_is(n, forbidden) for n in _imported(ROOT / "dpledger" / name)), name
    assert {"cli.py", "demo.py", "harness.py"} <= composing  # the walk sees real imports
    # Libraries under the root package (dpledger.flower, a silo's side) take one plane at most.
    both = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "dpledger").rglob("*.py")
        if p.parent != ROOT / "dpledger" and all(any(_is(n, q) for n in _imported(p)) for q in planes)
    ]
    assert both == []


def test_the_client_commands_import_no_server_internals_and_run_one_way() -> None:
    """The people's, auditors' and witness's commands (dpledger/people, audit, witness) import nothing
    of the service but its accounting, nothing of the composition layer, and each other one way only
    (CLIENT's order), so that no two of their modules import each other, directly or around a loop."""
    modules = {}
    for room in CLIENT:
        for path in sorted((ROOT / "dpledger" / room).glob("*.py")):
            name = f"dpledger.{room}" if path.name == "__init__.py" else f"dpledger.{room}.{path.stem}"
            modules[name] = _imported(path) | _submodules_imported(path)
    assert {"dpledger.audit.recompose", "dpledger.witness.cosigner", "dpledger.people.terminal"} <= set(modules)
    composition = tuple(f"dpledger.{Path(name).stem}" for name in COMPOSITION)
    crossings = sorted(
        f"{module} imports {name}" for module, names in modules.items() for name in names
        if (_is(name, "dpledger.service") and not any(_is(name, allowed) for allowed in CLIENT_MAY_IMPORT))
        or any(_is(name, c) for c in composition)
        or any(_is(name, f"dpledger.{later}") for i, room in enumerate(CLIENT) if _is(module, f"dpledger.{room}")
               for later in CLIENT[:i])
    )
    assert crossings == []
    # The ledger's audit and the auditor's recomposition replay a chain with one replay.
    assert "dpledger.wire.chain_replay" in modules["dpledger.audit.recompose"]
    assert "dpledger.wire.chain_replay" in _imported(ROOT / "service" / "ledger" / "audit.py")
    # No loop among their modules (a module importing one of its own package's modules, and back).
    edges = {m: {n for n in names if n in modules and n != m} for m, names in modules.items()}
    loops = [m for m in modules if _reaches(edges, m, m)]
    assert loops == []


def _reaches(edges: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, stack = set(), list(edges[start])
    while stack:
        node = stack.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            stack.extend(edges.get(node, ()))
    return False


def _submodules_imported(path: Path) -> set[str]:
    """`from package import name` as `package.name` too, where the name may be a module of it."""
    return {f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None for alias in node.names}


def test_the_silo_library_imports_nothing_of_the_simulator() -> None:
    """Inside the worker, imports run one way: the simulator, the job runner and a Flower silo import
    the silo library (`trainer/silo/`: gate, round protocol, DP-SGD engine, Opacus adapter), and the
    library imports nothing of the worker outside itself, so what a hospital runs is that library
    alone and a change to the simulator cannot change it. Static, as above, so a lazy import cannot
    hide a crossing; then a fresh interpreter that loads every module of the library, as a silo's
    own script does."""
    library = ROOT / "trainer" / "silo"
    crossings = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted(library.rglob("*.py"))
        for name in sorted(_imported(path))
        if (_is(name, "dpledger") and not _is(name, "dpledger.trainer.silo") and not _is(name, "dpledger.wire"))
        or _is(name, "research")
    ]
    assert crossings == []
    simulator = [p for p in (ROOT / "trainer" / "federated").rglob("*.py")
                 if any(_is(n, "dpledger.trainer.silo") for n in _imported(p))]
    assert simulator  # the walk sees the simulator's real imports of the library
    loaded = loaded_after(packages=("dpledger.trainer.silo",))
    assert {"dpledger.trainer.silo.gate", "dpledger.trainer.silo.dpsgd.engine"} <= set(loaded)
    outside = [m for m in loaded if _is(m, "dpledger") and not _is(m, "dpledger.trainer.silo") and not _is(m, "dpledger.wire")
               and m not in ("dpledger", "dpledger.trainer")]
    assert outside == []
