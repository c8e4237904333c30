#!/usr/bin/env bash
# Checks the include graph against the layering of docs/DESIGN.md:
#   common <- proto <- config <- daemon        common <- proto <- client (fsdpctl)
#   common <- collectives <- transport <- daemon
# A file may include headers of its own folder and of the folders below it, and nothing
# includes daemon/. Generated protocol headers belong to proto/.
set -euo pipefail
src=${FSDP_SOURCE_DIR:?}
cd "$src"

declare -A allowed=(
  [common]="common"
  [proto]="common proto"
  [config]="common proto config"
  [collectives]="common collectives"
  [transport]="common collectives transport"
  [client]="common proto client"
  [daemon]="common proto config collectives transport daemon"
)

declare -A owner
for dir in "${!allowed[@]}"; do
  for h in "$dir"/*.h; do
    [[ -e "$h" ]] && owner[$(basename "$h")]=$dir
  done
done

status=0
for dir in "${!allowed[@]}"; do
  for f in "$dir"/*.[ch]; do
    [[ -e "$f" ]] || continue
    while IFS= read -r header; do
      case "$header" in
        fsdp/v1/*|grpc/health/v1/*) home=proto ;;
        *) home=${owner[$(basename "$header")]:-} ;;
      esac
      [[ -n "$home" ]] || { echo "$f: includes \"$header\", which no module owns"; status=1; continue; }
      if [[ " ${allowed[$dir]} " != *" $home "* ]]; then
        echo "$f: includes \"$header\" from $home/, but $dir/ may only use: ${allowed[$dir]}"
        status=1
      fi
    done < <(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$f")
  done
done
[[ $status == 0 ]] && echo "include graph follows the layering"
exit $status
