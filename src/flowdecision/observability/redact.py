"""What may be shown to a person: text without secrets or invisible tricks.

Two rules, written once and used by every message, log line, status page and
CLI table:

* :func:`redact_text` masks the password and secret-looking query values of
  every URL inside a longer text, such as a driver's error message
  (:func:`~flowdecision.connections.urls.redact_url`), and libpq's
  ``password=`` keyword.
* :func:`printable` shows control characters, lone surrogates and Unicode
  *format* characters (category ``Cf``: bidi overrides and isolates, zero-width
  characters, tags) as ``\\uXXXX``, so an id like ``pay-\\u202eexe.fdp`` cannot
  pass for ``pay-pdf.exe``; :func:`json_safe` does the same to a JSON line as
  JSON escapes, so the line still decodes to the exact text.
"""

from __future__ import annotations

import re
import unicodedata

from ..connections.urls import redact_url

__all__ = ["json_safe", "printable", "redact_text"]

# A URL inside prose: a scheme (engine prefixes such as dbos+ included), then
# everything up to white space or a quote that ends it in our messages.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s`'\"<>]+")
# libpq's keyword form (`host=h password=secret`), which drivers echo too.
_KEYWORD_PASSWORD = re.compile(r"\b(password|passwd|pwd)(\s*=\s*)('[^']*'|[^\s'\"]+)", re.I)


def redact_text(text: str) -> str:
    """``text`` with every URL in it redacted (:func:`redact_url`) and libpq
    ``password=...`` keywords masked; text without ``://`` or ``=`` is returned as is."""
    if "://" in text:
        text = _URL_IN_TEXT.sub(lambda match: redact_url(match.group()), text)
    if "=" in text:
        text = _KEYWORD_PASSWORD.sub(r"\1\2***", text)
    return text


# Candidates for escaping: C0, DEL, C1, lone surrogates, and the blocks that hold
# every format character (Cf) of the Unicode version Python ships; a candidate is
# escaped when it is a control/surrogate or its category is Cf.
# tests/test_redact.py checks that this class covers every Cf character.
_NON_ASCII_CANDIDATES = (
    "\x80-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e"
    "\u200b-\u200f\u202a-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb\ud800-\udfff"
    "\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3"
    "\U0001d173-\U0001d17a\U000e0000-\U000e0fff"
)
_CANDIDATES = re.compile(f"[\x00-\x1f\x7f{_NON_ASCII_CANDIDATES}]")
# In a JSON text C0 characters stand only outside strings (the encoder escapes
# them inside), as white space that must stay.
_JSON_CANDIDATES = re.compile(f"[{_NON_ASCII_CANDIDATES}]")


def _hidden(char: str) -> bool:
    code = ord(char)
    return (
        code < 0x20
        or 0x7F <= code <= 0x9F
        or 0xD800 <= code <= 0xDFFF
        or (unicodedata.category(char) == "Cf")
    )


def _shown(char: str) -> str:
    code = ord(char)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with control, surrogate and format (Cf) characters shown as ``\\uXXXX``.

    ASCII text without controls comes back as is (no copy).
    """
    if text.isascii() and text.isprintable():
        return text
    return _CANDIDATES.sub(
        lambda match: _shown(match.group()) if _hidden(match.group()) else match.group(), text
    )


def _json_escape(char: str) -> str:
    code = ord(char)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def json_safe(line: str) -> str:
    """A JSON text with every format (Cf) or C1 character written as a JSON escape.

    Such characters can only stand inside JSON strings, so the result decodes to
    the same value; a terminal showing the line shows no bidi trick.
    """
    if line.isascii():
        return line
    return _JSON_CANDIDATES.sub(
        lambda match: _json_escape(match.group()) if _hidden(match.group()) else match.group(),
        line,
    )
