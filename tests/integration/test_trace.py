"""The flight recorder (trace.ops) and `fsdpctl trace JOB --out FILE` through a real fsdpd:
two local ranks train three steps; the trace is Chrome's trace-event JSON with a track per
rank's gathers and reduces and one for the daemon's work, each rank's operation once per
step, its wait before its run, in order of time on each track; --steps keeps the last
ones; the recorder keeps the newest trace.ops records; an unknown job, or a job without a
recorder, is refused naming why. `fsdpctl why JOB` names the rank a collective waits for and
what each rank last did."""

import json
import os

import threading
import time

from fsdpd_harness import fsdpd  # noqa: F401
from test_metrics import train


def trace(d, tmp_path, *args, name="trace.json"):
    out = tmp_path / name
    r = d.fsdpctl("trace", *args, "--out", str(out))
    return r, (json.loads(out.read_text()) if r.returncode == 0 else None)


def test_a_trace_shows_every_ranks_operations_and_the_daemons_work(fsdpd, tmp_path):
    d = fsdpd()
    train(d, 3)
    r, t = trace(d, tmp_path, "j")
    assert r.returncode == 0, r.stderr
    assert "operations of job j" in r.stdout
    events = t["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {0: "rank 0 gathers", 1: "rank 0 reduces", 2: "rank 1 gathers",
                     3: "rank 1 reduces", 100000: "daemon work"}
    slices = [e for e in events if e["ph"] == "X"]
    runs = [e for e in slices if not e["name"].endswith("(waits)")]
    for tid, what in ((0, "unshard u"), (1, "reduce u"), (2, "unshard u"), (3, "reduce u")):
        mine = [e for e in runs if e["tid"] == tid]
        assert [e["name"] for e in mine] == [what] * 3
        assert [e["args"]["step"] for e in mine] == [1, 2, 3]
        assert all(e["args"]["code"] == "OK" and e["dur"] >= 0 for e in mine)
        assert mine[0]["args"]["bytes"] == 37 * 11 * 2  # bf16 copies, one rank's
    work = [e["name"] for e in runs if e["tid"] == 100000]
    assert work.count("gather u") == 3 and work.count("reduce u") == 3
    assert "prefault u" in work
    for tid in (0, 1, 2, 3, 100000):  # each track in time order, waits before their runs
        ts = [e["ts"] for e in slices if e["tid"] == tid]
        assert ts == sorted(ts) and min(ts) >= 0
    # --steps 1: the last step's operations (and its work) only.
    r, last = trace(d, tmp_path, "j", "--steps", "1", name="last.json")
    assert r.returncode == 0, r.stderr
    steps = {e["args"]["step"] for e in last["traceEvents"] if e["ph"] == "X"}
    assert steps == {3}


