"""The live pipeline: a node hosts one stage of a pipeline run (docs/pipeline.md).

placement.py (which stage, the stage map; pure), links.py (the `/peertrain/pipe/1.0.0`
stream adapter), worker.py (the stage's loop in the trainer thread), service.py
(PipelineService: the two together). The stage math itself is node/pipeline/ (pure torch).
"""
