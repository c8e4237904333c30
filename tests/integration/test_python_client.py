"""The Python package (python/fsdpd, ctypes over libfsdp.so) against a real fsdpd, as a
trainer uses it: L = 2 ranks in 2 processes register a unit, write their master shards
through the tensor views, unshard (fp32 exact, bf16 as torch rounds), reshard, write their
full gradients and reduce-scatter to the mean; fsdpd.Error carries code, status and the
daemon's message; Client() takes its arguments from the environment as torchrun sets it; the
context manager detaches.

Every use of the package runs in a child process: a session belongs to its process, and the
pytest process already holds grpcio's own gRPC core. The package is found through the source
tree's python/ and the library through the build tree (FSDPD_LIB), as CTest sets
FSDP_SOURCE_DIR and FSDP_BUILD_DIR.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from fsdpd_harness import BUILD_DIR, SOURCE_DIR, built_with, fsdpd  # noqa: F401

PYTHON = sys.executable  # .venv/bin/python, with torch (scripts/venv.sh)
LIB = BUILD_DIR / "lib" / "libfsdp.so"
DAEMON_ARGS = ("--set", "memory.job_limit=64MiB")
CHILD_TIMEOUT = 60


pytestmark = pytest.mark.skipif(
    built_with("FSDP_SANITIZE"),
    reason="ASan/UBSan build: libfsdp.so would need libasan preloaded into the interpreter; "
           "the package is tested against the regular build")


# The rank process. argv: mode, then mode-specific arguments; prints one JSON line.
WORKER = textwrap.dedent(r'''
    import json, os, sys, time
    mode = sys.argv[1]
    if mode in ("memoryview", "stale-read"):
        sys.modules["torch"] = None  # as if torch were not installed
    import fsdpd

    def barrier(name, world):
        d = os.environ["BARRIER_DIR"]
        open(os.path.join(d, f"{name}.{os.environ['LOCAL_RANK']}"), "w").close()
        deadline = time.monotonic() + 30
        while not all(os.path.exists(os.path.join(d, f"{name}.{r}")) for r in range(world)):
            if time.monotonic() > deadline:
                sys.exit(f"barrier {name} timed out")
            time.sleep(0.005)

    def err(e):
        return {"code": e.code, "status": e.status, "message": e.message, "rc": e.rc}

    PARAMS = [("weight", (7, 5), True), ("bias", (7,), True), ("frozen", (3,), False)]

    if mode == "ranks":
        import torch
        dtype = sys.argv[2]
        client = fsdpd.Client()  # everything from FSDPD_SOCKET/FSDPD_JOB/LOCAL_*
        L, rank = client.local_world_size, client.rank
        unit = client.register_unit("layer-" + dtype, PARAMS, param_dtype=dtype)

        def masters(r):  # what rank r writes into its master shard
            g = torch.Generator().manual_seed(1000 + r)
            return torch.randn(unit.shard_numel, generator=g, dtype=torch.float32)

        def grads(r):
            g = torch.Generator().manual_seed(2000 + r)
            return torch.randn(unit.padded_numel, generator=g, dtype=torch.float32)

        assert unit.master_shard.dtype == torch.float32
        unit.master_shard.copy_(masters(rank))
        barrier("masters-" + dtype, L)
        unit.unshard(step=1)
        whole = torch.cat([masters(r) for r in range(L)])
        if dtype == "float32":
            unsharded_ok = torch.equal(unit.unsharded, whole)
        else:
            unsharded_ok = torch.equal(unit.unsharded, whole.to(torch.bfloat16))
        assert torch.equal(unit.master, whole)  # every rank sees every shard
        unsharded_dtype = str(unit.unsharded.dtype)
        unit.reshard(step=1)
        assert unit.unsharded is None and unit.full_grad is None  # not lent now

        unit.unshard(step=1, backward=True)  # lends full_grad too
        full_grad_dtype = str(unit.full_grad.dtype)
        unit.full_grad.copy_(grads(rank).to(unit.full_grad.dtype))
        unit.reshard(step=1)
        unit.reduce_scatter_async(step=1)
        unit.wait()
        assert unit.full_grad is None  # the reduce took it back
        lo, hi = unit.shard * unit.shard_numel, (unit.shard + 1) * unit.shard_numel
        if dtype == "float32":
            mean = (grads(0) + grads(1)) / 2
            grad_ok = torch.equal(unit.grad_shard, mean[lo:hi])
        else:
            # The daemon's reduce: the sum rounded to bf16, scaled by 1/2 and rounded again.
            g = [grads(r).to(torch.bfloat16).float() for r in range(L)]
            mean = ((g[0] + g[1]).bfloat16().float() / 2).bfloat16().float()
            grad_ok = torch.equal(unit.grad_shard, mean[lo:hi])
        out = {"rank": rank, "shard": unit.shard, "numel": unit.numel,
               "padded_numel": unit.padded_numel, "shard_numel": unit.shard_numel,
               "param_offsets": unit.param_offsets, "unsharded_dtype": unsharded_dtype,
               "full_grad_dtype": full_grad_dtype, "unsharded_ok": unsharded_ok,
               "grad_ok": grad_ok, "session_id": client.session_id, "job": client.job,
               "grad_max_err": float((unit.grad_shard - mean[lo:hi]).abs().max())}
        client.close()
        print(json.dumps(out))

    elif mode == "pieces":
        # FSDP2's layout: each rank's piece of each parameter is torch.chunk's on dim 0.
        import torch
        client = fsdpd.Client()
        L, rank = client.local_world_size, client.rank
        unit = client.register_unit("pieces", PARAMS, layout="PER_PARAM")

        def full(seed):  # every parameter whole, as seed makes it
            g = torch.Generator().manual_seed(seed)
            return [torch.randn(shape, generator=g) for _, shape, _ in PARAMS]

        for piece, whole in zip(unit.master_pieces(), full(1)):
            piece.copy_(torch.chunk(whole, L)[rank])
        barrier("pieces", L)
        unit.unshard(step=1, backward=True)
        copies = [unit.unsharded[o:o + w.numel()].view(w.shape)
                  for o, w in zip(unit.param_offsets, full(1))]
        unsharded_ok = all(torch.equal(c, w) for c, w in zip(copies, full(1)))
        grads = full(100 + rank)
        for o, g in zip(unit.param_offsets, grads):
            unit.full_grad[o:o + g.numel()].copy_(g.reshape(-1))
        unit.reshard(step=1)
        unit.reduce_scatter(step=1)
        mean = [(a + b) / 2 for a, b in zip(full(100), full(101))]
        grad_ok = all(torch.equal(p, torch.chunk(m, L)[rank])
                      for p, m in zip(unit.grad_pieces(), mean))
        print(json.dumps({"layout": unit.layout, "unsharded_ok": unsharded_ok,
                          "grad_ok": grad_ok,
                          "shapes": [list(p.shape) for p in unit.master_pieces()],
                          "rows": unit.param_rows_per_shard}))
        client.close()

    elif mode == "memoryview":
        import struct
        with fsdpd.Client(job="mv", rank=0, local_world_size=1) as c:
            u = c.register_unit("u", [("w", (4, 3))])
            vals = [float(i) * 0.25 for i in range(u.shard_numel)]
            u.master_shard[:] = memoryview(struct.pack(f"{len(vals)}f", *vals)).cast("f")
            u.unshard()
            out = {"type": type(u.unsharded).__name__, "readonly": u.unsharded.readonly,
                   "unsharded": u.unsharded.tolist(), "expected": vals}
            u.reshard()
        print(json.dumps(out))

    elif mode == "stale-read":  # reads the unsharded buffer after its Reshard, as a bug would
        with fsdpd.Client(job="stale", rank=0, local_world_size=1) as c:
            u = c.register_unit("u", [("w", (4, 3))])
            u.unshard()
            kept = u.unsharded
            u.reshard()
            print("read", kept[0], flush=True)
        print(json.dumps({}))

    elif mode == "errors":
        out = {}
        try:
            fsdpd.Client(job="no spaces allowed", rank=0, local_world_size=1)
        except fsdpd.Error as e:
            out["bad_job"] = err(e)
        with fsdpd.Client(job="errs", rank=0, local_world_size=1) as c:
            c.register_unit("u", PARAMS)
            try:
                c.register_unit("u", PARAMS[:1])
            except fsdpd.Error as e:
                out["mismatch"] = err(e)
        print(json.dumps(out))

    elif mode == "token":
        # Two ranks of one job, the token from the environment; a third Client with another.
        out = {}
        with fsdpd.Client(job="tok", rank=0, local_world_size=2) as c:
            try:
                fsdpd.Client(job="tok", rank=1, local_world_size=2, job_token="guessed")
            except fsdpd.Error as e:
                out["other_token"] = err(e)
            with fsdpd.Client(job="tok", rank=1, local_world_size=2) as same:
                out["same_token"] = same.session_id != c.session_id
        print(json.dumps(out))

    elif mode == "restart":
        # Holds a unit while the test restarts the daemon under it: the new daemon knows
        # neither the session nor the unit.
        c = fsdpd.Client(job="restart", rank=0, local_world_size=2, wait_for_ready=True)
        u = c.register_unit("u", PARAMS)
        v = c.register_unit("v", PARAMS)
        # Two started Unshards wait for rank 1, which never comes, when the daemon goes:
        # the first wait finds the fast path's channel closed and asks over gRPC, and so does
        # the second, whose fast path is gone by then.
        u.unshard_async(1)
        v.unshard_async(1)
        print("ready", flush=True)
        sys.stdin.readline()
        out = {}
        for name, unit in (("wait_u", u), ("wait_v", v)):
            try:
                unit.wait()
                out[name] = None
            except fsdpd.Error as e:
                out[name] = err(e)
        deadline = time.monotonic() + 10
        while "unshard" not in out:
            try:
                u.unshard()
                out["unshard"] = None
            except fsdpd.Error as e:
                # The first call may find the old connection broken; the next reconnects.
                if e.code != "FSDP_E_UNAVAILABLE" or time.monotonic() > deadline:
                    out["unshard"] = err(e)
                time.sleep(0.05)
        print(json.dumps(out))

    elif mode == "context":
        # Prints the session id while attached, waits, then leaves the with block.
        with fsdpd.Client() as c:
            print(json.dumps({"session_id": c.session_id, "job": c.job, "rank": c.rank,
                              "local_world_size": c.local_world_size,
                              "generation": c.generation}), flush=True)
            sys.stdin.readline()
        print(json.dumps({"closed": c.closed}), flush=True)
        sys.stdin.readline()
''')


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    barriers = tmp_path / "barriers"
    barriers.mkdir()

    def env_for(d, **extra):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("FSDPD_")
               and k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")}
        env.update(PYTHONPATH=str(SOURCE_DIR / "python"), FSDPD_LIB=str(LIB),
                   FSDPD_SOCKET=str(d.socket_path), BARRIER_DIR=str(barriers))
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def start(d, *args, **extra):
        return subprocess.Popen([PYTHON, str(path), *args], env=env_for(d, **extra),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=tmp_path)

    procs = []

    def spawn(d, *args, **extra):
        p = start(d, *args, **extra)
        procs.append(p)
        return p

    yield spawn
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def result(p, stdin=None):
    out, err = p.communicate(stdin, timeout=CHILD_TIMEOUT)
    assert p.returncode == 0, f"worker exited {p.returncode}:\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def sessions(d):
    return {s.session_id: s for s in d.status().sessions}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_ranks_unshard_reduce_scatter(fsdpd, worker, dtype):
    d = fsdpd(*DAEMON_ARGS)
    procs = [worker(d, "ranks", dtype, FSDPD_JOB="pyjob", LOCAL_RANK=r, LOCAL_WORLD_SIZE=2)
             for r in range(2)]
    outs = [result(p) for p in procs]
    torch_dtype = f"torch.{dtype}"
    for r, o in enumerate(outs):
        assert o["rank"] == r and o["shard"] == r and o["job"] == "pyjob"
        assert (o["numel"], o["padded_numel"], o["shard_numel"]) == (45, 46, 23)
        assert o["param_offsets"] == [0, 35, 42]
        assert o["unsharded_dtype"] == torch_dtype and o["full_grad_dtype"] == torch_dtype
        assert o["unsharded_ok"], f"rank {r}: unsharded != concatenated masters ({dtype})"
        assert o["grad_ok"], f"rank {r}: grad_shard != mean of grads, max err {o['grad_max_err']}"
    assert outs[0]["session_id"] != outs[1]["session_id"]
    # Both closed: their sessions are gone, the job's unit stays.
    assert not sessions(d)
    assert d.fsdpctl("units").returncode == 0


def test_per_param_pieces_are_fsdp2s_shards(fsdpd, worker):
    """A PER_PARAM unit's pieces of the master and gradient shards are each rank's
    torch.chunk of each parameter, shaped: written there, the Unshard gives the parameters
    whole; the mean of the ranks' gradients, reduced, is each piece's chunk of it."""
    d = fsdpd(*DAEMON_ARGS)
    procs = [worker(d, "pieces", FSDPD_JOB="pieces", LOCAL_RANK=r, LOCAL_WORLD_SIZE=2)
             for r in range(2)]
    outs = [result(p) for p in procs]
    assert [o["shapes"] for o in outs] == [[[4, 5], [4], [2]], [[3, 5], [3], [1]]]
    for o in outs:
        assert o["layout"] == "PER_PARAM" and o["rows"] == [4, 4, 2]
        assert o["unsharded_ok"] and o["grad_ok"], o


def test_memoryviews_without_torch(fsdpd, worker):
    d = fsdpd(*DAEMON_ARGS)
    o = result(worker(d, "memoryview"))
    assert o["type"] == "memoryview" and o["readonly"]
    assert o["unsharded"] == o["expected"]


def test_fences_are_a_debugging_aid(fsdpd, worker):
    """FSDP_FENCES=1 makes a buffer given back inaccessible at once: a read of the unsharded
    copy after its Reshard faults. Off by default: a fence is a page-table walk of the whole
    unit and a TLB shootdown across the trainer's threads (a fifth of the CPU of a 64 MiB
    reduce-scatter), and the area keeps its mapping for the buffer's next lending."""
    d = fsdpd(*DAEMON_ARGS)
    fenced = worker(d, "stale-read", FSDP_FENCES=1)
    out, _ = fenced.communicate(timeout=CHILD_TIMEOUT)
    assert fenced.returncode == -signal.SIGSEGV and "read" not in out, out
    assert result(worker(d, "stale-read")) == {}


