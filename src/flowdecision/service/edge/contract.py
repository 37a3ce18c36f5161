"""What the edge relies on inside uvicorn, checked before it serves (and by a test).

The edge wraps uvicorn's HTTP protocol classes and replaces its listening
server, so it depends on names uvicorn does not promise to keep. They are all
listed here; :func:`contract_problems` reads uvicorn's installed source (no
request needed) and names each one that moved. ``serve`` refuses to start the
guarded edge on a uvicorn that breaks the contract (``--edge=plain`` still
runs), and ``tests/test_service_edge.py`` fails on it, naming what moved.

The range of versions tested is pinned in ``pyproject.toml`` (the ``service``
extra): :data:`TESTED` repeats it, and the test checks the two agree.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
from functools import cache

__all__ = ["PROTOCOL_MODULES", "TESTED", "contract_problems", "installed_versions"]

#: The versions tested, as pinned in pyproject.toml: package -> (lowest, first untested).
TESTED = {
    "uvicorn": ((0, 55), (0, 56)),
    "httptools": ((0, 9), (0, 10)),
    "uvloop": ((0, 23), (0, 24)),
}

#: uvicorn's HTTP/1.1 protocol modules the edge wraps (class, request cycle class).
PROTOCOL_MODULES = {
    "uvicorn.protocols.http.h11_impl": ("H11Protocol", "RequestResponseCycle"),
    "uvicorn.protocols.http.httptools_impl": ("HttpToolsProtocol", "RequestResponseCycle"),
}

#: Methods of the protocol class the edge overrides or calls.
_PROTOCOL_METHODS = (
    "connection_made",
    "connection_lost",
    "data_received",
    "eof_received",
    "on_response_complete",  # completes a response (flush, linger, keep-alive timer)
    "send_400_response",  # uvicorn's plain-text answer to malformed HTTP, made JSON
    "_unset_keepalive_if_required",  # uvicorn's keep-alive timer, replaced by ours
    "pause_writing",  # its flow control, which the write timeout watches
    "resume_writing",
)
#: Attributes the protocol sets on itself: the current request and the transport.
_PROTOCOL_ATTRIBUTES = ("cycle", "transport")
#: What the edge reads of a request cycle.
_CYCLE_ATTRIBUTES = ("more_body", "response_started", "response_complete", "disconnected")
#: The protocol's constructor, as the edge's factory calls it.
_PROTOCOL_PARAMETERS = ("config", "server_state", "app_state")
#: uvicorn.Server: startup(sockets=[]) runs the lifespan and listens on nothing;
#: the edge's acceptors go into ``servers`` so that shutdown closes them.
_SERVER_METHODS = ("startup", "shutdown", "on_tick", "handle_exit", "main_loop")
_SERVER_ATTRIBUTES = ("servers", "server_state", "lifespan", "started", "should_exit")


def _self_assignments(node: ast.AST) -> set[str]:
    """Names assigned as ``self.<name> = ...`` anywhere inside ``node``."""
    names: set[str] = set()
    for child in ast.walk(node):
        targets: list[ast.expr] = []
        if isinstance(child, ast.Assign):
            targets = list(child.targets)
        elif isinstance(child, ast.AnnAssign | ast.AugAssign):
            targets = [child.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                names.add(target.attr)
    return names


def _class_node(tree: ast.Module, name: str) -> ast.ClassDef | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


@cache
def contract_problems() -> tuple[str, ...]:
    """What moved in the installed uvicorn that the edge relies on (empty: nothing)."""
    problems: list[str] = []
    for module_name, (protocol_name, cycle_name) in PROTOCOL_MODULES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            if module_name.endswith("httptools_impl") and error.name == "httptools":
                continue  # httptools is optional; h11 is then the only parser
            problems.append(f"{module_name} cannot be imported: {error}")
            continue
        tree = ast.parse(inspect.getsource(module))
        protocol = getattr(module, protocol_name, None)
        protocol_node = _class_node(tree, protocol_name)
        cycle_node = _class_node(tree, cycle_name)
        if protocol is None or protocol_node is None or cycle_node is None:
            problems.append(f"{module_name} has no {protocol_name} or {cycle_name}")
            continue
        where = f"{module_name}.{protocol_name}"
        problems += [
            f"{where}.{name}() is gone"
            for name in _PROTOCOL_METHODS
            if not callable(getattr(protocol, name, None))
        ]
        parameters = inspect.signature(protocol.__init__).parameters
        problems += [
            f"{where}() no longer takes `{name}`"
            for name in _PROTOCOL_PARAMETERS
            if name not in parameters
        ]
        assigned = _self_assignments(protocol_node)
        problems += [
            f"{where} no longer sets self.{name}"
            for name in _PROTOCOL_ATTRIBUTES
            if name not in assigned
        ]
        cycle_assigned = _self_assignments(cycle_node)
        problems += [
            f"{module_name}.{cycle_name} no longer sets self.{name}"
            for name in _CYCLE_ATTRIBUTES
            if name not in cycle_assigned
        ]
    server = importlib.import_module("uvicorn.server")
    server_node = _class_node(ast.parse(inspect.getsource(server)), "Server")
    server_class = getattr(server, "Server", None)
    if server_node is None or server_class is None:
        return (*problems, "uvicorn.server has no Server")
    problems += [
        f"uvicorn.Server.{name}() is gone"
        for name in _SERVER_METHODS
        if not callable(getattr(server_class, name, None))
    ]
    if "sockets" not in inspect.signature(server_class.startup).parameters:
        problems.append("uvicorn.Server.startup() no longer takes `sockets`")
    assigned = _self_assignments(server_node)
    problems += [
        f"uvicorn.Server no longer sets self.{name}"
        for name in _SERVER_ATTRIBUTES
        if name not in assigned
    ]
    return tuple(problems)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts: list[int] = []
    for part in text.split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def installed_versions() -> dict[str, tuple[tuple[int, ...], bool]]:
    """package -> (installed version, within :data:`TESTED`), for the installed packages."""
    found: dict[str, tuple[tuple[int, ...], bool]] = {}
    for package, (low, high) in TESTED.items():
        try:
            version = _version_tuple(importlib.metadata.version(package))
        except importlib.metadata.PackageNotFoundError:
            continue
        found[package] = (version, low <= version < high)
    return found
