"""node/ml/trainer/adamw.py against torch.optim.AdamW: the same steps bit for bit, and state
dicts that load into each other (checkpoints of either kind resume on the other)."""

from __future__ import annotations

import copy

import pytest
import torch

from node.ml.trainer.adamw import AdamW
from node.training.state import from_tensors, to_tensors


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 3))


def _groups(model: torch.nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _train(model: torch.nn.Module, opt, steps: range, freeze_last_at: int = -1) -> None:
    """Steps with a learning rate that changes every step (as the trainer's schedule does)
    and, at `freeze_last_at`, a parameter without a gradient (skipped, as torch does)."""
    gen = torch.Generator().manual_seed(1)
    for step in steps:
        for group in opt.param_groups:
            group["lr"] = 1e-2 / (1 + step)
        x = torch.randn(8, 6, generator=gen)
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        if step == freeze_last_at:
            list(model.parameters())[-1].grad = None
        opt.step()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_steps_equal_torch_adamw_bit_for_bit() -> None:
    ours_model, torch_model = _model(), _model()
    ours = AdamW(_groups(ours_model), lr=1e-2, betas=(0.9, 0.95))
    ref = torch.optim.AdamW(_groups(torch_model), lr=1e-2, betas=(0.9, 0.95))
    _train(ours_model, ours, range(12), freeze_last_at=5)
    _train(torch_model, ref, range(12), freeze_last_at=5)
    assert _same(ours_model, torch_model)
    mine, theirs = ours.state_dict(), ref.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys()
    for i, s in theirs["state"].items():
        for name, tensor in s.items():
            assert torch.equal(mine["state"][i][name], tensor), (i, name)


@pytest.mark.parametrize("direction", ["torch->ours", "ours->torch"])
def test_state_dicts_load_into_each_other_through_a_checkpoint(direction: str) -> None:
    """A checkpoint (state.py's flattening: betas come back as a list, keys as written)
    written by one optimizer resumes on the other exactly as on itself."""
    kinds = {"ours": AdamW, "torch": torch.optim.AdamW}
    first, second = (kinds[k] for k in direction.split("->"))
    writer_model = _model()
    writer = first(_groups(writer_model), lr=1e-2)
    _train(writer_model, writer, range(4))
    flat = to_tensors({"m": writer_model.state_dict(), "o": writer.state_dict()})
    # cloned, as a file read back is: both load_state_dicts take the tensors they are given
    saved = from_tensors({name: t.clone() for name, t in flat.items()})

    resumed_model = _model(seed=7)
    resumed_model.load_state_dict(saved["m"])
    resumed = second(_groups(resumed_model), lr=1e-2)
    resumed.load_state_dict(saved["o"])
    _train(writer_model, writer, range(4, 9))
    _train(resumed_model, resumed, range(4, 9))
    assert _same(writer_model, resumed_model)


def test_a_state_dict_of_another_model_is_refused() -> None:
    small = AdamW(_groups(_model()))
    other = torch.nn.Linear(6, 5)
    bigger = AdamW([{"params": [other.weight, other.bias]}, {"params": []}])
    with pytest.raises(ValueError, match=r"sizes \[2, 0\], this model's \[2, 2\]"):
        small.load_state_dict(bigger.state_dict())


def test_unknown_group_options_are_refused() -> None:
    with pytest.raises(ValueError, match="amsgrad"):
        AdamW([{"params": [torch.nn.Parameter(torch.ones(1))], "amsgrad": True}])


def test_building_and_stepping_imports_no_dynamo() -> None:
    """The reason this optimizer exists: run in a fresh interpreter, where nothing else
    imported torch._dynamo yet."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from node.ml.trainer.adamw import AdamW\n"
            "m = torch.nn.Linear(2, 2); o = AdamW(m.parameters())\n"
            "m(torch.ones(1, 2)).sum().backward(); o.step(); o.zero_grad()\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_moments_of_another_shape_are_refused_at_load() -> None:
    """A forged checkpoint whose moments do not fit the parameters: a clear error when it
    is loaded (the trainer then starts from scratch), not a shape error in the first step."""
    model = _model()
    opt = AdamW(_groups(model))
    _train(model, opt, range(1))
    state = opt.state_dict()
    state["state"][0]["exp_avg"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"exp_avg of parameter 0 has shape \(3, 3\), "
                                         r"the parameter \(5, 6\)"):
        AdamW(_groups(_model())).load_state_dict(state)


# -- the fused kernel (the trainer's choice on CUDA) and the device-side skip ---------------

CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_fused_steps_equal_torch_fused_adamw_bit_for_bit(device: str) -> None:
    ours_model, torch_model = _model().to(device), _model().to(device)
    ours = AdamW(_groups(ours_model), lr=1e-2, betas=(0.9, 0.95), fused=True)
    ref = torch.optim.AdamW(_groups(torch_model), lr=1e-2, betas=(0.9, 0.95), fused=True)
    _train_on(device, ours_model, ours, range(12), freeze_last_at=5)
    _train_on(device, torch_model, ref, range(12), freeze_last_at=5)
    assert _same(ours_model, torch_model)
    for i, s in ref.state_dict()["state"].items():
        mine = ours.state_dict()["state"][i]
        assert mine["step"].device == s["step"].device  # on the parameters' device
        for name, tensor in s.items():
            assert torch.equal(mine[name], tensor), (i, name)


def _train_on(device: str, model: torch.nn.Module, opt, steps: range,
              freeze_last_at: int = -1) -> None:
    gen = torch.Generator().manual_seed(1)
    for step in steps:
        for group in opt.param_groups:
            group["lr"] = 1e-2 / (1 + step)
        x = torch.randn(8, 6, generator=gen).to(device)
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        if step == freeze_last_at:
            list(model.parameters())[-1].grad = None
        opt.step()


@pytest.mark.parametrize("fused", [False, True])
def test_found_inf_skips_the_whole_update(fused: bool) -> None:
    """Weights, moments and step counters stay as they were; a clear flag steps as usual."""
    model = _model()
    opt = AdamW(_groups(model), lr=1e-2, fused=fused)
    _train(model, opt, range(2))
    before = ({k: v.clone() for k, v in model.state_dict().items()},
              {i: {n: t.clone() for n, t in s.items()}
               for i, s in opt.state_dict()["state"].items()})
    model(torch.ones(3, 6)).square().mean().backward()
    opt.step(found_inf=torch.tensor(1.0))
    assert all(torch.equal(v, before[0][k]) for k, v in model.state_dict().items())
    for i, s in opt.state_dict()["state"].items():
        for name, tensor in s.items():
            assert torch.equal(tensor, before[1][i][name]), (i, name)
    opt.step(found_inf=torch.tensor(0.0))
    assert all(float(s["step"]) == 3.0 for s in opt.state_dict()["state"].values())
    assert not torch.equal(model.state_dict()["0.weight"], before[0]["0.weight"])


@pytest.mark.parametrize("direction", ["fused->foreach", "foreach->fused"])
def test_fused_and_foreach_state_dicts_load_into_each_other(direction: str) -> None:
    first, second = (k == "fused" for k in direction.split("->"))
    writer_model = _model()
    writer = AdamW(_groups(writer_model), lr=1e-2, fused=first)
    _train(writer_model, writer, range(3))
    reader_model = _model(seed=7)
    reader_model.load_state_dict(writer_model.state_dict())
    reader = AdamW(_groups(reader_model), lr=1e-2, fused=second)
    reader.load_state_dict(copy.deepcopy(writer.state_dict()))  # load takes, not copies
    _train(reader_model, reader, range(3, 5))  # the counters are where its kernel wants them
    assert all(float(s["step"]) == 5.0 for s in reader.state_dict()["state"].values())
    _train(writer_model, writer, range(3, 5))  # the two kernels round differently, no more
    for p, q in zip(writer_model.parameters(), reader_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_fused_kernel_imports_no_dynamo() -> None:
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from node.ml.trainer.adamw import AdamW\n"
            "m = torch.nn.Linear(2, 2); o = AdamW(m.parameters(), fused=True)\n"
            "m(torch.ones(1, 2)).sum().backward(); o.step(found_inf=torch.tensor(0.0))\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"
