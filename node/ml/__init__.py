"""The pure-torch layer: models, the trainer, outer optimizers, aggregation rules, pipeline
stages, stage recovery and device choice.

Nothing here imports trio, libp2p, p2p/ or node's live services (tests/test_layering.py
holds it to that): every module can be read, tested and benchmarked as plain torch code, in
one process, without a network. The services beside this package (node/training,
node/averaging, node/pipe, node/checkpoints) drive it: they own the threads, the streams and
the clocks; this package owns the arithmetic.

    trainer/    models, data, tasks, our AdamW, the local training loop, memory estimates
    optim/      outer optimizers (DiLoCo, NoLoCo) and partner choice
    aggregate/  robust aggregation (mean, median, Krum, FoolsGold, SybilWall, variance)
    pipeline/   pipeline stages, their schedule and the in-process runner
    recovery/   CheckFree stage rebuilds and choosing recovery sources
    device.py   which device to train on, and what it has free
"""
