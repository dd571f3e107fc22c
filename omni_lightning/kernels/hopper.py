"""A :class:`~omni_lightning.kernels.launches.KernelLaunch` compiled for Hopper (sm_90a) on any machine,
GPU or not, and what the compiled code says: the matrix instructions, registers, spills, shared
memory and the occupancy they allow on an H100.

:func:`compile_launch` runs ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``
(Triton picks sm_90a for capability 90: ``wgmma`` needs it), then the ``ptxas`` Triton ships with
``-v`` on the PTX it produced, with the flags Triton itself passes (its own log is discarded), for
the registers and the spill bytes. Matrix instructions are read off the PTX: ``wgmma.mma_async``
(SASS ``HGMMA``), ``mma.sync`` (SASS ``HMMA``: the Ampere path) or none. Shared memory is Triton's
own count (``metadata.shared``), the dynamic allocation a launch asks for.

Occupancy is the CUDA occupancy calculator's arithmetic for compute capability 9.0: 64 warps, 2,048
threads, 32 blocks and 65,536 registers per SM, registers allocated per warp in units of 256, 233,472
bytes (228 KB) of shared memory per SM with 1 KB reserved per block, 232,448 (227 KB) at most per
block. Not modelled: the register file's per-quadrant split and any ``maxnreg`` cap Triton sets.
Results are cached per compile in this process (:data:`_COMPILED`): launches that Triton would
compile once are compiled once. Triton's own disk cache applies as usual (``TRITON_CACHE_DIR``).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass

from omni_lightning.kernels.launches import KernelLaunch, hopper_target

SHARED_LIMIT = 232_448  # bytes per block (227 KB)
SHARED_PER_SM = 233_472  # 228 KB
_COMPILED: dict[tuple, Compiled] = {}


@dataclass(frozen=True)
class Compiled:
    """What ptxas and Triton say of one compile (sizes in bytes)."""

    mma: str  # "wgmma", "mma.sync" or "none"
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int
    occupancy_warps: int  # warps per SM the registers, shared memory and thread limits allow

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    def as_dict(self) -> dict:
        return asdict(self)


def missing() -> str | None:
    """Why a compile for sm_90a cannot run here (Triton, its NVIDIA backend or its ptxas missing), or None."""
    try:
        import triton  # noqa: F401
        from triton.compiler import make_backend

        make_backend(hopper_target())
    except Exception as err:  # ImportError, or no NVIDIA backend in this Triton build
        return f"Triton's NVIDIA backend is not available: {type(err).__name__}: {err}"
    path = ptxas()
    if not path or not os.path.isfile(path):
        return f"no ptxas (looked for {path})"
    return None


def ptxas() -> str | None:
    """The ``ptxas`` Triton uses for sm_90 (its bundled one unless ``TRITON_PTXAS_PATH`` says otherwise)."""
    from triton import knobs

    try:
        return knobs.nvidia.ptxas.path
    except Exception:  # a knob that cannot resolve (no binary)
        return None


def occupancy(num_warps: int, registers: int, shared: int) -> int:
    """Warps per SM on compute capability 9.0 (module docstring)."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_registers = (65_536 // per_warp) // num_warps
    by_threads = 2_048 // (32 * num_warps)
    by_shared = SHARED_PER_SM // (shared + 1_024) if shared <= SHARED_LIMIT else 0
    return min(by_registers, by_threads, by_shared, 32) * num_warps


def ptxas_report(ptx: str) -> dict[str, int]:
    """``ptxas -v --gpu-name sm_90a`` on ``ptx``, with Triton's flags: registers, spills, stack."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas(), "-lineinfo", "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", src, "-o", src + ".o"]
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    return dict(
        registers=number(r"Used (\d+) registers"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
        stack=number(r"(\d+) bytes stack frame"),
    )


def matrix_instructions(ptx: str) -> str:
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    return "mma.sync" if re.search(r"\bmma\.sync\b", ptx) else "none"


def compile_launch(launch: KernelLaunch) -> Compiled:
    """``launch`` compiled for sm_90a and inspected (cached per distinct compile)."""
    if launch.key in _COMPILED:
        return _COMPILED[launch.key]
    import triton
    from triton.compiler import ASTSource

    source = ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs)
    options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
    kernel = triton.compile(source, target=hopper_target(), options=options)
    ptx = kernel.asm["ptx"]
    shared = int(kernel.metadata.shared)
    report = ptxas_report(ptx)
    result = Compiled(mma=matrix_instructions(ptx), shared=shared,
                      occupancy_warps=occupancy(launch.num_warps, report["registers"], shared), **report)  # fmt: skip
    _COMPILED[launch.key] = result
    return result


def clean(launch: KernelLaunch, compiled: Compiled) -> list[str]:
    """What keeps ``launch`` off the default path: spills, shared memory over the limit (empty: clean)."""
    problems = []
    if compiled.spills or compiled.stack:
        problems.append(f"spills {compiled.spill_stores} / {compiled.spill_loads} B, stack {compiled.stack} B")
    if compiled.shared > SHARED_LIMIT:
        problems.append(f"shared memory {compiled.shared} B over the {SHARED_LIMIT} B limit")
    return problems
