"""The one shape of a node service, and the context services share.

A service is one capability of the daemon: it speaks the protocols named in `protocols`
(ids taken from protocols/), owns its own state, and runs as one task in the daemon's
nursery. `run(ctx, task_status=...)` registers its stream handlers, calls
`task_status.started()` once it is ready (so the next service may rely on it, as with
trio's `nursery.start`) and then runs until cancelled. `statistics()` returns a plain,
JSON-able dict: `node status` is `{service.name: service.statistics()}`.

Services never reach into one another. What several of them read or write lives in the
`NodeContext` (built before any service starts) and its `RunContext` (built once, when the
node knows its run). Where one service drives another (training calls the averager's
`exchange` at a round boundary, checkpoint snapshots go to the checkpoint service), the
daemon passes the callee's bound method at construction: the dependency is visible in
daemon.py, never a lambda over an attribute that is set later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import trio

from node.transport.transports import Transports

if TYPE_CHECKING:
    from node.checkpoints.store import CheckpointStore
    from node.config import NodeConfig
    from node.membership.view import Membership
    from node.run.store import RunStore
    from node.training.rounds import TrainingStats
    from p2p.host import Substrate
    from p2p.pubsub import PacedPublisher
    from protocols.keys import Signer
    from protocols.manifest import Manifest
    from protocols.rundoc import RunDocument


class Service(Protocol):
    @property
    def name(self) -> str: ...  # its key in `node status` (a class attribute will do)

    @property
    def protocols(self) -> tuple[str, ...]: ...  # stream protocol ids served (not gossip)

    async def run(self, ctx: NodeContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...

    def statistics(self) -> dict[str, Any]: ...


class Phases:
    """Where the node is (`node status` and the join benchmark read it), and when each
    phase first began, in seconds after start."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.current = "starting"
        self.times: dict[str, float] = {"starting": 0.0}

    def enter(self, phase: str) -> None:
        self.current = phase
        self.times.setdefault(phase, round(time.monotonic() - self.started, 3))


@dataclass
class RunContext:
    """What services of one run share; exists from the moment the manifest is verified."""

    run_id: str
    manifest: Manifest
    document: RunDocument  # this node's replica of the signed run document
    progress: TrainingStats  # written by the training service, read by heartbeats & co.
    # The trainer thread's outer optimizer, once built (SybilWall's history table lives in
    # its aggregator); None before that and on nodes that do not train.
    outer: Any = None
    # The pipeline stage this node hosts (pipeline runs: node/pipe/service.py); None else.
    stage: int | None = None
    stage_training: bool = False  # its worker runs (placement moves others first)


@dataclass
class NodeContext:
    """What every service of one node shares; built by the daemon before any starts."""

    config: NodeConfig
    substrate: Substrate
    signer: Signer
    publisher: PacedPublisher
    runs: RunStore
    checkpoints: CheckpointStore
    membership: Membership
    phases: Phases = field(default_factory=Phases)
    device: str = "cpu"
    run: RunContext | None = None  # set once, when the run is known
    # How every peer is reached (node/transport/transports.py): streams, path kinds, round
    # trips, lanes, handlers on every transport. Built on the substrate; the daemon attaches
    # the WebRTC channels, the path labeller and the reach verdict as it builds them.
    transports: Transports = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.transports is None:
            self.transports = Transports(self.substrate)

    @property
    def peer_id(self) -> str:
        return self.signer.peer_id

    def own_stats(self) -> dict[str, Any]:
        """What this node reports about itself to the swarm (heartbeats, run document)."""
        stats: dict[str, Any] = {"uptime": round(time.monotonic() - self.phases.started, 1)}
        if self.run is not None:
            p = self.run.progress
            # `trained`: what our weights embody (<= step, the round clock); a partner's
            # averaged round credits us with it (node/training/service.py), and a recovering
            # stage prefers the replica whose stage weights claim the most
            # (node/ml/recovery/sources.py).
            stats.update(step=p.step, loss=p.loss, val=p.val_loss, stage=self.run.stage,
                         gnorm=p.grad_norm,  # CheckFree weighs a lost stage's neighbours by it
                         trained=p.trained,
                         # base rounds per exchange this node wants (node/training/service.py)
                         span=p.span_wanted if p.span_wanted > 1 else None)
            # When written (our wall clock): gossip can deliver it late; the median over
            # the peers also tells each node how far its own clock is off the swarm's.
            stats["t"] = round(time.time(), 1)
            if self.run.stage_training:
                stats["staged"] = 1
        return {k: v for k, v in stats.items() if v is not None}

    def the_run(self) -> RunContext:
        """For services that exist only inside a run (the daemon builds them after it)."""
        if self.run is None:
            raise RuntimeError("this service needs a run; the daemon starts it after joining")
        return self.run