def test_errors_carry_code_status_and_message(fsdpd, worker):
    d = fsdpd(*DAEMON_ARGS)
    o = result(worker(d, "errors"))
    bad = o["bad_job"]
    assert (bad["code"], bad["status"]) == ("FSDP_E_INVALID_ARGUMENT", "INVALID_ARGUMENT")
    assert "no spaces allowed" in bad["message"] and "job" in bad["message"]
    mismatch = o["mismatch"]
    assert (mismatch["code"], mismatch["status"]) == ("FSDP_E_FAILED_PRECONDITION",
                                                       "FAILED_PRECONDITION")
    assert "unit 'u'" in mismatch["message"]


def test_the_job_token_comes_from_the_environment(fsdpd, worker):
    d = fsdpd(*DAEMON_ARGS)
    o = result(worker(d, "token", FSDPD_JOB_TOKEN="launcher-secret"))
    e = o["other_token"]
    assert (e["code"], e["status"]) == ("FSDP_E_PERMISSION_DENIED", "PERMISSION_DENIED"), e
    assert "field 'job_token' is not the job token job 'tok' was first attached with" in \
        e["message"], e
    assert "launcher-secret" not in e["message"] and "guessed" not in e["message"]
    assert o["same_token"]


def test_unknown_session_and_unit_after_restart(fsdpd, worker):
    d = fsdpd(*DAEMON_ARGS)
    p = worker(d, "restart")
    assert p.stdout.readline().strip() == "ready", p.stderr.read()
    d.kill()
    fsdpd(*DAEMON_ARGS, run_dir=d.run_dir, name="fsdpd-restarted")
    o = result(p, "go\n")
    for name in ("wait_u", "wait_v"):  # the old connection may be the one to say so
        assert o[name]["status"] in ("NOT_FOUND", "UNAVAILABLE"), o[name]
    e = o["unshard"]
    assert (e["code"], e["status"]) == ("FSDP_E_NOT_FOUND", "NOT_FOUND"), e
    assert "not attached" in e["message"]


