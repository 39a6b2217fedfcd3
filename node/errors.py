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
    """The trainer stopped with an error: the node stops too, with the reason."""

    exit_code = 9


class MetricsPortError(NodeError):
    """`--metrics HOST:PORT` cannot be listened on (taken, or not this machine's address):
    a usage error, like a `--listen` that cannot bind, found before the node joins."""

    exit_code = 2


class DeviceUnavailable(NodeError):
    """`--device cuda[:N]` on a machine without that GPU (checked before the node dials)."""

    exit_code = 10


class DeviceMemoryError(NodeError):
    """Training would not fit in the GPU's free memory (checked before the first step)."""

    exit_code = 11
