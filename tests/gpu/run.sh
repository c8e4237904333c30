#!/usr/bin/env bash
# Runs the gpu tests and benches on a machine with a GPU from the bundle that
# scripts/gpu-bundle.sh made (.gpu/), from the repository root: it needs the GPU's driver and
# nothing of the build machine. Prints PASS, FAIL or SKIP (exit 77: no usable GPU) for each and
# exits 1 if any failed.
#   tests/gpu/run.sh          run them all
#   tests/gpu/run.sh --list   print the executables they need (scripts/gpu-bundle.sh bundles these)
set -uo pipefail

# One command line each, its first word an executable of .gpu/bin or python3 (the target's,
# with CUDA torch: it runs a script of the tree); a new gpu test or bench is one more line.
steps=(
  "test_cuda_kernels"
  "python3 tests/gpu/test_cuda_backend.py"
  "fsdp-cuda-kernels-bench --mib 256 --runs 20"
  "python3 bench/cuda_unshard_bench.py --mib 64 1024 --runs 20"
)

if [[ ${1-} == --list ]]; then
  for step in "${steps[@]}"; do
    [[ ${step%% *} == python3 ]] || echo "${step%% *}"
  done
  exit 0
fi

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [[ ! -f $root/.gpu/env.sh ]]; then
  echo "tests/gpu/run.sh: no .gpu/env.sh: run scripts/gpu-bundle.sh after a build first" >&2
  exit 2
fi
# shellcheck source=/dev/null
source "$root/.gpu/env.sh"
cd "$root"

# Which GPU and driver answered, so that a skip can be told from a missing GPU.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null ||
  echo "(nvidia-smi not found)"

failed=0
summary=()
for step in "${steps[@]}"; do
  echo "== $step"
  # Word splitting of the step's arguments is intended.
  # shellcheck disable=SC2086
  timeout 300 $step
  rc=$?
  case $rc in
    0) verdict=PASS ;;
    77) verdict=SKIP ;;
    *) verdict="FAIL (exit $rc)"; failed=1 ;;
  esac
  summary+=("$verdict $step")
done
echo "== summary"
printf '%s\n' "${summary[@]}"
exit $failed
