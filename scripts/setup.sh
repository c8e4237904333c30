#!/usr/bin/env bash
# Installs the Debian packages fsdpd needs to build, run and test. Idempotent: when every
# package is already there it prints nothing and touches nothing. Uses sudo when not root.
set -euo pipefail

packages=(
  build-essential cmake pkg-config
  libgrpc-dev protobuf-compiler protobuf-compiler-grpc
  libprotobuf-c-dev protobuf-c-compiler
  libucx-dev libuv1-dev libcmocka-dev libsystemd-dev libinih-dev
  python3-grpcio python3-protobuf
  systemd libjson-c-dev python3-pytest
)
# Tests that train PyTorch models need torch; it is large, so only 'make test' asks for it.
if [[ "${FSDP_SETUP_TEST:-0}" == 1 ]]; then
  packages+=(python3-torch)
fi

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
