"""Will training fit on the GPU? Arithmetic only (no torch), checked before the first step.

An out-of-memory error mid-run loses the join (the download, the wait for a round) and
says nothing an operator can act on; this estimate, compared with the device's free memory
before the model moves there, turns it into one line with a suggestion.

What a step holds (fp32 master weights, AdamW, bf16 autocast on CUDA):
- weights, gradients: 4 bytes per parameter each; AdamW's two moments: 8 bytes; under
  autocast, the bf16 copies of the weights it casts (kept for the backward): 2 bytes;
- activations kept for the backward pass of a GPT layer: 37*s*b*h bytes with 16-bit
  activations (s context, b batch, h d_model; doubled for fp32): Korthikanti et al. 2022
  ("Reducing Activation Recomputation in Large Transformer Models", section 4.1) count
  34*s*b*h, and the H100 measured 9% more per sample (autocast's fp32 layer-norm outputs).
  Their 5*a*s^2*b for the attention scores, softmax and dropout is left out: torch's fused
  attention (flash / memory-efficient SDPA, what `F.scaled_dot_product_attention` runs on
  CUDA) never stores them, and this GPT has no dropout. The logits, the loss's fp32 copy
  and its gradient: b*s*vocab*(2+4+4) bytes;
- on CUDA, 96 MiB of workspaces (cuBLAS, SDPA) that torch's caching allocator holds;
- headroom: 20% on top for the caching allocator's fragmentation.

Calibrated on an NVIDIA H100 (torch 2.11, bf16 autocast, issue 29) against
`torch.cuda.max_memory_allocated` over three eager steps: the 86M byte GPT (d_model 768, 12
layers, 12 heads, context 1024) peaked at 4.11, 6.90, 12.58 and 23.81 GB at batch 8, 16, 32
and 64 (compiled: 6.91 at 16, 23.66 at 64), a 3.3M one (d_model 256, 4 layers, context 256,
batch 16) at 0.32 GB; this estimate says 4.46, 7.28, 12.91, 24.16 and 0.33 GB before the
headroom: 1.5-8.6% above, never below (tests/ml/test_device_memory.py holds it within 30%
on a GPU). It errs high most at small batches: the measured fixed part is about 14 bytes
per parameter, not 18 (likely because the peak comes in the backward, before every gradient
exists). With the s^2 term it said 64.3 GiB of
activations at batch 64, about 3.4x what the GPU used, and refused batches that fit.
A model given by a factory has no formula: its activations are not estimated (0), and an
out-of-memory error in the first step is reported the same way (node/training/build.py).
"""

from __future__ import annotations

from dataclasses import dataclass

HEADROOM = 0.2
CUDA_WORKSPACE = 96 * 1024**2  # cuBLAS and SDPA workspaces, measured on an H100
GIB = 1024**3


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    weights: int
    gradients: int
    optimizer: int
    activations: int
    weight_copies: int = 0  # autocast's 16-bit copies of the weights
    workspace: int = 0  # the CUDA libraries' workspaces

    @property
    def peak(self) -> int:
        """Bytes the step allocates at its peak (what torch.cuda.max_memory_allocated says)."""
        return (self.weights + self.gradients + self.optimizer + self.weight_copies
                + self.workspace + self.activations)

    @property
    def fixed(self) -> int:
        """The part that does not depend on the batch."""
        return self.peak - self.activations

    @property
    def total(self) -> int:
        """Bytes the step needs, headroom included."""
        return int(self.peak * (1 + HEADROOM))


def gpt_activation_bytes(batch: int, context: int, d_model: int, n_layers: int,
                         n_heads: int, vocab: int, *, half: bool = True) -> int:
    """Activations a byte GPT keeps for backward (module docstring: the formula; `n_heads`
    no longer enters it: fused attention keeps no s x s scores)."""
    per_layer = 37 * context * batch * d_model
    layers = n_layers * per_layer * (1 if half else 2)
    logits = batch * context * vocab * ((2 if half else 4) + 4 + 4)
    return int(layers + logits)


def estimate(n_params: int, activation_bytes: int, *, half: bool = False,
             cuda: bool = False) -> MemoryEstimate:
    """fp32 weights and gradients, AdamW's two fp32 moments, the given activations, with
    `half` (bf16 autocast) the 16-bit weight copies, and on `cuda` the libraries'
    workspaces."""
    return MemoryEstimate(weights=4 * n_params, gradients=4 * n_params,
                          optimizer=8 * n_params, activations=activation_bytes,
                          weight_copies=2 * n_params if half else 0,
                          workspace=CUDA_WORKSPACE if cuda else 0)


def shortfall(est: MemoryEstimate, free_bytes: int, device: str, batch: int) -> str | None:
    """None when the step fits in `free_bytes`; else the one-line reason and what to try."""
    if est.total <= free_bytes:
        return None
    fixed = int(est.fixed * (1 + HEADROOM))
    if fixed <= free_bytes and est.activations > 0:
        per_sample = est.activations * (1 + HEADROOM) / batch
        fits = int((free_bytes - fixed) // per_sample) if per_sample else batch
        hint = (f"train.batch_size {fits} would fit; use a run with a smaller batch, or "
                "--device cpu" if fits >= 1 else "use a run with more pipeline stages (a "
                "smaller model per peer), or --device cpu")
    else:
        hint = ("the model and its optimizer state alone do not fit: use a run with more "
                "pipeline stages (a smaller model per peer), or --device cpu")
    return (f"training needs about {_size(est.total)} on {device} but {_size(free_bytes)} "
            f"are free (weights {_size(est.weights)}, gradients {_size(est.gradients)}, AdamW "
            f"{_size(est.optimizer)}, "
            + (f"bf16 weight copies {_size(est.weight_copies)}, " if est.weight_copies else "")
            + (f"workspaces {_size(est.workspace)}, " if est.workspace else "")
            + f"activations for batch {batch} {_size(est.activations)}, "
            f"+{HEADROOM:.0%}); {hint}")


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 1024**2:.1f} MiB"
