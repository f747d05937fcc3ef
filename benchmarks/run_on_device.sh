#!/usr/bin/env bash
# One batched GPU session on the device machine (one H200): every GPU test, then the benchmarks, each time-boxed,
# logs and JSON under $OUT. Prepare wheels first (diffusers etc. are not installed there):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl diffusers==0.42.1 transformers==5.24.0 peft==0.21.2 importlib_metadata
# (and, for the peer case of the attention benchmark, the public vsa package's python sources in .peer/vsa/: unzip
# `pip download --no-deps vsa==0.0.4`'s wheel there) and call the device tool with carry=[".whl", ".peer"] and:
#   bash benchmarks/run_on_device.sh <commit> [parts]      parts: comma list of tests,gemm,attention,e2e (default all)
# One device call is limited to 10 minutes: "tests,gemm" and "attention,e2e" each fit.
set -uo pipefail
COMMIT=${1:?usage: run_on_device.sh <commit> [tests,gemm,attention,e2e]}
WHAT=${2:-tests,gemm,attention,e2e}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

has() { [[ ",$WHAT," == *",$1,"* ]]; }
if has tests; then
  timeout 270 python3 -m pytest -m gpu tests/gpu tests/test_lora_gpu.py -q -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
fi
if has gemm; then
  timeout 150 python3 benchmarks/gemm.py --no-fused --commit "$COMMIT" --out "$OUT/gemm_h200.json" 2>&1 | tail -25
fi
if has attention; then
  timeout 330 python3 benchmarks/attention.py --no-sweep --peer-dir .peer --commit "$COMMIT" --out "$OUT/attention_h200.json" 2>&1 | grep -v Warn | tail -24
fi
if has e2e; then
  timeout 230 python3 benchmarks/end_to_end.py --reps 5 --commit "$COMMIT" --out "$OUT/end_to_end_h200.json" 2>&1 | grep -v '^ \|^{\|^}' | tail -12
fi
