#!/usr/bin/env python3
"""Checks the include graph against the layers of docs/DESIGN.md.

Every C file (and CUDA file, .cu) belongs to the row of LAYERS that names it, or else to the deepest folder of
LAYERS that holds it, and may include headers of the rows its row names (its own among them,
and what lies under each: 'proto' covers 'proto/host'); every folder holding C files has a
row.
Generated protocol headers (fsdp/v1/, grpc/health/v1/) belong to proto/, and public headers
(<fsdp/...>) to everyone. No module (a .c or .cu and its .h) may reach itself through the includes
of the modules it includes.

Usage: check_layering.py [ROOT]   (default: $FSDP_SOURCE_DIR)
"""
import os
import re
import subprocess
import sys

# Bottom to top: a folder may use the ones it names, each of them lower.
LAYERS = {
    'common': [],
    'proto': ['common', 'proto/limits.h'],
    # Plain constants both sides agree on, apart from the gRPC side of proto/.
    'proto/limits.h': [],
    # The byte formats between the data planes, apart from gRPC and protobuf.
    'proto/host': ['common'],
    'config': ['common', 'proto'],
    'kernels': ['common'],
    'transport': ['common', 'proto/host'],
    'collectives': ['common', 'proto/limits.h', 'proto/host', 'kernels', 'transport'],
    'cuda': ['common', 'kernels'],
    'checkpoint': ['common'],
    'client': ['common', 'proto'],
    'fsdpctl': ['common', 'proto', 'kernels', 'client', 'checkpoint'],
    # The daemon's rooms, bottom to top; its top folder (the process's lifecycle) uses them all.
    # The accept loop and connection limit of every socket the daemon listens on itself.
    'daemon/accept': ['common'],
    'daemon/rpc': ['common', 'proto', 'config', 'daemon/accept'],
    'daemon/session': ['common', 'proto', 'daemon/accept', 'daemon/store/job_owner.h'],
    'daemon/backend': ['common', 'kernels', 'cuda'],
    'daemon/store': ['common', 'proto/limits.h', 'config', 'collectives', 'daemon/backend',
                     'daemon/store/job_owner.h'],
    # Whom a job belongs to, which the sessions check at every Attach.
    'daemon/store/job_owner.h': ['proto/limits.h'],
    'daemon/cluster': ['common', 'proto', 'proto/host', 'config', 'transport', 'daemon/rpc'],
    # The metrics endpoint and Prometheus's format, which know nothing of the daemon.
    'daemon/metrics': ['common'],
    'daemon/dataplane': ['common', 'proto/host', 'kernels', 'transport', 'collectives',
                         'daemon/backend', 'daemon/store', 'daemon/cluster', 'daemon/metrics'],
    'daemon/checkpoints': ['common', 'checkpoint', 'daemon/backend', 'daemon/store',
                           'daemon/dataplane'],
    'daemon/services': ['common', 'proto', 'config', 'daemon/rpc', 'daemon/session',
                        'daemon/backend', 'daemon/store', 'daemon/cluster', 'daemon/dataplane',
                        'daemon/checkpoints', 'daemon/metrics'],
    'daemon': ['common', 'proto', 'proto/host', 'config', 'kernels', 'transport', 'collectives',
               'cuda',
               'daemon/rpc', 'daemon/session', 'daemon/backend', 'daemon/store', 'daemon/cluster',
               'daemon/dataplane', 'daemon/checkpoints', 'daemon/metrics', 'daemon/services'],
}
# Tools and tests sit on top and may use every layer, but nothing uses them.
LAYERS['bench'] = LAYERS['tests'] = sorted(LAYERS)
GENERATED = ('fsdp/v1/', 'grpc/health/v1/')
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def folder_of(path):
    """The row of LAYERS path belongs to: its own, or its deepest folder's; None if none."""
    if path in LAYERS:
        return path
    parts = path.split('/')[:-1]
    for depth in range(len(parts), 0, -1):
        candidate = '/'.join(parts[:depth])
        if candidate in LAYERS:
            return candidate
    return None


def sources(root):
    out = subprocess.run(['git', '-C', root, 'ls-files', '-co', '--exclude-standard', '*.c', '*.cu', '*.h'],
                         capture_output=True, text=True, check=True).stdout.split()
    return [f for f in out if not f.startswith('include/') and os.path.exists(os.path.join(root, f))]


def cycles(graph):
    """The strongly connected components of graph (module -> modules) with more than one module."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def check(root):
    problems = []
    files = sources(root)
    modules = {}
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
                if f.endswith(('.c', '.cu')) or header != f:
                    modules.setdefault(os.path.splitext(f)[0], set()).add(header[:-2])
            else:
                problems.append(f'{f}: includes "{header}", which is not a path from the project root')
                continue
            if target != home and not any(target == used or target.startswith(used + '/')
                                          for used in LAYERS[home]):
                where = target if target.endswith('.h') else target + '/'
                problems.append(f'{f}: includes "{header}" from {where}, '
                                f'but {home}/ may only use: {", ".join(LAYERS[home]) or "nothing"}')
    for module in modules:
        modules[module].discard(module)
    for component in cycles(modules):
        problems.append('include cycle among: ' + ', '.join(component))
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
    print('include graph follows the layering, with no cycle')
    return 0


if __name__ == '__main__':
    sys.exit(main())
