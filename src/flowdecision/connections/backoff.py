"""Retry timing shared by the HTTP callers (the client and the webhook sink).

``parse_retry_after`` reads a ``Retry-After`` header; ``full_jitter`` is the
"full jitter" exponential backoff (a uniform draw between 0 and a doubling
ceiling), which spreads retries of many callers that failed together.
"""

from __future__ import annotations

import email.utils
import random
import time

from ..errors import InvalidArgumentError

__all__ = ["full_jitter", "parse_retry_after"]


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP date)."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(int(value))
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    current = time.time() if now is None else now
    return max(float(when.timestamp()) - current, 0.0)


def full_jitter(retry: int, *, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Delay before retry ``retry`` (1-based): uniform in ``[0, min(cap, base·2^(retry-1))]``."""
    if retry < 1:
        raise InvalidArgumentError(f"retry must be at least 1, got {retry}")
    ceiling = min(cap_s, base_s * 2.0 ** min(retry - 1, 62))
    return rng.uniform(0.0, ceiling)
