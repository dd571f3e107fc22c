"""Which rows run in the next forward, at which shape: the decode engine's planner (pure Python).

Every forward has a bucket shape ``(rows, chunk)``: ``rows`` batch rows (a power of two; padding rows
use a scratch slot), each advancing up to ``chunk`` frames (shorter rows are padded in time; their
state is saved at their true end). Few shapes mean few CUDA graph captures; ``rows * chunk <=
frames`` (the frame budget) bounds memory.

The planner is greedy, one forward at a time. For each chunk it takes the rows with the most frames
left and scores the forward by real frames over cost, all in frames: ``rows * chunk`` plus
``step_cost`` (a forward's fixed cost), plus ``new_shape_cost`` for a shape not run yet (a capture or
new cuDNN plans), plus another ``step_cost`` when the forward leaves rows unfinished (one-step
look-ahead). Shapes run before are candidates too, rows padded up; batch decode (``pad_in_time``)
also pads chunks up to a shape it has. A streaming step decodes every row before it returns (``whole``):
its forwards are planned for the whole step (``whole_step``: the cheapest runs of rows, each row whole in
one forward, padded in rows and frames to shapes captured where that costs less than a forward or a shape
more), where that costs less than planning greedily to the end; at a server's warm shapes and CUDA's
prices, a step then runs in one or two forwards rather than in a handful of small ones.
``scripts/profiling/simulate_plan.py`` prices plans. ``new_shape_cost`` is low (:data:`NEW_SHAPE_COST`): a
greedy planner that prices a new shape near a whole forward never finds the few small shapes that
end a batch's requests without padding (at a 0.03 share of an H100, 512 frames a forward, the 2-30 s
job padded 12.5 % and the long-tailed one 14 % at 1024; 2.8 % and 4.8 % at 64), and an engine keeps
its shapes from one job to the next, so each is paid once.

``exact_eager`` (set with CUDA graphs on): a forward longer than ``graph_frames`` uses the whole
budget, ``rows * chunk == frames``, at least half its rows real, so every eager forward has the same
tensor sizes and the caching allocator reuses the same blocks. A forward that finishes every row may
take any shape within the budget. Not done: look-ahead over several forwards.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ROWS = (1, 2, 4, 8, 16, 32, 64)
# dense where streaming chunks live (every size up to 8 frames: a stream's chunk is never padded
# much), then x1.5 steps; past MAX_CHUNK (attention scores grow with the chunk) only as one row
# taking a whole budget (a lone long request)
CHUNKS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048,
          3072, 4096, 6144, 8192)  # fmt: skip
MAX_CHUNK = 1024
NEW_SHAPE_COST = 64  # frames a shape not run yet costs the planner (see the module docstring)


@dataclass(frozen=True)
class Plan:
    """One forward: bucket ``(rows, chunk)``; ``take[i]`` frames of request ``requests[i]``."""

    rows: int
    chunk: int
    requests: tuple[int, ...]
    take: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.chunk


@dataclass(frozen=True)
class Planner:
    """Shapes within ``frames`` padded frames per forward and ``max_rows`` rows (see module docstring)."""

    frames: int
    max_rows: int = 64
    chunks: tuple[int, ...] = CHUNKS
    rows: tuple[int, ...] = ROWS
    step_cost: int = 128
    new_shape_cost: int = NEW_SHAPE_COST
    graph_frames: int = 0  # shapes of at most this many frames run as CUDA graphs (0: none)
    exact_eager: bool = False  # eager (longer) forwards use exactly `frames` (see the module docstring)

    def __post_init__(self) -> None:
        if self.frames < 1:
            raise ValueError(f"the frame budget must be >= 1 frame per forward, got {self.frames}")
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}")

    def row_bucket(self, n: int) -> int:
        """The smallest row bucket holding ``n`` rows (``n`` itself past the largest; padding rows
        all use the scratch slot, so a bucket may exceed ``max_rows``)."""
        return next((r for r in self.rows if r >= n), n)

    def shapes(self) -> list[tuple[int, int]]:
        """Every bucket a forward may have."""
        found = set()
        for chunk in self.chunks:
            if chunk <= self.frames:
                for n in range(1, self.max_rows + 1):
                    found.update((rows, chunk) for rows, _ in self._candidates(n, chunk))
        return sorted(found)

    def _candidates(self, n_rows: int, chunk: int, finishes: bool = False) -> list[tuple[int, int]]:
        """``(rows bucket, rows taken)`` of the shapes a forward of ``chunk`` frames may have;
        ``finishes``: such a forward of every row would leave no frame (a streaming step, say)."""
        out = []
        if chunk <= min(self.graph_frames, MAX_CHUNK):  # a CUDA graph: any bucket within graph_frames
            n = min(n_rows, self.graph_frames // chunk, self.max_rows)
            rows = self.row_bucket(n)
            while rows * chunk > self.graph_frames:
                n = max(r for r in self.rows if r < rows) if rows > 1 else 1
                rows = self.row_bucket(n)
            out.append((rows, n))
        exact = self.exact_eager and not (finishes and n_rows <= self.max_rows)
        if exact:  # eager: the whole budget, so every eager forward reuses the same blocks
            rows = self.frames // chunk
            n = min(n_rows, rows, self.max_rows)
            # not when most rows would be padding: a lone request is not run as 32 rows (a CUDA graph
            # of its own shape does it at a fraction of the cost once captured, which the capture
            # penalty would otherwise never let happen)
            if rows * chunk == self.frames and rows * chunk > self.graph_frames and rows in self.rows and 2 * n >= rows:
                out.append((rows, n))
        elif chunk <= MAX_CHUNK or n_rows == 1:  # a lone request's last forward: any chunk in the budget
            n = min(n_rows, self.frames // chunk, self.max_rows)
            rows = self.row_bucket(n)
            while rows * chunk > self.frames:  # n fits the budget; its bucket may not
                n = max(r for r in self.rows if r < rows) if rows > 1 else 1
                rows = self.row_bucket(n)
            if rows * chunk > self.graph_frames:
                out.append((rows, n))
        return out

    def next(
        self, remaining: Sequence[int], seen: Iterable[tuple[int, int]] = (), pad_in_time: bool = False,
        whole: bool = False,
    ) -> Plan:  # fmt: skip
        """The next forward for requests with ``remaining[i] >= 1`` frames left (at least one).
        ``pad_in_time``: a forward that finishes every row may also take a shape run before whose chunk
        is longer than they need (batch decode: replay a shape it has rather than capture a new one).
        ``whole``: every row is decoded before the caller goes on (a streaming step): the first forward of
        :meth:`whole_step`'s plan where it costs less than planning greedily to the end."""
        order = sorted(range(len(remaining)), key=lambda i: (-remaining[i], i))
        if not order or remaining[order[0]] < 1:
            raise ValueError("nothing to plan: every request has 0 frames left")
        seen = {s for s in seen if s[0] * s[1] <= self.frames}
        left = [remaining[i] for i in order]  # longest first
        rows, chunk, n = self._greedy(left, seen, pad_in_time)
        step = self.whole_step(left, seen) if whole else (0.0, [])
        if step[1] and step[0] < self._greedy_cost(left, seen, pad_in_time, (rows, chunk, n), step[0]):
            rows, chunk, n = step[1][0]
        return Plan(rows, chunk, tuple(order[:n]), tuple(min(chunk, r) for r in left[:n]))

    def _greedy(self, left: list[int], seen: set[tuple[int, int]], pad_in_time: bool) -> tuple[int, int, int]:
        """The greedy forward for rows of ``left`` frames (longest first): ``(rows bucket, chunk, rows taken)``."""
        # real frames of the n longest rows at a chunk, without a pass over them (64 streams: ~300 candidates)
        rising, before = left[::-1], list(itertools.accumulate(left, initial=0))
        best: tuple[float, int, int, int] | None = None
        longest = left[0]
        for chunk, rows, n in self._all_candidates(len(left), longest, seen, pad_in_time):
            full = min(n, len(left) - bisect.bisect_left(rising, chunk))  # rows with a whole chunk left
            cost = self._price(rows, chunk, seen)
            if n == len(left) and chunk < longest:  # every row still left: one more forward at least
                cost += self.step_cost
            score = (full * chunk + before[n] - before[full]) / cost
            if best is None or score > best[0] + 1e-12:
                best = (score, rows, chunk, n)
        return best[1:]

    def _price(self, rows: int, chunk: int, seen: set[tuple[int, int]]) -> int:
        """A forward's price in frames: its own, a forward's fixed cost, and a new shape's where it is one."""
        return rows * chunk + self.step_cost + (self.new_shape_cost if (rows, chunk) not in seen else 0)

    def _greedy_cost(
        self, left: list[int], seen: set[tuple[int, int]], pad_in_time: bool, first: tuple[int, int, int], limit: float
    ) -> float:
        """The price of greedy forwards (``first``, then :meth:`_greedy`'s) until every row is done, or
        the first sum past ``limit`` (no need to go on)."""
        left, seen, cost, plan = list(left), set(seen), 0.0, first
        while True:
            rows, chunk, n = plan
            cost += self._price(rows, chunk, seen)
            seen.add((rows, chunk))
            left = sorted((x for x in (*(r - min(chunk, r) for r in left[:n]), *left[n:]) if x), reverse=True)
            if not left or cost > limit:
                return cost
            plan = self._greedy(left, seen, pad_in_time)

    def whole_step(self, left: Sequence[int], seen: set[tuple[int, int]]) -> tuple[float, list[tuple[int, int, int]]]:
        """The cheapest forwards that decode rows of ``left`` frames (longest first) each whole in one of them,
        a run of rows in that order per forward: their price and ``(rows bucket, chunk, rows taken)`` each;
        ``(0.0, [])`` where the longest row fits no forward of at most ``graph_frames`` (``frames`` without graphs).
        A forward is priced ``rows * chunk + step_cost``, plus ``new_shape_cost`` for a shape not in ``seen``;
        so a step's last few rows ride in a run of a bucket already captured (rows and frames padded) rather
        than in forwards of shapes of their own, where that costs less. Exact for such plans (a forward's
        price depends only on its longest row and how many it takes); planning greedily, which may split a
        row over forwards, is sometimes cheaper (:meth:`next` takes the cheaper)."""
        limit = min(self.graph_frames or self.frames, self.frames)
        buckets = [r for r in self.rows if r <= self.row_bucket(self.max_rows)]
        kept = {r: sorted(c for rr, c in seen if rr == r) for r in buckets}
        options: dict[int, list[tuple[int, int, int]]] = {}  # frames needed -> (price, rows, chunk)
        for need in set(left):
            own = self.chunks[bisect.bisect_left(self.chunks, need)] if need <= self.chunks[-1] else None
            found = []
            for rows in buckets:
                have = kept[rows][k] if (k := bisect.bisect_left(kept[rows], need)) < len(kept[rows]) else None
                for chunk in {c for c in (own, have) if c is not None and rows * c <= limit and c <= MAX_CHUNK}:
                    found.append((self._price(rows, chunk, seen), rows, chunk))
            if not found:
                return 0.0, []
            options[need] = found
        n = len(left)
        best: list[tuple[float, int, int, int]] = [(0.0, 0, 0, 0)] * (n + 1)  # rows i.. : (price, rows, chunk, taken)
        for i in range(n - 1, -1, -1):
            best[i] = min((price + best[min(n, i + rows)][0], rows, chunk, min(rows, n - i))
                          for price, rows, chunk in options[left[i]])  # fmt: skip
        plans, i = [], 0
        while i < n:
            plans.append(best[i][1:])
            i += best[i][3]
        return best[0][0], plans

    def _all_candidates(
        self, n_rows: int, longest: int, seen: set[tuple[int, int]], pad_in_time: bool = False
    ) -> list[tuple[int, int, int]]:
        """``(chunk, rows bucket, rows taken)``: each chunk's own shapes up to the first that holds the
        longest row (larger chunks only add padding), then every shape run before (``seen``) that fits
        the budget and none of those chunks, rows padded up if need be (a few rows' last frames replay
        a captured bucket rather than capture one of their own; a stream's step is never padded in time
        past its own bucket, unless ``pad_in_time``)."""
        out, top = [], 0
        for chunk in self.chunks:
            if chunk > self.frames:
                break
            out.extend((chunk, rows, n) for rows, n in self._candidates(n_rows, chunk, finishes=chunk >= longest))
            top = chunk
            if chunk >= longest:
                break
        limit = max(self.chunks) if pad_in_time else top
        out.extend((chunk, rows, min(n_rows, rows, self.max_rows)) for rows, chunk in sorted(seen) if chunk <= limit)
        return out
