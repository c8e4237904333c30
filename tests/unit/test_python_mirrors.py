"""The Python package's ctypes mirrors (python/fsdpd/_lib.py) against the public headers as the
compiler sees them (bin/public_layout, built from unit/public_layout.c): every mirrored struct's
size and each field's name, offset and width, in order; every declared function's return width
and parameter count; and every libfsdp function the package calls is declared, so that none
runs with ctypes' default prototype (an int return: a pointer cut to 32 bits)."""
import ctypes
import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

SOURCE_DIR = Path(os.environ.get("FSDP_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BUILD_DIR = Path(os.environ.get("FSDP_BUILD_DIR", SOURCE_DIR / "build"))
PACKAGE = SOURCE_DIR / "python" / "fsdpd"
# _lib.py alone: the package would import torch, and the library is not loaded.
_spec = importlib.util.spec_from_file_location("fsdpd_lib", PACKAGE / "_lib.py")
_lib = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_lib)

# Each C type and its mirror.
MIRRORS = {
    "fsdp_client_options_t": _lib.ClientOptions,
    "fsdp_trainer_options_t": _lib.TrainerOptions,
    "fsdp_param_desc_t": _lib.ParamDesc,
    "fsdp_unit_desc_t": _lib.UnitDesc,
    "fsdp_unit_view_t": _lib.UnitView,
    "fsdp_unit_schedule_t": _lib.UnitSchedule,
    "fsdp_schedule_t": _lib.Schedule,
    "fsdp_param_group_t": _lib.ParamGroup,
    "fsdp_optim_t": _lib.Optim,
}


@pytest.fixture(scope="module")
def compiled():
    out = subprocess.run([str(BUILD_DIR / "bin" / "public_layout")], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def test_every_mirror_is_checked(compiled):
    mirrors = {v for v in vars(_lib).values()
               if isinstance(v, type) and issubclass(v, ctypes.Structure)}
    assert mirrors == set(MIRRORS.values())
    assert set(compiled["structs"]) == set(MIRRORS)


@pytest.mark.parametrize("ctype", sorted(MIRRORS))
def test_struct_mirror_is_the_header_s(compiled, ctype):
    mirror = MIRRORS[ctype]
    header = [tuple(f) for f in compiled["structs"][ctype]["fields"]]
    ours = [(name, getattr(mirror, name).offset, getattr(mirror, name).size)
            for name, _ in mirror._fields_]
    assert [f[0] for f in ours] == [f[0] for f in header], \
        f"_lib.{mirror.__name__}'s fields, then {ctype}'s"
    wrong = [f"{name}: offset {o} size {s} here, offset {co} size {cs} in C"
             for (name, o, s), (_, co, cs) in zip(ours, header) if (o, s) != (co, cs)]
    assert not wrong, f"_lib.{mirror.__name__} against {ctype}: " + "; ".join(wrong)
    assert ctypes.sizeof(mirror) == compiled["structs"][ctype]["size"]


def test_constants_are_the_header_s(compiled):
    """_lib's SCALAR_*, PASS_*, REDUCE_* and LAYOUT_* are the header's FSDP_ constants,
    every one."""
    header = {name.removeprefix("FSDP_"): value for name, value in compiled["constants"].items()}
    ours = {name: value for name, value in vars(_lib).items()
            if re.match(r"(SCALAR|PASS|REDUCE|LAYOUT)_[A-Z0-9_]+$", name)}
    assert ours == header


def test_every_function_the_package_calls_is_declared():
    used = set()
    for path in PACKAGE.glob("*.py"):
        used |= set(re.findall(r"\.(fsdp_\w+)\b", path.read_text()))
    assert used, "no call found: has the package's way of calling libfsdp changed?"
    assert sorted(used - set(_lib._SIGNATURES)) == []


def test_declared_prototypes_are_the_header_s(compiled):
    header = compiled["functions"]
    assert sorted(_lib._SIGNATURES) == sorted(header)
    wrong = []
    for name, (restype, argtypes) in sorted(_lib._SIGNATURES.items()):
        ours = [0 if restype is None else ctypes.sizeof(restype), len(argtypes)]
        if ours != header[name]:
            wrong.append(f"{name}: returns {ours[0]} bytes from {ours[1]} parameters here, "
                         f"{header[name][0]} from {header[name][1]} in C")
    assert not wrong, "; ".join(wrong)
