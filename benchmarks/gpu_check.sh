#!/usr/bin/env bash
# On a machine with a CUDA GPU: run the kernel tests compiled (Triton, not interpreted), the
# engine's pallas-vs-xla greedy check, and the kernel benchmarks, within 8 minutes in all.
# Writes benchmarks/results/gpu_kernel_tests.{txt,xml}, kernels_gpu.json and kernels_gpu.txt
# (and copies them to $OUT when that is set). Exit status: non-zero if any step failed.
#
#   PYTHON=/path/to/venv/bin/python benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
RESULTS=benchmarks/results
mkdir -p "$RESULTS"
start=$SECONDS

if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")'; then
  echo "gpu_check: JAX sees no GPU here ($("$PY" -c 'import jax; print(jax.devices())' 2>&1))"
  exit 2
fi
"$PY" -c 'import jax; print("gpu_check:", jax.__version__, jax.devices())'

# 1. The same test bodies as on the CPU, compiled: the "compiled" variants only (about 3 min).
timeout 270 "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/test_kernels_paged_attention.py tests/test_kernels_ssm_scan.py tests/test_kernels_mtp.py \
  -k compiled --junitxml="$RESULTS/gpu_kernel_tests.xml" 2>&1 | tee "$RESULTS/gpu_kernel_tests.txt"
tests_rc=${PIPESTATUS[0]}

# 2. The engine with kernel_backend="pallas" (compiled here) against "xla".
timeout 90 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernel_backend.py 2>&1 \
  | tee -a "$RESULTS/gpu_kernel_tests.txt"
engine_rc=${PIPESTATUS[0]}

# 3. Kernels vs XLA references over shapes and tilings, inside what is left of 8 minutes.
left=$(( 470 - (SECONDS - start) ))
budget=$(( left > 60 ? left - 45 : 15 ))
timeout "$left" "$PY" -m benchmarks.kernels --repeats 20 --budget-s "$budget" 2>&1 \
  | tee "$RESULTS/kernels_gpu.txt"
bench_rc=${PIPESTATUS[0]}

if [ -n "${OUT:-}" ]; then
  cp "$RESULTS"/gpu_kernel_tests.* "$RESULTS"/kernels_gpu.* "$OUT"/ 2>/dev/null || true
fi
echo "gpu_check: tests rc=$tests_rc engine rc=$engine_rc bench rc=$bench_rc in $((SECONDS - start)) s"
[ "$tests_rc" -eq 0 ] && [ "$engine_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
