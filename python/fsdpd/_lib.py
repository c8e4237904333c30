"""ctypes bindings of libfsdp.so: the C API of include/fsdp/, nothing more.

The structures mirror fsdp_client.h's and fsdp_trainer.h's field for field, and _SIGNATURES
declares every function the package calls; a change there must be made here too, and
tests/unit/test_python_mirrors.py holds both to the headers as the compiler sees them.
The library is found once, on first use: $FSDPD_LIB if set (a path to libfsdp.so), else the
one `pip install ./python` built into this package (fsdpd/libfsdp.so), else the build tree
next to this package (<repo>/build/lib/libfsdp.so, <repo>/build/libfsdp.so), else the
installed one: in the libdir of its pkg-config file (fsdp.pc, which `cmake --install`
writes), else libfsdp.so.0 through the dynamic loader's search path.
"""

import ctypes
import os
import subprocess
import threading
from pathlib import Path

SCALAR_DEFAULT, SCALAR_FP32, SCALAR_BF16, SCALAR_FP16 = 0, 1, 2, 3
STRATEGIES = {"FULL_SHARD": 1, "SHARD_GRAD_OP": 2, "HYBRID_SHARD": 3, "NO_SHARD": 4}
PASS_FORWARD, PASS_BACKWARD = 0, 1
LAYOUT_FLAT, LAYOUT_PER_PARAM = 0, 1  # FSDP_LAYOUT_*
# FSDP_REDUCE_*
REDUCE_ACCUMULATE, REDUCE_DEFER_ALL_REDUCE, REDUCE_STEP_OPTIMIZER, REDUCE_STEP_ONLY = 1, 2, 4, 8
OPTIMIZERS = {"AdamW": 1, "Adam": 2, "SGD": 3}  # fsdp_optim_kind_t


class ClientOptions(ctypes.Structure):
    _fields_ = [("timeout_ms", ctypes.c_int), ("max_message_bytes", ctypes.c_int),
                ("wait_for_ready", ctypes.c_bool)]


class TrainerOptions(ctypes.Structure):
    _fields_ = [("job", ctypes.c_char_p), ("local_rank", ctypes.c_uint),
                ("local_world_size", ctypes.c_uint), ("generation", ctypes.c_uint64),
                ("job_token", ctypes.c_char_p), ("world_size", ctypes.c_uint),
                ("node_rank", ctypes.c_uint)]


class ParamDesc(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("shape", ctypes.POINTER(ctypes.c_uint64)),
                ("ndim", ctypes.c_size_t), ("requires_grad", ctypes.c_bool)]


class UnitDesc(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("params", ctypes.POINTER(ParamDesc)),
                ("n_params", ctypes.c_size_t), ("strategy", ctypes.c_int),
                ("param_type", ctypes.c_int), ("reduce_type", ctypes.c_int),
                ("gradient_predivide_factor", ctypes.c_double),
                ("gradient_postdivide_factor", ctypes.c_double), ("scratch", ctypes.c_bool),
                ("layout", ctypes.c_int)]


class UnitView(ctypes.Structure):
    _fields_ = [("numel", ctypes.c_uint64), ("padded_numel", ctypes.c_uint64),
                ("shard_numel", ctypes.c_uint64), ("shard", ctypes.c_uint),
                ("param_offsets", ctypes.POINTER(ctypes.c_uint64)),
                ("n_params", ctypes.c_size_t), ("unsharded", ctypes.c_void_p),
                ("master", ctypes.c_void_p), ("grad", ctypes.c_void_p),
                ("host_first_shard", ctypes.c_uint), ("host_shards", ctypes.c_uint),
                ("full_grad", ctypes.c_void_p), ("gathered_step", ctypes.c_uint64),
                ("reduced_step", ctypes.c_uint64), ("replica", ctypes.c_uint),
                ("optimizer_steps", ctypes.POINTER(ctypes.c_uint64)),
                ("optimizer_state", ctypes.c_void_p * 3), ("optimizer_arrays", ctypes.c_uint),
                ("layout", ctypes.c_int),
                ("param_shard_offsets", ctypes.POINTER(ctypes.c_uint64)),
                ("param_rows_per_shard", ctypes.POINTER(ctypes.c_uint64))]


class ParamGroup(ctypes.Structure):
    _fields_ = [("params", ctypes.POINTER(ctypes.c_char_p)), ("n_params", ctypes.c_size_t),
                ("lr", ctypes.c_double), ("weight_decay", ctypes.c_double),
                ("maximize", ctypes.c_bool), ("beta1", ctypes.c_double),
                ("beta2", ctypes.c_double), ("eps", ctypes.c_double), ("amsgrad", ctypes.c_bool),
                ("momentum", ctypes.c_double), ("dampening", ctypes.c_double),
                ("nesterov", ctypes.c_bool)]


class Optim(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("groups", ctypes.POINTER(ParamGroup)),
                ("n_groups", ctypes.c_size_t), ("max_grad_norm", ctypes.c_double)]


class UnitSchedule(ctypes.Structure):
    _fields_ = [("unit", ctypes.c_void_p), ("reshard_after_forward", ctypes.c_bool)]


