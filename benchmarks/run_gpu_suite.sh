#!/usr/bin/env bash
# The GPU suite on any CUDA host with the package installed (`pip install -e ".[test]"`): the GPU tests, then the
# benchmark suites, each writing <out>/<suite>_<device>.json with commit, device and command (docs/benchmarking.md).
#
#   bash benchmarks/run_gpu_suite.sh [--out DIR] [--parts tests,gemm,attention,e2e] [--commit SHA] [--peer-dir DIR]
#
#   --out       where the JSON and logs go (default: benchmarks/results)
#   --parts     comma list of tests, gemm, attention, e2e, v100, flashinfer, flashinfer_forward, and on a host with
#               N >= 2 GPUs multi_gpu_tests, cp, uneven, tp_w8a16 (docs/multi_gpu.md) (default: tests,gemm,attention,e2e)
#               parallel_one_gpu: the multi-rank tests with ranks sharing one GPU (gloo; junit XML beside the logs);
#               scaling_model: the context-parallel scaling model from one-GPU measurements (docs/multi_gpu.md);
#               flashinfer: FlashInfer's GPU tests and its peers (needs flashinfer-python; docs/benchmarking.md);
#               flashinfer_forward: the full forward with and without FlashInfer's kernels under the presets
#               fasth3: the FastH3-shaped t2va / fl2va requests, stack quantized while loading (80 GB cards)
#               train_lora: the LoRA training steps of the 24 GB and 80 GB recipes (train_lora.py)
#               memory_12gb: the 12 GB PC recipe over the memory model's shapes with request-sized caps
#               cpu_suite: the README's CPU test command on this GPU host (its GPUs hidden: docs/testing.md), JUnit XML
#               cache_profiles: the six cache profiles' t2va 50-step requests, weights quantized while building
#               (one 80 GB card; one process per cache setting); cache_fidelity: their clips against `exact`
#               at 50 steps, and those of `fast` / `fastest` alone (text encoder first: one 80 GB card)
#   --commit    the commit measured, for a copy of the tree without .git (default: git rev-parse HEAD)
#   --peer-dir  folder with the public vsa package's python sources, for the attention suite's peer case
#   --workers   pytest-xdist workers for the GPU tests, sharing the GPU (default 1; docs/benchmarking.md)
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=benchmarks/results
PARTS=tests,gemm,attention,e2e
COMMIT_ARGS=()
PEER_ARGS=()
WORKER_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --parts) PARTS=$2; shift 2 ;;
    --commit) COMMIT_ARGS=(--commit "$2"); shift 2 ;;
    --peer-dir) PEER_ARGS=(--peer-dir "$2"); shift 2 ;;
    --workers) WORKER_ARGS=(-n "$2" --dist loadfile); shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "run_gpu_suite.sh: error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# A short device tag for the file names: "NVIDIA H200" -> h200.
DEVICE=$(python -c "import re, torch; assert torch.cuda.is_available(), 'no CUDA GPU'; \
print(re.sub('[^a-z0-9]+', '_', torch.cuda.get_device_name().lower().replace('nvidia', '')).strip('_'))" 2>/dev/null) || {
  echo "run_gpu_suite.sh: error: no CUDA GPU visible to torch — run it on a GPU host" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true

status=0
run() {  # run <name> <command...>: log to $OUT/<name>.log, keep going on failure, remember it
  echo "== $1"
  "${@:2}" 2>&1 | tee "$OUT/$1.log" | tail -30
  local rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] || { echo "== $1 failed (exit $rc)"; status=1; }
}
has() { [[ ",$PARTS," == *",$1,"* ]]; }

has tests && run gpu_tests python -m pytest -o addopts="" -m gpu tests -q -p no:cacheprovider "${WORKER_ARGS[@]}"
has gemm && run gemm python benchmarks/gemm.py --no-fused "${COMMIT_ARGS[@]}" --out "$OUT/gemm_$DEVICE.json"
has attention && run attention python benchmarks/attention.py "${PEER_ARGS[@]}" "${COMMIT_ARGS[@]}" \
  --out "$OUT/attention_$DEVICE.json"
has e2e && run end_to_end python benchmarks/end_to_end.py --reps 5 "${COMMIT_ARGS[@]}" --out "$OUT/end_to_end_$DEVICE.json"
has v100 && run fa_v100 python benchmarks/attention_v100.py "${COMMIT_ARGS[@]}" --out "$OUT/fa_v100_$DEVICE.json"
has flashinfer && run flashinfer_tests python -m pytest -o addopts="" -m gpu tests/gpu/test_flashinfer_gpu.py -q \
  -p no:cacheprovider
