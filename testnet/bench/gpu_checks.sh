#!/bin/bash
# Issue 29's GPU checks in one go, for a machine with a CUDA GPU and a CUDA build of torch
# (`make bench-gpu`). It needs torch and rich, and for the tests pytest, pytest-trio, trio,
# hypothesis, pydantic, zstandard, base58 and platformdirs; not libp2p. About 4 minutes on
# an H100:
#   1. `node bench trainer --device cuda` (the 86M model, batch 16): rewrites the CUDA block
#      of docs/benchmarks.md's `trainer` section;
#   2. the same at batch 32, into $OUT/trainer-b32.md (compare with the 0.80x);
#   3. the CUDA tests: the memory estimate against the measured peak, fused AdamW against
#      torch's, the NaN caught on the GPU, accumulation, a real torch.compile beside training;
#   4. a join's trainer as the node builds it (compile "auto"): when the compiled forward
#      takes over, and the step time before and after (docs/training.md, "torch.compile
#      beside training").
# Logs go to $OUT (default gpu-results/). Each part has a time limit, and a failing part
# does not stop the others.
set -u
OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1

part() {  # part NAME SECONDS COMMAND...: run, log to $OUT/NAME.log, print the end
    local name=$1 limit=$2; shift 2
    echo "== $name ($(date +%T))"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $?"
    grep -v '^\s*$' "$OUT/$name.log" | tail -n 12
}

part trainer-b16 300 "$PY" -c "from testnet.bench import trainer; trainer.main(device='cuda')"
part trainer-b32 300 "$PY" -c "
from pathlib import Path
from testnet.bench import trainer
trainer.main(device='cuda', batch=32, doc=Path('$OUT/trainer-b32.md'))"
part cuda-tests 300 "$PY" -m pytest -q -p no:cacheprovider -rfEs \
    tests/ml/test_trainer_speed.py tests/ml/test_device_memory.py tests/ml/test_adamw.py
part join 150 "$PY" -m testnet.bench.gpu_join