class Schedule(ctypes.Structure):
    _fields_ = [("max_inflight", ctypes.c_uint), ("units", ctypes.POINTER(UnitSchedule)),
                ("n_units", ctypes.c_size_t), ("forward_order", ctypes.POINTER(ctypes.c_void_p)),
                ("n_forward_order", ctypes.c_size_t), ("forward_prefetch", ctypes.c_uint),
                ("backward_prefetch", ctypes.c_uint)]


_p = ctypes.c_void_p
_SIGNATURES = {
    # name: (restype, argtypes)
    "fsdp_strerror": (ctypes.c_char_p, [ctypes.c_int]),
    "fsdp_error_name": (ctypes.c_char_p, [ctypes.c_int]),
    "fsdp_error_status_name": (ctypes.c_char_p, [ctypes.c_int]),
    "fsdp_client_connect": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ClientOptions),
                                           ctypes.POINTER(_p)]),
    "fsdp_client_close": (None, [_p]),
    "fsdp_client_last_error": (ctypes.c_char_p, [_p]),
    "fsdp_trainer_attach": (ctypes.c_int, [_p, ctypes.POINTER(TrainerOptions),
                                           ctypes.POINTER(_p)]),
    "fsdp_trainer_detach": (ctypes.c_int, [_p]),
    "fsdp_trainer_session_id": (ctypes.c_uint64, [_p]),
    "fsdp_trainer_keepalive": (ctypes.c_int, [_p]),
    "fsdp_trainer_register_unit": (ctypes.c_int, [_p, ctypes.POINTER(UnitDesc),
                                                  ctypes.POINTER(_p)]),
    "fsdp_unit_view": (ctypes.POINTER(UnitView), [_p]),
    "fsdp_trainer_memory_device": (ctypes.c_int, [_p]),
    "fsdp_trainer_set_cuda_stream": (ctypes.c_int, [_p, ctypes.c_void_p]),
    "fsdp_trainer_unshard": (ctypes.c_int, [_p, _p, ctypes.c_uint64, ctypes.c_int]),
    "fsdp_trainer_unshard_start": (ctypes.c_int, [_p, _p, ctypes.c_uint64, ctypes.c_int]),
    "fsdp_trainer_wait": (ctypes.c_int, [_p, _p, ctypes.c_int]),
    "fsdp_trainer_set_schedule": (ctypes.c_int, [_p, ctypes.POINTER(Schedule)]),
    "fsdp_trainer_set_optimizer": (ctypes.c_int, [_p, ctypes.POINTER(Optim)]),
    "fsdp_trainer_save_checkpoint": (ctypes.c_int, [_p, ctypes.c_char_p, ctypes.c_uint64,
                                                    ctypes.POINTER(ctypes.c_uint64)]),
    "fsdp_trainer_load_checkpoint": (ctypes.c_int, [_p, ctypes.c_char_p,
                                                    ctypes.POINTER(ctypes.c_uint64)]),
    "fsdp_trainer_reshard": (ctypes.c_int, [_p, _p, ctypes.c_uint64]),
    "fsdp_trainer_reduce_scatter": (ctypes.c_int, [_p, _p, ctypes.c_uint64, ctypes.c_uint]),
    "fsdp_trainer_reduce_scatter_start": (ctypes.c_int, [_p, _p, ctypes.c_uint64,
                                                         ctypes.c_uint]),
}

_lock = threading.Lock()
_lib = None


def _pkg_config_libdir():
    """libfsdp's directory as its installed fsdp.pc says, or None (no pkg-config, no fsdp.pc)."""
    try:
        r = subprocess.run(["pkg-config", "--variable=libdir", "fsdp"], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def library_candidates():
    """Where libfsdp.so is looked for, in order."""
    env = os.environ.get("FSDPD_LIB")
    if env:
        return [env]
    here = Path(__file__).resolve().parent
    repo = here.parent.parent
    candidates = [str(here / "libfsdp.so"), str(repo / "build" / "lib" / "libfsdp.so"),
                  str(repo / "build" / "libfsdp.so")]
    libdir = _pkg_config_libdir()
    if libdir:
        candidates.append(str(Path(libdir) / "libfsdp.so.0"))
    return candidates + ["libfsdp.so.0"]


def lib():
    """The loaded library with its signatures set; raises OSError naming where it looked."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        candidates = library_candidates()
        errors = []
        for path in candidates:
            if "/" in path and not os.path.exists(path):
                errors.append(f"{path}: no such file")
                continue
            try:
                handle = ctypes.CDLL(path)
            except OSError as e:
                errors.append(str(e))
                continue
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(handle, name)
                fn.restype, fn.argtypes = restype, argtypes
            _lib = handle
            return _lib
        raise OSError("fsdpd: cannot load libfsdp.so (`pip install ./python` builds it into "
                      "the package; else install it with cmake --install where pkg-config or "
                      "the dynamic loader finds it, set FSDPD_LIB to its path, or build the "
                      "repository's build/ tree): " + "; ".join(errors))


def memory(address, nbytes, writable):
    """A memoryview of nbytes at address, format 'B', read-only unless writable. It does not
    own the memory: it is valid while the trainer that mapped it lives."""
    fn = ctypes.pythonapi.PyMemoryView_FromMemory
    fn.restype, fn.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
    PyBUF_READ, PyBUF_WRITE = 0x100, 0x200
    return fn(address, nbytes, PyBUF_WRITE if writable else PyBUF_READ)
