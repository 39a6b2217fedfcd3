"""A join's trainer on a GPU, built as the node builds it (manifest -> `build_training`,
`train.compile = "auto"`): the steps run eager while `torch.compile` runs beside them
(docs/training.md). When does the compiled forward take over, and what does a step take
before and after? Part of testnet/bench/gpu_checks.sh:

    python -m testnet.bench.gpu_join [SECONDS]

Prints one line per 100 steps (block times between two `flush()`es and syncs, so they are
the GPU's) and a summary; a CUDA GPU is required.
"""

from __future__ import annotations

import sys
import time

MANIFEST = """schema = 1
[run]
name = "gpu-join"
[model]
d_model = 768
n_layers = 12
n_heads = 12
context = 1024
[train]
batch_size = 16
eval_every = 1000000
[outer]
inner_steps = 50
"""
BLOCK = 20  # steps per timed block


def main(seconds: float = 75.0) -> None:
    import torch

    from node.training.build import build_training
    from protocols import manifest as mf

    if not torch.cuda.is_available():
        raise SystemExit("gpu_join: needs a CUDA GPU (torch.cuda.is_available() is False)")
    started = time.perf_counter()
    trainer = build_training(mf.parse_manifest(MANIFEST), "peer", "cuda")[0]
    print(f"built in {time.perf_counter() - started:.1f} s: compile {trainer.compile_status}, "
          f"{trainer.accum} micro-batch(es), read back every {trainer.sync_every}")
    last, step, switched, block_ms = time.perf_counter(), 0, None, 0.0
    while time.perf_counter() - started < seconds:
        for _ in range(BLOCK):
            trainer.step()
        step += BLOCK
        trainer.flush()
        torch.cuda.synchronize()
        now = time.perf_counter()
        block_ms, last = (now - last) / BLOCK * 1e3, now
        if switched is None and trainer.compile_status == "ready":
            switched = (step, now - started)
        if step % 100 == 0 or step == BLOCK:
            print(f"step {step:5d} at {now - started:6.1f} s: {block_ms:6.1f} ms/step "
                  f"({trainer.compile_status})")
    print(f"compiled forward in use from step {switched[0]} ({switched[1]:.1f} s)"
          if switched else f"compile not ready after {seconds:g} s: {trainer.compile_status}")
    print(f"last block {block_ms:.1f} ms/step; loss {trainer.last_loss:.3f} at step {step}")

if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 75.0)
