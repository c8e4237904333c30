"""The CUDA backend on one GPU, through fsdpd.torch: trainers sharing the daemon's GPU train
like one process on that GPU, a trainer killed in the middle of a collective leaves the
daemon and the other trainer whole, a checkpoint of the GPU's job brings it back on a new
daemon and moves to a host job and back, and two daemons on the GPU, as two hosts, train like one process over the rings
among hosts staged through pinned host memory.

Needs a GPU and a python3 with CUDA torch (FSDP_TEST_PYTHON, default python3 on PATH, which
runs the trainers); every test skips otherwise, and the file exits 77 when run as a CTest test
without them. Self-contained on purpose: a GPU machine may have none of Debian's packages, so
nothing here needs grpcio or the generated protobuf modules (the daemon is asked through
fsdpctl).
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from worker_records import final as _final, finish, losses as _losses  # noqa: E402

SOURCE_DIR = Path(os.environ.get("FSDP_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BUILD_DIR = Path(os.environ.get("FSDP_BUILD_DIR", SOURCE_DIR / "build"))
PYTHON = os.environ.get("FSDP_TEST_PYTHON") or shutil.which("python3") or sys.executable
WORKER = SOURCE_DIR / "tests" / "integration" / "shard_model_worker.py"
STEPS = 4
CHILD_TIMEOUT = 180
# Ports 0 for health and metrics: two daemons run at once.
DAEMON_ARGS = ("--set", "memory.job_limit=256MiB", "--health-listen", "127.0.0.1:0",
               "--metrics-listen", "127.0.0.1:0")


def _cuda_torch():
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([PYTHON, "-c", probe], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _cuda_torch(),
                                reason=f"{PYTHON} has no torch that sees a GPU")


class Daemon:
    def __init__(self, tmp_path, *args, backend="cuda"):
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.run_dir = tmp_path / "run"
        self.socket_path = self.run_dir / "fsdpd.sock"
        self.log_path = tmp_path / "fsdpd.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FSDPD_")}
        self.proc = subprocess.Popen(
            [str(BUILD_DIR / "bin" / "fsdpd"), "--run-dir", str(self.run_dir), "--backend",
             backend, *DAEMON_ARGS, *args],
            stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 30
        while "serving on" not in self.log():
            assert self.proc.poll() is None, f"fsdpd exited {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"fsdpd did not serve in 30 s:\n{self.log()}"
            time.sleep(0.05)

    def log(self):
        return self.log_path.read_text(errors="replace")

    def fsdpctl(self, *args, ok=(0,)):
        r = subprocess.run([str(BUILD_DIR / "bin" / "fsdpctl"), "--socket", str(self.socket_path),
                            *args], capture_output=True, text=True, timeout=15)
        assert r.returncode in ok, r.stderr
        return r.stdout

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=30)
        assert rc == 0, self.log()


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()


def _start(d, mode, world, rank, *args, hosts=1, restarts=0, device="cuda", steps=STEPS):
    """A worker: local rank `rank` of `world` on daemon d (global rank host * world + rank
    when there are several hosts), or the reference when d is None; device cpu for a
    daemon whose backend is the host's."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FSDPD_") and
           k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(SOURCE_DIR / "python"), FSDPD_LIB=str(BUILD_DIR / "lib" / "libfsdp.so"),
               FSDP_SOURCE_DIR=str(SOURCE_DIR), OMP_NUM_THREADS="1",
               TORCHELASTIC_RESTART_COUNT=str(restarts))
    if d is not None:
        env.update(FSDPD_SOCKET=str(d.socket_path), FSDPD_JOB="train", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world))
    if hosts > 1:
        env.update(LOCAL_RANK=str(rank % world), RANK=str(rank), WORLD_SIZE=str(world * hosts))
    return subprocess.Popen([PYTHON, str(WORKER), mode, "--steps", str(steps), "--device", device,
                             *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(procs, expect_rc=0):
    return finish(procs, CHILD_TIMEOUT, expect_rc)


def _worst(state, ref_state):
    """The largest difference of any parameter, relative to that tensor's largest value."""
    assert list(state) == list(ref_state)
    return max(max(abs(a - b) for a, b in zip(state[k], v)) / max(max(abs(x) for x in v), 1e-6)
               for k, v in ref_state.items())


def _worst_against(ranks, ref):
    """The worst relative difference from the reference of the ranks' mean loss, step by
    step, and of any rank's final parameters."""
    want = _losses(ref)
    worst_loss = max(abs(sum(_losses(r)[s] for r in ranks) / len(ranks) - want[s]) /
                     abs(want[s]) for s in want)
    return worst_loss, max(_worst(_final(r), _final(ref)) for r in ranks)


def _report(**figures):
    """One line the GPU run's log keeps for docs/PERFORMANCE.md."""
    print("RESULT " + json.dumps(figures), file=sys.stderr)


def test_two_trainers_sharing_the_gpu_train_like_one_process(daemon):
    """fp32 FULL_SHARD, 2 ranks on the daemon's GPU against one process on the whole batch
    on the same GPU (the ranks' halves and the reduce change the order of sums, hence a
    tolerance, the CPU test's)."""
    procs = [_start(daemon, "rank", 2, r) for r in range(2)]
    procs.append(_start(None, "reference", 2, 0))
    *ranks, ref = _finish(procs)
    want = _losses(ref)
    worst_loss, worst_param = _worst_against(ranks, ref)
    _report(test="fp32 equivalence, 2 trainers on one GPU", steps=STEPS, worst_loss_rel=worst_loss,
            worst_param_rel=worst_param, loss_first=want[1], loss_last=want[STEPS])
    assert abs(want[STEPS] - want[1]) > 1e-3 * abs(want[1])  # training moved
    assert worst_loss <= 1e-5 and worst_param <= 1e-5, (worst_loss, worst_param)
    assert "backend cuda on GPU 0" in daemon.log()
    assert json.loads(daemon.fsdpctl("--json", "status"))["backend"] == "cuda"
    # The reduces ran on the GPU (an fp32 copy is the masters themselves: no cast).
    unit = json.loads(daemon.fsdpctl("--json", "unit", "blocks.0"))
    assert unit["last_reduce_us"] > 0 and unit["last_gather_us"] == 0, unit


def test_bf16_on_the_gpu_is_the_mixed_precision_reference_bit_for_bit(daemon):
    """bf16 parameters: the daemon's cast and reduce kernels on the GPU perform the roundings
    the reference performs with torch on the same GPU, rank by rank, so every loss and every
    final parameter is equal, if cuBLAS computes each rank's slice alike in both."""
    procs = [_start(daemon, "rank", 2, r, "--param-dtype", "bf16") for r in range(2)]
    procs.append(_start(None, "reference", 2, 0, "--param-dtype", "bf16", "--world", "2"))
    *ranks, ref = _finish(procs)
    want = {rec["step"]: rec["rank_losses"] for rec in ref if "step" in rec}
    exact_losses = all({s: want[s][r] for s in want} == _losses(rec) for r, rec in enumerate(ranks))
    exact_params = all(_final(rec) == _final(ref) for rec in ranks)
    _report(test="bf16 exact, 2 trainers on one GPU", exact_losses=exact_losses,
            exact_params=exact_params,
            worst_param_rel=max(_worst(_final(r), _final(ref)) for r in ranks))
    assert want[STEPS] != want[1]
    assert exact_losses and exact_params
    unit = json.loads(daemon.fsdpctl("--json", "unit", "blocks.0"))
    assert unit["last_gather_us"] > 0 and unit["last_reduce_us"] > 0, unit


def test_a_trainer_killed_mid_collective_leaves_the_daemon_and_the_job_whole(daemon):
    """Rank 1 SIGKILLs itself as the backward of step 3 starts, its GPU memory mapped;
    rank 0, in the collective, hears ABORTED naming it. Both restart, resume from the
    daemon's GPU memory at step 3, and end where one process on the whole batch ends."""
    first = [_start(daemon, "rank", 2, 0), _start(daemon, "rank", 2, 1, "--kill-at-step", "3")]
    ref = _start(None, "reference", 2, 0)
    r0, r1 = _finish(first, expect_rc=None)
    assert first[1].returncode == -9 and first[0].returncode == 3
    error = next(r for r in r0 if "error" in r)
    assert error["status"] == "ABORTED"
    assert re.search(r"local rank(\(s\))? 1 of job 'train' (is gone|ended their session)",
                     error["error"]), error
    deadline = time.monotonic() + 10
    while json.loads(daemon.fsdpctl("--json", "status"))["sessions"]:
        assert time.monotonic() < deadline, "the sessions did not end"
        time.sleep(0.05)
    (job,) = json.loads(daemon.fsdpctl("--json", "status"))["memory"]["jobs"]
    assert [pool["lent"] for pool in job["gradients"]] == [0, 0] and job["copies"]["lent"] == 0

    again = [_start(daemon, "rank", 2, r, restarts=1) for r in range(2)]
    s0, s1 = _finish(again)
    (ref,) = _finish([ref])
    for records in (s0, s1):
        assert records[0]["resumed"] and records[0]["start"] == 3
    want = _losses(ref)
    for step in range(1, STEPS + 1):
        got = [{**_losses(a), **_losses(b)}[step] for a, b in ((r0, s0), (r1, s1))]
        assert abs(sum(got) / 2 - want[step]) <= 1e-5 * abs(want[step]), (step, got, want)
    assert max(_worst(_final(s), _final(ref)) for s in (s0, s1)) <= 1e-5


def test_a_checkpoint_of_the_gpus_job_brings_it_back_on_a_new_daemon(tmp_path):
    """The ranks train 2 steps on the daemon's GPU and save a checkpoint (the masters copied
    from the GPU into host staging, then written); that daemon goes. On a new one, new ranks
    load it (read into staging, then copied onto the GPU) and train steps 3 and 4: they end
    where one process on the whole batch ends."""
    saves = tmp_path / "checkpoints"
    ref = _start(None, "reference", 2, 0)
    d = Daemon(tmp_path / "first")
    try:
        first = _finish([_start(d, "rank", 2, r, "--save-at-step", "2", "--checkpoint",
                                str(saves)) for r in range(2)])
    finally:
        d.stop()
    assert all({"saved": 2} in records for records in first)
    d = Daemon(tmp_path / "again")
    try:
        again = _finish([_start(d, "rank", 2, r, "--load", str(saves)) for r in range(2)])
    finally:
        d.stop()
    (ref,) = _finish([ref])
    for records in again:
        assert records[0]["start"] == 3 and sorted(_losses(records)) == [3, 4]
    want = _losses(ref)
    for step in range(1, STEPS + 1):
        got = [{**_losses(a), **_losses(b)}[step] for a, b in zip(first, again)]
        assert abs(sum(got) / 2 - want[step]) <= 1e-5 * abs(want[step]), (step, got, want)
    worst = max(_worst(_final(s), _final(ref)) for s in again)
    _report(test="checkpoint of a GPU job, saved at step 2 and loaded on a new daemon",
            worst_param_rel=worst)
    assert worst <= 1e-5


def _leg(tmp_path, backend, *args, steps):
    """Two ranks on a daemon of that backend (the host's ranks compute on the CPU), its
    records once it is gone."""
    d = Daemon(tmp_path, backend=backend)
    device = "cuda" if backend == "cuda" else "cpu"
    try:
        return _finish([_start(d, "rank", 2, r, "--optim", "adamw", *args, device=device,
                               steps=steps) for r in range(2)])
    finally:
        d.stop()


def test_a_gpus_checkpoint_loads_into_a_host_job_and_back(tmp_path):
    """A checkpoint does not know where it was made: the GPU's job saves at step 2 (the
    masters and the daemon's AdamW state copied off the GPU), a host daemon's job loads it
    and holds the same masters bit for bit, trains step 3 on the CPU and saves; a GPU's job
    loads that and holds step 3's masters bit for bit."""
    on_gpu, on_host = tmp_path / "from-gpu", tmp_path / "from-host"
    saved = _leg(tmp_path / "gpu", "cuda", "--save-at-step", "2", "--checkpoint", str(on_gpu),
                 steps=STEPS)
    loaded = _leg(tmp_path / "host", "host", "--load", str(on_gpu), steps=2)
    stepped = _leg(tmp_path / "host-step", "host", "--load", str(on_gpu), "--save-at-step", "3",
                   "--checkpoint", str(on_host), steps=3)
    back = _leg(tmp_path / "gpu-again", "cuda", "--load", str(on_host), steps=3)
    assert all({"saved": 2} in r for r in saved) and all({"saved": 3} in r for r in stepped)
    assert all(r[0]["start"] == 3 for r in loaded) and all(r[0]["start"] == 4 for r in back)
    assert all(_final(r) == _final(saved[0]) for r in saved + loaded)
    assert all(_final(r) == _final(stepped[0]) for r in stepped + back)
    assert _final(stepped[0]) != _final(saved[0])  # step 3 moved the masters
    _report(test="a GPU job's checkpoint into a host job and back", exact=True)


@pytest.mark.parametrize("clip", [False, True], ids=["adamw", "adamw-clipped"])
def test_the_daemons_optimizer_on_the_gpu_trains_like_torch_optim(daemon, clip):
    """fsdpd.optim's AdamW stepping the masters on the daemon's GPU (the host kernels'
    arithmetic, as tests/gpu/test_cuda_kernels.c checks) against one process on the whole
    batch on the same GPU, whose gradients are the ranks' reduced as the daemon reduces them
    and whose step is torch's AdamW on a CPU copy with the IEEE root: the host's arithmetic
    (torch's CUDA AdamW contracts a*b+c into one rounding, 1e-4 away after 4 steps). Bit
    for bit; clipped to a norm of 0.5, the GPU sums the squares in an order of its own,
    whose last bits the clip's scale carries, hence a tolerance there."""
    args = ("--optim", "adamw", *(("--clip",) if clip else ()))
    procs = [_start(daemon, "rank", 2, r, *args) for r in range(2)]
    procs.append(_start(None, "reference", 2, 0, *args, "--world", "2",
                        *(("--daemon-clip",) if clip else ())))
    *ranks, ref = _finish(procs)
    want = _losses(ref)
    worst_loss, worst_param = _worst_against(ranks, ref)
    _report(test=f"the daemon's AdamW on the GPU{', clipped' if clip else ''}", steps=STEPS,
            worst_loss_rel=worst_loss, worst_param_rel=worst_param)
    assert abs(want[STEPS] - want[1]) > 1e-3 * abs(want[1])  # training moved
    bound = 1e-5 if clip else 0.0
    assert worst_loss <= bound and worst_param <= bound, (worst_loss, worst_param)
    unit = json.loads(daemon.fsdpctl("--json", "unit", "blocks.0"))
    assert unit["optimizer_steps"] == STEPS, unit


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD"])
def test_two_daemons_on_the_gpu_train_like_one_process_over_staged_rings(tmp_path, strategy):
    """Two daemons on the one GPU as two hosts, 2 trainers each (NCCL refuses two ranks on
    one GPU; the rings among hosts need none): FULL_SHARD's reduce-scatter and all-gather
    and HYBRID_SHARD's all-reduce among replicas move pinned host buffers staged from the
    GPU, over UCX. Each trainer takes the slice of the batch of its global rank, and the
    run equals one process on the whole batch, within the CPU test's tolerance."""
    hosts = ",".join(f"127.0.0.1:{p}" for p in _free_ports(2))
    daemons = [Daemon(tmp_path / f"host{h}", "--hosts", hosts, "--host-rank", str(h),
                      "--local-world-size", "2", "--set", "peer.insecure=true")
               for h in range(2)]
    try:
        deadline = time.monotonic() + 30
        while not all(json.loads(d.fsdpctl("--json", "peers", ok=(0, 3)))["ready"]
                      for d in daemons):
            assert time.monotonic() < deadline, [d.log() for d in daemons]
            time.sleep(0.05)
        procs = [_start(daemons[g // 2], "rank", 2, g, "--strategy", strategy, "--features",
                        hosts=2) for g in range(4)]
        procs.append(_start(None, "reference", 4, 0, "--features"))
        *ranks, ref = _finish(procs)
        for d in daemons:
            (job,) = json.loads(d.fsdpctl("--json", "status"))["memory"]["jobs"]
            assert job["ring_staging_buffers"] > 0, job
    finally:
        for d in daemons:
            d.stop()
    worst_loss, worst_param = _worst_against(ranks, ref)
    _report(test=f"{strategy}, 2 daemons x 2 trainers on one GPU, staged rings", steps=STEPS,
            worst_loss_rel=worst_loss, worst_param_rel=worst_param)
    assert worst_loss <= 1e-5 and worst_param <= 1e-5, (worst_loss, worst_param)


if __name__ == "__main__":
    if not _cuda_torch():
        print(f"skipped: {PYTHON} has no torch that sees a GPU")
        sys.exit(77)
    # -s: the RESULT lines; further arguments (-k EXPR) choose tests.
    sys.exit(pytest.main(["-q", "-s", "-p", "no:cacheprovider", __file__, *sys.argv[1:]]))
