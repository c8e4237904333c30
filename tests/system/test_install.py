"""fsdpd installed as a user installs it: `cmake --install` into a prefix of its own and a C
program built against libfsdp through pkg-config (fsdp.pc); and `pip install ./python` alone
into a fresh virtual environment of the system's python3 (no system site packages, no
FSDPD_LIB, no installed libfsdp): the package builds libfsdp from the repository
(scikit-build-core, which pip fetches from PyPI) and carries it, so that its first call to a
daemon works (issue 30 item 4: it failed with "cannot load libfsdp.so").
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from fsdpd_harness import built_with, fsdpd  # noqa: E402,F401

SOURCE_DIR = Path(os.environ.get("FSDP_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BUILD_DIR = Path(os.environ.get("FSDP_BUILD_DIR", SOURCE_DIR / "build"))

PROGRAM = r'''
#include <stdio.h>
#include <fsdp/fsdp_client.h>
#include <fsdp/fsdp_trainer.h>
int main(void) {
  printf("%s\n", fsdp_strerror(FSDP_E_DATA_LOSS));
  return fsdp_trainer_memory_device(NULL) == -1 ? 0 : 1;
}
'''


pytestmark = pytest.mark.skipif(built_with("FSDP_SANITIZE"),
                                reason="ASan/UBSan build: a program or python3 loading its "
                                       "libfsdp would need libasan loaded first")


def run(*argv, env=None, cwd=None):
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env,
                       cwd=cwd, timeout=120)
    assert r.returncode == 0, f"{argv}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_install_pkg_config_and_the_python_package(tmp_path):
    prefix = tmp_path / "prefix"
    run("cmake", "--install", BUILD_DIR, "--prefix", prefix)
    (pc,) = prefix.rglob("fsdp.pc")
    env = {"PATH": os.environ["PATH"], "PKG_CONFIG_PATH": str(pc.parent)}

    flags = run("pkg-config", "--cflags", "--libs", "fsdp", env=env).split()
    source = tmp_path / "hello.c"
    source.write_text(PROGRAM)
    run("cc", "-std=c11", source, *flags, "-o", tmp_path / "hello", env=env)
    libdir = run("pkg-config", "--variable=libdir", "fsdp", env=env).strip()
    out = run(tmp_path / "hello", env={**env, "LD_LIBRARY_PATH": libdir})
    assert out.strip() == "data loss", out

    # The package still finds an installed libfsdp through pkg-config when it carries none.
    check = ("import sys; sys.path.insert(0, sys.argv[1]); import fsdpd._lib as l; "
             "print(l.library_candidates())")
    out = run(sys.executable, "-c", check, SOURCE_DIR / "python", env=env, cwd=tmp_path)
    assert str(Path(libdir) / "libfsdp.so.0") in out, out


def test_pip_install_alone_gives_a_package_that_talks_to_a_daemon(fsdpd, tmp_path):
    venv = tmp_path / "venv"
    run("/usr/bin/python3", "-m", "venv", venv)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    # pip builds a local directory in place; scikit-build-core builds in a directory of its
    # own, so the tree is left as it was (checked below).
    before = run("git", "-C", SOURCE_DIR, "status", "--porcelain", "--ignored", "python")
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(SOURCE_DIR / "python")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, f"pip install ./python: exit {r.returncode}\n{r.stderr[-4000:]}"
    after = run("git", "-C", SOURCE_DIR, "status", "--porcelain", "--ignored", "python")
    assert before == after, (before, after)
    d = fsdpd()
    call = """
import json, fsdpd, fsdpd._lib
with fsdpd.Client(socket=%r, job="installed") as client:
    unit = client.register_unit("u", [("w", (4, 2))])
    unit.master_shard[0] = 1.5
    print(json.dumps({"lib": fsdpd._lib.lib()._name, "numel": unit.numel,
                      "file": fsdpd.__file__}))
""" % str(d.socket_path)
    out = run(venv / "bin" / "python", "-c", call, env={"PATH": os.environ["PATH"]},
              cwd=tmp_path)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["numel"] == 8 and got["file"].startswith(str(venv)), got
    assert got["lib"].startswith(str(venv)) and got["lib"].endswith("fsdpd/libfsdp.so"), got
