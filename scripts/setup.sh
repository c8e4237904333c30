#!/usr/bin/env bash
# Installs the Debian packages fsdpd needs to build and run it, with --test also what the
# tests need, and with --bench what the benchmarks compare against (ucx_perftest, OpenMPI).
# Idempotent: when every package is already there it prints nothing and touches nothing.
# Uses sudo when not root.
set -euo pipefail

packages=(
  build-essential cmake pkg-config                    # toolchain
  libgrpc-dev protobuf-compiler                       # gRPC C core; protoc for the tests' Python modules
  libprotobuf-c-dev protobuf-c-compiler               # protobuf-c runtime and protoc-c
  libuv1-dev libsystemd-dev libinih-dev libjson-c-dev # loop, sd_notify, config, fsdpctl --json
  libxxhash-dev                                       # checkpoints' checksums
  libcmocka-dev                                       # the build defines the C tests too
  libucx-dev                                          # UCX (ucp): the data plane between daemons
  libmicrohttpd-dev                                   # the metrics endpoint's HTTP server
)
for arg in "$@"; do
  case "$arg" in
    --test)
      packages+=(
        python3-venv   # .venv/ (scripts/venv.sh): the tests' grpcio, protobuf, pytest, torch
        systemd        # systemd-analyze verify of the unit
        prometheus     # a real Prometheus scraping the daemon, and promtool check metrics
        chromium       # the status page rendered headless (test_metrics)
      )
      ;;
    --bench)
      packages+=(
        ucx-utils                      # ucx_perftest: UCX's point-to-point peer of fsdp-ucx-bench
        openmpi-bin libopenmpi-dev     # OpenMPI's collectives, the other peer (optional in CMake)
      )
      ;;
    *)
      echo "setup: unknown option $arg (expected --test and/or --bench)" >&2
      exit 2
      ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done
((${#missing[@]} == 0)) && exit 0

sudo=()
((EUID == 0)) || sudo=(sudo)
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
