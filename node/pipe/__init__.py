"""The live pipeline: a node hosts one stage of a pipeline run (docs/pipeline.md).

placement.py (which stage, the stage map; pure), links.py (the `/peertrain/pipe/1.0.0`
stream adapter), worker.py (the stage's loop in the trainer thread), replicas.py (NoLoCo
between a stage's hosts), stage_ckpt.py (a host's own checkpoint of its stage), stall.py
(whether the host's steps complete: the `stalled` phase), service.py (PipelineService: all
of them together). The stage math itself is node/ml/pipeline/ (pure torch).
"""
