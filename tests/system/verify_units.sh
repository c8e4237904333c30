#!/usr/bin/env bash
# Checks the systemd unit, sysusers.d and tmpfiles.d files with systemd's own tools, offline.
# Skips (exit 77) where the tools are missing.
set -euo pipefail
src=${FSDP_SOURCE_DIR:?}
build=${FSDP_BUILD_DIR:?}
for tool in systemd-analyze systemd-sysusers systemd-tmpfiles; do
  command -v "$tool" >/dev/null || { echo "skip: $tool not installed"; exit 77; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The unit, as generated for the install prefix: systemd-analyze checks that ExecStart's
# binary exists, so point it at the build.
# It exits 0 on unknown keys and bad values, so any line it prints is a problem; offline it
# cannot resolve the fsdpd user, which sysusers.d creates at install.
unit="$build/systemd/fsdpd.service"
sed "s|^ExecStart=[^ ]*/fsdpd |ExecStart=$build/bin/fsdpd |" "$unit" > "$tmp/fsdpd.service"
grep -q "^ExecStart=$build/bin/fsdpd --config " "$tmp/fsdpd.service" ||
  { echo "unexpected ExecStart in $unit"; exit 1; }
problems=$(systemd-analyze verify --man=no "$tmp/fsdpd.service" 2>&1 |
  grep -v -e '^$' -e "Failed to resolve user 'fsdpd'" -e 'System has not been booted with systemd' \
    -e 'Failed to connect to bus' || true)
if [[ -n "$problems" ]]; then
  printf 'systemd-analyze verify:\n%s\n' "$problems"
  exit 1
fi
for key in Type=notify WatchdogSec= RuntimeDirectory=fsdpd NoNewPrivileges=yes \
           ProtectSystem=strict PrivateTmp=yes RestrictAddressFamilies=; do
  grep -q "^$key" "$unit" || { echo "fsdpd.service lacks $key"; exit 1; }
done

# sysusers.d and tmpfiles.d, applied to a scratch root: the user must come out of the first
# and own the run directory, mode 0750, made by the second.
mkdir -p "$tmp/root/etc"
systemd-sysusers --root="$tmp/root" "$src/systemd/fsdpd.sysusers" >/dev/null
uid=$(awk -F: '$1 == "fsdpd" {print $3}' "$tmp/root/etc/passwd")
[[ -n "$uid" ]] || { echo "sysusers.d did not create the fsdpd user"; exit 1; }
systemd-tmpfiles --root="$tmp/root" --create "$src/systemd/fsdpd.tmpfiles"
got=$(stat -c '%a %u' "$tmp/root/run/fsdpd")
[[ "$got" == "750 $uid" ]] || { echo "run dir is '$got', expected '750 $uid'"; exit 1; }
echo "systemd files verified"
