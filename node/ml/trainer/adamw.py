"""AdamW (decoupled weight decay, bias-corrected moments) for the inner loop, without
torch.optim.

Why not `torch.optim.AdamW`: torch.optim imports torch._dynamo the first time an optimizer
is built or steps (its `_disable_dynamo` and `_use_grad` wrappers), and that import is as
long as torch's own: 1.0 s of CPU on top of 0.95 s (2-core dev machine, idle). A joining
node pays it while its network side connects and downloads, in the same GIL, so it was
half of the torch import a join waits beside (docs/benchmarks.md, "Joining mid-run").

The update is torch's, operation for operation (torch 2.13's `_multi_tensor_adamw` /
`_single_tensor_adamw`: they agree), so a step here equals a `torch.optim.AdamW` step bit
for bit; tests/ml/test_adamw.py holds it to that. `state_dict()` has torch's layout too (state
keyed by parameter index; `step`, `exp_avg`, `exp_avg_sq`; every group option), so a
checkpoint written by either loads into the other.

`fused=True` calls torch's fused AdamW kernel (`torch._fused_adamw_`, an aten op: no
torch.optim, no torch._dynamo) as `torch.optim.AdamW(fused=True)` does, bit for bit: one
kernel launch per step instead of a dozen foreach passes, which is what a GPU wants (the
trainer turns it on for CUDA). Its step counters live on the parameters' device, and it
takes `found_inf`: a device flag that skips the whole update (weights, moments, step
counters) without reading anything back to the host, so a non-finite step is dropped on
the GPU and noticed later (node/ml/trainer/loop.py). The foreach path takes the same flag
and reads it on the host (free on a CPU, where it is used).

Only what the trainer and the pipeline stages use: fp32 or bf16 dense parameters, a
float learning rate set per group, no amsgrad, no maximize.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

# What torch.optim.AdamW's groups carry besides ours; written so its load_state_dict (an
# older node of the swarm, a user's script) accepts our checkpoints.
_TORCH_OPTIONS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                  "differentiable": False, "fused": None, "decoupled_weight_decay": True}
_OPTIONS = ("lr", "betas", "eps", "weight_decay")


class AdamW:
    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], *,
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, fused: bool = False) -> None:
        self.fused = fused
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        given: list[Any] = list(params)
        groups: list[dict[str, Any]] = (
            [{"params": given}] if given and not isinstance(given[0], dict) else given)
        self.param_groups: list[dict[str, Any]] = []
        for group in groups:
            unknown = set(group) - {"params", *_OPTIONS}
            if unknown:
                raise ValueError(f"AdamW: unknown group option(s) {sorted(unknown)}")
            self.param_groups.append({**defaults, **group, "params": list(group["params"])})
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """One update of every parameter that has a gradient. `found_inf`, a 0-d float
        tensor, skips it where nonzero (as torch's GradScaler passes it): on the device for
        a fused optimizer, by one read on the host otherwise."""
        if found_inf is not None and not self.fused and bool(found_inf):
            return
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr, (beta1, beta2) = group["lr"], group["betas"]
            grads = [p.grad for p in params]
            states = [self._state_of(p) for p in params]
            exp_avgs = [s["exp_avg"] for s in states]
            exp_avg_sqs = [s["exp_avg_sq"] for s in states]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1)
            if self.fused:
                self._fused_step(group, params, grads, exp_avgs, exp_avg_sqs, steps, found_inf)
                continue
            if group["weight_decay"] != 0:
                torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
            counts = [s.item() for s in steps]
            step_sizes = [(lr / (1 - beta1 ** n)) * -1 for n in counts]
            denoms = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denoms, [(1 - beta2 ** n) ** 0.5 for n in counts])
            torch._foreach_add_(denoms, group["eps"])
            torch._foreach_addcdiv_(params, exp_avgs, denoms, step_sizes)

    @staticmethod
    def _fused_step(group: dict[str, Any], params: list[torch.Tensor],
                    grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                    exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor],
                    found_inf: torch.Tensor | None) -> None:
        # torch.optim.adam._fused_adam: one kernel per (device, dtype); it skips everything
        # when found_inf is set, and the step counters (counted up before) are put back.
        beta1, beta2 = group["betas"]
        kinds: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(params):
            kinds.setdefault((p.device, p.dtype), []).append(i)
        for (device, _), ix in kinds.items():
            flag = None if found_inf is None else found_inf.to(device, non_blocking=True)
            kind_steps = [steps[i] for i in ix]
            torch._fused_adamw_([params[i] for i in ix], [grads[i] for i in ix],
                                [exp_avgs[i] for i in ix], [exp_avg_sqs[i] for i in ix], [],
                                kind_steps, lr=group["lr"], beta1=beta1, beta2=beta2,
                                weight_decay=group["weight_decay"], eps=group["eps"],
                                amsgrad=False, maximize=False, grad_scale=None, found_inf=flag)
            if flag is not None:
                torch._foreach_sub_(kind_steps, [flag] * len(kind_steps))

    def _state_of(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state.get(p)
        if state is None:
            # the fused kernel reads the step on the parameter's device (torch's layout
            # for fused=True); the foreach path keeps it on the CPU (no read per step)
            state = self.state[p] = {
                "step": torch.tensor(0.0, dtype=torch.float32,
                                     device=p.device if self.fused else "cpu"),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        return state

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout: parameters numbered in group order; the tensors are ours
        (not copies), as torch's are."""
        index: dict[torch.Tensor, int] = {}
        groups = []
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                ids.append(index.setdefault(p, len(index)))
            groups.append({**{k: group[k] for k in _OPTIONS}, **_TORCH_OPTIONS,
                           "params": ids})
        return {"state": {index[p]: dict(s) for p, s in self.state.items()},
                "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Ours or torch.optim.AdamW's: the groups must match ours in number and sizes
        (ValueError otherwise); their options and the moments are taken (not copied, as torch
        takes them)."""
        saved = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        if [len(s["params"]) for s in saved] != sizes:
            raise ValueError(
                "optimizer state of another model: parameter groups of sizes "
                f"{[len(s['params']) for s in saved]}, this model's {sizes}")
        params: dict[Any, torch.Tensor] = {}
        for s, g in zip(saved, self.param_groups, strict=True):
            g.update({k: s[k] for k in _OPTIONS if k in s})
            g["betas"] = tuple(g["betas"])
            params.update(zip(s["params"], g["params"], strict=True))
        for key, values in state_dict["state"].items():
            p = params[key]
            for name in ("exp_avg", "exp_avg_sq"):  # a forged checkpoint: refused here, not
                if values[name].shape != p.shape:  # by a shape error in the first step
                    raise ValueError(f"optimizer state of another model: {name} of parameter "
                                     f"{key} has shape {tuple(values[name].shape)}, the "
                                     f"parameter {tuple(p.shape)}")
        self.state = {}
        for key, values in state_dict["state"].items():
            p = params[key]
            self.state[p] = {
                "step": values["step"].to(torch.float32).reshape(()).to(
                    p.device if self.fused else "cpu"),
                "exp_avg": values["exp_avg"].to(dtype=p.dtype, device=p.device),
                "exp_avg_sq": values["exp_avg_sq"].to(dtype=p.dtype, device=p.device)}
