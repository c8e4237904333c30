"""Who may do what on the daemon's unix socket, with real uids: the socket lets in root, the
daemon's user and its group, and among them

- a job belongs to the uid that attached it first: another uid's Attach to it is refused
  (PERMISSION_DENIED naming the job and both uids), while its trainers run and for as long
  as the daemon keeps its units after they ended, so no other user can read the job's
  parameters or write what it gathers;
- the Operator methods that change the daemon's state (Drain, Resume, ReloadConfig) are for
  root, the daemon's uid and daemon.operator_group; the read-only ones are open.

The test runs as root and acts as other users from child processes that drop to them
(subprocess's user, group and extra_groups), members of the daemon's group where they must
reach the socket. Their daemons run in a run directory those users can reach (pytest's own
temporary directories are private to root)."""

import array
import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest

from fsdpd_harness import (FSDPCTL, PYTHON_GEN, SOURCE_DIR, clean_env,  # noqa: F401
                           fsdpd, operator_pb2, status_code_and_details, trainer_pb2)
from test_unshard import FP32, Rank, on_all, values_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acting as other uids needs root")

NOBODY = 65534   # nobody / nogroup on Debian
OTHER = 4242     # a uid and gid with no name, in no group but the ones given here
DAEMON_GID = os.getegid()  # the daemon runs as we do: its group lets a user onto the socket
SHAPES = ((5, 7), (3,))
DETACH = "/fsdp.v1.Trainer/Detach"
HERE = Path(__file__).resolve().parent
# The other users' interpreter: the one the tests' environment was made from, which they may
# run (the environment's own lies in the clone); _world_readable gives it grpcio and protobuf.
OTHER_PYTHON = getattr(sys, "_base_executable", sys.executable)


