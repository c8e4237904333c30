"""Checkpoint paths a trainer names are used with its own rights, never the daemon's (issue 29,
item 1), tried with real uids as test_access does: a trainer of another uid, a member of the
daemon's group, asks SaveCheckpoint and LoadCheckpoint through its session.

- A link planted where the daemon clears an unfinished save, or where it replaces a step,
  is refused, never followed: the directory it points to keeps its files.
- A save goes only where the trainer's uid may write (its files then are its own), a load
  only from where it may read: a root-only checkpoint of a job of the same name stays
  unread, and its size is not told.
- A checkpoint of another job is never replaced or pruned, and a trainer names no step
  past its job's last completed one.

The test runs as root; the daemon runs as root too, the strongest rights a path could be
mistaken for."""

import json
import os

import pytest

from fsdpd_harness import fsdpd, poll, trainer_pb2  # noqa: F401
from test_access import OTHER, OTHER_PYTHON, _world_readable, as_user, run_dir  # noqa: F401
from test_checkpoint import checkpoint, trained

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acting as other uids needs root")

# A trainer of another user: attaches job argv[3] as its only rank, registers a trainable
# unit, trains step 1, then asks each (method, path, step) of argv[4] (JSON) through its
# session and prints one line for each: "OK <path> <step>" or "<CODE> <details>".
_TRAINER = r"""
import json, sys, tempfile
sys.path.insert(0, sys.argv[1])
import grpc
from fsdpd_harness import Daemon, operator_pb2
from test_unshard import FP32, Rank
d = Daemon(tempfile.gettempdir(), run_dir=sys.argv[2])
r = Rank(d, 0, 1, job=sys.argv[3])
layout = r.register(shapes=((64,),), requires_grad=True)
r.op("Unshard", step=1, backward=True)
r.write_full_grad([0.5] * layout.padded_numel, FP32)
r.op("ReduceScatter", step=1)
for method, path, step in json.loads(sys.argv[4]):
    try:
        reply = d.call(f"/fsdp.v1.Operator/{method}", operator_pb2.CheckpointRequest(
            job=sys.argv[3], path=path, session_id=r.session, step=step),
            operator_pb2.CheckpointReply, timeout=30)
        print("OK", reply.path, reply.step)
    except grpc.RpcError as e:
        print(e.code().name, e.details())
"""


def as_trainer(d, job, calls, uid=OTHER):
    """The replies, a line each, to calls [(method, path, step)] of a trainer of uid."""
    out = as_user([OTHER_PYTHON, "-c", _TRAINER, str(_world_readable() / "integration"),
                   str(d.run_dir), job,
                   json.dumps([[m, str(p), s] for m, p, s in calls])], uid, uid)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.fixture
def place(run_dir):  # noqa: F811
    """A directory every user may traverse, beside the run directory."""
    return run_dir.parent


def end_job(d, ranks):
    """Its trainers detach; with store.job_retention 100ms the job goes soon."""
    for r in ranks:
        d.call("/fsdp.v1.Trainer/Detach", trainer_pb2.DetachRequest(session_id=r.session),
               trainer_pb2.DetachReply)
    poll(lambda: not d.status().jobs, 10, what="the job freed")


def owned(path, uid, mode=0o755):
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, uid)
    path.chmod(mode)
    return path


def victim_dir(place):
    """Root's directory of mode 0700 holding a file that must survive."""
    victim = owned(place / "victim", 0, 0o700)
    (victim / "precious").write_text("keep me")
    return victim


def test_a_planted_link_is_never_followed(fsdpd, run_dir, place):  # noqa: F811
    d = fsdpd(run_dir=run_dir)
    victim = victim_dir(place)
    saves = owned(place / "saves", OTHER)
    # Where a save of step 1 clears what an unfinished save left, under either name an fsdpd
    # has given it, and where the finished one goes.
    for name in ("step-1.partial", "step-1.t.partial", "step-1"):
        (saves / name).symlink_to(victim)
        os.lchown(saves / name, OTHER, OTHER)
    (reply,) = as_trainer(d, "t", [("SaveCheckpoint", saves, 1)])
    assert reply.startswith("FAILED_PRECONDITION"), reply
    assert "symbolic link" in reply, reply
    assert sorted(os.listdir(victim)) == ["precious"]
    # A link as a parent of the path is not followed either.
    (reply,) = as_trainer(d, "t", [("SaveCheckpoint", saves / "step-1" / "deeper", 1)])
    assert reply.startswith("FAILED_PRECONDITION") and "symbolic link" in reply, reply
    assert sorted(os.listdir(victim)) == ["precious"]
    d.assert_serving()


