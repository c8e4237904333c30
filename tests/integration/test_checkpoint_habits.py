"""Checkpoints as PyTorch users take them (issue 30 item 4), through fsdpd.torch against a
real fsdpd: a checkpoint loads into a job of another name (a new torchrun launch has a new
run id), with or without the daemon's optimizer on either side; a model's persistent
buffers (BatchNorm's running statistics) are in every checkpoint and in `fsdpctl export`,
whose file loads with load_state_dict(strict=True); the daemon's own saves of a job whose
trainers use a torch optimizer say, at the save and at the resume, that its state is not
in them. Each trainer is a child process under the tests' interpreter (.venv/bin/python),
as in test_shard_model.py, whose helpers it uses.
"""

import json
import shutil
import subprocess

from fsdpd_harness import SOURCE_DIR, built_with, fsdpd, poll, run_fsdpctl  # noqa: F401
from test_shard_model import CHILD_TIMEOUT, DAEMON_ARGS, LIB, PYTHON  # noqa: F401
import os

import pytest

pytestmark = pytest.mark.skipif(built_with("FSDP_SANITIZE"),
                                reason="ASan/UBSan build: libfsdp.so would need libasan "
                                       "preloaded into the interpreter")

# One trainer: argv[1] is a JSON plan {"optim": "torch" | "daemon" | "none", "load": DIR,
# "load_optim": bool, "steps": N, "save": DIR, "save_optim": bool, "eval": bool}; it prints
# one JSON line of what it saw.
TRAINER = r'''
import json, os, sys, warnings
import torch
from torch import nn
import fsdpd, fsdpd.torch, fsdpd.optim

torch.manual_seed(0)
torch.set_num_threads(1)
plan = json.loads(sys.argv[1])
warnings.simplefilter("always")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


client = fsdpd.Client()
model = fsdpd.torch.shard_model(Net(), client, wrap={nn.Linear})
rank, world = client.rank, client.local_world_size
if plan["optim"] == "daemon":
    opt = fsdpd.optim.AdamW(model, lr=0.01)
elif plan["optim"] == "torch":
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
else:
    opt = None
out = {"resumed": model.resumed, "warnings": []}


def buffers():
    return {k: v.tolist() for k, v in model.module.state_dict().items()
            if k.startswith("bn.running") or k.endswith("num_batches_tracked")}


with warnings.catch_warnings(record=True) as caught:
    try:
        if plan.get("load"):
            out["loaded"] = model.load_checkpoint(
                plan["load"], optimizer=opt if plan.get("load_optim") else None)
            out["loaded_buffers"] = buffers()
    except fsdpd.Error as e:
        out["error"] = [e.status, e.message]
    if plan.get("eval"):
        model.eval()
        with torch.no_grad():
            model(torch.zeros(2, 4))
        out["eval_buffers"] = buffers()
        model.train()
    losses = {}
    for step in range(model.completed_steps + 1,
                      model.completed_steps + 1 + plan.get("steps", 0)):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        n = 8 // world
        loss = nn.functional.mse_loss(model(x[rank * n:(rank + 1) * n]),
                                      y[rank * n:(rank + 1) * n])
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        losses[step] = loss.item()
        out.setdefault("buffers", {})[step] = buffers()
    out["losses"] = losses
    if plan.get("save"):
        out["saved"] = model.save_checkpoint(
            plan["save"], optimizer=opt if plan.get("save_optim") else None)
    out["warnings"] = [str(w.message) for w in caught]
if opt is not None and plan["optim"] == "torch":
    out["opt_steps"] = sorted({float(s["step"]) for s in opt.state_dict()["state"].values()})
if opt is not None and plan["optim"] == "daemon":
    out["opt_steps"] = sorted({int(s["step"]) for s in opt.state_dict()["state"].values()})
out["state"] = {k: v.tolist() for k, v in model.full_state_dict().items()}
client.close()
print(json.dumps(out))
'''

# Loads an exported safetensors file into a fresh Net with strict=True (argv: the file).
STRICT_LOAD = r'''
import json, struct, sys
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)

raw = open(sys.argv[1], "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
header = json.loads(raw[8:8 + n])
header.pop("__metadata__", None)
state = {}
for name, t in header.items():
    assert t["dtype"] == "F32", t
    a, b = t["data_offsets"]
    state[name] = torch.frombuffer(bytearray(raw[8 + n + a:8 + n + b]),
                                   dtype=torch.float32).reshape(t["shape"])
net = Net()
net.load_state_dict(state, strict=True)
print(json.dumps({k: v.tolist() for k, v in net.state_dict().items()}))
'''


