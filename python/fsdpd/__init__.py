"""fsdpd: keep a PyTorch trainer's sharded parameters in the fsdpd daemon.

A thin layer over libfsdp.so (ctypes, no compiled extension): a Client is one trainer
session (a job's local rank) with the job's shared memory mapped into this process; a Unit is
a registered group of parameters whose buffers (fp32 masters, fp32 gradient shards, this
rank's full gradient, the unsharded copy) are exposed without a copy, as torch tensors when
torch can be imported and as memoryviews otherwise. See python/README.md.

Lifetime: every buffer view points into memory the library unmaps at close(); touching a view
after close() crashes the process. The unsharded buffer is mapped read-only (every rank reads
it): writing it, even through a torch tensor that looks writable, is a segfault.
Threads: a Client is used by one thread at a time. A process forked after a Client exists (a
DataLoader's workers) may run on, but the Client is its parent's: it refuses every call
there, and neither the child's end nor its garbage collection detaches the parent's
session.
"""

import ctypes
import errno
import os
import warnings

from . import _lib

__all__ = ["Error", "Client", "Unit", "DEFAULT_SOCKET"]

# FSDP_DEFAULT_SOCKET of proto/limits.h: daemon.run_dir's default and the socket's name.
DEFAULT_SOCKET = "./run/fsdpd.sock"

try:  # Optional: without torch the buffers are memoryviews.
    import torch as _torch
except ImportError:  # pragma: no cover - depends on the machine
    _torch = None

class Error(Exception):
    """A failed fsdpd call.

    rc: the library's negative return value. code: its name, "FSDP_E_NOT_FOUND" for a
    domain code, the errno name ("EINVAL", "EBUSY") for -errno. status: the gRPC status name
    the code travels as, from libfsdp's table ("NOT_FOUND"; "INTERNAL" for an errno the RPC
    table does not map). message: the daemon's message (or the library's, for a failure on this side)."""

    def __init__(self, rc, message="", what=None):
        self.rc = rc
        name = _lib.lib().fsdp_error_name(rc)
        if name is not None:
            self.code = name.decode()
        else:
            self.code = errno.errorcode.get(-rc, f"E{-rc}")
        self.status = _lib.lib().fsdp_error_status_name(rc).decode()
        self.message = message
        self.description = _lib.lib().fsdp_strerror(rc).decode()
        text = f"{self.code} ({self.description})"
        if what:
            text = f"{what}: {text}"
        super().__init__(f"{text}: {message}" if message else text)


def _env_int(name, default):
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} is not an integer") from None


def _target(socket):
    """A gRPC target for socket: "unix:..." as given, a filesystem path made absolute."""
    if socket.startswith("unix:"):
        return socket
    return "unix:" + os.path.abspath(socket)


# Element types: (the C enum, memoryview format, torch dtype name, bytes per element).
_SCALARS = {
    _lib.SCALAR_FP32: ("f", "float32", 4),
    _lib.SCALAR_BF16: ("H", "bfloat16", 2),  # raw bits in a memoryview
    _lib.SCALAR_FP16: ("e", "float16", 2),
}
_SCALAR_NAMES = {"fp32": _lib.SCALAR_FP32, "float32": _lib.SCALAR_FP32,
                 "float": _lib.SCALAR_FP32, "bf16": _lib.SCALAR_BF16,
                 "bfloat16": _lib.SCALAR_BF16, "fp16": _lib.SCALAR_FP16,
                 "float16": _lib.SCALAR_FP16, "half": _lib.SCALAR_FP16}


def _scalar(dtype, what):
    """The C enum for a dtype given as None, a name ("bf16", "bfloat16") or a torch dtype."""
    if dtype is None:
        return _lib.SCALAR_DEFAULT
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    try:
        return _SCALAR_NAMES[name.lower()]
    except KeyError:
        raise ValueError(f"{what} {dtype!r}: expected float32, bfloat16 or float16") from None


