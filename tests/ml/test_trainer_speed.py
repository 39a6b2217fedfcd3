"""The trainer at the GPU's speed (issue 29): read-backs every few steps with non-finite
steps caught on the device, gradient accumulation, torch.compile beside training with its
eager fallback. CPU tests drive the same code paths (the fused kernel runs on CPUs too);
the CUDA ones run where a GPU is present."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from node.ml.trainer.loop import TrainConfig, Trainer, TrainingDiverged
from node.ml.trainer.tasks import DigitsMLPTask, TaskConfig, build_task

CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")


class NaNAt(DigitsMLPTask):
    """Digits whose `bad`-th training batch (1-based) is all NaN: one non-finite step."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad, self.calls = bad, 0

    def train_batch(self, batch_size, generator):
        x, y = super().train_batch(batch_size, generator)
        self.calls += 1
        return (torch.full_like(x, math.nan), y) if self.calls == self.bad else (x, y)


def _config(**overrides) -> TrainConfig:
    base = dict(batch_size=32, lr=1e-2, warmup_steps=2, max_steps=50, eval_every=0,
                device="cpu")
    return TrainConfig(**{**base, **overrides})


def _same_weights(a: Trainer, b: Trainer) -> bool:
    return torch.equal(a.parameters_vector(), b.parameters_vector())


# -- read-backs every few steps; non-finite steps caught on the device ----------------------


def test_defaults_on_a_cpu_read_back_every_step_with_our_foreach_adamw():
    trainer = Trainer(DigitsMLPTask(), _config())
    assert (trainer.sync_every, trainer.accum, trainer.optimizer.fused) == (1, 1, False)
    assert trainer.compile_status == "off" and trainer.compile_done.is_set()
    stats = [trainer.step() for _ in range(3)]
    assert [s.measured for s in stats] == [1, 2, 3]


def test_stats_are_read_back_every_sync_every_steps_and_are_the_same_numbers():
    every = Trainer(DigitsMLPTask(), _config(fused=True))
    sparse = Trainer(DigitsMLPTask(), _config(fused=True, sync_every=4))
    dense = [every.step() for _ in range(9)]
    few = [sparse.step() for _ in range(9)]
    # the first step is read at once (a join's first step shows its loss), then every 4th
    assert [s.measured for s in few] == [1, 1, 1, 4, 4, 4, 4, 8, 8]
    for s in few:  # each step shows the newest loss read back, the one of step `measured`
        assert s.loss == dense[s.measured - 1].loss
        assert s.grad_norm == dense[s.measured - 1].grad_norm
    assert _same_weights(every, sparse)  # reading less often changes nothing else


def test_a_read_back_queued_behind_the_steps_is_taken_in_once_landed_and_catches_nan():
    """CUDA's way (`read_back_async`): the read-back is a copy queued behind the kernels,
    taken in by the first step that finds it landed, so the host never waits for the GPU.
    On a CPU it lands at once, so the next step takes it in."""
    every = Trainer(DigitsMLPTask(), _config(fused=True))
    lagged = Trainer(DigitsMLPTask(), _config(fused=True, sync_every=4))
    lagged.read_back_async = True
    dense = [every.step() for _ in range(9)]
    few = [lagged.step() for _ in range(9)]
    assert [s.measured for s in few] == [1, 1, 1, 1, 4, 4, 4, 4, 8]
    for s in few:
        assert s.loss == dense[s.measured - 1].loss
    lagged.flush()
    assert lagged.measured == 9 and lagged.last_loss == dense[-1].loss
    assert _same_weights(every, lagged)

    trainer = Trainer(NaNAt(bad=3), _config(fused=True, sync_every=4))
    trainer.read_back_async = True
    reference = Trainer(NaNAt(bad=0), _config(fused=True))
    for _ in range(4):  # step 4 queues the read-back of steps 2-4, the NaN one among them
        trainer.step()
    reference.step(), reference.step()
    with pytest.raises(TrainingDiverged) as info:
        trainer.step()  # step 5 takes it in
    assert info.value.step == 3 and trainer.step_count == 2
    assert _same_weights(trainer, reference)
    assert trainer.step().step == 3


