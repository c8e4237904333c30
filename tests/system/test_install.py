"""fsdpd installed as a user installs it: `cmake --install` into a prefix of its own, a C
program built against libfsdp through pkg-config (fsdp.pc), and `pip install ./python` into a
fresh virtual environment (with the system's site packages, for torch), which then finds the
installed libfsdp through pkg-config and imports with no environment at all.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def _sanitized_build():
    try:
        return "FSDP_SANITIZE:BOOL=ON" in (BUILD_DIR / "CMakeCache.txt").read_text()
    except FileNotFoundError:
        return False


pytestmark = pytest.mark.skipif(_sanitized_build(),
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

    # From a copy: pip builds a local directory in place, which would leave files in the tree.
    package = tmp_path / "python"
    shutil.copytree(SOURCE_DIR / "python", package,
                    ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--system-site-packages", venv)
    run(venv / "bin" / "pip", "install", "-q", "--no-build-isolation", "--no-index",
        "--no-deps", package, env={**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    python = venv / "bin" / "python"
    out = run(python, "-c", "import fsdpd; print(fsdpd.__file__)", env={}, cwd=tmp_path)
    assert out.startswith(str(venv)), out
    check = ("import fsdpd._lib as l; lib = l.lib(); "
             "print(lib._name); print(lib.fsdp_strerror(-22).decode())")
    name, message = run(python, "-c", check, env=env, cwd=tmp_path).split("\n")[:2]
    assert Path(name).resolve().parent == Path(libdir).resolve(), name
    assert message == "Invalid argument"
