"""The package layout docs/ARCHITECTURE.md describes, kept true: who may import whom.

Reads every module's imports from its source (``ast``), so a lazy import inside
a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import flowdecision

ROOT = Path(flowdecision.__file__).parent

#: The packages whose modules are layers of their own (``core.model`` is below
#: ``core.dispatcher``): a rule names the module, not the package.
LAYERED = ("core", "observability", "connections")

#: unit -> the flowdecision units (packages, or a layered package's modules) it must never import
FORBIDDEN = {
    # Storage knows no ledger, outbox or anything above them.
    "store": {
        "ledger",
        "sinks",
        "core.dispatcher",
        "service",
        "cli",
        "chaos",
        "observability.health",
    },
    # The ledger and the outbox share storage through `store`, never each other.
    "ledger": {"sinks", "core.dispatcher", "service", "cli", "chaos"},
    "sinks": {"ledger", "core.dispatcher", "service", "cli", "chaos"},
    # The harness is a client of the library: nothing in the library depends on it.
    "core.dispatcher": {"chaos", "service", "cli"},
    "service": {"chaos", "cli"},
    # What reaches other processes is below everything that uses it (the defaults aside).
    "connections": {
        "core.model",
        "core.identity",
        "core.dispatcher",
        "store",
        "ledger",
        "sinks",
        "service",
        "cli",
        "chaos",
        "client",
    },
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["flowdecision", *parts])


def _imports(path: Path) -> set[str]:
    """Absolute names of the flowdecision modules ``path`` imports."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] == "flowdecision"}


