#!/usr/bin/env python3
"""Checks the include graph against the layers of docs/DESIGN.md.

Every C file belongs to the deepest folder of LAYERS that holds it, and may include headers
of the folders its row names (its own among them); every folder holding C files has a row.
Generated protocol headers (fsdp/v1/, grpc/health/v1/) belong to proto/, and public headers
(<fsdp/...>) to everyone.

Usage: check_layering.py [ROOT]   (default: $FSDP_SOURCE_DIR)
"""
import os
import re
import subprocess
import sys

# Bottom to top: a folder may use the ones it names, each of them lower.
LAYERS = {
    'common': [],
    'proto': ['common'],
    'config': ['common', 'proto'],
    'kernels': ['common'],
    'transport': ['common'],
    'collectives': ['common', 'kernels', 'transport'],
    'client': ['common', 'proto'],
    'fsdpctl': ['common', 'proto', 'client'],
    # The daemon's rooms, bottom to top; its top folder (the process's lifecycle) uses them all.
    'daemon/rpc': ['common', 'proto', 'config'],
    'daemon/session': ['common', 'proto'],
    'daemon/store': ['common', 'proto', 'config', 'daemon/session'],
    'daemon/cluster': ['common', 'proto', 'config', 'transport', 'daemon/rpc'],
    # daemon/rpc: while the data plane still parks gRPC calls itself.
    'daemon/dataplane': ['common', 'kernels', 'transport', 'collectives', 'daemon/rpc',
                         'daemon/session', 'daemon/store', 'daemon/cluster'],
    # daemon: while the handlers still take the whole daemon object.
    'daemon/services': ['common', 'proto', 'config', 'daemon/rpc', 'daemon/session',
                        'daemon/store', 'daemon/cluster', 'daemon/dataplane', 'daemon'],
    'daemon': ['common', 'proto', 'config', 'kernels', 'transport', 'collectives', 'daemon/rpc',
               'daemon/session', 'daemon/store', 'daemon/cluster', 'daemon/dataplane',
               'daemon/services'],
}
# Tools and tests sit on top and may use every layer, but nothing uses them.
LAYERS['bench'] = LAYERS['tests'] = sorted(LAYERS)
GENERATED = ('fsdp/v1/', 'grpc/health/v1/')
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def folder_of(path):
    """The deepest folder of LAYERS holding path, or None."""
    parts = path.split('/')[:-1]
    for depth in range(len(parts), 0, -1):
        candidate = '/'.join(parts[:depth])
        if candidate in LAYERS:
            return candidate
    return None


def sources(root):
    out = subprocess.run(['git', '-C', root, 'ls-files', '-co', '--exclude-standard', '*.c', '*.h'],
                         capture_output=True, text=True, check=True).stdout.split()
    return [f for f in out if not f.startswith('include/') and os.path.exists(os.path.join(root, f))]


def check(root):
    problems = []
    files = sources(root)
    for f in files:
        home = folder_of(f)
        if home is None:
            problems.append(f'{f}: its folder has no row in the layering; add one')
            continue
        with open(os.path.join(root, f), encoding='utf-8') as fh:
            includes = INCLUDE.findall(fh.read())
        for header in includes:
            if header.startswith(GENERATED):
                target = 'proto'
            elif os.path.exists(os.path.join(root, header)):
                target = folder_of(header)
            else:
                problems.append(f'{f}: includes "{header}", which is not a path from the project root')
                continue
            if target != home and target not in LAYERS[home]:
                problems.append(f'{f}: includes "{header}" from {target}/, '
                                f'but {home}/ may only use: {", ".join(LAYERS[home]) or "nothing"}')
    return problems


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.environ.get('FSDP_SOURCE_DIR')
    if not root:
        sys.exit('usage: check_layering.py ROOT (or set FSDP_SOURCE_DIR)')
    problems = check(root)
    for p in problems:
        print(p)
    if problems:
        return 1
    print('include graph follows the layering')
    return 0


if __name__ == '__main__':
    sys.exit(main())