@pytest.mark.parametrize("fused", [False, True])
def test_a_nan_step_is_caught_at_the_next_read_back_and_nothing_after_it_applied(fused):
    """Step 3's batch is NaN. Read back every 4 steps, the trainer raises in step 4 (not
    3), for step 3, and is where a trainer that stopped after step 2 is: weights, AdamW
    state, step count. It can go on from there."""
    trainer = Trainer(NaNAt(bad=3), _config(fused=fused, sync_every=4))
    reference = Trainer(NaNAt(bad=0), _config(fused=fused))
    trainer.step(), trainer.step(), reference.step(), reference.step()
    trainer.step()  # the NaN step: no error yet, nothing read back
    with pytest.raises(TrainingDiverged) as info:
        trainer.step()
    assert info.value.step == 3 and math.isnan(info.value.loss)
    assert trainer.step_count == 2
    assert _same_weights(trainer, reference)
    steps = {float(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()}
    assert steps == {2.0}
    assert trainer.step().step == 3  # goes on (its data stream moved past the NaN batch)


def test_a_nan_step_read_back_at_once_raises_in_that_step_as_before():
    trainer = Trainer(NaNAt(bad=2), _config())
    trainer.step()
    with pytest.raises(TrainingDiverged) as info:
        trainer.step()
    assert info.value.step == 2 and trainer.step_count == 1


def test_a_pending_nan_is_raised_before_the_weights_leave():
    """A boundary (parameters_vector) or a checkpoint (state_dict) between read-backs reads
    back first: a diverged window never becomes an exchange or a checkpoint."""
    for read in (lambda t: t.parameters_vector(), lambda t: t.state_dict(),
                 lambda t: t.evaluate()):
        trainer = Trainer(NaNAt(bad=2), _config(fused=True, sync_every=10))
        trainer.step(), trainer.step()
        with pytest.raises(TrainingDiverged):
            read(trainer)
        assert trainer.step_count == 1


# -- gradient accumulation ----------------------------------------------------------------


@pytest.mark.parametrize("task_name", ["digits-mlp", "bytes-gpt"])
def test_accumulated_micro_batches_make_the_big_batchs_update(task_name):
    task = (build_task(TaskConfig(name="bytes-gpt", d_model=32, n_layers=2, n_heads=2,
                                  context=32, max_bytes=100_000))
            if task_name == "bytes-gpt" else DigitsMLPTask())
    whole = Trainer(task, _config(batch_size=16, grad_accum=1))
    split = Trainer(task, _config(batch_size=16, grad_accum=4))
    assert (whole.micro_batch, split.micro_batch) == (16, 4)
    for _ in range(3):
        a, b = whole.step(), split.step()
        assert b.loss == pytest.approx(a.loss, rel=1e-5)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
    # float rounding only: the sums run in another order (a 16-core machine's threads split
    # them differently: 1 element in 85,002 off by 1.2e-5 there)
    torch.testing.assert_close(split.parameters_vector(), whole.parameters_vector(),
                               rtol=1e-3, atol=1e-5)


def test_accumulation_must_divide_the_batch():
    from node.ml.trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="grad_accum=3"):
        TrainConfig(batch_size=16, grad_accum=3)


# -- torch.compile beside training ----------------------------------------------------------


class FakeCompiler:
    """Stands in for torch.compile (minutes on this CPU): blocks until released, then hands
    back a forward that counts its calls and runs the model it was given (the twin)."""

    def __init__(self, fail: bool = False, fail_later: bool = False) -> None:
        self.release = threading.Event()
        self.fail, self.fail_later = fail, fail_later
        self.calls = 0
        self.example_shape: tuple[int, ...] | None = None
        self.model: torch.nn.Module | None = None

    def __call__(self, model, example):
        self.example_shape, self.model = tuple(example.shape), model
        assert torch.is_grad_enabled() and model.training  # the training graph
        if not self.release.wait(60):
            raise TimeoutError("the test never released the compiler")
        if self.fail:
            raise RuntimeError("no compiler here")

        def forward(x):
            self.calls += 1
            if self.fail_later:
                raise RuntimeError("a graph break gone wrong")
            return model(x)

        return forward