@functools.lru_cache(maxsize=None)
def _world_readable():
    """A copy, under a directory every user may traverse, of what the other users' processes
    run: this folder's modules, the generated protobuf modules, fsdpctl, and grpcio and
    protobuf from the tests' environment (.venv/, in the clone), which they import into the
    interpreter that environment was made from (OTHER_PYTHON). A clone under a home
    directory of mode 0700 (Debian's default) is closed to them (issue 29 item 3)."""
    root = Path(tempfile.mkdtemp(prefix="fsdpd-access-harness-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    root.chmod(0o755)
    (root / "integration").mkdir(mode=0o755)
    for module in HERE.glob("*.py"):
        shutil.copy(module, root / "integration")
    shutil.copytree(PYTHON_GEN, root / "build" / "python-gen",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "build" / "bin").mkdir(parents=True)
    shutil.copy(FSDPCTL, root / "build" / "bin")
    (root / "include" / "fsdp").mkdir(parents=True)  # the harness reads the version there
    shutil.copy(SOURCE_DIR / "include" / "fsdp" / "fsdp_version.h.in", root / "include" / "fsdp")
    site = Path(grpc.__file__).resolve().parent.parent
    for package in ("grpc", "google"):
        shutil.copytree(site / package, root / "site" / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
    return root


@pytest.fixture
def run_dir():
    """A run directory under a parent every user may traverse (the daemon makes it 0750)."""
    parent = Path(tempfile.mkdtemp(prefix="fsdpd-access-"))
    parent.chmod(0o755)
    yield parent / "run"
    shutil.rmtree(parent, ignore_errors=True)


def other_env():
    """The environment of the other users' processes: _world_readable's copy."""
    shared = _world_readable()
    return clean_env({"PYTHONDONTWRITEBYTECODE": "1", "HOME": "/",
                      "PYTHONPATH": str(shared / "site"), "FSDP_SOURCE_DIR": str(shared),
                      "FSDP_BUILD_DIR": str(shared / "build")})


def as_user(argv, uid, gid, groups=(DAEMON_GID,)):
    """Runs argv as uid:gid with supplementary groups; returns the CompletedProcess."""
    env = other_env()
    return subprocess.run(argv, user=uid, group=gid, extra_groups=list(groups), env=env,
                          cwd="/", capture_output=True, text=True, timeout=60)


# A trainer of another user: attaches as a rank of `job`; if let in, maps the job's memory,
# registers the unit, writes 666.0 into its master shard for the job to gather, detaches.
# Prints "CODE details" when refused, "ATTACHED" otherwise.
_INTRUDER = r"""
import sys, tempfile
sys.path.insert(0, sys.argv[1])
import grpc
from fsdpd_harness import Daemon, trainer_pb2
from test_unshard import Rank
from test_access import DETACH, SHAPES
d = Daemon(tempfile.gettempdir(), run_dir=sys.argv[2])
job, rank, world = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
try:
    r = Rank(d, rank, world, job=job)
except grpc.RpcError as e:
    print(e.code().name, e.details())
    sys.exit(0)
if sys.argv[6] == "write":
    layout = r.register(shapes=SHAPES)
    r.write_master_shard(layout, [666.0] * layout.padded_numel)
d.call(DETACH, trainer_pb2.DetachRequest(session_id=r.session), trainer_pb2.DetachReply)
print("ATTACHED")
"""


def intrude(d, job, rank, world, uid, gid, write=True):
    r = as_user([OTHER_PYTHON, "-c", _INTRUDER, str(_world_readable() / "integration"),
                 str(d.run_dir), job, str(rank), str(world), "write" if write else "attach"],
                uid, gid)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def write_masters(ranks, layouts, values):
    for r, lay in zip(ranks, layouts):
        r.write_master_shard(lay, values)


def gathered(rank, layout):
    """The unsharded unit as fp32 values."""
    return list(array.array("f", rank.unsharded(layout, FP32)))


def test_another_uid_cannot_take_over_a_rank_of_a_job(fsdpd, run_dir):
    d = fsdpd("--set", "memory.job_limit=64MiB", run_dir=run_dir)
    ranks = [Rank(d, r, 2, job="victim") for r in range(2)]
    layouts = [r.register(shapes=SHAPES) for r in ranks]
    values = values_for(layouts[0].padded_numel, 3)
    write_masters(ranks, layouts, values)
    assert on_all(ranks, "Unshard", step=1) == [None, None]

    # Rank 1's trainer exits; the job's units stay for it to come back.
    d.call(DETACH, trainer_pb2.DetachRequest(session_id=ranks[1].session),
           trainer_pb2.DetachReply)
    ranks[1].sock.close()
    out = intrude(d, "victim", 1, 2, NOBODY, NOBODY)
    assert out == (f"PERMISSION_DENIED /fsdp.v1.Trainer/Attach: job 'victim' belongs to uid "
                   f"{os.geteuid()} (whose trainer attached it first), not to the calling uid "
                   f"{NOBODY}; every trainer of a job runs as its owner"), out

    # The owner's restarted trainer gets its rank back; the job gathers only its own values.
    ranks[1] = Rank(d, 1, 2, job="victim")
    layouts[1] = ranks[1].register(shapes=SHAPES)
    assert on_all(ranks, "Unshard", step=2) == [None, None]
    assert gathered(ranks[0], layouts[0]) == list(array.array("f", values))
    assert gathered(ranks[1], layouts[1]) == list(array.array("f", values))

    # Every session of the job gone: the job is still the owner's while its units live.
    for r in ranks:
        d.call(DETACH, trainer_pb2.DetachRequest(session_id=r.session), trainer_pb2.DetachReply)
    assert [j.job for j in d.status().jobs] == ["victim"]
    out = intrude(d, "victim", 0, 2, NOBODY, NOBODY)
    assert out.startswith("PERMISSION_DENIED /fsdp.v1.Trainer/Attach: job 'victim' belongs"), out
    d.assert_serving()


def test_a_job_with_no_units_yet_belongs_to_its_first_trainer(fsdpd, run_dir):
    """Before any unit or memory exists only the sessions know the owner; root is no
    exception either: a job is kept to one uid both ways."""
    d = fsdpd(run_dir=run_dir)
    mine = Rank(d, 0, 2, job="mine")  # root's; no unit registered
    assert intrude(d, "mine", 1, 2, OTHER, OTHER, write=False).startswith(
        f"PERMISSION_DENIED /fsdp.v1.Trainer/Attach: job 'mine' belongs to uid {os.geteuid()} "
        f"(whose trainer attached it first), not to the calling uid {OTHER}")

    # Another user's job, its trainer attached and waiting: root cannot attach to it.
    shared = _world_readable()
    env = other_env()
    holder = subprocess.Popen([OTHER_PYTHON, "-c", _HOLDER, str(shared / "integration"),
                               str(d.run_dir)],
                              user=OTHER, group=OTHER, extra_groups=[DAEMON_GID], env=env,
                              cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        said, holder_session = holder.stdout.readline().split()
        assert said == "ATTACHED"
        holder_session = int(holder_session)
        with pytest.raises(grpc.RpcError) as excinfo:
            Rank(d, 1, 2, job="theirs")
        code, details = status_code_and_details(excinfo)
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert (f"job 'theirs' belongs to uid {OTHER} (whose trainer attached it first), not to "
                f"the calling uid {os.geteuid()}") in details
        assert {(s.session_id, s.job, s.uid) for s in d.status().sessions} == {
            (mine.session, "mine", os.geteuid()), (holder_session, "theirs", OTHER)}
    finally:
        holder.stdin.close()
        assert holder.wait(30) == 0


# As another user: attaches job 'theirs' rank 0 of 2, says so, and holds the session until
# its stdin closes.
_HOLDER = r"""
import sys, tempfile
sys.path.insert(0, sys.argv[1])
from fsdpd_harness import Daemon
from test_unshard import Rank
d = Daemon(tempfile.gettempdir(), run_dir=sys.argv[2])
r = Rank(d, 0, 2, job="theirs")
print("ATTACHED", r.session, flush=True)
sys.stdin.read()
"""


def fsdpctl_as(d, uid, gid, *args, groups=(DAEMON_GID,)):
    fsdpctl = _world_readable() / "build" / "bin" / "fsdpctl"
    return as_user([str(fsdpctl), "--socket", str(d.socket_path), *args], uid, gid, groups)


# Operator calls over grpcio as another user: prints "OK" or "CODE details" per method.
_OPERATOR_CALLS = r"""
import sys
sys.path.insert(0, sys.argv[1])
import grpc
from fsdpd_harness import operator_pb2 as o
ch = grpc.insecure_channel("unix:" + sys.argv[2])
for method in sys.argv[3:]:
    call = ch.unary_unary("/fsdp.v1.Operator/" + method,
                          request_serializer=lambda m: m.SerializeToString())
    request = getattr(o, method + "Request", o.StatusRequest)()
    try:
        call(request, timeout=10)
        print("OK")
    except grpc.RpcError as e:
        print(e.code().name, e.details())
"""


def operator_calls(d, uid, gid, *methods, groups=(DAEMON_GID,)):
    r = as_user([OTHER_PYTHON, "-c", _OPERATOR_CALLS, str(_world_readable() / "integration"),
                 str(d.socket_path), *methods], uid, gid, groups)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split("\n")


def state(d):
    return operator_pb2.ServingState.Name(d.status().state)


def test_only_operators_change_the_daemons_state(fsdpd, run_dir):
    d = fsdpd(run_dir=run_dir)
    # A member of the daemon's group reaches the socket and may look...
    for args in (("status",), ("units",), ("config", "show"), ("health",)):
        r = fsdpctl_as(d, NOBODY, NOBODY, *args)
        assert r.returncode == 0, (args, r.stderr)
    # ...but not drain, resume or reload it.
    need = (f"uid {NOBODY} may not call it: it changes the daemon's state, which needs root, "
            f"the daemon's uid {os.geteuid()} or a member of daemon.operator_group (not set)")
    for args, method in ((("drain",), "Drain"), (("resume",), "Resume"),
                         (("config", "reload"), "ReloadConfig")):
        r = fsdpctl_as(d, NOBODY, NOBODY, *args)
        assert r.returncode != 0, (args, r.stdout)
        assert f"/fsdp.v1.Operator/{method}: {need}" in r.stderr, r.stderr
    out = operator_calls(d, NOBODY, NOBODY, "Drain", "ReloadConfig", "Resume", "Status",
                         "ListUnits")
    assert out == [f"PERMISSION_DENIED /fsdp.v1.Operator/{m}: {need}"
                   for m in ("Drain", "ReloadConfig", "Resume")] + ["OK", "OK"], out
    assert state(d) == "SERVING_STATE_SERVING"
    assert d.check("") == 1  # SERVING

    # The daemon's owner may (root here, and root is the daemon's uid).
    assert d.fsdpctl("drain").returncode == 0
    assert state(d) == "SERVING_STATE_DRAINING"
    assert d.fsdpctl("config", "reload").returncode == 0
    assert d.fsdpctl("resume").returncode == 0
    assert state(d) == "SERVING_STATE_SERVING"


@pytest.mark.parametrize("group", ["nogroup", str(OTHER)], ids=["name", "gid"])
def test_operator_group_members_change_the_daemons_state(fsdpd, run_dir, group):
    d = fsdpd("--set", f"daemon.operator_group={group}", run_dir=run_dir)
    member_gid = NOBODY if group == "nogroup" else OTHER
    # A member through its supplementary groups (a primary group counts too: NOBODY's below).
    r = fsdpctl_as(d, 5151, 5151, "drain", groups=(DAEMON_GID, member_gid))
    assert r.returncode == 0, r.stderr
    assert state(d) == "SERVING_STATE_DRAINING"
    r = fsdpctl_as(d, 5151, member_gid, "resume")
    assert r.returncode == 0, r.stderr
    assert state(d) == "SERVING_STATE_SERVING"
    # A group member who is not in the operator group is refused, and told which group.
    r = fsdpctl_as(d, 5252, 5252, "drain")
    assert r.returncode != 0
    assert (f"/fsdp.v1.Operator/Drain: uid 5252 may not call it: it changes the daemon's "
            f"state, which needs root, the daemon's uid {os.geteuid()} or a member of "
            f"daemon.operator_group '{group}'") in r.stderr, r.stderr
    assert state(d) == "SERVING_STATE_SERVING"


def test_an_unknown_operator_group_is_a_config_error(fsdpd, run_dir, tmp_path):
    bad = "key 'daemon.operator_group': value 'no-such-group-here' is no group on this host"
    d = fsdpd("--set", "daemon.operator_group=no-such-group-here", run_dir=run_dir, wait=False)
    assert d.wait() == 78
    assert bad in d.stderr(), d.stderr()
    # A reload to one keeps the running config (and its operators).
    conf = tmp_path / "fsdpd.conf"
    conf.write_text("[daemon]\noperator_group = nogroup\n")
    d = fsdpd("--config", conf, run_dir=run_dir)
    conf.write_text("[daemon]\noperator_group = no-such-group-here\n")
    r = d.fsdpctl("config", "reload")
    assert r.returncode == 1 and bad in r.stderr, r.stderr
    assert d.config_entry("daemon.operator_group").value == "nogroup"
    assert fsdpctl_as(d, 5151, NOBODY, "drain").returncode == 0


def refused_attach(d, job, rank, world, job_token=""):
    with pytest.raises(grpc.RpcError) as excinfo:
        Rank(d, rank, world, job=job, job_token=job_token)
    return status_code_and_details(excinfo)


def test_a_job_token_keeps_apart_jobs_of_one_uid(fsdpd):
    """Trainers of one uid (containers run as one user) are told apart by the token their
    launcher handed them: the first Attach of a job fixes it, and it holds while the job's
    units live; the token never appears in a message."""
    d = fsdpd("--set", "memory.job_limit=64MiB")
    secret = "launcher-secret-" + "x" * 200
    first = Rank(d, 0, 2, job="tok", job_token=secret)
    wrong = ("field 'job_token' is not the job token job 'tok' was first attached with; every "
             "trainer of a job gives the one its launcher handed out, or none")
    for token in ("", "launcher-secret", secret + "y", secret[:-1] + "X"):
        code, details = refused_attach(d, "tok", 1, 2, token)
        assert code == grpc.StatusCode.PERMISSION_DENIED and wrong in details, details
        assert "launcher" not in details.replace("its launcher", "")
    second = Rank(d, 1, 2, job="tok", job_token=secret)
    for r in (first, second):
        r.register(shapes=SHAPES)
        d.call(DETACH, trainer_pb2.DetachRequest(session_id=r.session), trainer_pb2.DetachReply)
    # No session left: the store still knows the job's token.
    assert refused_attach(d, "tok", 0, 2)[0] == grpc.StatusCode.PERMISSION_DENIED
    Rank(d, 0, 2, job="tok", job_token=secret)

    # A job attached without a token admits no trainer that gives one.
    keep = Rank(d, 0, 1, job="open")
    code, details = refused_attach(d, "open", 0, 1, "some-token")
    assert code == grpc.StatusCode.PERMISSION_DENIED and "job 'open'" in details, details
    assert keep.session

    code, details = refused_attach(d, "long", 0, 1, "t" * 257)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "field 'job_token' is 257 bytes, more than 256" in details