def test_a_trainer_saves_only_where_its_uid_may_write(fsdpd, run_dir, place):  # noqa: F811
    d = fsdpd(run_dir=run_dir)
    root_only = owned(place / "root-only", 0)
    mine = owned(place / "mine", OTHER)
    replies = as_trainer(d, "t", [("SaveCheckpoint", root_only, 0),
                                  ("SaveCheckpoint", root_only / "made" / "by-root", 0),
                                  ("SaveCheckpoint", mine / "deeper", 0),
                                  ("SaveCheckpoint", mine, 1 << 63)])
    assert replies[0].startswith("PERMISSION_DENIED"), replies
    assert replies[1].startswith("PERMISSION_DENIED"), replies
    assert os.listdir(root_only) == []  # no directory made with the daemon's rights
    assert replies[2] == f"OK {mine}/deeper/step-1 1", replies
    for path in [mine / "deeper", *(mine / "deeper").rglob("*")]:
        assert path.stat().st_uid == OTHER, path  # the trainer's own files
    assert replies[3].startswith("OUT_OF_RANGE") and "'step' = 9223372036854775808" in replies[3]
    assert "completed step 1" in replies[3], replies
    d.assert_serving()


def test_a_trainer_reads_no_checkpoint_its_uid_may_not(fsdpd, run_dir, place):  # noqa: F811
    """Root's job 'shared' saves into a root-only directory and ends; another uid's job of the
    same name, once the first is gone, asks to load it: refused before a byte or a size of
    it is read."""
    d = fsdpd("--set", "store.job_retention=100ms", run_dir=run_dir)
    ranks, _ = trained(d)  # root's job 'j'
    secret = owned(place / "secret", 0, 0o700)
    assert checkpoint(d, "SaveCheckpoint", secret).step == 1
    end_job(d, ranks)
    replies = as_trainer(d, "j", [("LoadCheckpoint", secret, 0),
                                  ("LoadCheckpoint", secret / "step-1", 0)])
    for reply in replies:
        assert reply.startswith("PERMISSION_DENIED"), replies
        assert "numel" not in reply, reply
    d.assert_serving()


def test_another_jobs_checkpoint_is_never_replaced_or_pruned(fsdpd, run_dir, place):  # noqa: F811
    """In a directory both may write, root's job 'j' saves step 1; another uid's job 'k'
    saves steps 1 there too, with checkpoint.keep 1: 'j''s stays whole."""
    d = fsdpd("--set", "checkpoint.keep=1", run_dir=run_dir)
    trained(d)
    shared = owned(place / "shared", 0, 0o777)
    assert checkpoint(d, "SaveCheckpoint", shared).step == 1
    before = {p.name: p.read_bytes() for p in (shared / "step-1").iterdir()}
    replies = as_trainer(d, "k", [("SaveCheckpoint", shared, 0),
                                  ("SaveCheckpoint", shared / "k", 0)])
    assert replies[0].startswith("FAILED_PRECONDITION") and "job 'j'" in replies[0], replies
    assert replies[1] == f"OK {shared}/k/step-1 1", replies
    assert {p.name: p.read_bytes() for p in (shared / "step-1").iterdir()} == before
    assert sorted(os.listdir(shared)) == ["k", "step-1"]
    d.assert_serving()


def test_the_daemons_own_directory_serves_only_the_jobs_own_uid(fsdpd, run_dir, place):  # noqa: F811
    """checkpoint.dir/<job>/ is written and read with the daemon's rights, for the job's
    trainers whatever their uid: a job of the same name but of another uid, made after the
    first one ended, does not load the first one's checkpoint from there."""
    saves = place / "daemon-saves"
    d = fsdpd("--set", f"checkpoint.dir={saves}", "--set", "store.job_retention=100ms",
              run_dir=run_dir)
    ranks, _ = trained(d)
    assert checkpoint(d, "SaveCheckpoint", saves / "j").step == 1
    end_job(d, ranks)
    (reply,) = as_trainer(d, "j", [("LoadCheckpoint", saves / "j", 0)])
    assert reply.startswith("PERMISSION_DENIED") and f"uid {OTHER}" in reply, reply
    # Its own saves there are its own, beside the first job's.
    (reply,) = as_trainer(d, "j", [("SaveCheckpoint", saves / "j" / "mine", 0)])
    assert reply == f"OK {saves}/j/mine/step-1 1", reply
    d.assert_serving()

