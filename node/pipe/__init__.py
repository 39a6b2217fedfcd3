"""The live pipeline: a node hosts one stage of a pipeline run (docs/pipeline.md).

Pure rules at the bottom: placement.py (which stage, the stage map), convergence.py,
claims.py (stage leases in the run document), stall.py (the `stalled` phase); the wire
and the trainer thread: links.py (the `/peertrain/pipe/1.0.0` stream adapter), fetch.py
(asking for a stage's weights), worker.py (the stage's worker) and its loops drive.py
(the first stage) and serve_loop.py (the others), replicas.py (NoLoCo's rounds),
stage_ckpt.py (a host's own checkpoint of its stage). The service's pieces,
each over state.py's PipeState: stage_map.py, choice.py, replica_averaging.py,
routing.py, weights.py, recovery.py, stage_thread.py; service.py (PipelineService)
composes them. The stage math itself is node/ml/pipeline/ (pure torch).
"""