def _trainers(d, tmp_path, job, plan, world=1):
    """world local ranks of job on daemon d following plan; each one's JSON record and
    stderr."""
    script = tmp_path / "habits_trainer.py"
    script.write_text(TRAINER)
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("FSDPD_", "TORCHELASTIC_")) and
               k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE")}
        env.update(PYTHONPATH=str(SOURCE_DIR / "python"), FSDPD_LIB=str(LIB),
                   FSDPD_SOCKET=str(d.socket_path), FSDPD_JOB=job, LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([PYTHON, str(script), json.dumps(plan, default=str)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=CHILD_TIMEOUT)
        assert p.returncode == 0, err[-3000:]
        outs.append((json.loads(out.strip().splitlines()[-1]), err))
    return outs


def _close(a, b, tol=1e-6):
    return json.dumps(a) == json.dumps(b) if tol == 0 else all(
        abs(x - y) <= tol * max(1.0, abs(x)) for x, y in zip(_flat(a), _flat(b)))


def _flat(v):
    if isinstance(v, dict):
        return [x for k in sorted(v) for x in _flat(v[k])]
    if isinstance(v, list):
        return [x for e in v for x in _flat(e)]
    return [float(v)]


def test_a_checkpoint_loads_into_a_job_of_another_name(fsdpd, tmp_path):
    """Job 'ck' (2 ranks, torch's AdamW) saves step 2 with its optimizer; job 'ck2', a new
    launch of another name, loads the directory's newest (another job's: the daemon's log
    says whose) with its optimizer and goes on at step 3 from the same parameters, buffers
    and moments. A job that saved into the same directory takes its own newest there, and
    another's step directory by its path. In checkpoint.dir/<job>/, where the daemon reads
    with its own rights, another job's checkpoint is still refused."""
    d = fsdpd(*DAEMON_ARGS, "--set", f"checkpoint.dir={tmp_path / 'daemon'}")
    shared = tmp_path / "shared"
    (first, _), _ = _trainers(d, tmp_path, "ck", {"optim": "torch", "steps": 2,
                                                  "save": shared, "save_optim": True}, world=2)
    assert first["saved"] == 2 and first["opt_steps"] == [2.0]
    (again, _), _ = _trainers(d, tmp_path, "ck2", {"optim": "torch", "load": shared,
                                                   "load_optim": True, "steps": 1}, world=2)
    assert again["loaded"] == 2 and list(again["losses"]) == ["3"]
    assert again["loaded_buffers"] == first["buffers"]["2"]  # rank 0's
    assert again["opt_steps"] == [3.0]  # its moments went on
    poll(lambda: "job 'ck2': checkpoint of step 2 of job 'ck' loaded" in d.stderr(), 5,
         what="the load's log line naming the job that saved it")

    # Several jobs in one directory: the job's own newest, and another's by its path.
    (own, _), = _trainers(d, tmp_path, "ck3", {"optim": "none", "steps": 1, "save": shared})
    assert own["saved"] == 1
    (mine, _), = _trainers(d, tmp_path, "ck3", {"optim": "none", "load": shared})
    (theirs, _), = _trainers(d, tmp_path, "ck3",
                             {"optim": "none", "load": shared / "step-2"})
    assert (mine["loaded"], theirs["loaded"]) == (1, 2)
    assert _close(theirs["state"], first["state"], 0)

    # With the daemon's rights, in checkpoint.dir/<job>/: the job's own only.
    own_dir = tmp_path / "daemon" / "ck4"
    own_dir.mkdir(parents=True)
    shutil.copytree(shared / "step-2", own_dir / "step-2")
    (step_dir, _), = _trainers(d, tmp_path, "ck4", {"optim": "none", "load": own_dir / "step-2"})
    (newest, _), = _trainers(d, tmp_path, "ck4", {"optim": "none", "load": own_dir})
    assert step_dir["error"][0] == "FAILED_PRECONDITION"
    assert "is of job 'ck', not 'ck4'" in step_dir["error"][1], step_dir
    assert newest["error"][0] == "NOT_FOUND"
    assert "no complete checkpoint of job 'ck4'" in newest["error"][1], newest


def test_the_daemons_optimizer_state_loads_into_a_torch_optimizer_job_and_back(fsdpd,
                                                                              tmp_path):
    """A checkpoint saved with fsdpd.optim's AdamW loads into a job with torch's AdamW (its
    masters; the daemon's state left out, said in the log; the torch optimizer starts
    afresh with a warning) and into one with no optimizer; one saved with torch's AdamW
    loads into a job with fsdpd.optim's, whose state then starts at zero, step 0 (said in
    the log), and which trains on from there. Before, each was FAILED_PRECONDITION for the
    arrays' mismatch."""
    d = fsdpd(*DAEMON_ARGS)
    daemon_dir, torch_dir = tmp_path / "by-daemon", tmp_path / "by-torch"
    (saved, _), = _trainers(d, tmp_path, "a", {"optim": "daemon", "steps": 2,
                                               "save": daemon_dir})
    assert saved["saved"] == 2 and saved["opt_steps"] == [2]
    (into_torch, _), = _trainers(d, tmp_path, "b", {"optim": "torch", "load": daemon_dir,
                                                    "load_optim": True, "steps": 1})
    assert into_torch["loaded"] == 2 and into_torch["opt_steps"] == [1.0]
    assert any("holds no torch optimizer state (optimizer.pt): the AdamW starts afresh" in w
               for w in into_torch["warnings"]), into_torch["warnings"]
    (into_none, _), = _trainers(d, tmp_path, "c", {"optim": "none", "load": daemon_dir})
    assert into_none["loaded"] == 2 and _close(into_none["state"], saved["state"], 0)
    poll(lambda: "job 'b': the daemon optimizer's state of" in d.stderr(), 5,
         what="the log line of the state left out")

    (by_torch, _), = _trainers(d, tmp_path, "d", {"optim": "torch", "steps": 2,
                                                  "save": torch_dir, "save_optim": True})
    (into_daemon, _), = _trainers(d, tmp_path, "e", {"optim": "daemon", "load": torch_dir,
                                                     "steps": 1})
    assert into_daemon["loaded"] == 2 and list(into_daemon["losses"]) == ["3"]
    assert into_daemon["opt_steps"] == [1]  # from step 0: the state started at zero
    assert "holds no optimizer state: the daemon's optimizer starts at zero, step 0" in \
        d.stderr()


def test_buffers_are_in_checkpoints_and_the_export_loads_strictly(fsdpd, tmp_path):
    """BatchNorm's running statistics (and num_batches_tracked) are saved with the masters
    (global rank 0's), come back with load_checkpoint, and are in `fsdpctl export`'s file,
    which a fresh module loads with load_state_dict(strict=True)."""
    d = fsdpd(*DAEMON_ARGS)
    ckpt = tmp_path / "ckpt"
    (rank0, _), (rank1, _) = _trainers(d, tmp_path, "bn", {"optim": "torch", "steps": 2,
                                                           "save": ckpt}, world=2)
    assert rank0["buffers"]["2"] != rank1["buffers"]["2"]  # each rank's batches
    assert rank0["buffers"]["2"]["bn.num_batches_tracked"] == 2
    (loaded, _), = _trainers(d, tmp_path, "bn2", {"optim": "none", "load": ckpt})
    assert loaded["loaded_buffers"] == rank0["buffers"]["2"]
    out = tmp_path / "model.safetensors"
    r = run_fsdpctl("export", ckpt, "--out", out)
    assert r.returncode == 0, r.stderr
    script = tmp_path / "strict_load.py"
    script.write_text(STRICT_LOAD)
    r = subprocess.run([PYTHON, str(script), str(out)], capture_output=True, text=True,
                       timeout=CHILD_TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    exported = json.loads(r.stdout.strip().splitlines()[-1])
    assert _close(exported, rank0["state"], 0)
    assert exported["bn.running_var"] == rank0["buffers"]["2"]["bn.running_var"]


def test_the_daemons_saves_of_a_torch_optimizer_job_say_what_they_lack(fsdpd, tmp_path):
    """A job training with torch's AdamW is saved by the schedule (checkpoint.every_steps)
    and at the stop: each save warns that the trainers' optimizer state is not in it, and
    the resume (checkpoint.resume = latest) warns again, in the daemon's log and in the
    trainer's. The module's buffers come back with the resume, at the first forward."""
    options = (*DAEMON_ARGS, "--set", f"checkpoint.dir={tmp_path}",
               "--set", "checkpoint.every_steps=2", "--set", "checkpoint.resume=latest")
    d = fsdpd(*options)
    (first, _), = _trainers(d, tmp_path, "sched", {"optim": "torch", "steps": 3})
    poll(lambda: (tmp_path / "sched" / "step-2" / "manifest.json").exists(), 20,
         what="step 2's checkpoint")
    lacks = "holds the masters but no optimizer state of the trainers'"
    poll(lambda: f"checkpoint of step 2 in {tmp_path / 'sched' / 'step-2'} {lacks}"
         in d.stderr(), 5, what="the schedule's save's warning")
    d.stop()
    assert f"checkpoint of step 3 in {tmp_path / 'sched' / 'step-3'} {lacks}" in d.stderr()
    d = fsdpd(*options, name="again")
    (again, err), = _trainers(d, tmp_path, "sched", {"optim": "torch", "eval": True})
    assert again["resumed"] and again["eval_buffers"] == first["buffers"]["3"]
    assert any("job resumed after step 3" in w and "torch optimizer" in w
               for w in again["warnings"]), again["warnings"]
    poll(lambda: "which holds no optimizer state: a trainer's torch optimizer starts afresh"
         in d.stderr(), 5, what="the resume's warning")
