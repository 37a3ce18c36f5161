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

#: package -> the flowdecision packages/modules it must never import
FORBIDDEN = {
    # Storage knows no ledger, outbox or anything above them.
    "store": {"ledger", "sinks", "dispatcher", "service", "cli", "chaos", "health"},
    # The ledger and the outbox share storage through `store`, never each other.
    "ledger": {"sinks", "dispatcher", "service", "cli", "chaos"},
    "sinks": {"ledger", "dispatcher", "service", "cli", "chaos"},
    # The harness is a client of the library: nothing in the library depends on it.
    "dispatcher": {"chaos", "service", "cli"},
    "service": {"chaos", "cli"},
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
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def _files(package: str) -> list[Path]:
    single = ROOT / f"{package}.py"
    return [single] if single.exists() else sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_the_architecture_allows(package: str) -> None:
    files = _files(package)
    assert files, f"flowdecision/{package} is gone: update docs/ARCHITECTURE.md and this test"
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in sorted(_imports(path))
        if _top(name) in FORBIDDEN[package]
    ]
    assert not offences, "\n".join(offences)


#: package -> everything in flowdecision it may import (stricter than FORBIDDEN).
ALLOWED = {
    # `defaults` (constants only): every constructor's defaults, from one place.
    "store": {"store", "errors", "closing", "redact", "defaults", "tracing"},
    # `bodies` (TypedDicts only): to_dict() returns the service's JSON shape.
    "ledger": {
        "ledger",
        "store",
        "errors",
        "limits",
        "identity",
        "jsonwire",
        "redact",
        "bodies",
        "defaults",
        "tracing",
    },
    "sinks": {
        "sinks",
        "store",
        "errors",
        "limits",
        "model",
        "backoff",
        "closing",
        "redact",
        "bodies",
        "defaults",
        "tracing",
        # The async HTTP transport (aiohttp) of the webhook and Restate sinks.
        "transport",
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
