#!/usr/bin/env bash
# Makes the project's Python environment, .venv/ at the repository root, from Debian's
# python3 (python3-venv), with python/requirements-test.txt: the tests, examples and
# benchmarks run with .venv/bin/python. Idempotent: with the requirements already installed
# (a stamp holds their hash) it prints nothing and touches nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
requirements=python/requirements-test.txt
stamp=$venv/.requirements.sha256
want=$(sha256sum "$requirements" | cut -d' ' -f1)
[[ -x $venv/bin/python && -f $stamp && $(cat "$stamp") == "$want" ]] && exit 0

echo "setup: making $venv with $requirements"
[[ -x $venv/bin/python ]] || /usr/bin/python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements"
echo "$want" > "$stamp"
