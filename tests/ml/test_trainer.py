"""node/ml/trainer/: data, models, tasks and the inner loop (tiny models, CPU, one thread)."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from node.ml.trainer import (
    GPT,
    ConfigError,
    DataError,
    DeviceError,
    DigitsMLP,
    FactoryError,
    GPTConfig,
    TaskConfig,
    TrainConfig,
    Trainer,
    TrainerStateError,
    TrainingDiverged,
    build_task,
    get_batch,
    load_factory,
    load_stdlib_corpus,
    load_text_files,
    lr_at,
    resolve_device,
    stdlib_files,
)
from node.ml.trainer.data import is_validation

TINY_GPT = dict(name="bytes-gpt", d_model=32, n_layers=1, n_heads=2, context=32)


@pytest.fixture(scope="module")
def digits_task():
    return build_task(TaskConfig(name="digits-mlp"))


@pytest.fixture(scope="module")
def tiny_gpt_task():
    return build_task(TaskConfig(**TINY_GPT, max_bytes=400_000))


# ------------------------------------------------------------------------------------------------
# Data


def test_stdlib_files_skip_tests_and_site_packages():
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 300
    assert "os.py" in files and "json/decoder.py" in files
    for name in files:
        parts = name.split("/")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts), name
        assert name.endswith(".py")


def test_corpus_split_is_deterministic_and_disjoint_by_file():
    a = load_stdlib_corpus(max_bytes=300_000)
    b = load_stdlib_corpus(max_bytes=300_000)
    assert a.split == "document"
    assert a.train_names == b.train_names and a.val_names == b.val_names
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert not set(a.train_names) & set(a.val_names)
    assert a.train.dtype == torch.uint8 and a.train.numel() + a.val.numel() == 300_000
    # The split of a file depends on its name alone, whatever the cap.
    big = load_stdlib_corpus(max_bytes=1_000_000)
    assert all(is_validation(n, 0.05) for n in big.val_names)
    assert not any(is_validation(n, 0.05) for n in big.train_names)
    assert set(a.val_names) <= set(big.val_names) | set(big.train_names)


def test_get_batch_windows_and_determinism():
    data = torch.arange(100, dtype=torch.uint8)
    x1, y1 = get_batch(data, 8, 10, torch.Generator().manual_seed(1))
    x2, _ = get_batch(data, 8, 10, torch.Generator().manual_seed(1))
    assert x1.shape == (8, 10) and x1.dtype == torch.int64
    assert torch.equal(x1, x2)
    assert torch.equal(y1, x1 + 1)  # next-byte targets
    with pytest.raises(DataError, match="context"):
        get_batch(data[:10], 2, 10, torch.Generator())


def test_user_text_and_jsonl_files(tmp_path):
    for i in range(40):
        (tmp_path / f"doc{i:02}.txt").write_text(f"document {i} " * 20)
    corpus = load_text_files([tmp_path])
    assert corpus.split == "document" and corpus.val.numel() > 0
    assert not set(corpus.train_names) & set(corpus.val_names)
    assert "doc00.txt" in corpus.train_names + corpus.val_names

    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("\n".join(json.dumps({"body": f"record {i} " * 10}) for i in range(50)))
    records = load_text_files([jsonl], format="jsonl", jsonl_field="body")
    assert len(records.train_names) + len(records.val_names) == 50

    single = tmp_path / "one.txt"
    single.write_bytes(b"x" * 1000)
    one = load_text_files([single])  # one file cannot be split by file: split by bytes
    assert one.split == "bytes" and one.train.numel() == 950 and one.val.numel() == 50


def test_user_data_errors_are_clear(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match="no such file") as info:
        load_text_files([missing])
    assert info.value.path == str(missing)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": "fine"}\n{not json}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:4: not valid JSON") as info:
        load_text_files([bad], format="jsonl")
    assert info.value.line == 4

    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"text": "ok"}\n{"content": "x"}\n')
    with pytest.raises(DataError, match=r":2: record has no field 'text'"):
        load_text_files([wrong], format="jsonl")

    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty corpus"):
        load_text_files([empty])
    with pytest.raises(DataError, match="format"):
        load_text_files([empty], format="csv")  # type: ignore[arg-type]

    with pytest.raises(DataError, match="needs more than the context"):
        tiny = tmp_path / "tiny.txt"
        tiny.write_bytes(b"abc" * 10)
        build_task(TaskConfig(**TINY_GPT, data_files=(str(tiny),)))


# ------------------------------------------------------------------------------------------------
# Models and factories


def test_gpt_shapes_tied_and_init():
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=32, n_layers=2, n_heads=4, context=16))
    assert model.lm_head.weight is model.wte.weight
    logits = model(torch.randint(256, (3, 16)))
    assert logits.shape == (3, 16, 256)
    assert abs(model.wte.weight.std().item() - 0.02) < 0.002
    with pytest.raises(ConfigError, match="multiple of n_heads"):
        GPTConfig(d_model=30, n_heads=4)
    assert sum(p.numel() for p in DigitsMLP().parameters()) == 85_002


def test_load_factory_and_its_errors():
    model = load_factory("node.ml.trainer.models:DigitsMLP")()
    assert isinstance(model, DigitsMLP)
    cases = {
        "no_colon_here": "form",
        "node.ml.trainer.nonexistent:make": "cannot import",
        "node.ml.trainer.models:missing_thing": "no attribute",
        "node.ml.trainer.models:__doc__": "not callable",
    }
    for spec, message in cases.items():
        with pytest.raises(FactoryError, match=message) as info:
            load_factory(spec)
        assert info.value.spec == spec
    with pytest.raises(FactoryError, match=r"not a torch\.nn\.Module"):
        load_factory("builtins:dict")()
    with pytest.raises(ConfigError, match="unknown task"):
        build_task(TaskConfig(name="imagenet"))


# ------------------------------------------------------------------------------------------------
# The loop


def _digits_config(**overrides) -> TrainConfig:
    base = dict(batch_size=64, lr=2e-3, warmup_steps=10, max_steps=100, eval_every=50)
    return TrainConfig(**{**base, **overrides})


def test_digits_loss_falls(digits_task):
    trainer = Trainer(digits_task, _digits_config())
    before = trainer.evaluate_metrics()
    stats = [trainer.step() for _ in range(100)]
    after = trainer.evaluate_metrics()
    assert [s.step for s in stats] == list(range(1, 101))
    assert [s.val_loss is not None for s in stats].count(True) == 2  # eval_every=50
    assert after["loss"] < 0.5 * before["loss"]
    assert after["accuracy"] > 0.7 > before["accuracy"]
    assert stats[-1].seconds > 0 and stats[-1].lr == pytest.approx(lr_at(99, trainer.config))


def test_tiny_bytes_gpt_steps_and_evaluates(tiny_gpt_task):
    trainer = Trainer(tiny_gpt_task, TrainConfig(batch_size=4, eval_batches=2, eval_every=3))
    stats = [trainer.step() for _ in range(3)]
    assert all(math.isfinite(s.loss) for s in stats)
    assert stats[-1].val_loss is not None
    assert trainer.evaluate() == pytest.approx(stats[-1].val_loss)  # fixed eval batches
    assert abs(stats[0].loss - math.log(256)) < 0.5  # starts near uniform over bytes


def test_same_seed_same_init_and_replicas_differ_in_data(digits_task):
    a = Trainer(digits_task, _digits_config(seed=3, replica=0))
    b = Trainer(digits_task, _digits_config(seed=3, replica=1))
    c = Trainer(digits_task, _digits_config(seed=4, replica=0))
    assert torch.equal(a.parameters_vector(), b.parameters_vector())
    assert not torch.equal(a.parameters_vector(), c.parameters_vector())
    a.step(), b.step()
    assert not torch.equal(a.parameters_vector(), b.parameters_vector())  # different batches
    again = Trainer(digits_task, _digits_config(seed=3, replica=0))
    again.step()
    assert torch.equal(a.parameters_vector(), again.parameters_vector())  # reproducible


def test_lr_schedule_warmup_cosine_floor():
    config = TrainConfig(lr=1e-3, warmup_steps=10, max_steps=110)
    assert lr_at(0, config) == pytest.approx(1e-4)
    assert lr_at(4, config) == pytest.approx(5e-4)
    assert lr_at(9, config) == pytest.approx(1e-3)
    assert lr_at(60, config) == pytest.approx(1e-4 + 0.5 * 9e-4)  # half way down the cosine
    assert lr_at(110, config) == pytest.approx(1e-4)  # the floor is lr/10
    assert lr_at(10_000, config) == pytest.approx(1e-4)
    values = [lr_at(s, config) for s in range(10, 111)]
    assert values == sorted(values, reverse=True)
    with pytest.raises(ConfigError, match="lr"):
        TrainConfig(lr=0)


def test_parameters_vector_round_trip_without_aliasing(digits_task):
    trainer = Trainer(digits_task, _digits_config())
    vector = trainer.parameters_vector()
    assert vector.dtype == torch.float32 and vector.numel() == trainer.n_params
    target = torch.zeros_like(vector)
    trainer.set_parameters_vector(target)
    trainer.step()
    assert torch.count_nonzero(target) == 0  # the model copied, not aliased, the vector
    trainer.set_parameters_vector(vector)
    assert torch.equal(trainer.parameters_vector(), vector)
    with pytest.raises(ValueError, match="expected a vector"):
        trainer.set_parameters_vector(vector[:-1])


def test_state_dict_resumes_exactly(digits_task):
    a = Trainer(digits_task, _digits_config())
    for _ in range(5):
        a.step()
    state = a.state_dict()
    b = Trainer(digits_task, _digits_config(seed=99))
    b.load_state_dict(state)
    assert b.step_count == 5
    assert a.step().loss == b.step().loss
    assert torch.equal(a.parameters_vector(), b.parameters_vector())
    with pytest.raises(TrainerStateError):
        b.load_state_dict({**state, "version": 999})


def test_device_selection_errors():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda")
    with pytest.raises(DeviceError, match="unknown device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="CUDA is not available") as info:
            resolve_device("cuda:0")
        assert info.value.requested == "cuda:0"


def test_step_from_another_thread_and_divergence(digits_task):
    trainer = Trainer(digits_task, _digits_config(threads=1))
    results = []
    worker = threading.Thread(target=lambda: results.append(trainer.step()))
    worker.start()
    worker.join()
    assert results[0].step == 1
    trainer.set_parameters_vector(torch.full((trainer.n_params,), float("nan")))
    with pytest.raises(TrainingDiverged) as info:
        trainer.step()
    assert info.value.step == 2 and trainer.step_count == 1


# -- digits: per-peer label skew and the testnet attacker's poisoned data -----------------


def test_label_skew_gives_each_replica_its_own_stable_class_mix():
    def classes(replica: int) -> torch.Tensor:
        task = build_task(TaskConfig(name="digits-mlp", label_skew=0.1, replica=replica))
        _, y = task.train_batch(512, torch.Generator().manual_seed(0))
        return torch.bincount(y, minlength=10).float() / 512

    a, again, b = classes(1), classes(1), classes(2)
    assert torch.equal(a, again)  # a function of the replica alone
    assert a.max() > 0.3 and b.max() > 0.3  # a few classes dominate (IID: ~0.1 each)
    assert (a - b).abs().sum() > 0.5  # and the peers differ
    iid = build_task(TaskConfig(name="digits-mlp"))
    _, y = iid.train_batch(2048, torch.Generator().manual_seed(0))
    assert torch.bincount(y, minlength=10).float().div(2048).max() < 0.2


def test_poisoned_digits_teach_the_attack_and_every_node_measures_it():
    rates = {}
    for attack in (None, "label-flip", "backdoor"):
        task = build_task(TaskConfig(name="digits-mlp", attack=attack))
        trainer = Trainer(task, TrainConfig(batch_size=32, lr=1e-2, eval_every=1000, seed=3))
        for _ in range(200):
            trainer.step()
        rates[attack] = trainer.evaluate_metrics()
    assert set(rates[None]) >= {"loss", "accuracy", "label_flip", "backdoor"}
    assert rates["label-flip"]["label_flip"] > rates[None]["label_flip"] + 0.2
    assert rates["backdoor"]["backdoor"] > rates[None]["backdoor"] + 0.5
    with pytest.raises(ConfigError, match="unknown attack"):
        build_task(TaskConfig(name="digits-mlp", attack="teleport"))
