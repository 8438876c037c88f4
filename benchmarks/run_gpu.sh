#!/usr/bin/env bash
# The GPU benchmarks in one command (run it on a machine with a CUDA GPU, from anywhere):
#   jaxmp throughput / memory / FLOP/s per policy, the PyTorch AMP peer and the wrapper
#   overhead, on the same GPU -> benchmarks/results/gpu_<device>.json; then the README table.
# Arguments go to python -m benchmarks.run_gpu (e.g. --models resnet50 --merge, --skip-torch, --dry-run).
# PYTHON selects the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
# Reuse compiled steps between the per-run processes and between invocations.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxmp_bench_jax_cache}"
"$PY" -m benchmarks.run_gpu "$@"
case " $* " in
  *" --dry-run "*|*" --help "*|*" -h "*) ;;  # dry runs and help never touch the committed tables
  *) "$PY" -m benchmarks.report --write-readme ;;
esac