def test_environment_defaults_and_context_manager_detaches(fsdpd, worker):
    d = fsdpd(*DAEMON_ARGS)
    p = worker(d, "context", FSDPD_JOB="envjob", LOCAL_RANK=1, LOCAL_WORLD_SIZE=3,
               TORCHELASTIC_RESTART_COUNT=2)
    attached = json.loads(p.stdout.readline())
    assert attached == {"session_id": attached["session_id"], "job": "envjob", "rank": 1,
                        "local_world_size": 3, "generation": 2}
    s = sessions(d)[attached["session_id"]]
    assert (s.job, s.local_rank, s.local_world_size, s.generation, s.pid) == \
        ("envjob", 1, 3, 2, p.pid)
    p.stdin.write("\n")
    p.stdin.flush()
    assert json.loads(p.stdout.readline()) == {"closed": True}
    # The process still lives: the session is gone because the with block detached it.
    assert p.poll() is None
    assert attached["session_id"] not in sessions(d)
    p.communicate("\n", timeout=CHILD_TIMEOUT)
    assert p.returncode == 0


def test_close_is_quiet_when_the_daemon_is_gone(fsdpd, worker):
    """A trainer closing its client after the daemon went away (Ctrl-C reaching both) ends
    without an error: its session went with the daemon."""
    d = fsdpd(*DAEMON_ARGS)
    p = worker(d, "context", FSDPD_JOB="gone", LOCAL_RANK=0, LOCAL_WORLD_SIZE=1)
    json.loads(p.stdout.readline())
    d.kill()
    p.stdin.write("\n")
    p.stdin.flush()
    assert json.loads(p.stdout.readline()) == {"closed": True}
    p.communicate("\n", timeout=CHILD_TIMEOUT)
    assert p.returncode == 0
