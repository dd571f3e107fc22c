"""Which rows run in the next forward, at which shape: the decode engine's planner (pure Python).

Every forward has a bucket shape ``(rows, chunk)``: ``rows`` batch rows (a power of two; unused rows
are padding on a scratch slot) each advancing up to ``chunk`` frames (rows with fewer frames left
are padded in time; their state is saved at their true end). A small set of shapes means few CUDA
graph captures; ``rows * chunk <= frames`` (the frame budget, from the memory budget) bounds memory.

The planner is greedy, one forward at a time: for each chunk size it takes the rows with the most
frames left (as many as the budget allows), and scores the forward by its real frames over its cost,
``rows * chunk`` padded frames plus ``step_cost`` (a forward's fixed cost: hundreds of kernel launches)
plus ``new_shape_cost`` if that shape would be captured as a CUDA graph now (``graph_frames``: shapes
of at most that many frames are; ``seen``: those captured already). Requests of similar lengths (the
sampler's batches) advance together in large chunks and finish with one small exact chunk; a lone
long request advances ``frames`` at a time. Not done: look-ahead over several forwards (the greedy
choice pads under 5 % on the 2-30 s job, docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ROWS = (1, 2, 4, 8, 16, 32, 64)
# dense where streaming chunks live (every size up to 8 frames: a stream's chunk is never padded
# much), then
# x1.5 steps; at most 1024 frames (82 s) per row: attention scores grow with the chunk (engine/budget.py)
CHUNKS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)  # fmt: skip


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
    step_cost: int = 48
    new_shape_cost: int = 4096
    graph_frames: int = 0  # shapes of at most this many frames run as CUDA graphs (0: none)

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
        """Every bucket within the budget."""
        rows = sorted({self.row_bucket(n) for n in range(1, self.max_rows + 1)})
        return [(r, c) for c in self.chunks for r in rows if r * c <= self.frames]

    def next(self, remaining: Sequence[int], seen: Iterable[tuple[int, int]] = ()) -> Plan:
        """The next forward for requests with ``remaining[i] >= 1`` frames left (at least one)."""
        order = sorted(range(len(remaining)), key=lambda i: (-remaining[i], i))
        if not order or remaining[order[0]] < 1:
            raise ValueError("nothing to plan: every request has 0 frames left")
        seen = set(seen)
        best: tuple[float, Plan] | None = None
        longest = remaining[order[0]]
        for chunk in self.chunks:
            if chunk > self.frames:
                break
            n = min(len(order), self.frames // chunk, self.max_rows)
            rows = self.row_bucket(n)
            while rows * chunk > self.frames:  # n fits the budget; its bucket may not
                n = max(r for r in self.rows if r < rows) if rows > 1 else 1
                rows = self.row_bucket(n)
            picked = order[:n]
            take = tuple(min(chunk, remaining[i]) for i in picked)
            capture = rows * chunk <= self.graph_frames and (rows, chunk) not in seen
            cost = rows * chunk + self.step_cost + (self.new_shape_cost if capture else 0)
            score = sum(take) / cost
            if best is None or score > best[0] + 1e-12:
                best = (score, Plan(rows, chunk, tuple(picked), take))
            if chunk >= longest:  # larger chunks only add padding
                break
        return best[1]
