#!/usr/bin/env bash
# Fills .gpu/ at the repository root with what a machine that has a GPU and its driver, but
# none of this build's libraries, needs to run the gpu tests and benches (tests/gpu/run.sh)
# from a copy of the tree at any path:
#   bin/   fsdpd, fsdpctl and the executables tests/gpu/run.sh --list names
#   lib/   libfsdp.so, the CUDA backend's module (at the place the loader looks for it,
#          relative to fsdpd, as in the build tree), every shared library these load except
#          the C and C++ runtimes and the GPU driver's, and UCX's transport modules (lib/ucx/)
#   python-gen/  the generated protobuf modules the Python tests import
#   env.sh sourced on that machine: PATH, LD_LIBRARY_PATH, UCX_MODULE_DIR, and the
#          FSDP_BUILD_DIR/FSDP_SOURCE_DIR/FSDPD_LIB the tests and the Python package read
# Copies are stripped of debug info. The CUDA runtime (libcudart) is bundled, as any
# library; NCCL, hundreds of MiB, is not: env.sh adds the one pip's nvidia-nccl packages
# install beside torch, where there is one.
#   scripts/gpu-bundle.sh [BUILD_DIR]   (default build/, after a build with the CUDA backend)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
out=$root/.gpu

die() {
  echo "gpu-bundle: $*" >&2
  exit 1
}

# Libraries the target machine provides: glibc's, the C++ runtime, and the GPU driver's
# (libcuda must match the kernel module, so it is never bundled).
system_lib='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libresolv|libutil|libstdc\+\+|libgcc_s|libcuda|libnvidia-[a-z0-9-]+)\.so'
# Bundled, but taken from the target where it has them (env.sh): everyone's TLS and
# compression libraries.
common_lib='^(libssl|libcrypto|libz|liblzma|libzstd|liblz4|libgcrypt|libgpg-error|libcap|libnuma)\.so'

# "soname path" for each library the dynamic loader resolves for file; "soname not" for those
# it cannot find.
resolved_libs() {
  ldd "$1" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 } $2 == "=>" && $3 == "not" { print $1, "not" }'
}

module=$(cd "$build" && find lib -name fsdp-cuda.so -print -quit)
[[ -n $module ]] || die "no fsdp-cuda.so under $build/lib: build with the CUDA toolkit and NCCL (FSDP_CUDA=ON)"
mapfile -t gpu_programs < <(bash "$root/tests/gpu/run.sh" --list)
programs=(fsdpd fsdpctl)
# A test this build did not make (test_cuda_nccl without NCCL's header) is left out, and
# tests/gpu/run.sh skips its step.
for p in "${gpu_programs[@]}"; do
  if [[ -x $build/bin/$p ]]; then
    programs+=("$p")
  else
    echo "gpu-bundle: $p was not built here: its step will be skipped"
  fi
done

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib/ucx" "$out/lib/common" "$out/$(dirname "$module")"
elves=()
for p in "${programs[@]}"; do
  [[ -x $build/bin/$p ]] || die "$build/bin/$p is missing: build it first"
  cp "$build/bin/$p" "$out/bin/$p"
  elves+=("$out/bin/$p")
done
cp "$build/$module" "$out/$module"
cp -r "$build/python-gen" "$out/python-gen"
# Real files rather than links: the copy of the tree may not keep links. libfsdp.so.0 is
# what the binaries ask for, libfsdp.so what the Python package opens.
cp -L "$build/lib/libfsdp.so" "$out/lib/libfsdp.so.0"
cp -L "$build/lib/libfsdp.so" "$out/lib/libfsdp.so"
elves+=("$out/$module" "$out/lib/libfsdp.so")

# UCX loads its transports from <libucs's dir>/ucx at run time; ldd does not see them.
ucs=$(resolved_libs "$out/bin/fsdpd" | awk '$1 == "libucs.so.0" { print $2 }')
[[ -n $ucs ]] || die "fsdpd does not link libucs"
for m in "$(dirname "$(readlink -f "$ucs")")"/ucx/lib*.so.0; do
  cp -L "$m" "$out/lib/ucx/"
  elves+=("$out/lib/ucx/$(basename "$m")")
done

# Every library ldd resolves for a bundled file, under the name the loader asks for.
for e in "${elves[@]}"; do
  while read -r soname path; do
    [[ $soname =~ $system_lib || $path == "$out"/* ]] && continue
    [[ $path == not ]] && die "ldd cannot find $soname for $e"
    if [[ $soname =~ $common_lib ]]; then
      cp -L "$path" "$out/lib/common/$soname"
    else
      cp -L "$path" "$out/lib/$soname"
    fi
  done < <(LD_LIBRARY_PATH=$out/lib:$out/lib/ucx resolved_libs "$e")
done
find "$out/bin" "$out/lib" -type f -exec strip --strip-debug {} +

cat > "$out/env.sh" <<'ENV'
# Sourced from anywhere: makes the bundle's programs and libraries the ones found (see
# scripts/gpu-bundle.sh).
gpu_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export FSDP_BUILD_DIR=$gpu_dir
FSDP_SOURCE_DIR=$(dirname "$gpu_dir")
export FSDP_SOURCE_DIR
export FSDPD_LIB=$gpu_dir/lib/libfsdp.so
export PATH=$gpu_dir/bin${PATH:+:$PATH}
export UCX_MODULE_DIR=$gpu_dir/lib/ucx
# lib/common holds the libraries every distribution has (TLS, compression): the target's
# own are taken where it has them, as a newer one serves what was built against ours and its
# own programs (python3 and what it loads) keep theirs. lib/use links to the others.
use=$gpu_dir/lib/use
rm -rf "$use" && mkdir -p "$use"
have=$(ldconfig -p 2>/dev/null)
for f in "$gpu_dir"/lib/common/*; do
  grep -q "^[[:space:]]${f##*/} " <<<"$have" || ln -s "$f" "$use/"
done
# lib/ucx too: a transport module links another by a path of the build machine.
gpu_libs=$gpu_dir/lib:$use:$gpu_dir/lib/ucx
# NCCL from torch's pip packages (nvidia-nccl-cu*), after the bundle's own libraries.
for nccl in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
  for d in "$nccl"/nvidia/nccl/lib "$nccl"/nvidia/cu*/lib; do
    [[ -e $d/libnccl.so.2 ]] && gpu_libs=$gpu_libs:$d && break 2
  done
done
export LD_LIBRARY_PATH=$gpu_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
unset gpu_dir gpu_libs nccl d use have f
ENV

# The bundle must resolve to itself: with only env.sh's environment, every library of every
# bundled file is found in .gpu/ or is one of the target's own.
for e in "$out"/bin/* "$out/$module" "$out"/lib/*.so* "$out"/lib/ucx/*; do
  while read -r soname path; do
    [[ $soname =~ $system_lib || $soname =~ $common_lib || $path == "$out"/* ]] ||
      die "$e loads $soname from $path, outside the bundle"
  done < <(env -i bash -c "source '$out/env.sh'; $(declare -f resolved_libs); resolved_libs '$e'")
done

glibc=$(objdump -T "$out"/bin/* "$out"/lib/*.so* "$out"/lib/ucx/* "$out/$module" 2>/dev/null |
  grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
glibcxx=$(objdump -T "$out"/bin/* "$out"/lib/*.so* "$out/$module" 2>/dev/null |
  grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -1)
echo "gpu-bundle: $(du -sh "$out" | cut -f1) in $out ($(find "$out" -type f | wc -l) files);" \
  "needs ${glibc:-no glibc symbol}, ${glibcxx:-no libstdc++} and the GPU driver on the target"
