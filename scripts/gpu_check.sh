#!/usr/bin/env bash
# Certifies a machine with an NVIDIA GPU for relax_gym's GPU path, on random-weight Qwen3 shapes (nothing is
# downloaded): the tests marked `gpu`, then `benchmarks/gpu_path.py` per shape (one table each; extra arguments
# go to it, e.g. --peak-tflops for a GPU other than an H100), then `benchmarks/serve_path.py` with the server
# on the GPU (512 concurrent requests, weight sync by CUDA IPC, disk, gloo and NCCL).
#
# Packages: by default `scripts/setup_venv.sh test,megatron` into .venv (needs a package registry). On a
# machine without one, GPU_CHECK_WHEELS=DIR uses the python3 on PATH (with its CUDA torch and transformers)
# plus the wheels in DIR, installed into a temporary folder (docs/training.md's GPU section lists them).
#
# Each step runs under its own time limit (GPU_CHECK_STEP_TIMEOUT seconds, default 1800) and a failed step does
# not stop the next; the exit status is the first failure's. Also settable: GPU_CHECK_SHAPES (default
# "qwen3-0.6b qwen3-1.7b qwen3-4b"), GPU_CHECK_SERVE_ARGS (serve_path's arguments), GPU_CHECK_OUT=DIR (each
# step's output is also written there, as <step>.log).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
  site="$(mktemp -d)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$GPU_CHECK_WHEELS"/*.whl || exit
  package="$(python3 scripts/package_tree.py "$(mktemp -d)/package")" || exit  # relax_gym as it installs
  export PYTHONPATH="$package:$site${PYTHONPATH:+:$PYTHONPATH}"
else
  bash scripts/setup_venv.sh test,megatron || exit
  . .venv/bin/activate
fi
python3 - <<'PY' || exit
import sys, torch, transformers
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device on this machine")
print(f"gpu_check: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
PY
out="${GPU_CHECK_OUT:-}"
[ -z "$out" ] || mkdir -p "$out"
limit="${GPU_CHECK_STEP_TIMEOUT:-1800}"
status=0

step() {  # step NAME COMMAND...: runs COMMAND under the time limit, tees its output, keeps the first failure
  local name="$1" code=0
  shift
  echo "gpu_check: == $name: $* =="
  local start=$SECONDS
  if [ -n "$out" ]; then
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log" || code=$?
  else
    timeout --kill-after=10 "$limit" "$@" 2>&1 || code=$?
  fi
  echo "gpu_check: $name: exit $code after $((SECONDS - start)) s$([ "$code" -eq 124 ] && echo " (time limit $limit s)")"
  [ "$code" -eq 0 ] || [ "$status" -ne 0 ] || status=$code
}

# pytest -m gpu over the files that hold gpu tests: collecting every file would need every test extra; exit 5
# (none ran) counts as a failure
mapfile -t gpu_files < <(grep -l "pytest.mark.gpu" tests/*/test_*.py)
step gpu-tests python3 -m pytest -m gpu -q -p no:cacheprovider "${gpu_files[@]}"
for shape in ${GPU_CHECK_SHAPES:-qwen3-0.6b qwen3-1.7b qwen3-4b}; do
  step "gpu-path-$shape" python3 benchmarks/gpu_path.py --shape "$shape" "$@"
done
# shellcheck disable=SC2086  # the arguments are words on purpose
step serve-path python3 benchmarks/serve_path.py ${GPU_CHECK_SERVE_ARGS:---model qwen3-0.6b --sync-shape qwen3-0.6b}
echo "gpu_check: done, exit $status"
exit "$status"