def test_the_recorder_keeps_the_newest_and_refusals_name_why(fsdpd, tmp_path):
    d = fsdpd("--set", "trace.ops=8")
    train(d, 3)
    r = d.fsdpctl("--json", "trace", "j", "--out", str(tmp_path / "t.json"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["records"] == 8 and out["recorded"] > 8
    # A link planted at the name is replaced, never written through.
    victim = tmp_path / "victim"
    victim.write_text("kept")
    (tmp_path / "linked.json").symlink_to(victim)
    r, t = trace(d, tmp_path, "j", name="linked.json")
    assert r.returncode == 0 and victim.read_text() == "kept", r.stderr
    assert not (tmp_path / "linked.json").is_symlink() and t["traceEvents"]
    r, _ = trace(d, tmp_path, "nope")
    assert r.returncode == 1 and "no job 'nope' in this daemon" in r.stderr
    off = fsdpd("--set", "trace.ops=0", name="off")
    train(off, 1)
    r, _ = trace(off, tmp_path, "j")
    assert r.returncode == 1 and "trace.ops was 0 when it began" in r.stderr


def test_why_names_the_rank_a_gather_waits_for_and_what_it_last_did(fsdpd):
    """Two steps trained, then rank 0 asks for step 3's gather and rank 1 does not: `fsdpctl
    why j` says the gather waits for local rank 1, whose last operation was step 2's reduce,
    lists the collective (asked 0, missing 1) and each rank's last operation; --json says
    the same. Once rank 1 asks, nothing waits."""
    d = fsdpd()
    ranks, _ = train(d, 2)
    first = threading.Thread(target=ranks[0].op, args=("Unshard",), kwargs=dict(step=3))
    first.start()
    deadline = time.monotonic() + 10
    while "waited" not in (out := d.fsdpctl("why", "j").stdout):
        assert time.monotonic() < deadline, out
        time.sleep(0.05)
    assert out.startswith("job 'j' unit 'u' step 3: its gather has waited"), out
    assert "for local rank(s) 1; local rank 1 last: reduce of unit 'u' step 2," in out, out
    row = next(line.split() for line in out.splitlines() if line.startswith("u "))
    assert row[:3] == ["u", "gather", "3"] and row[4:6] == ["0", "1"], out
    w = json.loads(d.fsdpctl("--json", "why", "j").stdout)
    assert [(c["unit"], c["what"], c["step"], c["asked"], c["missing"], c["running"])
            for c in w["waiting"]] == [("u", "gather", 3, [0], [1], False)]
    assert [(r["rank"], r["attached"], r["last"]["what"], r["last"]["step"], r["last"]["code"])
            for r in w["ranks"]] == [(0, True, "reduce", 2, "OK"), (1, True, "reduce", 2, "OK")]
    ranks[1].op("Unshard", step=3)
    first.join(10)
    assert d.fsdpctl("why", "j").stdout.startswith("job 'j': nothing waits")
    r = d.fsdpctl("why", "nope")
    assert r.returncode == 1 and "no job 'nope' in this daemon" in r.stderr


def test_a_timeout_keeps_the_flight_record_and_names_it(fsdpd, tmp_path):
    """A gather rank 1 never asks for times out (store.collective_timeout): rank 0 hears
    ABORTED naming rank 1 and the file where the daemon kept the job's flight record, in its
    run directory; the log names it too; `fsdpctl record FILE --out` writes it as Chrome
    trace JSON with a track per rank. A file that is no record, or a forged one (a rank past
    the limit, more records than a recorder keeps), or a FIFO, is refused saying so."""
    import grpc
    import pytest
    d = fsdpd("--set", "store.collective_timeout=500ms",
              "--set", "daemon.housekeeping_interval=50ms")
    ranks, _ = train(d, 1)
    with pytest.raises(grpc.RpcError) as e:
        ranks[0].op("Unshard", step=2)
    message = e.value.details()
    assert e.value.code() == grpc.StatusCode.ABORTED, message
    assert "local rank(s) 1 of job 'j' did not ask to unshard in time " \
        "(store.collective_timeout); the job's flight record: " in message, message
    path = message.rsplit("the job's flight record: ", 1)[1]
    assert path.startswith(str(d.run_dir)) and path.endswith(".record"), path
    assert f"its flight record at the timeout is {path}" in d.stderr()
    out = tmp_path / "timeout.json"
    r = d.fsdpctl("record", path, "--out", str(out))
    assert r.returncode == 0 and "operations of job j" in r.stdout, r.stderr
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"rank 0 gathers", "rank 1 gathers", "rank 0 reduces", "rank 1 reduces"} <= names
    steps = {e["args"]["step"] for e in events if e["ph"] == "X" and "step" in e["args"]}
    assert 1 in steps
    from fsdpd_harness import operator_pb2
    empty = operator_pb2.OpRecord()
    for name, content, why in (
            ("garbage", b"\xff" * 64, "not a flight record (it does not decode)"),
            ("rank", operator_pb2.TraceReply(records=[operator_pb2.OpRecord(kind=1, rank=1000)]),
             "a record of a local rank past the protocol's limit"),
            ("many", operator_pb2.TraceReply(records=[empty] * 65537),
             "more records than a flight recorder keeps")):
        forged = tmp_path / f"{name}.record"
        forged.write_bytes(content if isinstance(content, bytes) else content.SerializeToString())
        r = d.fsdpctl("record", str(forged), "--out", str(tmp_path / f"{name}.json"))
        assert r.returncode == 1 and why in r.stderr, (name, r.stderr)
    fifo = tmp_path / "fifo.record"  # no writer ever comes: refused, not waited on
    os.mkfifo(fifo)
    r = d.fsdpctl("record", str(fifo), "--out", str(tmp_path / "fifo.json"), timeout=10)
    assert r.returncode == 1 and "not a regular file" in r.stderr, r.stderr
