"""Errors a user of `node join` can see. Each message says what went wrong and what to try."""


class NodeError(Exception):
    """Base: the CLI prints the message (no traceback) and exits with `exit_code`."""

    exit_code = 1


class BootstrapUnreachable(NodeError):
    exit_code = 3


class RunNotFound(NodeError):
    exit_code = 4


class ManifestRejected(NodeError):
    exit_code = 5


class StateDirError(NodeError):
    exit_code = 6


class TrainingFailed(NodeError):
    """The trainer stopped with an error: the node stops too, with the reason. Exit 9, or
    DEVICE_MEMORY_EXIT when the cause is the trainer's own DeviceMemoryError
    (node/ml/trainer/errors.py, the one class of that name): that failure has its own exit
    status and advice (docs/operator.md)."""

    exit_code = 9

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


#: TrainingFailed's exit status when training does not fit in the GPU's free memory.
DEVICE_MEMORY_EXIT = 11


class MetricsPortError(NodeError):
    """`--metrics HOST:PORT` cannot be listened on (taken, or not this machine's address):
    a usage error, like a `--listen` that cannot bind, found before the node joins."""

    exit_code = 2


class DeviceUnavailable(NodeError):
    """`--device cuda[:N]` on a machine without that GPU (checked before the node dials)."""

    exit_code = 10
