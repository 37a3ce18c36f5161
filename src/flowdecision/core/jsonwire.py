"""serde_json-compatible JSON parsing and encoding.

The Rust original hashes ``serde_json::to_vec`` output and parses requests with
``serde_json::from_slice``, so the port must accept exactly the same texts and
produce exactly the same bytes.  Reading, Python's :mod:`json` is close, and its C
accelerators do the heavy lifting; this module patches the gaps. Writing is orjson's:

* parsing: integers beyond the i64/u64 range become floats, the integer ``-0``
  becomes ``-0.0``, ``NaN``/``Infinity``/overflowing numbers, lone surrogate
  escapes and nesting of 128 containers or more are rejected, and bytes must be
  UTF-8 (``json.loads`` would sniff UTF-16/32);
* optionally (``exact_numbers=True``, not serde's behaviour): numbers the model
  cannot keep exactly are rejected instead of rounded, naming their path;
* encoding: one encoder, orjson, which writes serde_json's bytes (Ryu's float
  layout, ``1e16`` and ``0.00001``; serde's escapes); non-finite floats are
  rejected.

Objects repeated keys keep the last value (like ``serde_json::Map``).  Because a
repeated *struct* field is an error in serde, parsed objects that repeated a key
are returned as :class:`DuplicateKeyDict`, which records the repeated keys so
the model layer can reject them; see :func:`duplicate_keys`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from decimal import Decimal
from typing import Any, Final

import orjson

from ..errors import InexactNumberError, JsonWireError
from .limits import I64_MIN, JSON_MAX_DEPTH, U64_MAX

__all__ = [
    "MAX_DEPTH",
    "DuplicateKeyDict",
    "Fragment",
    "InexactNumberError",
    "JsonWireError",
    "canonicalize",
    "count_items",
    "duplicate_keys",
    "encode_json",
    "encode_json_text",
    "encode_str",
    "format_float",
    "key_segment",
    "parse_json",
]

#: Deepest container nesting serde_json accepts by default (re-exported).
MAX_DEPTH: Final = JSON_MAX_DEPTH

_INF: Final = float("inf")
_MIN_NORMAL: Final = 2.2250738585072014e-308


class DuplicateKeyDict(dict[str, Any]):
    """A parsed JSON object whose text repeated a key; the last value was kept.

    It behaves as a plain ``dict``; ``duplicate_keys`` names the repeated keys.
    """

    __slots__ = ("duplicate_keys",)
    duplicate_keys: frozenset[str]


def duplicate_keys(obj: object) -> frozenset[str]:
    """Return the keys repeated in the JSON text that produced ``obj`` (if any)."""
    if isinstance(obj, DuplicateKeyDict):
        return obj.duplicate_keys
    return frozenset()


# --------------------------------------------------------------------------- parsing


def _object_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    # Rare path: remember which keys repeated so struct parsing can refuse them.
    seen: set[str] = set()
    repeated: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            repeated.add(key)
        seen.add(key)
    marked = DuplicateKeyDict(obj)
    marked.duplicate_keys = frozenset(repeated)
    return marked


def _reject_constant(name: str) -> Any:
    # json.loads accepts NaN/Infinity/-Infinity; JSON (and serde_json) do not.
    raise JsonWireError(f"`{name}` is not a valid JSON value")


def _parse_int(text: str) -> int | float:
    if len(text) < 19:  # at most 18 digits: always inside i64
        if text == "-0":
            # serde_json turns the integer -0 into the float -0.0.
            return -0.0
        return int(text)
    if len(text) <= 21:
        value = int(text)
        if I64_MIN <= value <= U64_MAX:
            return value
    # Beyond i64/u64 serde_json falls back to f64 (and fails on overflow).
    return _parse_float(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if value == _INF or value == -_INF:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise JsonWireError(f"number out of range: `{shown}`")
    return value


# Escapes that matter for surrogates, matched left to right so that an escaped
# backslash is consumed as a pair (keeping the parity of what follows right):
# an escaped backslash, a valid surrogate pair, or (group 1) a lone surrogate.
_SURROGATE_SCAN: Final = re.compile(
    r"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|(\\u[dD][0-9a-fA-F]{3})"
)
_SURROGATE_ESCAPE: Final = re.compile(r"\\u[dD][89a-fA-F]")
# A high surrogate escape not followed by a low one, or a low one not preceded
# by a high one (valid only when the text has no escaped backslashes).  It
# starts with the literal `\u` so the regex engine can scan for it quickly.
_LONE_SURROGATE: Final = re.compile(
    r"\\u[dD](?:[89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    r"|[c-fC-F][0-9a-fA-F]{2}(?<!\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}))"
)

# Depth scan helpers: keep only brackets and quotes, brackets as parentheses.
_DEPTH_DELETE: Final = bytes(range(256)).translate(None, b'[]{}"')
_DEPTH_PARENS: Final = bytes.maketrans(b"[]{}", b"()()")


def _has_surrogate(text: str) -> bool:
    # Encoding is far faster than a character-class regex scan.
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _position(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - text.rfind("\n", 0, pos)


def _check_surrogate_escapes(text: str) -> None:
    # json.loads decodes lone surrogate escapes into unpaired surrogates;
    # serde_json rejects them.  Only texts holding a surrogate escape are scanned.
    if "\\u" not in text or _SURROGATE_ESCAPE.search(text) is None:
        return
    found: str | None = None
    start = 0
    if "\\\\" not in text:
        # No escaped backslashes, so every `\u` starts an escape: one search.
        lone = _LONE_SURROGATE.search(text)
        if lone is not None:
            found, start = lone.group(0), lone.start()
    else:
        for match in _SURROGATE_SCAN.finditer(text):
            if match.group(1) is not None:
                found, start = match.group(1), match.start(1)
                break
    if found is not None:
        line, column = _position(text, start)
        raise JsonWireError(f"lone surrogate escape `{found}`", line=line, column=column)


# Item count helpers: keep only what delimits an item (containers, commas) and quotes.
_ITEMS_DELETE: Final = bytes(range(256)).translate(None, b'[{,"')


def count_items(raw: bytes) -> int:
    """About how many values a JSON text holds, without parsing it: its containers
    plus the commas between items, outside strings (for valid JSON, an upper bound
    of its values and containers, and what parsing it costs).

    Runs at C speed on bytes (one ``translate`` pass, about 1.5 ms per MB, and a
    split when there are strings).
    """
    if b"\\" in raw:  # escaped backslashes and quotes do not delimit strings
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    shape = raw.translate(None, _ITEMS_DELETE)
    if b'"' in shape:
        shape = b"".join(shape.split(b'"')[0::2])
    return len(shape)


def _depth_exceeds(raw: bytes, limit: int) -> bool:
    """True if the (valid JSON) text nests more than ``limit`` containers.

    Runs at C speed on bytes: drop escaped backslashes and quotes, keep only
    brackets and quotes, drop string contents, then peel innermost ``()``
    pairs one level per round (``bytes.replace`` does not cascade).
    """
    shape = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    shape = shape.translate(_DEPTH_PARENS, _DEPTH_DELETE)
    shape = b"".join(shape.split(b'"')[0::2])
    for _ in range(limit):
        if not shape:
            return False
        shape = shape.replace(b"()", b"")
    return bool(shape)


# -- exact numbers: refuse what serde_json would round ------------------------------


class _Inexact:
    """A number that would lose precision; raised (exact mode) or left as a marker."""

    __slots__ = ("problem",)

    def __init__(self, problem: str) -> None:
        self.problem = problem


class _InexactNumber(Exception):
    def __init__(self, inexact: _Inexact) -> None:
        super().__init__(inexact.problem)
        self.inexact = inexact


def _shown(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


def _inexact_int(text: str) -> _Inexact | None:
    if len(text) < 19 or (len(text) <= 21 and I64_MIN <= int(text) <= U64_MAX):
        return None
    return _Inexact(
        f"integer `{_shown(text)}` is outside the 64-bit range ({I64_MIN}..{U64_MAX}) "
        "and would be rounded to a float"
    )


def _inexact_float(text: str, value: float) -> _Inexact | None:
    shortest = repr(value)
    # The shortest repr round-trips to `value`; the text is kept exactly when it
    # names the same decimal number (`1.50`, `1e3` and `1000.0` all do).
    if shortest == text or Decimal(text) == Decimal(shortest):
        return None
    return _Inexact(
        f"number `{_shown(text)}` cannot be held exactly by a 64-bit float "
        f"(it would become `{format_float(value)}`)"
    )


def _exact_int(text: str) -> int | float:
    if len(text) < 19:  # the common case, as in _parse_int
        return -0.0 if text == "-0" else int(text)
    inexact = _inexact_int(text)
    if inexact is not None:
        raise _InexactNumber(inexact)
    return _parse_int(text)


def _exact_float(text: str) -> float:
    value = _parse_float(text)
    # At most 15 significant digits (DBL_DIG) in the normal range always print
    # back as the same number: no need to compare decimals.
    if len(text) <= 15 and abs(value) >= _MIN_NORMAL:
        return value
    inexact = _inexact_float(text, value)
    if inexact is not None:
        raise _InexactNumber(inexact)
    return value


def _marked_int(text: str) -> int | float | _Inexact:
    return _inexact_int(text) or _parse_int(text)


def _marked_float(text: str) -> float | _Inexact:
    value = _parse_float(text)
    return _inexact_float(text, value) or value


def key_segment(key: str) -> str:
    """The path segment for an object key: ``.key``, or ``["key"]`` if it is no identifier."""
    if key.isidentifier():
        return f".{key}"
    return f"[{encode_str(key)}]"


def _find_inexact(value: Any, path: str) -> Iterator[tuple[str, _Inexact]]:
    """The inexact-number markers in document order, with their paths."""
    if isinstance(value, _Inexact):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _find_inexact(item, f"{path}{key_segment(key)}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _find_inexact(item, f"{path}[{index}]")


# The number hooks cost less than any regex pre-scan that could avoid them.
_DECODER: Final = json.JSONDecoder(
    object_pairs_hook=_object_pairs,
    parse_constant=_reject_constant,
    parse_int=_parse_int,
    parse_float=_parse_float,
)
_EXACT_DECODER: Final = json.JSONDecoder(
    object_pairs_hook=_object_pairs,
    parse_constant=_reject_constant,
    parse_int=_exact_int,
    parse_float=_exact_float,
)
# Only used to locate an inexact number once the exact decoder has found one.
_MARKING_DECODER: Final = json.JSONDecoder(
    object_pairs_hook=_object_pairs,
    parse_constant=_reject_constant,
    parse_int=_marked_int,
    parse_float=_marked_float,
)


def parse_json(
    data: bytes | bytearray | memoryview | str,
    *,
    max_depth: int | None = MAX_DEPTH,
    exact_numbers: bool = False,
) -> Any:
    """Parse one JSON document the way ``serde_json::from_slice`` into ``Value`` would.

    Integers within i64/u64 stay exact ``int``; larger ones become ``float``;
    the integer ``-0`` becomes ``-0.0``.  Objects become ``dict`` (the last of
    repeated keys wins; such objects are :class:`DuplicateKeyDict`).  Raises
    :class:`JsonWireError` for anything serde_json rejects: invalid UTF-8,
    syntax errors, trailing characters or commas, ``NaN``/``Infinity``, numbers
    that overflow ``f64``, lone surrogate escapes, and more than ``max_depth``
    nested containers (``None`` disables that limit).

    With ``exact_numbers`` (stricter than serde_json) a number that would not be
    kept exactly is an error too, whose ``path`` names where it sits: an integer
    outside i64/u64 (serde_json would round it to a float), or a decimal that
    no 64-bit float holds exactly enough to print it back as written (a float
    round-trips when its shortest form names the same number: ``0.1``,
    ``1.50`` and ``1e3`` do; ``0.10000000000000000001`` and ``1e-400`` do not).
    """
    if isinstance(data, str):
        text = data
        raw: bytes | None = None
        if _has_surrogate(text):
            raise JsonWireError("input contains a lone surrogate (not valid Unicode)")
    else:
        raw = bytes(data)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonWireError(f"invalid UTF-8 at byte offset {exc.start}") from None
    try:
        value = (_EXACT_DECODER if exact_numbers else _DECODER).decode(text)
    except _InexactNumber as exc:
        raise _locate_inexact(text, exc.inexact) from None
    except json.JSONDecodeError as exc:
        raise JsonWireError(
            _describe_decode_error(exc), line=exc.lineno, column=exc.colno
        ) from None
    except RecursionError:
        raise JsonWireError("recursion limit exceeded") from None
    _check_surrogate_escapes(text)
    if max_depth is not None and text.count("[") + text.count("{") > max_depth:
        if _depth_exceeds(text.encode("utf-8") if raw is None else raw, max_depth):
            raise JsonWireError(f"recursion limit exceeded (more than {max_depth} nested levels)")
    return value


def _locate_inexact(text: str, first: _Inexact) -> InexactNumberError:
    # Rare path: decode again, marking instead of raising, to name the paths.
    found = [
        (path.removeprefix("."), inexact.problem)
        for path, inexact in _find_inexact(_MARKING_DECODER.decode(text), "")
    ]
    if not found:  # it sat under a repeated key whose last value won
        return InexactNumberError(first.problem, None, [])
    path, problem = found[0]
    return InexactNumberError(problem, path, found)


def _describe_decode_error(exc: json.JSONDecodeError) -> str:
    # Reword the common cases the way serde_json names them.
    doc, pos = exc.doc, exc.pos
    if exc.msg == "Extra data":
        return "trailing characters"
    if pos >= len(doc.rstrip(" \t\r\n")):
        return "EOF while parsing a value"
    if doc[pos] in "]}" and doc[:pos].rstrip(" \t\r\n").endswith(","):
        return "trailing comma"
    if exc.msg.startswith("Invalid control character"):
        return "control character (\\u0000-\\u001F) found while parsing a string"
    return exc.msg


# -------------------------------------------------------------------------- encoding
#
# One encoder writes every wire text: orjson, whose float form is Ryu's shortest
# round trip in serde_json's layout (``1e16``, ``0.00001``, ``1.5e-7``) and whose
# string escapes are serde_json's (``"``, ``\\`` and U+0000..U+001F, ``\u00xx``
# lowercase; DEL, U+2028/U+2029 and the rest raw). orjson 3.11 began writing a
# positive exponent with a sign (``1e+16``), which serde_json does not: the pin
# (``orjson>=3.10,<3.11``) is the range tests/test_jsonwire.py checks byte for byte.

_SORTED: Final = orjson.OPT_SORT_KEYS

#: A value already encoded (by this module), placed as it is in a larger text.
Fragment: Final = orjson.Fragment


def _non_finite(value: Any) -> bool:
    if type(value) is float:
        return value != value or value in (_INF, -_INF)
    if isinstance(value, dict):
        return any(_non_finite(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_non_finite(item) for item in value)
    return False


def format_float(value: float) -> str:
    """Format a finite float as serde_json (Ryu) does: ``1.0``, ``1e16``, ``0.00001``."""
    if value != value or value in (_INF, -_INF):
        raise JsonWireError(f"non-finite float {value!r} cannot be encoded as JSON")
    return orjson.dumps(float(value)).decode()


def encode_str(value: str) -> str:
    """Encode one string as a JSON string literal, exactly as serde_json does."""
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:
        raise JsonWireError("value holds a lone surrogate, which is not valid UTF-8") from None


def encode_json(value: Any, *, sort_keys: bool = False) -> bytes:
    """Return exactly what ``serde_json::to_vec`` writes for ``value``.

    Output is compact; objects keep their insertion order unless
    ``sort_keys`` (then keys sort by code point at every level, like
    serde_json's default ``Map``).  ``None``/``bool``/``int``/``float``/``str``/
    ``list``/``tuple``/``dict`` and :data:`Fragment` are supported.  Raises
    :class:`JsonWireError` for non-finite floats, unsupported types, keys that
    are not strings, integers beyond i64/u64 and lone surrogates.
    """
    try:
        data = orjson.dumps(value, option=_SORTED if sort_keys else 0)
    except orjson.JSONEncodeError as exc:  # a type, a key, an integer over 64 bits, ...
        raise JsonWireError(f"value cannot be encoded as JSON: {exc}") from None
    # orjson writes NaN and the infinities as null; JSON has no such numbers.
    # (``find``, not ``in``: ``bytes.__contains__`` first tries its argument as an
    # integer and builds a TypeError to throw away, a third of this call's cost.)
    if data.find(b"null") != -1 and _non_finite(value):
        raise JsonWireError("value cannot be encoded as JSON: a float is not finite")
    return data


def encode_json_text(value: Any, *, sort_keys: bool = False) -> str:
    """Like :func:`encode_json` but returns ``str`` (hot paths call
    ``encode_json(value).decode()``: one Python call instead of two)."""
    return encode_json(value, sort_keys=sort_keys).decode()


def canonicalize(value: Any) -> Any:
    """Return ``value`` with object keys sorted by code point at every level.

    Arrays keep their order (tuples become lists); scalars are returned as is.
    The result is a fresh structure, so it is also a deep copy of containers.
    """
    if isinstance(value, dict):
        return {key: canonicalize(value[key]) for key in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [canonicalize(item) for item in value]
    return value