class _DeviceArray:
    """count elements at a device address, as __cuda_array_interface__ (version 2) describes
    them to torch.as_tensor: no copy, and no dependency beyond torch. bf16, which the
    interface cannot name, travels as int16 and is viewed back."""

    _TYPESTR = {_lib.SCALAR_FP32: "<f4", _lib.SCALAR_BF16: "<i2", _lib.SCALAR_FP16: "<f2"}

    def __init__(self, address, count, scalar):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": self._TYPESTR[scalar],
                                         "data": (address, False), "strides": None,
                                         "version": 2}


def _device_view(address, count, scalar, device):
    """A CUDA tensor over count elements of scalar at a device address (the daemon's GPU
    memory as this trainer mapped it: read-only buffers are mapped so by the driver)."""
    _, torch_name, _ = _SCALARS[scalar]
    dtype = getattr(_torch, torch_name)
    t = _torch.as_tensor(_DeviceArray(address, count, scalar), device=f"cuda:{device}")
    return t.view(dtype) if t.dtype != dtype else t


def _view(address, offset_elems, count, scalar, writable, device=-1):
    """A zero-copy view of count elements of scalar at address + offset_elems: host memory,
    or with device >= 0 that CUDA device's memory (a CUDA tensor; torch required)."""
    fmt, torch_name, size = _SCALARS[scalar]
    if count == 0 or not address:
        mv = memoryview(bytearray(0)).cast(fmt)
        if device >= 0:
            return _torch.empty(0, dtype=getattr(_torch, torch_name), device=f"cuda:{device}")
        return _torch.empty(0, dtype=getattr(_torch, torch_name)) if _torch else mv
    if device >= 0:
        if _torch is None:
            raise RuntimeError("fsdpd: the job's memory is on a GPU (the daemon's backend is "
                               "cuda): its buffers need torch with CUDA")
        return _device_view(address + offset_elems * size, count, scalar, device)
    mv = _lib.memory(address + offset_elems * size, count * size, writable)
    if _torch is None:
        return mv.cast(fmt)
    with warnings.catch_warnings():
        # torch warns that a read-only buffer gives a tensor that can be written; the class
        # documentation says writing the unsharded buffer is a crash.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return _torch.frombuffer(mv, dtype=getattr(_torch, torch_name), count=count)


