"""Programmatic dependent launch (sm_90): a TIRx kernel waits for the kernel before it (`griddepcontrol.wait`)
after its own setup and before its first global-memory access, then lets the kernel after it launch
(`griddepcontrol.launch_dependents`), so that the next kernel of a stream or CUDA graph is launched and set up
while this one's last CTAs run. `build.dependent_launch` gives the kernels that wait the launch attribute.
On by default (measured in docs/benchmarks.md, `models_run36_pdl`); `TVMFUSE_DEPENDENT_LAUNCH=0` builds without."""

from __future__ import annotations

import contextlib
import os

#: environment switch read when a kernel is built: "0" builds kernels that neither wait nor release (on otherwise)
SWITCH = "TVMFUSE_DEPENDENT_LAUNCH"


def dependent_launch() -> bool:
    """Whether kernels built now wait for their predecessor and release their successor (unless SWITCH=0)."""
    return os.environ.get(SWITCH, "1") != "0"


#: environment switch read when a GEMM kernel is chosen: "1" lets a GEMM whose B is a weight issue its first weight
#: loads (wgmma: the ring's first k-tiles of B; small M: an L2 prefetch of its rows) before its wait. Off by default:
#: the Llama layer's decode b1 took 235.6 µs with it against 188.1 (models_run41_early.json, H100)
EARLY_WEIGHTS_SWITCH = "TVMFUSE_EARLY_WEIGHTS"


def early_weights() -> bool:
    """Whether GEMMs of weights built now load those weights before their dependency wait (EARLY_WEIGHTS_SWITCH=1,
    with the dependent launch on)."""
    return dependent_launch() and os.environ.get(EARLY_WEIGHTS_SWITCH) == "1"


#: environment switch read when a wgmma GEMM is built: "1" builds it with the wait, launched dependent on the kernel
#: before it. Off by default: it launches once the kernel before has finished, while it still lets the next kernel
#: launch early and every other kernel keeps the dependent launch. A wgmma CTA holds its SM's whole register file and
#: most of its shared memory: launched dependent, its CTAs may sit on SMs waiting while the kernel before still has
#: CTAs to place. Measured on an H100 (models_run46.json): the Llama layer's prefill 512 took 429.6 µs without the
#: wait against 449.9 with it, BERT's 568.1 against 564.6 (models_run45.json: Llama 436.0 against 442.8)
WGMMA_SWITCH = "TVMFUSE_WGMMA_DEPENDENT"


def wgmma_waits() -> bool:
    """Whether wgmma GEMMs built now wait for their predecessor (WGMMA_SWITCH=1, with the dependent launch on)."""
    return dependent_launch() and os.environ.get(WGMMA_SWITCH) == "1"


def release_late() -> bool:
    """SWITCH=late (an experiment, not measured yet): the wgmma GEMM releases its successor once its loader has
    issued its last load (as CUTLASS's Hopper GEMMs do after their mainloop) instead of right after its wait."""
    return os.environ.get(SWITCH) == "late"


@contextlib.contextmanager
def switched_off(name: str, off: bool):
    """With `off`, environment switch `name` at 0 while the block runs and as it was after; otherwise nothing
    changes."""
    before = os.environ.get(name)
    if off:
        os.environ[name] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def dependent_launch_off(off: bool = True):
    """With `off`, SWITCH at 0 while the block runs and as it was after (a job built with --no-dependent-launch);
    otherwise nothing changes."""
    return switched_off(SWITCH, off)
