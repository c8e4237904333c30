"""The layering check passes on the tree, and fails on a copy of it that breaks a rule."""
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get('FSDP_SOURCE_DIR', os.path.dirname(os.path.dirname(HERE)))
CHECK = os.path.join(HERE, 'check_layering.py')


def run_check(root):
    return subprocess.run([sys.executable, CHECK, root], capture_output=True, text=True)


@pytest.fixture
def tree(tmp_path):
    """A git checkout of the tree's C sources, to break on purpose."""
    files = subprocess.run(['git', '-C', ROOT, 'ls-files', '-co', '--exclude-standard', '*.c', '*.h'],
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if os.path.exists(os.path.join(ROOT, f)):
            os.makedirs(tmp_path / os.path.dirname(f), exist_ok=True)
            shutil.copy(os.path.join(ROOT, f), tmp_path / f)
    subprocess.run(['git', 'init', '-q', str(tmp_path)], check=True)
    return tmp_path


def add_line(path, line):
    text = path.read_text()
    path.write_text(line + '\n' + text)


def test_the_tree_follows_the_layering():
    result = run_check(ROOT)
    assert result.returncode == 0, result.stdout


def test_an_include_of_a_higher_layer_fails(tree):
    add_line(tree / 'common/status.c', '#include "proto/wire.h"')
    result = run_check(str(tree))
    assert result.returncode == 1
    assert 'common/status.c: includes "proto/wire.h" from proto/' in result.stdout


def test_an_include_that_names_no_folder_fails(tree):
    add_line(tree / 'proto/wire.c', '#include "status.h"')
    result = run_check(str(tree))
    assert result.returncode == 1
    assert 'proto/wire.c: includes "status.h", which is not a path from the project root' in result.stdout


def test_a_folder_without_a_row_fails(tree):
    (tree / 'newlayer').mkdir()
    (tree / 'newlayer/thing.c').write_text('int thing;\n')
    result = run_check(str(tree))
    assert result.returncode == 1
    assert 'newlayer/thing.c: its folder has no row in the layering' in result.stdout


def test_the_host_formats_keep_apart_from_grpc(tree):
    # The transport uses the byte formats between hosts, not the gRPC side of proto/.
    add_line(tree / 'transport/ucx.c', '#include "proto/wire.h"')
    add_line(tree / 'proto/host/formats.c', '#include "fsdp/v1/peer.pb-c.h"')
    result = run_check(str(tree))
    assert result.returncode == 1
    assert ('transport/ucx.c: includes "proto/wire.h" from proto/, '
            'but transport/ may only use: common, proto/host') in result.stdout
    assert 'proto/host/formats.c: includes "fsdp/v1/peer.pb-c.h" from proto/' in result.stdout


def test_an_include_cycle_fails(tree):
    add_line(tree / 'common/status.c', '#include "common/fdpass.h"')
    add_line(tree / 'common/fdpass.c', '#include "common/status.h"')
    result = run_check(str(tree))
    assert result.returncode == 1
    assert 'include cycle among: common/fdpass, common/status' in result.stdout