class Unit:
    """A registered unit: its layout and zero-copy views of its buffers.

    numel, padded_numel, shard_numel, shard (the shard this rank holds), param_offsets (each
    parameter's element offset in the unsharded buffers), param_shapes, param_names; layout
    ("FLAT" or "PER_PARAM") and for PER_PARAM param_shard_offsets and param_rows_per_shard
    (where each parameter's piece is in every shard, and its rows there);
    gathered_step, reduced_step: as of registration, the newest step whose gather /
    reduce-scatter completed on the unit (0 before the first): non-zero when the job trained
    before this client attached, so the masters hold trained values; replica: which copy of
    its shard this rank holds among all ranks of all hosts holding it (0: the first).
    Buffers (torch tensors, or memoryviews without torch; bf16 memoryviews hold raw bits):
      master, master_shard   fp32, this host's shards (host_shards of them from
                             host_first_shard; on one host every shard) / this rank's
      grad, grad_shard       fp32, the same layout, written by reduce_scatter()
      master_pieces(),       PER_PARAM: this rank's piece of each parameter, shaped as it
      grad_pieces()          (its rows of the parameter, padding left out), as FSDP2's
                             DTensor shards are
    Lent per operation from the daemon's bounded pools (None while not lent):
      unsharded              param dtype, READ-ONLY memory: from unshard() until reshard()
                             (or the unshard of a newer step)
      full_grad              param dtype, this rank's gradient: lent by unshard(backward=True),
                             written by the trainer, consumed by reduce_scatter()
    A view of a lent buffer must not be used after it goes back: the pool lends the same
    memory to another unit.
    """

    def __init__(self, client, handle, name, params, param_type):
        self._client = client
        self._handle = handle
        self.name = name
        self.param_names = [p[0] for p in params]
        self.param_shapes = [tuple(int(s) for s in p[1]) for p in params]
        self.param_type = param_type
        v = _lib.lib().fsdp_unit_view(handle).contents
        self.numel, self.padded_numel = int(v.numel), int(v.padded_numel)
        self.shard_numel, self.shard = int(v.shard_numel), int(v.shard)
        self.param_offsets = [int(v.param_offsets[i]) for i in range(v.n_params)]
        self.gathered_step, self.reduced_step = int(v.gathered_step), int(v.reduced_step)
        self.replica = int(v.replica)
        self.host_first_shard, self.host_shards = int(v.host_first_shard), int(v.host_shards)
        self.layout = "PER_PARAM" if v.layout == _lib.LAYOUT_PER_PARAM else "FLAT"
        pieces = range(v.n_params) if v.layout == _lib.LAYOUT_PER_PARAM else ()
        self.param_shard_offsets = [int(v.param_shard_offsets[i]) for i in pieces]
        self.param_rows_per_shard = [int(v.param_rows_per_shard[i]) for i in pieces]
        start = (self.shard - self.host_first_shard) * self.shard_numel
        n = self.padded_numel
        host = self.host_shards * self.shard_numel
        self.device = client.device
        d = self.device
        self.master = _view(v.master, 0, host, _lib.SCALAR_FP32, True, d)
        self.master_shard = _view(v.master, start, self.shard_numel, _lib.SCALAR_FP32, True, d)
        self.grad = _view(v.grad, 0, host, _lib.SCALAR_FP32, True, d)
        self.grad_shard = _view(v.grad, start, self.shard_numel, _lib.SCALAR_FP32, True, d)
        self.unsharded = self.full_grad = None
        self._lent = (None, None)  # the addresses they view
        # The element type of unsharded and full_grad (a torch dtype, or a struct format).
        fmt, torch_name, _ = _SCALARS[param_type]
        self.dtype = getattr(_torch, torch_name) if _torch else fmt

    def master_pieces(self):
        """PER_PARAM: this rank's piece of each parameter in its master shard, shaped."""
        return self._pieces(self.master_shard)

    def grad_pieces(self):
        """PER_PARAM: this rank's piece of each parameter in its gradient shard, shaped."""
        return self._pieces(self.grad_shard)

    def _pieces(self, shard):
        if self.layout != "PER_PARAM":
            raise ValueError(f"unit '{self.name}' is {self.layout}: its shards hold no "
                             "parameter's piece of its own")
        if _torch is None:
            raise RuntimeError("fsdpd: a unit's pieces are shaped tensors: they need torch")
        pieces = []
        for shape, at, rows in zip(self.param_shapes, self.param_shard_offsets,
                                   self.param_rows_per_shard):
            dim0, rest = (shape[0], shape[1:]) if shape else (1, ())
            mine = max(0, min(rows, dim0 - self.shard * rows))
            row = 1
            for s in rest:
                row *= s
            piece = shard[at:at + mine * row]
            # A scalar is the first shard's alone: an empty piece elsewhere.
            pieces.append(piece.view((mine, *rest)) if shape or not mine else piece.view(()))
        return pieces

    def __repr__(self):
        return (f"<fsdpd.Unit {self.name!r} numel={self.numel} padded={self.padded_numel} "
                f"shard {self.shard} of {self.shard_numel}>")

    def _call(self, what, fn, *args):
        c = self._client
        c._check_open()
        if self.device >= 0:
            # The daemon reads what the trainer's kernels wrote (masters, full_grad) and
            # reuses what they read (a copy given back): they must run first. The request
            # carries an event recorded on the current stream, which the daemon's streams
            # wait on (or, with no events, the device is synchronized first). Its replies
            # come after its own work has run, so nothing is needed after the call.
            stream = _torch.cuda.current_stream(self.device).cuda_stream
            if _lib.lib().fsdp_trainer_set_cuda_stream(c._trainer, stream) != 0:
                _torch.cuda.synchronize(self.device)
        rc = c._call(f"{what} of unit '{self.name}'", fn, c._trainer, self._handle, *args)
        self._follow_view()
        return rc

    def _follow_view(self):
        """Points unsharded and full_grad at what the daemon lends now."""
        v = _lib.lib().fsdp_unit_view(self._handle).contents
        n = self.padded_numel
        if v.unsharded != self._lent[0]:
            self.unsharded = _view(v.unsharded, 0, n, self.param_type, False, self.device) \
                if v.unsharded else None
        if v.full_grad != self._lent[1]:
            self.full_grad = _view(v.full_grad, 0, n, self.param_type, True, self.device) \
                if v.full_grad else None
        self._lent = (v.unsharded, v.full_grad)

    def unshard(self, step=0, backward=False):
        """Gathers the unit for this rank; returns once `unsharded` holds it. For the
        backward pass it also lends `full_grad`."""
        self._call("unshard", _lib.lib().fsdp_trainer_unshard, step, _pass(backward))

    def unshard_async(self, step=0, backward=False):
        """Starts the Unshard (prefetch); wait() returns its result. Until then other
        operations on this unit fail with EBUSY."""
        self._call("unshard_async", _lib.lib().fsdp_trainer_unshard_start, step,
                   _pass(backward))

    def wait(self, timeout=None):
        """Waits for the started Unshard or ReduceScatter, at most timeout seconds (None: the
        client's deadline); running out cancels it (FSDP_E_DEADLINE_EXCEEDED)."""
        ms = 0 if timeout is None else max(1, int(timeout * 1000))
        self._call("wait", _lib.lib().fsdp_trainer_wait, ms)

    def reshard(self, step=0):
        """Lets go of the unsharded copy."""
        self._call("reshard", _lib.lib().fsdp_trainer_reshard, step)

    @property
    def optimizer_state(self):
        """The daemon's optimizer state of this host's shards, laid out like `master`: a
        list of fp32 views (Adam, AdamW: exp_avg, exp_avg_sq, then max_exp_avg_sq with
        amsgrad; SGD: the momentum buffer), empty before Client.set_optimizer."""
        v = _lib.lib().fsdp_unit_view(self._handle).contents
        host = self.host_shards * self.shard_numel
        return [_view(v.optimizer_state[a], 0, host, _lib.SCALAR_FP32, True, self.device)
                for a in range(v.optimizer_arrays)]

    def _steps_count(self):
        """The unit's step count where the daemon keeps it: a ctypes uint64, or on a GPU a
        one-element int64 tensor; None without optimizer state."""
        v = _lib.lib().fsdp_unit_view(self._handle).contents
        if not v.optimizer_steps:
            return None
        if self.device < 0:
            return v.optimizer_steps
        address = ctypes.cast(v.optimizer_steps, ctypes.c_void_p).value
        return _device_view(address, 2, _lib.SCALAR_FP32, self.device).view(_torch.int64)

    @property
    def optimizer_steps(self):
        """How many optimizer steps the daemon took on this unit (0 before the first)."""
        count = self._steps_count()
        return 0 if count is None else int(count[0])

    @optimizer_steps.setter
    def optimizer_steps(self, steps):
        count = self._steps_count()
        if count is None:
            raise ValueError(f"unit '{self.name}' has no optimizer state: set_optimizer first")
        count[0] = int(steps)

    def reduce_scatter(self, step=0, accumulate=False, defer_all_reduce=False,
                       step_optimizer=False):
        """Submits full_grad; returns once every local rank's is reduced into the gradient
        shards (the mean by default; accumulate adds to them instead). full_grad goes back to
        the daemon. defer_all_reduce (HYBRID_SHARD's gradient accumulation): the sum among
        the shard group is kept instead, and the next reduce without it all-reduces both
        among the replicas and writes the shards (adding only if every reduce since
        accumulated); no effect on a unit without replicas on other hosts. step_optimizer:
        then the daemon steps the unit's masters with the job's optimizer
        (Client.set_optimizer), and the call returns after the step."""
        self._call("reduce_scatter", _lib.lib().fsdp_trainer_reduce_scatter, step,
                   _reduce_flags(accumulate, defer_all_reduce, step_optimizer))

    def reduce_scatter_async(self, step=0, accumulate=False, defer_all_reduce=False,
                             step_optimizer=False):
        """Starts the ReduceScatter; wait() returns its result."""
        self._call("reduce_scatter_async", _lib.lib().fsdp_trainer_reduce_scatter_start, step,
                   _reduce_flags(accumulate, defer_all_reduce, step_optimizer))

    def step_optimizer(self, step=0):
        """The daemon steps the unit's masters with the job's optimizer over what its gradient
        shards hold (what the reduces since the last step wrote), with no reduce: torch's
        opt.step(). Every local rank calls it, holding no full_grad; returns after the
        step."""
        self._call("step_optimizer", _lib.lib().fsdp_trainer_reduce_scatter, step,
                   _lib.REDUCE_STEP_ONLY)

    def step_optimizer_async(self, step=0):
        """Starts step_optimizer(); wait() returns its result."""
        self._call("step_optimizer_async", _lib.lib().fsdp_trainer_reduce_scatter_start, step,
                   _lib.REDUCE_STEP_ONLY)


