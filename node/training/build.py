"""From a validated run manifest to the trainer and outer optimizer it describes."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from node.errors import NodeError
from protocols import manifest as mf

if TYPE_CHECKING:
    import torch

    from node.checkpoints.store import CheckpointStore
    from node.ml.optim.compress import SwarmTopK, TopKConfig
    from node.ml.optim.gossip import GossipLearning
    from node.ml.trainer.loop import Trainer
    from node.ml.types import Built, LocalTrainer, OuterOptimizer
    from node.training.rounds import TrainingStats


class TrainerSetupError(NodeError):
    exit_code = 7


def replica_index(peer_id: str) -> int:
    """A stable per-peer number: each replica draws its own data stream (spec 1b)."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big")


# train.compile -> TrainConfig.compile (None: on CUDA only)
COMPILE: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
ATTACKER_REPLICA = "sybil-attacker"  # every sybil draws the same data: identical models
# A testnet attacker trains this many rounds on its poisoned data, then sends that model
# every round (its label-flip rate is 0.51 at step 400 of the sybil scenario, 0.45 at 250).
POISON_ROUNDS = 2


def check_swarm_algorithm(m: mf.Manifest, attack: str | None = None) -> None:
    """What a node refuses to run, before it joins (a clear error, not an idle node)."""
    if m.outer.algorithm == "diloco" and m.pipeline is not None:
        raise TrainerSetupError("outer.algorithm = 'diloco' is for data-parallel runs; a "
                                "[pipeline] run's replicas average by 'noloco'")
    if m.pipeline is not None and m.model.task != "bytes-gpt":
        raise TrainerSetupError("a [pipeline] run cuts the byte-level GPT: it needs "
                                "model.task = 'bytes-gpt'")
    if m.pipeline is not None and attack is not None:
        raise TrainerSetupError("--attack poisons a whole model: not in a pipeline run")
    if attack is not None and (m.model.task != "digits-mlp" or m.outer.algorithm != "gossip"):
        raise TrainerSetupError("--attack poisons digits: it needs model.task = 'digits-mlp' "
                                "and outer.algorithm = 'gossip'")


def neighbours(m: mf.Manifest) -> int | None:
    """Gossip learning's k neighbours per round (None: NoLoCo's groups of outer.group_size)."""
    return m.aggregate.neighbours if m.outer.algorithm == "gossip" else None


def build_training(m: mf.Manifest, peer_id: str, device: str,
                   data: list[str] | None = None,
                   attack: str | None = None) -> Built:
    """Build (trainer, outer optimizer or None, inner steps H), from the run's initial
    weights (`resume_newest` then loads a checkpoint into them). Runs in a worker thread."""
    from node.ml.optim.noloco import NoLoCo, NoLoCoConfig
    from node.ml.trainer.loop import TrainConfig, Trainer
    from node.ml.trainer.tasks import TaskConfig, build_task

    task = build_task(TaskConfig(
        name=m.model.task,
        d_model=m.model.d_model,
        n_layers=m.model.n_layers,
        n_heads=m.model.n_heads,
        context=m.model.context,
        data_files=tuple(data) if data else tuple(m.data.paths) if m.data.source == "files"
        else (),
        data_format=m.data.format,
        jsonl_field=m.data.jsonl_field,
        val_fraction=m.data.val_fraction,
        model_factory=m.model.factory or None,
        label_skew=m.data.label_skew,
        replica=replica_index(peer_id),
        attack=attack,
    ))
    t = m.train
    trainer = Trainer(task, TrainConfig(
        lr=t.lr, warmup_steps=t.warmup_steps, max_steps=t.total_steps,
        weight_decay=t.weight_decay, grad_clip=t.grad_clip, batch_size=t.batch_size,
        eval_every=t.eval_every, eval_batches=t.eval_batches, device=device,
        threads=t.threads, seed=m.run.seed,
        compile=COMPILE[t.compile],
        replica=replica_index(ATTACKER_REPLICA if attack else peer_id),
    ))
    if m.outer.algorithm == "none":
        return trainer, None, m.outer.inner_steps
    check_swarm_algorithm(m, attack)
    if m.outer.algorithm == "gossip":
        return trainer, _gossip(m, trainer, peer_id, attack), m.outer.inner_steps
    if m.outer.codec == "topk":
        return trainer, topk_outer(m, trainer.parameters_vector()), m.outer.inner_steps
    if m.outer.algorithm == "diloco":  # the baseline: an all-reduce every round
        from node.ml.optim.diloco import DiLoCoConfig, SwarmDiLoCo

        outer: SwarmDiLoCo | NoLoCo = SwarmDiLoCo(trainer.parameters_vector(), DiLoCoConfig(
            outer_lr=m.outer.outer_lr, momentum=m.outer.momentum, nesterov=m.outer.nesterov))
    else:
        outer = NoLoCo(trainer.parameters_vector(),
                       NoLoCoConfig(outer_lr=m.outer.outer_lr, momentum=m.outer.momentum))
    return trainer, outer, m.outer.inner_steps


def topk_config(m: mf.Manifest) -> TopKConfig:
    """The compression a topk run sends: compress.py's defaults (NoLoCo: TopKConfig();
    DiLoCo: SparseLoCo's), narrowed to the manifest's topk_max_* bounds so that every peer
    accepts our frames (k/chunk and the bit widths are what a receiver checks)."""
    from node.ml.optim.compress import SPARSELOCO_TOPK, TopKConfig

    base = SPARSELOCO_TOPK if m.outer.algorithm == "diloco" else TopKConfig()
    o = m.outer
    k = min(base.k, int(o.topk_max_density * base.chunk))
    if k < 1:
        raise TrainerSetupError(f"outer.topk_max_density = {o.topk_max_density:g} keeps no "
                                f"value of a chunk of {base.chunk}: at least {1 / base.chunk:g}")
    anchor = min(base.anchor_bits, o.topk_max_anchor_bits)
    return dataclasses.replace(base, density=k / base.chunk,
                               value_bits=min(base.value_bits, o.topk_max_bits),
                               anchor_bits=anchor if anchor >= 2 else 0)


