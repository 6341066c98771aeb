"""Programmatic dependent launch (PDL, Hopper and newer): a kernel launched with it may start while the
kernel before it in the stream is still running, so its launch and its loads of data that kernel does
not write (tables, weights) overlap that kernel's end.

The rules every slora kernel with a `USE_PDL` flag follows:
- `pdl_start` at its start lets the next kernel (if launched with PDL) start its programs;
- it calls `pdl_wait` before it reads anything a kernel of the stream may still be writing (activations),
  and before it writes anything; `pdl_wait` returns once the previous kernel has finished and its writes
  are visible;
- every program calls `pdl_wait` before it exits, so this kernel's end implies the previous one's, and by
  the same rule in that one, all earlier kernels': a kernel launched without PDL after it is safe.

Since each kernel lets the next start at its very beginning, a run of PDL kernels may all be in flight at
once, back to the last kernel launched without PDL. So what a kernel reads before `pdl_wait` must not be
written by any kernel of that run: in the engine it reads only the step's inputs (block and page tables,
slots, context lengths, the LoRA segments and tables, cos/sin), computed or copied before the step's
layers, and weights (the norm's, adapters' pages of the pool, which no kernel of a step writes).
"""
import functools

import torch
import triton
import triton.language as tl


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


def pdl_supported(device: torch.device) -> bool:
    """Whether programmatic dependent launch is available: an NVIDIA GPU of compute capability 9.0 or newer
    (ROCm reports its own versions as capabilities) and a Triton that has its instructions."""
    if device.type != "cuda":
        return False
    return _gpu_has_pdl(torch.cuda.current_device() if device.index is None else device.index)


# Memoised: every wrapper launched with pdl checks it, hundreds of times per eager step, and the answer
# is a fact of the hardware and the installed Triton, fixed for the process.
@functools.cache
def _gpu_has_pdl(index: int) -> bool:
    return (torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9
            and hasattr(tl.extra.cuda, "gdc_wait"))


def launch_options(pdl: bool) -> dict[str, bool]:
    """The launch keyword for a kernel call: none without pdl, so that Tritons older than the keyword
    still launch every kernel."""
    return {"launch_pdl": True} if pdl else {}


def check_pdl_supported(pdl: bool, device: torch.device) -> None:
    if pdl and not pdl_supported(device):
        raise ValueError(f"pdl=True needs a CUDA GPU of compute capability 9.0 or newer, got device {device}")