def _reduce_flags(accumulate, defer_all_reduce, step_optimizer):
    return ((_lib.REDUCE_ACCUMULATE if accumulate else 0) |
            (_lib.REDUCE_DEFER_ALL_REDUCE if defer_all_reduce else 0) |
            (_lib.REDUCE_STEP_OPTIMIZER if step_optimizer else 0))


def _pass(backward):
    return _lib.PASS_BACKWARD if backward else _lib.PASS_FORWARD


class Client:
    """One trainer session: connects to the daemon and attaches as (job, rank).

    socket: the daemon's unix socket path, or "unix:PATH" ($FSDPD_SOCKET, else
    ./run/fsdpd.sock). job: the job name ($FSDPD_JOB, else torchrun's $TORCHELASTIC_RUN_ID;
    required). rank: the local rank ($LOCAL_RANK, else 0). local_world_size:
    ($LOCAL_WORLD_SIZE, else 1). Under torchrun ($WORLD_SIZE, $GROUP_RANK) the daemon
    refuses the attach, naming both, unless its topology is the launcher's: world size =
    hosts x local_world_size, this host the GROUP_RANK-th. generation: which
    run of the job this is, higher after every restart, the same for all its ranks
    ($TORCHELASTIC_RESTART_COUNT as torchrun sets it, else 0): collectives among hosts of a
    restarted job never meet what its failed run left behind. job_token: a secret the
    job's launcher hands all its trainers ($FSDPD_JOB_TOKEN, else none): the daemon lets
    no trainer with another token into the job, which keeps apart jobs that run as one
    user. timeout: each call's deadline in seconds (None: the library's 5 s).
    wait_for_ready: calls wait for a daemon that is not up yet, until their deadline,
    instead of failing at once.
    """

    def __init__(self, socket=None, job=None, rank=None, local_world_size=None, timeout=None,
                 wait_for_ready=False, generation=None, job_token=None):
        self._client = None
        self._trainer = None
        self._units = {}
        self._pid = os.getpid()
        if socket is None:
            socket = os.environ.get("FSDPD_SOCKET") or DEFAULT_SOCKET
        if job is None:  # torchrun's run id by default: one job per launch
            job = os.environ.get("FSDPD_JOB") or os.environ.get("TORCHELASTIC_RUN_ID")
            if not job:
                raise ValueError("fsdpd.Client: no job: pass job=, set FSDPD_JOB, or start "
                                 "the trainers with torchrun (TORCHELASTIC_RUN_ID)")
            if job == "none" and not os.environ.get("FSDPD_JOB"):
                raise ValueError("fsdpd.Client: torchrun was started without --rdzv_id: its "
                                 "run id is 'none', the same for every launch, which would "
                                 "make every launch one job; pass torchrun --rdzv_id NAME, "
                                 "or set FSDPD_JOB")
        if rank is None:
            rank = _env_int("LOCAL_RANK", 0)
        if local_world_size is None:
            local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
        if generation is None:
            generation = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
        if job_token is None:
            job_token = os.environ.get("FSDPD_JOB_TOKEN", "")
        if generation < 0:
            raise ValueError(f"fsdpd.Client: generation {generation}: expected 0 or more")
        if rank < 0 or local_world_size < 1:
            raise ValueError(f"fsdpd.Client: rank {rank} of local_world_size "
                             f"{local_world_size}: expected 0 <= rank < local_world_size")
        self.socket, self.job = socket, job
        self.rank, self.local_world_size = int(rank), int(local_world_size)
        lib = _lib.lib()

        opts = _lib.ClientOptions(0, 0, bool(wait_for_ready))
        if timeout is not None:
            opts.timeout_ms = max(1, int(timeout * 1000))
        client = ctypes.c_void_p()
        self._call(f"connect to {socket}", lib.fsdp_client_connect, _target(socket).encode(),
                   ctypes.byref(opts), ctypes.byref(client))
        self._client = client
        self.generation = int(generation)
        # torchrun's view of the world, which the daemon checks against its own.
        world_size = _env_int("WORLD_SIZE", 0)
        node_rank = _env_int("GROUP_RANK", _env_int("RANK", 0) // self.local_world_size)
        topts = _lib.TrainerOptions(job.encode(), self.rank, self.local_world_size,
                                    self.generation, job_token.encode(), world_size,
                                    node_rank)
        trainer = ctypes.c_void_p()
        try:
            self._call(f"attach job '{job}' rank {self.rank}", lib.fsdp_trainer_attach, client,
                       ctypes.byref(topts), ctypes.byref(trainer))
        except Error:
            lib.fsdp_client_close(client)
            self._client = None
            raise
        self._trainer = trainer
        self.session_id = int(lib.fsdp_trainer_session_id(trainer))
        # Where the job's buffers are: -1 host memory, else this CUDA device's (the daemon's
        # backend is cuda), and the units' views are CUDA tensors.
        self.device = int(lib.fsdp_trainer_memory_device(trainer))

    def _call(self, what, fn, *args):
        """fn(*args): every libfsdp call that returns a status goes through here. A negative
        one raises Error for what, with the client's message (none before it connected)."""
        rc = fn(*args)
        if rc < 0:
            msg = _lib.lib().fsdp_client_last_error(self._client) if self._client else b""
            raise Error(rc, (msg or b"").decode(errors="replace"), what)
        return rc

    def _check_open(self):
        if self._pid != os.getpid():
            raise RuntimeError(f"fsdpd.Client of job '{self.job}' rank {self.rank} belongs to "
                               f"process {self._pid}, which attached it: this process "
                               f"({os.getpid()}) was forked from it (a DataLoader worker?) and "
                               "cannot use it; make a Client in the process that trains")
        if self._trainer is None:
            raise ValueError("fsdpd.Client is closed")

    @property
    def closed(self):
        return self._trainer is None

    def keepalive(self):
        """Renews the session's lease (for trainers idle longer than session.lease)."""
        self._check_open()
        self._call("keepalive", _lib.lib().fsdp_trainer_keepalive, self._trainer)

    def register_unit(self, name, params, strategy="FULL_SHARD", param_dtype=None,
                      reduce_dtype=None, gradient_predivide_factor=0.0,
                      gradient_postdivide_factor=0.0, scratch=False, layout="FLAT"):
        """Registers a unit of fp32 parameters and returns its Unit.

        params: a list of (name, shape, requires_grad) (requires_grad may be left out:
        True), in flattening order. strategy: FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or
        NO_SHARD. param_dtype: the unsharded copy's and full_grad's type, reduce_dtype: the
        reduction's (None: float32 / param_dtype; names or torch dtypes). Every local rank
        registers the same spec; registering it again returns the same Unit. scratch: the
        caller's own unit (a buffer for its collectives), not the model's: checkpoints leave
        it out and the job's step is counted without it. layout: "FLAT" (FSDP1's flat
        parameter cut into equal shards) or "PER_PARAM" (FSDP2's: each parameter cut on dim 0,
        each shard a piece of every parameter)."""
        self._check_open()
        layouts = {"FLAT": _lib.LAYOUT_FLAT, "PER_PARAM": _lib.LAYOUT_PER_PARAM}
        if str(layout).upper() not in layouts:
            raise ValueError(f"layout {layout!r}: expected FLAT or PER_PARAM")
        try:
            strategy_value = _lib.STRATEGIES[str(strategy).upper()]
        except KeyError:
            raise ValueError(f"strategy {strategy!r}: expected one of "
                             f"{', '.join(_lib.STRATEGIES)}") from None
        param_type = _scalar(param_dtype, "param_dtype")
        reduce_type = _scalar(reduce_dtype, "reduce_dtype")
        params = [tuple(p) if len(p) == 3 else (p[0], p[1], True) for p in params]
        shapes = [(ctypes.c_uint64 * len(p[1]))(*[int(s) for s in p[1]]) for p in params]
        descs = (_lib.ParamDesc * max(1, len(params)))()
        for i, (pname, _shape, requires_grad) in enumerate(params):
            descs[i] = _lib.ParamDesc(str(pname).encode(), shapes[i], len(shapes[i]),
                                      bool(requires_grad))
        desc = _lib.UnitDesc(str(name).encode(), descs, len(params), strategy_value,
                             param_type, reduce_type, float(gradient_predivide_factor),
                             float(gradient_postdivide_factor), bool(scratch),
                             layouts[str(layout).upper()])
        handle = ctypes.c_void_p()
        self._call(f"register unit '{name}'", _lib.lib().fsdp_trainer_register_unit,
                   self._trainer, ctypes.byref(desc), ctypes.byref(handle))
        unit = self._units.get(handle.value)
        if unit is None:
            resolved = param_type if param_type != _lib.SCALAR_DEFAULT else _lib.SCALAR_FP32
            unit = Unit(self, handle, str(name), params, resolved)
            self._units[handle.value] = unit
        return unit

    def set_schedule(self, max_inflight=0, reshard_after_forward=None, forward_order=None,
                     forward_prefetch=0, backward_prefetch=0):
        """Sets how the daemon runs the job's units (every local rank sets the same).
        max_inflight: the unsharded copies of units that reshard after forward the ranks hold
        at once, and the full-gradient buffers of such units each rank holds (FSDP's
        limit_all_gathers), 1 to 64; 0 keeps the job's. reshard_after_forward: {Unit: bool}
        for units whose copy is (or is not) let go after their forward; the others keep their
        strategy's default (FULL_SHARD and HYBRID_SHARD: True). forward_order: [Unit] as the
        forward runs them; None: the daemon records it from the steps. forward_prefetch,
        backward_prefetch: how many units the daemon gathers ahead of the one a rank's
        forward (backward) Unshard asks for, 0 to 64; with either, a rank's Unshard of a
        step says that all its master shards are final for that step."""
        self._check_open()
        units = list((reshard_after_forward or {}).items())
        entries = (_lib.UnitSchedule * max(1, len(units)))()
        for i, (unit, reshard) in enumerate(units):
            entries[i] = _lib.UnitSchedule(unit._handle.value, bool(reshard))
        order = list(forward_order or [])
        handles = (ctypes.c_void_p * max(1, len(order)))(*[u._handle.value for u in order])
        schedule = _lib.Schedule(int(max_inflight), entries, len(units), handles, len(order),
                                 int(forward_prefetch), int(backward_prefetch))
        self._call("set schedule", _lib.lib().fsdp_trainer_set_schedule, self._trainer,
                   ctypes.byref(schedule))

    def save_checkpoint(self, directory, step=0):
        """Has the daemon write the job's state on this host (every unit's masters, its
        optimizer's state) into directory/step-N/ and returns N: step, or when 0 the least
        step the job's trainable units completed a reduce of. Between steps, every local
        rank's optimizer step done; one rank calls it."""
        self._check_open()
        done = ctypes.c_uint64()
        path = os.path.abspath(os.fspath(directory))
        self._call(f"save checkpoint {path}", _lib.lib().fsdp_trainer_save_checkpoint,
                   self._trainer, path.encode(), int(step), ctypes.byref(done))
        return int(done.value)

    def load_checkpoint(self, directory):
        """Reads directory (a step directory, or the newest under it) into the job's units,
        which must be laid out as saved, and returns its step, after which training goes
        on. Between steps; one rank calls it."""
        self._check_open()
        step = ctypes.c_uint64()
        path = os.path.abspath(os.fspath(directory))
        self._call(f"load checkpoint {path}", _lib.lib().fsdp_trainer_load_checkpoint,
                   self._trainer, path.encode(), ctypes.byref(step))
        return int(step.value)

    def set_optimizer(self, kind, groups, max_grad_norm=0.0):
        """Sets the optimizer the daemon runs over the job's master shards (torch.optim's
        formulas), or its hyperparameters once set: kind "AdamW", "Adam" or "SGD"; groups a
        list of dicts like torch's param_groups, whose "params" are original parameter names
        (a group without "params" takes those no other group names) and whose other keys are
        lr, weight_decay, maximize, betas (a pair), eps, amsgrad, momentum, dampening,
        nesterov. max_grad_norm > 0 clips the gradient by its global norm (every host's
        shards) before each step: a step's reduces then return once every unit's is in and
        all are stepped, so start them all (reduce_scatter_async) before waiting. The kind
        and each group's parameters stay as first set; the units' optimizer_state shows the
        state from then on."""
        self._check_open()
        if kind not in _lib.OPTIMIZERS:
            raise ValueError(f"optimizer kind {kind!r}: expected one of "
                             f"{', '.join(_lib.OPTIMIZERS)}")
        keep = []  # what the structures point into, alive until the call returns
        entries = (_lib.ParamGroup * max(1, len(groups)))()
        for i, g in enumerate(groups):
            names = [n.encode() for n in g.get("params", ())]
            array = (ctypes.c_char_p * max(1, len(names)))(*names)
            keep.append(array)
            beta1, beta2 = g.get("betas", (0.0, 0.0))
            entries[i] = _lib.ParamGroup(array, len(names), float(g.get("lr", 0.0)),
                                         float(g.get("weight_decay", 0.0)),
                                         bool(g.get("maximize", False)), float(beta1),
                                         float(beta2), float(g.get("eps", 0.0)),
                                         bool(g.get("amsgrad", False)),
                                         float(g.get("momentum", 0.0)),
                                         float(g.get("dampening", 0.0)),
                                         bool(g.get("nesterov", False)))
        optim = _lib.Optim(_lib.OPTIMIZERS[kind], entries, len(groups), float(max_grad_norm))
        self._call("set optimizer", _lib.lib().fsdp_trainer_set_optimizer, self._trainer,
                   ctypes.byref(optim))

    def close(self):
        """Detaches (the daemon keeps the job's units and memory) and closes the connection.
        Every buffer view of this client's units dangles afterwards. Idempotent; raises
        Error if the daemon refused the Detach (the session is closed here either way), but
        not when the daemon is gone: its sessions went with it."""
        if getattr(self, "_pid", os.getpid()) != os.getpid():
            return  # a forked copy: the session and the connection are the parent's
        lib = _lib.lib()
        err = None
        if self._trainer is not None:
            trainer, self._trainer = self._trainer, None  # closed here even if refused
            try:
                self._call("detach", lib.fsdp_trainer_detach, trainer)
            except Error as e:
                if e.status != "UNAVAILABLE":
                    err = e
        self._units.clear()
        if self._client is not None:
            lib.fsdp_client_close(self._client)
            self._client = None
        if err is not None:
            raise err

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # A process that exits without close() is detached by the daemon anyway (the memory
        # channel closes); this only spares a long-lived process the leaked session.
        try:
            if getattr(self, "_trainer", None) is not None or getattr(self, "_client", None):
                self.close()
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self.closed else f"session {self.session_id}"
        return (f"<fsdpd.Client job={self.job!r} rank {self.rank} of "
                f"{self.local_world_size}, {state}>")
