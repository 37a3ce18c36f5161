"""Every exception flowdecision raises on purpose derives from one root (issue 9/10).

``test_limits.py`` checks the exception *classes* the package defines; this
checks the *raise sites*: a ``raise ValueError(...)`` would escape
``except FlowDecisionError``. The argument errors keep their built-in base as a
mixin (:class:`InvalidArgumentError` is a ``ValueError``), so callers' existing
``except ValueError`` keeps working.
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

import flowdecision
from flowdecision import (
    FlowDecisionError,
    HarnessError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
)
from flowdecision.connections.backoff import full_jitter

ROOT = Path(flowdecision.__file__).parent

#: Built-in exceptions that may be raised anywhere, and why. Kept short on purpose.
ALLOWED_ANYWHERE = {
    # Python's own convention for a method a subclass must override.
    "NotImplementedError",
    # Ends the process with an exit status: not an error a caller catches.
    "SystemExit",
}

#: (file, built-in) pairs allowed in one place only, and why.
ALLOWED_AT = {
    # Fake engines that simulate *their* failure: a real engine's exception type
    # is its own, never ours, and the dispatcher must treat it as foreign.
    ("cli/demo.py", "ConnectionError"),
    ("chaos/worker.py", "ConnectionResetError"),
    # A module __getattr__ keeping a moved name importable: Python's protocol
    # for "no such attribute" is AttributeError, nothing else.
    ("store/migrations.py", "AttributeError"),
}


def _builtin_exception(node: ast.expr) -> str | None:
    """The built-in exception class ``raise node`` raises, if any.

    ``raise error`` (re-raising a caught variable), ``raise`` alone and
    ``raise factory(...)`` are not built-in classes and pass.
    """
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
        # asyncio.CancelledError and friends: cancellation is a protocol, not an error.
        return None
    if isinstance(target, ast.Name):
        value = getattr(builtins, target.id, None)
        if isinstance(value, type) and issubclass(value, BaseException):
            return target.id
    return None


def _builtin_raises() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            name = _builtin_exception(node.exc)
            if name is None or name in ALLOWED_ANYWHERE or (relative, name) in ALLOWED_AT:
                continue
            found.append(f"{relative}:{node.lineno}: raise {name}")
    return found


def test_no_raise_site_in_the_package_raises_a_built_in_exception() -> None:
    assert _builtin_raises() == []


def test_private_exceptions_never_leave_their_module() -> None:
    # A private exception (``_TooLarge``, ``_InputError``) is an internal signal, not
    # under the root; it is allowed only where the same module catches it by name.
    escaping = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        caught = {
            ast.unparse(handler.type)
            for handler in ast.walk(tree)
            if isinstance(handler, ast.ExceptHandler) and handler.type is not None
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                name = ast.unparse(node.exc.func)
                if (
                    name.startswith("_")
                    and name[1:2].isupper()
                    and not any(name in handler for handler in caught)
                ):
                    escaping.append(f"{path.relative_to(ROOT)}:{node.lineno}: raise {name}")
    assert escaping == []


def test_the_walk_would_see_a_built_in_raise() -> None:
    # A guard for the guard: the checker flags a call, a bare class, and lets a re-raise pass.
    assert _builtin_exception(ast.parse("raise ValueError('x')").body[0].exc) == "ValueError"  # type: ignore[attr-defined,arg-type]
    assert _builtin_exception(ast.parse("raise KeyError").body[0].exc) == "KeyError"  # type: ignore[attr-defined,arg-type]
    assert _builtin_exception(ast.parse("raise error").body[0].exc) is None  # type: ignore[attr-defined,arg-type]


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (InvalidArgumentError, ValueError),
        (InvalidArgumentTypeError, TypeError),
        (HarnessError, RuntimeError),
    ],
)
def test_argument_errors_keep_their_built_in_base(
    cls: type[FlowDecisionError], builtin: type[Exception]
) -> None:
    assert issubclass(cls, FlowDecisionError) and issubclass(cls, builtin)
    assert cls.code and cls.__name__ in flowdecision.__all__


def test_a_bad_argument_is_caught_by_the_package_root_and_by_value_error() -> None:
    import random

    for catch in (FlowDecisionError, ValueError):
        with pytest.raises(catch, match="retry must be at least 1"):
            full_jitter(0, base_s=1.0, cap_s=1.0, rng=random.Random(0))
