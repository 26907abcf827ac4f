#!/usr/bin/env bash
# One device call for issue 17, run from the project root on the GPU machine, with this tree
# copied to .speed/ and Unsloth's site folder to .peer/site (both carried):
#   bash .speed/bench/device_call.sh "CELL,CELL,..." [gpu-tests]
# Results and logs go to $OUT.
set -o pipefail
cd .speed || exit 1
[ -e tests/assets ] || ln -s ../../tests/assets tests/assets
export PYTHONPATH=$PWD:$PWD/../.peer/site HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee $OUT/gpu.txt
if [ "$2" = gpu-tests ]; then
  python3 -m pytest -q -s tests/gpu/test_fast_lora_cuda.py tests/gpu/test_means_cuda.py \
    > $OUT/gpu-tests.log 2>&1; tail -4 $OUT/gpu-tests.log
fi
python3 bench/run.py peer --out $OUT --cells "$1" 2>&1 | tee $OUT/run.log
if [ "$3" = profile ]; then
  (cd bench && timeout 150 python3 profile_step.py '{"label": "ll-7b-4096-fast", "preset": "24gb",
    "size": "7b", "max_length": 4096, "steps": 6, "grad_accum": 4, "sets": ["lora.dropout=0",
    "data.packed_attention=varlen"]}' --out $OUT > $OUT/profile.log 2>&1; tail -3 $OUT/profile.log)
fi
