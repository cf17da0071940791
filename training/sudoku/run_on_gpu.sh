#!/usr/bin/env bash
# One call on the GPU machine: build diffuserve (its CPU backend evaluates checkpoints
# through the real sampler while the GPUs train) unless it is installed, then one training
# run per visible GPU, the same train.py options with seeds 0, 1, ...; every run ends with
# its final evaluation before DEADLINE seconds after this script starts (default 560: the
# device's per-call limit is 600). $OUT gets run<g>.tar.* (each run's best checkpoint and
# log, in parts under the 16 MB a returned file may have) and logs.tar (every run's output).
# RUN<g>_ARGS (e.g. RUN1_ARGS="--layers 12") adds options for run g alone, so one call can
# compare two recipes.
# Usage: [DEADLINE=s] [RUN<g>_ARGS=...] bash training/sudoku/run_on_gpu.sh [train.py options]
set -uo pipefail
start=$(date +%s)
cd "$(dirname "$0")/../.."
out="$(realpath -m "${OUT:-gpu-logs}")"
mkdir -p "$out"
if ls .device/transformers-*.whl >/dev/null 2>&1; then  # transformers >= 5.23, as the tests pin
  python3 -m pip install -q --no-deps --upgrade --target /tmp/newer-transformers .device/transformers-*.whl
  export PYTHONPATH="/tmp/newer-transformers${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! (cd /tmp && python3 -c "import diffuserve") 2>/dev/null; then
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install -q --no-build-isolation --no-deps \
    --config-settings=cmake.define.DIFFUSERVE_CUDA=OFF . > /tmp/build.log 2>&1 \
    || { tail -30 /tmp/build.log; exit 1; }
fi
gpus=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
# Training time: what is left before the deadline, less the pool of puzzles (train.py's
# --pool-seconds, 40 by default), the last evaluation and packing (~90 s).
minutes=$(python3 -c "print(round(max(0.5, (${DEADLINE:-560} - ($(date +%s) - $start) - 40 - 90) / 60), 2))")
echo "$gpus GPU(s), $minutes minutes of training each"
for ((g = 0; g < gpus; g++)); do
  extra="RUN${g}_ARGS"
  # shellcheck disable=SC2086  # the extra options split into words, as on a command line
  CUDA_VISIBLE_DEVICES=$g PYTHONUNBUFFERED=1 python3 training/sudoku/train.py --out "/tmp/run$g" --seed "$g" \
    --minutes "$minutes" --eval-threads $(( $(nproc) / gpus - 2 > 1 ? $(nproc) / gpus - 2 : 1 )) "$@" ${!extra:-} \
    > "/tmp/run$g.log" 2>&1 &
done
wait
for ((g = 0; g < gpus; g++)); do
  echo "== run $g (seed $g)"; grep -E '"solved"|Error|error' "/tmp/run$g.log" | tail -8
  [ -d "/tmp/run$g/best" ] && (cd "/tmp/run$g" && tar cf - best training_log.jsonl | split -b 15M - "$out/run$g.tar.")
done
tar cf "$out/logs.tar" -C /tmp $(cd /tmp && ls run*.log)
