#!/usr/bin/env bash
# Runs the gpu tests and benches on a machine with a GPU from the bundle that
# scripts/gpu-bundle.sh made (.gpu/), from the repository root: it needs the GPU's driver and
# nothing of the build machine. Prints PASS, FAIL or SKIP (exit 77: no usable GPU, or a test
# the build did not make) for each and exits 1 if any failed.
#   tests/gpu/run.sh          run them all
#   tests/gpu/run.sh 1 3      run steps 1 and 3 of the list below (a device call's time is
#                             limited: the list may take two)
#   tests/gpu/run.sh --list   print the executables they need (scripts/gpu-bundle.sh bundles these)
set -uo pipefail

# One command line each (shell words: quotes group), its first word an executable of
# .gpu/bin or python3 (the target's, with CUDA torch: it runs a script of the tree); a new gpu
# test or bench is one more line.
steps=(
  "test_cuda_kernels"
  "python3 tests/gpu/test_cuda_backend.py -k 'not optimizer and not two_daemons'"
  "python3 tests/gpu/test_cuda_backend.py -k 'optimizer or two_daemons'"
  "fsdp-cuda-kernels-bench --mib 256 --runs 20"
  "python3 bench/cuda_unshard_bench.py --mib 64 1024 --runs 20"
  "python3 bench/gpu_train_bench.py --models blocks24 1b --steps 6 --warmup 2"
  "test_cuda_nccl"
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
cd "$root" || exit 2

# Which GPU and driver answered, so that a skip can be told from a missing GPU.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null ||
  echo "(nvidia-smi not found)"

# The steps asked for by number, or all.
chosen=("$@")
if [[ ${#chosen[@]} -eq 0 ]]; then
  for i in "${!steps[@]}"; do chosen+=($((i + 1))); done
fi

failed=0
summary=()
for n in "${chosen[@]}"; do
  if [[ ! $n =~ ^[0-9]+$ ]] || ((n < 1 || n > ${#steps[@]})); then
    echo "tests/gpu/run.sh: no step '$n' (1..${#steps[@]})" >&2
    exit 2
  fi
  step=${steps[n - 1]}
  echo "== $step"
  if [[ ${step%% *} != python3 ]] && ! command -v "${step%% *}" >/dev/null; then
    rc=77 # not in the bundle: this build did not make it (scripts/gpu-bundle.sh said so)
  else
    # A step is shell words: its quotes group its arguments.
    eval "timeout 300 $step"
    rc=$?
  fi
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
