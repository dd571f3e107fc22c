"""``omni-lightning serve`` as processes: engine processes decode, front processes speak HTTP and WebSocket
(``serving/supervisor.py``). Every client is exact whichever front it reached, ``/metrics`` sums every
process, SIGTERM drains and exits 0, and no child outlives the server or a dead sibling."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import httpx
import pytest
from serve_helpers import clients_exact, serve_command, wait_until

pytest.importorskip("fastapi")


def children(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs (from /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found + [g for c in found for g in children(c)]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_engine_and_two_fronts_each_client_exact_metrics_summed_sigterm_exits_0():
    proc, line, url = serve_command("--front_processes", "2")
    try:
        assert "1 engine process, 2 fronts; listening on" in line, line
        assert "streams on a lane of their own" in line, line  # the default (--stream_lane null), a CPU's too
        pids = set()
        while len(pids) < 2:  # both fronts answer (a new connection each: the kernel spreads them)
            pids.add(httpx.get(f"{url}/health").json()["pid"])
        clients_exact(url, 12, seed=0)
        text = httpx.get(f"{url}/metrics").text  # one front answers for every process
        ok = sum(float(v) for v in re.findall(r'omni_requests_total\{route="(?:code2wav|stream)",status="200"\} (\S+)',
                                              text))  # fmt: skip
        assert ok == 12, text
        assert float(re.search(r"^omni_audio_seconds_total (\S+)", text, re.M).group(1)) > 0
        kids = children(proc.pid)
        assert len(kids) >= 3  # the engine and two fronts (and multiprocessing's helper)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert wait_until(lambda: not any(alive(k) for k in kids), 10)
        # every process serve owns logs to stderr: the engine's warm-up and start-up lines too, not only the fronts'
        said = proc.stderr.read()
        assert re.search(r"serve: warm-up \(chunks of .* took \d+\.\d\d s", said), said[-3000:]
        for who in ("engine", "front 0", "front 1"):
            kept = rf"serve: {who} \(pid \d+\): \d+ objects of its start-up kept out"
            assert re.search(kept, said), (who, said[-3000:])
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_dead_engine_stops_the_server_non_zero_and_children_die_with_a_killed_parent():
    proc, line, url = serve_command("--front_processes", "1")
    try:
        kids = children(proc.pid)
        spawned = sorted(k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes())
        assert len(spawned) == 2, kids
        os.kill(spawned[0], signal.SIGKILL)  # the engine: started before the front
        assert proc.wait(60) != 0
        assert "ended while serving" in proc.stderr.read()
        assert wait_until(lambda: not any(alive(k) for k in kids), 10)
    finally:
        proc.kill()
        proc.wait()
    proc, line, url = serve_command("--front_processes", "2")
    try:
        kids = children(proc.pid)
        proc.kill()  # the parent dies without a word: its children follow
        proc.wait()
        assert wait_until(lambda: not any(alive(k) for k in kids), 15), [k for k in kids if alive(k)]
    finally:
        proc.kill()
        proc.wait()
