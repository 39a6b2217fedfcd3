"""The pure training pieces: data, models, tasks and the inner loop. No networking.

Typical use, from the daemon's training thread::

    task = build_task(TaskConfig(name="bytes-gpt"))
    trainer = Trainer(task, TrainConfig(seed=run_seed, replica=my_index))
    for _ in range(H):
        stats = trainer.step()
    theta = trainer.parameters_vector()  # hand to node/ml/optim/ for the outer step

See docs/training.md.
"""

from .data import Corpus, get_batch, load_stdlib_corpus, load_text_files, stdlib_files
from .errors import ConfigError, DataError, DeviceError, FactoryError, TrainerError
from .loop import (
    StepStats,
    TrainConfig,
    Trainer,
    TrainerStateError,
    TrainingDiverged,
    derive_seed,
    lr_at,
    resolve_device,
)
from .models import GPT, DigitsMLP, GPTConfig, count_parameters, load_factory
from .tasks import (
    TASK_NAMES,
    BytesGPTTask,
    DigitsMLPTask,
    Task,
    TaskConfig,
    build_task,
    load_digits,
)

__all__ = [
    "GPT",
    "TASK_NAMES",
    "BytesGPTTask",
    "ConfigError",
    "Corpus",
    "DataError",
    "DeviceError",
    "DigitsMLP",
    "DigitsMLPTask",
    "FactoryError",
    "GPTConfig",
    "StepStats",
    "Task",
    "TaskConfig",
    "TrainConfig",
    "Trainer",
    "TrainerError",
    "TrainerStateError",
    "TrainingDiverged",
    "build_task",
    "count_parameters",
    "derive_seed",
    "get_batch",
    "load_digits",
    "load_factory",
    "load_stdlib_corpus",
    "load_text_files",
    "lr_at",
    "resolve_device",
    "stdlib_files",
]