def topk_outer(m: mf.Manifest, params: torch.Tensor) -> SwarmTopK:
    """`outer.codec = "topk"`: CompressedNoLoCo or CompressedDiLoCo (the manifest's outer
    lr and momentum), behind the service's outer-step interface (compress.SwarmTopK)."""
    from node.ml.optim.compress import CompressedDiLoCo, CompressedNoLoCo, SwarmTopK

    o, topk = m.outer, topk_config(m)
    if o.algorithm == "diloco":
        from node.ml.optim.diloco import DiLoCoConfig

        return SwarmTopK(CompressedDiLoCo(params, DiLoCoConfig(
            outer_lr=o.outer_lr, momentum=o.momentum, nesterov=o.nesterov), topk))
    from node.ml.optim.noloco import NoLoCoConfig

    return SwarmTopK(CompressedNoLoCo(
        params, NoLoCoConfig(outer_lr=o.outer_lr, momentum=o.momentum), topk))


def resume_newest(m: mf.Manifest, trainer: LocalTrainer, outer: OuterOptimizer | None,
                  checkpoints: CheckpointStore, stats: TrainingStats | None = None) -> None:
    """Continue from the run's newest checkpoint in the store, if it holds one. `stats`
    (the TrainingStats) learns what the weights now carry: the checkpoint's claim of
    trained steps (its manifest step) and its id, the lineage of what we write next."""
    latest = checkpoints.latest(mf.run_id(mf.canonical_bytes(m)))
    if latest:
        trained = _resume(trainer, outer, checkpoints, latest)
        if trained is not None and stats is not None:
            stats.trained, stats.lineage = trained, latest


class Prebuild:
    """The trainer and outer optimizer, built in the background as soon as torch is loaded
    and no checkpoint is downloading (`hold()` false), before the join resumes them from
    the checkpoint (`resume_newest`). The build (model init, data, optimizer state; 0.4-0.5
    s on the 2-core machine) runs while the first run-document sync is awaited, or else
    right after the download: beside the download it took CPU the download needed, on the
    joiner and on its provider, whose session runs at the trainers' nice (`node bench
    join`, 6 interleaved pairs: download 0.2-1.0 s shorter in each, build up to 0.2 s
    longer; docs/benchmarks.md). A thread of its own at the node's priority; `result()`
    re-raises what the build raised, in the trainer thread that asks."""

    def __init__(self, build: Callable[[], Built],
                 hold: Callable[[], bool] = lambda: False) -> None:
        from node.process import preload

        self._cancelled = threading.Event()

        def when_ready() -> Built:
            while not preload.wait(timeout=0.1):
                if self._cancelled.is_set():  # a node stopped while torch loaded: its
                    raise CancelledError  # exit waits for this thread, not for torch
            while hold():
                if self._cancelled.wait(0.05):
                    raise CancelledError
            return build()

        pool = ThreadPoolExecutor(1, thread_name_prefix="peertrain-prebuild")
        self._future = pool.submit(when_ready)
        pool.shutdown(wait=False)  # the thread ends with the build

    def result(self) -> Built:
        return self._future.result()

    def cancel(self) -> None:
        """Build nothing if torch is not loaded yet or a checkpoint still downloads (a
        build under way finishes)."""
        self._cancelled.set()


def _gossip(m: mf.Manifest, trainer: Trainer, peer_id: str,
            attack: str | None) -> GossipLearning:
    """Gossip learning with the manifest's aggregator; an attacker aggregates nothing."""
    from node.ml.aggregate import make_aggregator
    from node.ml.optim.gossip import GossipLearning, layout_of

    layout = layout_of(trainer.model)
    if attack is not None:
        return GossipLearning(layout, None)
    params: dict[str, Any] = {}
    if m.aggregate.method in ("sybilwall", "foolsgold"):
        # Histories as updates from the shared initial weights (spec §3g: else they telescope
        # into the models themselves). Every peer's init is the same function of the seed.
        gl = GossipLearning(layout, None)
        params["reference"] = {k: v.clone() for k, v in
                               gl.unflatten(trainer.parameters_vector()).items()}
    return GossipLearning(layout, make_aggregator(m.aggregate.method, self_id=peer_id, **params))


def _resume(trainer: LocalTrainer, outer: OuterOptimizer | None, store: CheckpointStore,
            cid: str) -> int | None:
    """Continue from a local checkpoint and return the trained steps it claims (its
    manifest step); a damaged or foreign one is skipped with a logged reason (training
    starts from the initial weights instead) and None returned."""
    import logging

    from node.ml.trainer.errors import TrainerError
    from node.training.state import restore_checkpoint

    log = logging.getLogger("node.training")
    try:
        manifest, tensors = store.load(cid)
        restore_checkpoint(trainer, outer, tensors)
    except (NodeError, TrainerError, KeyError, RuntimeError, ValueError) as e:
        log.warning("not resuming from %s: %s", cid, e)
        return None
    log.info("resumed from checkpoint %s (step %d, %d steps trained)", cid, trainer.step_count,
             manifest.step)
    return int(manifest.step)
