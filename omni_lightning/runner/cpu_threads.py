"""torch's intra-op threads for a command-line run on the CPU: the cores free to this process.

torch starts one thread per core it sees. Where those cores are busy (other processes, this run's own
data-loader workers) its threads wait on each other: on a shared 2-core machine two threads made the
README's 40-step fit about 3x slower than one (docs/performance.md, "CPU threads"). The command line
counts the cores this process may run on (``os.sched_getaffinity``), less its loader workers and the
cores other processes keep busy (the 1-minute load average), at least one. ``OMP_NUM_THREADS`` set in
the environment is the user's choice and stands. Standard library and torch only.
"""

from __future__ import annotations

import os

_said: str | None = None  # how the command line chose, for the start-up line


def free_cores(workers: int = 0) -> tuple[int, str]:
    """The cores free to this process beside its ``workers`` loader workers, and the reason in words
    (``2 cores, load 1.3, 2 loader workers``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    busy = min(cores, int(load))  # cores others keep busy, whole ones: a quiet machine's 0.5 counts none
    free = max(1, cores - busy - workers)
    reason = [f"{cores} core{'s' * (cores != 1)}", f"load {load:.1f}"]
    if workers:
        reason.append(f"{workers} loader worker{'s' * (workers != 1)}")
    return free, ", ".join(reason)


def choose_threads(workers: int = 0) -> str:
    """Sets torch's intra-op threads to :func:`free_cores` unless ``OMP_NUM_THREADS`` is set; returns what
    the start-up line says (``1 torch thread (2 cores, load 4.4)``)."""
    import torch

    global _said
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        n = torch.get_num_threads()
        _said = f"{n} torch thread{'s' * (n != 1)} (OMP_NUM_THREADS)"
        return _said
    n, reason = free_cores(workers)
    torch.set_num_threads(n)
    _said = f"{n} torch thread{'s' * (n != 1)} ({reason})"
    return _said


def threads_said() -> str:
    """The start-up line's account of torch's threads: the command line's choice, else torch's count."""
    if _said is not None:
        return _said
    import torch

    n = torch.get_num_threads()
    return f"{n} torch thread{'s' * (n != 1)}"


def forget() -> None:
    """Drops the command line's account (its run ended; torch's count was put back)."""
    global _said
    _said = None