def test_steps_run_eager_while_compiling_then_switch_to_the_compiled_forward():
    fake = FakeCompiler()
    trainer = Trainer(DigitsMLPTask(), _config(compile=True, grad_accum=2), compiler=fake)
    eager = Trainer(DigitsMLPTask(), _config(grad_accum=2))
    assert trainer.compile_status == "compiling"
    for _ in range(3):  # the compiler is still blocked: these steps did not wait for it
        assert trainer.step().loss == eager.step().loss
    assert fake.calls == 0 and not trainer.compile_done.is_set()
    fake.release.set()
    assert trainer.compile_done.wait(60) and trainer.compile_status == "ready"
    assert fake.example_shape == (16, 64)  # the micro-batch's shape, for no recompile
    # the twin shares the parameters (gradients land on the trainer's own), not the module
    assert fake.model is not trainer.model
    assert all(p is q for p, q in zip(fake.model.parameters(), trainer.params, strict=True))
    for _ in range(2):
        assert trainer.step().loss == pytest.approx(eager.step().loss, rel=1e-6)
    assert fake.calls == 4  # 2 steps x 2 micro-batches
    trainer.evaluate()  # eval mode on the model, not on the twin
    assert fake.model.training


def test_a_compiler_that_fails_leaves_training_eager():
    fake = FakeCompiler(fail=True)
    fake.release.set()
    trainer = Trainer(DigitsMLPTask(), _config(compile=True), compiler=fake)
    assert trainer.compile_done.wait(60)
    assert trainer.compile_status == "failed: RuntimeError: no compiler here"
    eager = Trainer(DigitsMLPTask(), _config())
    assert [trainer.step().loss for _ in range(2)] == [eager.step().loss for _ in range(2)]


def test_a_compiled_forward_that_fails_falls_back_to_eager_in_the_same_step():
    fake = FakeCompiler(fail_later=True)
    fake.release.set()
    trainer = Trainer(DigitsMLPTask(), _config(compile=True), compiler=fake)
    assert trainer.compile_done.wait(60) and trainer.compile_status == "ready"
    eager = Trainer(DigitsMLPTask(), _config())
    assert trainer.step().loss == eager.step().loss
    assert fake.calls == 1 and trainer.compile_status.startswith("failed: RuntimeError")
    assert trainer.step().loss == eager.step().loss and fake.calls == 1


def test_compile_is_off_on_a_cpu_unless_asked():
    assert Trainer(DigitsMLPTask(), _config()).compile_status == "off"


# -- where a GPU is present -------------------------------------------------------------------


def _gpt_on_cuda(**overrides) -> Trainer:
    task = build_task(TaskConfig(name="bytes-gpt", d_model=128, n_layers=2, n_heads=4,
                                 context=128, max_bytes=400_000))
    return Trainer(task, TrainConfig(**{"device": "cuda", "batch_size": 8, "eval_every": 0,
                                        "compile": False, **overrides}))


@CUDA
def test_cuda_defaults_fused_adamw_and_sparse_read_backs():
    trainer = _gpt_on_cuda()
    assert trainer.optimizer.fused and trainer.sync_every == 10
    assert trainer.read_back_async  # a copy queued behind the kernels, no blocking read
    stats = [trainer.step() for _ in range(12)]
    assert [s.measured for s in stats][:10] == [1] * 10  # step 10 queued its read-back
    assert all(math.isfinite(s.loss) for s in stats)
    trainer.flush()
    assert trainer.measured == 12 and math.isfinite(trainer.last_loss)


@CUDA
def test_cuda_nan_step_is_caught_on_the_device():
    trainer = _gpt_on_cuda(sync_every=4)
    trainer.step(), trainer.step()
    before = trainer.parameters_vector()
    bias = trainer.model.ln_f.bias
    kept = bias.detach().clone()
    with torch.no_grad():  # a poisoned final norm makes step 3's loss NaN
        bias.fill_(math.nan)
    trainer.step()
    with torch.no_grad():
        bias.copy_(kept)
    trainer.step()  # step 4 queues the read-back of steps 2-4 behind its kernels
    with pytest.raises(TrainingDiverged) as info:
        trainer.flush()
    assert info.value.step == 3 and trainer.step_count == 2
    assert torch.equal(trainer.parameters_vector(), before)


