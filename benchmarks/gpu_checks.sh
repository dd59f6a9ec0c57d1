#!/usr/bin/env bash
# The GPU checks, in one call on a lent GPU (a lease is minutes, so one script does all):
#
#   1. tests/test_scan_pallas.py with the real GPU kernels (every strategy the GPU runs,
#      Triton and Mosaic GPU; look-back with hundreds of chunks in flight);
#   2. benchmarks/scan.py in bfloat16 against the copy floor measured in the same run;
#   3. benchmarks/train_step.py in bfloat16, griffin_100m and griffin_1_3b, with MFU;
#   4. the training step under shard_map on a mesh of all local GPUs.
#
#   bash benchmarks/gpu_checks.sh OUT_DIR [CARRY_DIR]
#
# CARRY_DIR (default .whl) may hold wheels the machine lacks (gin-config,
# recurrentgemma, typeguard) and `*.model.json` ModelConfigs written on a host with the
# full stack (`python benchmarks/gpu_checks_prepare.py CARRY_DIR`): the GPU image has
# JAX and Flax but not SeqIO/TensorFlow, which the Gin presets' import path brings.
# Each step has its own time limit and log, so one failure does not hide the others.
set -u
out=${1:?usage: gpu_checks.sh OUT_DIR [CARRY_DIR]}
carry=${2:-.whl}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls "$carry"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$carry"/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

step() {  # step NAME SECONDS COMMAND...: runs COMMAND under a limit, logs to OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$out/summary.txt"
  tail -n 25 "$out/$name.log" | sed 's/^/   /' >> "$out/summary.txt"
}

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
    --format=csv; python3 -c "import jax, flax, optax; print('jax', jax.__version__, \
'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"; } \
  > "$out/summary.txt" 2>&1

step pallas_tests 100 python3 -m pytest -q --noconftest -p no:cacheprovider \
  tests/test_scan_pallas.py
step scan_bf16 90 python3 benchmarks/scan.py --dtype=bfloat16 --batch=8 --channels=4096 \
  --lengths=4096,16384 --repeats=10 \
  --impls=lax:1,associative,pallas:chunked,pallas:lookback,recurrentgemma
for model in griffin_100m:16:90 griffin_1_3b:8:130; do
  IFS=: read -r name batch limit <<< "$model"
  step "train_$name" "$limit" python3 benchmarks/train_step.py --preset="$carry/$name.model.json" \
    --dtype=bfloat16 --batch="$batch" --seq=2048 --steps=6 --warmup=2 \
    --json="$out/train_$name.json"
done
step shard_map_step 60 python3 benchmarks/gpu_shard_map_step.py
cat "$out/summary.txt"