has flashinfer && run flashinfer python benchmarks/flashinfer_peers.py "${COMMIT_ARGS[@]}" \
  --out "$OUT/attention_flashinfer_$DEVICE.json"
has flashinfer_forward && run forward_flashinfer python benchmarks/forward.py "${COMMIT_ARGS[@]}" \
  --cases native,exact,exact_flashinfer,fast,fast_flashinfer_fp8 --out "$OUT/forward_flashinfer_$DEVICE.json"
has fasth3 && run fasth3 python benchmarks/fasth3.py "${COMMIT_ARGS[@]}" --out "$OUT/fasth3_$DEVICE.json"
has train_lora && run train_lora python benchmarks/train_lora.py "${COMMIT_ARGS[@]}" --checkpoint .cache/h3work/checkpoint \
  --out "$OUT/train_lora_$DEVICE.json"
has memory_12gb && run memory_12gb python benchmarks/placement.py "${COMMIT_ARGS[@]}" --cases pc_12gb_32gib --no-warmup --keep-checkpoint \
  --work-dir .cache/h3work --request-sized-cap --shapes 480x832x124,640x1088x175,480x832x345,768x1344x259 \
  --out "$OUT/placement_request_cap_$DEVICE.json"
has cpu_suite && run cpu_suite python -m pytest -q -p no:cacheprovider -n "$(nproc)" -rs \
  --junitxml "$OUT/cpu_suite_gpu_host_$DEVICE.xml"
for cache in first_block_cache taylorseer taylorseer_lite; do
  has cache_profiles && run "cache_profiles_$cache" python benchmarks/request.py "${COMMIT_ARGS[@]}" --dit-format quantized \
    --cases "t2va_fast_$cache,t2va_fastest_$cache" --out "$OUT/request_cache_${cache}_$DEVICE.json"
done
has cache_fidelity && run cache_fidelity python benchmarks/fidelity.py "${COMMIT_ARGS[@]}" --text-encoder-first \
  --steps 50 --prompt-count 1 --cases fast,fast_first_block_cache,fast_taylorseer,fast_taylorseer_lite,fastest,fastest_first_block_cache,fastest_taylorseer,fastest_taylorseer_lite \
  --out "$OUT/fidelity_cache_profiles_$DEVICE.json" --page "$OUT/fidelity_cache_profiles_$DEVICE"
# Multi-rank work on one GPU: the per-rank timings of the scaling model, and ranks sharing the GPU over gloo.
has scaling_model && run scaling_model python benchmarks/multi_gpu_model.py "${COMMIT_ARGS[@]}" \
  --out "$OUT/multi_gpu_model_$DEVICE.json"
has parallel_one_gpu && run parallel_one_gpu python -m pytest -o addopts="" -m gpu tests/gpu/test_parallel_one_gpu.py \
  -q -p no:cacheprovider --junitxml "$OUT/parallel_one_gpu_$DEVICE.xml"

# Multi-GPU parts: one launch per part over every visible GPU (each fits a 10-minute slot on H200s).
N=$(python -c "import torch; print(torch.cuda.device_count())")
if has multi_gpu_tests || has cp || has uneven || has tp_w8a16; then
  [[ $N -ge 2 ]] || { echo "run_gpu_suite.sh: error: the multi-GPU parts need 2 or more GPUs, $N visible" >&2; exit 2; }
fi
BENCH=(torchrun --nproc-per-node "$N" benchmarks/multi_gpu.py "${COMMIT_ARGS[@]}")
has multi_gpu_tests && run multi_gpu_tests python -m pytest -o addopts="" -m gpu tests/gpu/test_multi_gpu.py \
  tests/parallel/test_placement.py -q -p no:cacheprovider
has cp && run "multi_gpu_x$N" "${BENCH[@]}" --tp --out "$OUT/multi_gpu_${DEVICE}x$N.json"
has uneven && run "multi_gpu_x${N}_uneven" "${BENCH[@]}" --cases native_cudnn --text-rows 513 --skip-vae \
  --out "$OUT/multi_gpu_${DEVICE}x${N}_uneven.json"
has tp_w8a16 && run "multi_gpu_x${N}_tp_w8a16" "${BENCH[@]}" --cases "native_cudnn,tp$N" --tp-quant w8a16 --skip-vae \
  --out "$OUT/multi_gpu_${DEVICE}x${N}_tp_w8a16.json"
exit $status
