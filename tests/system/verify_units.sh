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
           ProtectSystem=strict PrivateTmp=yes RestrictAddressFamilies= StateDirectory=fsdpd; do
  grep -q "^$key" "$unit" || { echo "fsdpd.service lacks $key"; exit 1; }
done

# Issue 29 item 3: under ProtectSystem=strict only the unit's own directories are writable,
# and under PrivateTmp=yes the daemon's /tmp is its own and goes at stop. checkpoint.dir as
# the docs give it must lie in a directory the unit makes writable and survive a stop.
checkpoint_dir=/var/lib/fsdpd/checkpoints
grep -q "checkpoint.dir = $checkpoint_dir" "$src/README.md" ||
  { echo "README.md does not give checkpoint.dir = $checkpoint_dir under systemd"; exit 1; }
writable=()
while IFS='=' read -r key value; do
  case $key in
  StateDirectory) for d in $value; do writable+=("/var/lib/$d"); done ;;
  ReadWritePaths) for d in $value; do writable+=("${d#-}"); done ;;
  esac
done < <(grep -E '^(StateDirectory|ReadWritePaths)=' "$unit")
inside=
for d in "${writable[@]}"; do
  [[ "$checkpoint_dir/" == "$d/"* ]] && inside=$d
done
[[ -n "$inside" ]] ||
  { echo "checkpoint.dir $checkpoint_dir is in none of the unit's writable paths (${writable[*]:-none}): ProtectSystem=strict makes it read-only"; exit 1; }
[[ "$inside" != /tmp* && "$inside" != /var/tmp* ]] ||
  { echo "the unit's writable $inside is under PrivateTmp's private /tmp"; exit 1; }

# The same sandbox, live: the unit's [Service] settings from NoNewPrivileges= on, with
# StateDirectory, through systemd-run, writing a file where checkpoint.dir would be. Only
# where systemd runs the machine and we are root.
if [[ -d /run/systemd/system && $(id -u) == 0 ]]; then
  props=()
  while IFS= read -r line; do props+=(-p "$line"); done < <(
    sed -n '/^NoNewPrivileges=/,/^\[Install\]/p' "$unit" | grep -E '^[A-Za-z]+=' )
  name=fsdpd-sandbox-test-$$
  systemd-run --quiet --wait --collect -p StateDirectory="$name" -p DynamicUser=yes \
    "${props[@]}" /bin/sh -c "mkdir -p /var/lib/$name/checkpoints &&
      echo ok > /var/lib/$name/checkpoints/probe" ||
    { echo "a write below StateDirectory failed under the unit's sandbox"; exit 1; }
  [[ "$(cat "/var/lib/private/$name/checkpoints/probe" 2>/dev/null ||
        cat "/var/lib/$name/checkpoints/probe")" == ok ]] ||
    { echo "the checkpoint written under the unit's sandbox is not there after it stopped"; exit 1; }
  rm -rf "/var/lib/private/$name" "/var/lib/$name"
else
  echo "skip: the live start under the unit's sandbox (systemd-run) needs systemd as PID 1 and root"
fi

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