@CUDA
def test_cuda_accumulation_matches_the_big_batch():
    whole, split = _gpt_on_cuda(grad_accum=1), _gpt_on_cuda(grad_accum=4)
    for _ in range(3):
        whole.step(), split.step()
    torch.testing.assert_close(split.parameters_vector(), whole.parameters_vector(),
                               rtol=2e-2, atol=2e-4)  # bf16 autocast rounds per micro-batch


@CUDA
def test_cuda_torch_compile_beside_training_becomes_ready():
    trainer = _gpt_on_cuda(compile=True)
    first = trainer.step()  # eager: the compile runs beside it
    assert trainer.compile_done.wait(300), "torch.compile took over 5 minutes"
    assert trainer.compile_status == "ready", trainer.compile_status
    stats = [trainer.step() for _ in range(20)]
    assert all(math.isfinite(s.loss) for s in stats) and stats[-1].loss < first.loss


# -- the manifest's switch --------------------------------------------------------------------


def test_train_compile_in_the_manifest_keeps_old_run_ids_and_reaches_the_trainer():
    from protocols import manifest as mf

    base = mf.parse_manifest('[run]\nname = "r"\n')
    assert base.train.compile == "auto"
    assert "compile" not in mf.canonical_bytes(base).decode()  # same bytes as before it
    off = mf.parse_manifest('[run]\nname = "r"\n[train]\ncompile = "off"\n')
    assert '"compile":"off"' in mf.canonical_bytes(off).decode()
    assert mf.run_id(mf.canonical_bytes(off)) != mf.run_id(mf.canonical_bytes(base))
    with pytest.raises(mf.ManifestError, match=r"train\.compile"):
        mf.parse_manifest('[run]\nname = "r"\n[train]\ncompile = true\n')

    from node.training.build import COMPILE, build_training

    assert COMPILE == {"auto": None, "on": True, "off": False}
    digits = ('[run]\nname = "r"\n[model]\ntask = "digits-mlp"\n[data]\nsource = "digits"\n'
              '[outer]\nalgorithm = "none"\n[train]\ncompile = ')
    for value, compiling in (('"off"', False), ('"auto"', False)):  # a CPU: never
        trainer, _, _ = build_training(mf.parse_manifest(digits + value + "\n"), "peer", "cpu")
        assert trainer.config.compile is COMPILE[value.strip('"')]
        assert (trainer.compile_status == "compiling") is compiling


def test_a_cpu_trainer_imports_no_dynamo():
    """Compile is off on a CPU, and the AdamW is ours: the join pays no torch._dynamo."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from node.ml.trainer.loop import TrainConfig, Trainer\n"
            "from node.ml.trainer.tasks import DigitsMLPTask\n"
            "t = Trainer(DigitsMLPTask(), TrainConfig(device='cpu', batch_size=8))\n"
            "t.step(); t.parameters_vector()\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"


# -- what the training service shows ----------------------------------------------------------


async def test_the_service_shows_the_newest_loss_read_back():
    """With read-backs every 4 steps, `node status`'s loss is a real one (that of the last
    step read back), and a NaN step still stops the node's training with TrainingDiverged."""
    import trio

    from node.training.service import TrainingService

    trainer = Trainer(DigitsMLPTask(), _config(fused=True, sync_every=4))
    service = TrainingService(lambda: (trainer, None, 5), None, max_steps=7)
    with trio.fail_after(60):
        await service.run()
    assert service.stats.step == 7 and trainer.measured == 4
    assert service.stats.loss == trainer.last_loss and math.isfinite(service.stats.loss)

    diverging = Trainer(NaNAt(bad=6), _config(fused=True, sync_every=4))
    service = TrainingService(lambda: (diverging, None, 5), None, max_steps=20)
    with trio.fail_after(60), pytest.raises(TrainingDiverged) as info:
        await service.run()
    assert info.value.step == 6 and diverging.step_count == 5
    assert service.stats.phase == "failed" and service.stats.step == 7
