"""``serialized``: a method that runs under its object's ``_lock`` (a ``threading.RLock``), one call at a time.

The decode engine and the streaming decoder are shared by a server's threads: a thread per request
calling ``decode``, a thread per stream calling ``step({its stream: chunk})``. Their calls touch
shared slots, planner state and, on CUDA, the graphs' static buffers (two replays of one graph from
two threads would read each other's codes), so each call runs whole before the next. The lock is
re-entrant: a method may call another. What it does not do: run calls in parallel (one device runs
the forwards anyway) or order them fairly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def serialized(method: F) -> F:
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]
