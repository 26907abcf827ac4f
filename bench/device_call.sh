#!/usr/bin/env bash
# One device call for issue 17, run from the project root on the GPU machine with Unsloth's
# site folder (shared/tools/peer-unsloth/build.sh) in .peer/site, carried:
#   bash bench/device_call.sh "CELL,CELL,..." [gpu-tests] [profile]
# CELL: a label of `python bench/run.py peer` ("" for none). gpu-tests: tests/gpu first.
# attention: bench/attention_bench.py first.
# profile: bench/profile_step.py on lora-lab's and Unsloth's 7B 4 x 4096 cell afterwards;
# profile:LABEL,LABEL on those cells of profile_step.CELLS; host:LABEL,LABEL their host's Python
# (profile_step.py --host: cProfile).
# families:LABEL,LABEL: those cells of `bench/run.py families` afterwards, three at once (memory
# figures; their speeds are not clean).
# plan:NAME[:N[:LABEL,LABEL]]: the cells of `bench/run.py NAME` afterwards (those labels; all
# without), N at once (default 4; memory figures under the tiers' caps: presets-small,
# presets-7b, auto-layers; long-context at 1: Unsloth's and lora-lab's long 7B cells, ~6-8 min).
# The machine is given back after about 30 s idle: one call with every step costs one start.
# Results, logs, profiles and kernel traces go to $OUT.
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=$PWD:$PWD/.peer/site HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee $OUT/gpu.txt
cells=$1; shift
for step in "$@"; do
  if [ "$step" = gpu-tests ]; then
    timeout 150 python3 -m pytest -q -s tests/gpu > $OUT/gpu-tests.log 2>&1; tail -4 $OUT/gpu-tests.log
  fi
  if [ "$step" = attention ]; then
    timeout 200 python3 bench/attention_bench.py --out $OUT 2>&1 | tee $OUT/attention.log
  fi
done
[ -n "$cells" ] && python3 bench/run.py peer --out $OUT --cells "$cells" 2>&1 | tee $OUT/run.log
for step in "$@"; do
  case $step in families:*)
    python3 bench/run.py families --out $OUT --parallel 3 --cells "${step#families:}" 2>&1 \
      | grep -v "Writing model shards" | tee -a $OUT/run.log
  esac
done
for step in "$@"; do
  case $step in plan:*)
    IFS=: read -r name parallel labels <<< "${step#plan:}"
    python3 bench/run.py "$name" --out $OUT --parallel "${parallel:-4}" \
        ${labels:+--cells "$labels"} 2>&1 \
      | grep -v "Writing model shards" | tee -a $OUT/run.log
  esac
done
for step in "$@"; do
  case $step in host:*)
    (cd bench && for label in $(echo ${step#host:} | tr , ' '); do
        timeout 240 python3 profile_step.py "$label" --host --out $OUT >> $OUT/profile.log 2>&1
      done)
  esac
  case $step in profile|profile:*)
    labels=${step#profile:}; [ "$step" = profile ] && labels=ll-7b-4096,us-7b-4096
    (cd bench && for label in ${labels//,/ }; do
        timeout 240 python3 profile_step.py "$label" --out $OUT >> $OUT/profile.log 2>&1
        python3 trace_gaps.py $OUT/trace-$label.json.gz
      done)
  esac
done
