"""``UsageError``: a mistake of the user's (an argument, a path, a config value, the job's data), not a bug.

The command line prints one as one ``error:`` line and exits with status 2; every other exception is
a bug (or a broken environment) and exits with status 1 and its traceback. It subclasses
``ValueError``, so Python callers that catch ``ValueError`` from a constructor or a data source keep
working. Standard library only: the command line raises it before torch loads.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable


class UsageError(ValueError):
    """A mistake the user can fix (the message says what and how); exit status 2 on the command line."""


def check_count(name: str, value: object, minimum: int = 1, none_ok: bool = False) -> None:
    """UsageError naming ``name`` unless ``value`` is an int (not a bool) >= ``minimum`` (or None when
    ``none_ok``): a string or float from a config is refused here, not by a comparison deep inside."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        also = " (or None)" if none_ok else ""
        raise UsageError(f"{name} must be an integer >= {minimum}{also}, got {value!r}")


def check_sizes(name: str, sizes: Iterable[int]) -> tuple[int, ...]:
    """``sizes`` as a tuple of integers >= 1; else a UsageError naming ``name`` and the value."""
    sizes = tuple(sizes) if isinstance(sizes, Iterable) else sizes
    if not isinstance(sizes, tuple) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise UsageError(f"{name} must be an iterable of integers >= 1, got {sizes!r}")
    return sizes