def _top(name: str) -> str:
    """The unit ``name`` belongs to: its top package, or a layered package's module."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1] in LAYERED:
        return f"{parts[1]}.{parts[2]}"
    return parts[1] if len(parts) > 1 else ""


def _files(unit: str) -> list[Path]:
    where = ROOT.joinpath(*unit.split("."))
    single = where.with_suffix(".py")
    return [single] if single.exists() else sorted(where.rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_the_architecture_allows(package: str) -> None:
    files = _files(package)
    assert files, f"flowdecision/{package} is gone: update docs/ARCHITECTURE.md and this test"
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in sorted(_imports(path))
        if {_top(name), _top(name).split(".")[0]} & FORBIDDEN[package]
    ]
    assert not offences, "\n".join(offences)


#: package -> everything in flowdecision it may import (stricter than FORBIDDEN).
ALLOWED = {
    # Tracing is below everything that records spans: it knows only the error tree.
    "observability.tracing": {"observability.tracing", "errors"},
    # `defaults` (constants only): every constructor's defaults, from one place.
    "store": {
        "store",
        "errors",
        "connections.closing",
        "connections.urls",
        "observability.redact",
        "core.defaults",
        "observability.tracing",
    },
    # `bodies` (TypedDicts only): to_dict() returns the service's JSON shape.
    "ledger": {
        "ledger",
        "store",
        "errors",
        "core.limits",
        "core.identity",
        "core.jsonwire",
        "observability.redact",
        "connections.closing",
        "connections.urls",
        "core.bodies",
        "core.defaults",
        "observability.tracing",
    },
    "sinks": {
        "sinks",
        "store",
        "errors",
        "core.limits",
        "core.model",
        "connections.backoff",
        "connections.closing",
        "connections.urls",
        "observability.redact",
        "core.bodies",
        "core.defaults",
        "observability.tracing",
        # The one JSON encoder, for what a sink sends.
        "core.jsonwire",
        # The async HTTP transport (aiohttp) of the webhook and Restate sinks.
        "connections.transport",
    },
}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_storage_packages_import_only_their_allowlist(package: str) -> None:
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _files(package)
        for name in sorted(_imports(path))
        if _top(name) not in ALLOWED[package]
    ]
    assert not offences, "\n".join(offences)


def test_the_checker_sees_relative_and_lazy_imports() -> None:
    # A guard for the guard: relative imports, and lazy ones inside a function, are found.
    assert "flowdecision.store.sqlite" in _imports(ROOT / "ledger" / "sqlite.py")
    assert "flowdecision.ledger.postgres" in _imports(ROOT / "cli" / "ledger_cmds.py")


def test_no_module_outside_a_backend_calls_a_backends_private_storage_methods() -> None:
    backends = {ROOT / "ledger" / name for name in ("memory.py", "jsonfile.py", "sqlite.py")}
    backends |= {ROOT / "ledger" / "postgres.py", ROOT / "ledger" / "base.py"}
    offences = [
        f"{path.relative_to(ROOT)}: {needle}"
        for path in sorted(ROOT.rglob("*.py"))
        if path not in backends
        for needle in ("._read(", "._apply(", "._prune(", "._read_records(")
        if needle in path.read_text(encoding="utf-8")
    ]
    assert not offences, "\n".join(offences)


def test_the_service_edge_is_one_optional_seam() -> None:
    # Only server.py chooses the edge; the edge knows nothing of the app above it.
    edge = ROOT / "service" / "edge"
    importers = sorted(
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*.py")
        if edge not in path.parents
        and any(name.startswith("flowdecision.service.edge") for name in _imports(path))
    )
    assert importers == ["service/server.py"]
    reaches = {
        name
        for path in edge.rglob("*.py")
        for name in _imports(path)
        if not name.startswith("flowdecision.service.edge")
    }
    assert reaches <= {"flowdecision.service.logs", "flowdecision.service.logs.new_request_id"}


#: Where the project's own Python lives: none of it may use a private OpenTelemetry name.
PROJECT = ROOT.parents[1]
PROJECT_CODE = ("src", "tests", "bench", "examples")


def _private_opentelemetry_uses(source: str) -> list[str]:
    """Each private OpenTelemetry name the Python ``source`` uses: a ``_x`` module or name imported
    from ``opentelemetry``, or a ``_x`` attribute read (also by ``getattr``) of a name
    bound to an OpenTelemetry module or imported from one."""
    tree = ast.parse(source)
    bound: set[str] = set()  # local names of OpenTelemetry modules and their members
    found: list[str] = []

    def private(name: str) -> bool:
        return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "opentelemetry":
                    bound.add(alias.asname or alias.name.split(".")[0])
                    if private(alias.name):
                        found.append(f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == (
            "opentelemetry"
        ):
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if private(f"{node.module}.{alias.name}"):
                    found.append(f"from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and private(node.attr)
        ):
            found.append(f"{node.value.id}.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in bound
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and private(node.args[1].value)
        ):
            found.append(f"{node.func.id}({node.args[0].id}, {node.args[1].value!r})")
    return found


def test_no_project_file_uses_a_private_opentelemetry_name() -> None:
    offences = [
        f"{path.relative_to(PROJECT)}: {use}"
        for folder in PROJECT_CODE
        for path in sorted((PROJECT / folder).rglob("*.py"))
        for use in _private_opentelemetry_uses(path.read_text(encoding="utf-8"))
    ]
    assert not offences, "\n".join(offences)


def test_the_private_name_check_sees_each_form() -> None:
    # A guard for the guard: each way the old tracer reached a private name is found.
    sample = "\n".join(
        [
            "from opentelemetry import context, trace",
            "from opentelemetry.trace.propagation import _SPAN_KEY",
            "from opentelemetry.exporter.http.transport._base import BaseHTTPTransport",
            "from opentelemetry.util._decorator import _agnosticcontextmanager",
            "provider = trace._TRACER_PROVIDER",
            "runtime = getattr(context, '_RUNTIME_CONTEXT', None)",
            "public = trace.get_tracer_provider(), context.attach, trace.__name__",
        ]
    )
    assert _private_opentelemetry_uses(sample) == [
        "from opentelemetry.trace.propagation import _SPAN_KEY",
        "from opentelemetry.exporter.http.transport._base import BaseHTTPTransport",
        "from opentelemetry.util._decorator import _agnosticcontextmanager",
        "trace._TRACER_PROVIDER",
        "getattr(context, '_RUNTIME_CONTEXT')",
    ]


def _module_graph() -> dict[str, set[str]]:
    """Module -> the flowdecision modules it imports (lazy ones and ``TYPE_CHECKING``
    ones too). An imported name counts as the longest module it names; a package a
    module sits in is not counted (Python imports it first, whoever asks)."""
    paths = {_module_name(path): path for path in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        edges = set()
        for name in _imports(path):
            parts = name.split(".")
            target = next(
                (
                    ".".join(parts[:n])
                    for n in range(len(parts), 0, -1)
                    if ".".join(parts[:n]) in paths
                ),
                None,
            )
            if target is not None and target != module and not module.startswith(target + "."):
                edges.add(target)
        graph[module] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others() -> None:
    """No import cycle, however lazy: each module can be read knowing only those below it."""
    assert _cycles(_module_graph()) == []


def test_the_cycle_finder_finds_one() -> None:
    # A guard for the guard: a made-up cycle of three is found, a chain is not.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    # The graph sees lazy and relative imports, and a package's own modules.
    graph = _module_graph()
    assert "flowdecision.store.sqlite" in graph["flowdecision.ledger.sqlite"]
    assert "flowdecision.ledger.postgres" in graph["flowdecision.cli.ledger_cmds"]
