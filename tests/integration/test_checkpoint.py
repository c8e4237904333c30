"""Checkpoints written and read by the daemon (Operator.SaveCheckpoint, LoadCheckpoint,
checkpoint/checkpoint.h), on one host: the files and their metadata, a load that gives back
the masters and the optimizer's state bit for bit, every refusal (a load refused leaving the
job's memory as it was), and `fsdpctl export` to safetensors from the files alone, read back
by this test's own parser of the format."""

import array
import concurrent.futures
import json
import signal
import struct
import subprocess
import time

import grpc
import pytest

from fsdpd_harness import (built_with, fsdpd, operator_pb2, poll, run_fsdpctl,  # noqa: F401
                           trainer_pb2)
from test_optimizer import ADAMW, SHAPES, group, refused, set_optimizer, two_ranks
from test_unshard import FP32, Rank, bf16_bits, on_all


def checkpoint(d, method, path, job="j"):
    return d.call(f"/fsdp.v1.Operator/{method}",
                  operator_pb2.CheckpointRequest(job=job, path=str(path)),
                  operator_pb2.CheckpointReply, timeout=30)


def save_later(d, path, job="j"):
    """SaveCheckpoint started: its future."""
    save = d.channel().unary_unary(
        "/fsdp.v1.Operator/SaveCheckpoint",
        request_serializer=operator_pb2.CheckpointRequest.SerializeToString,
        response_deserializer=operator_pb2.CheckpointReply.FromString)
    return save.future(operator_pb2.CheckpointRequest(job=job, path=str(path)), timeout=30)


def with_adamw(d):
    """Two ranks of job 'j' with AdamW in the daemon: the ranks, their layouts, and where the
    masters and the optimizer's state lie in the job's memory."""
    ranks, layouts = two_ranks(d)
    reply = set_optimizer(ranks[0], trainer_pb2.ADAMW, group(**ADAMW))
    n = layouts[0].padded_numel
    (state,) = reply.units
    regions = [(layouts[0].master_offset, 4 * n), (state.steps_offset, 8)]
    regions += [(state.arrays_offset + a * state.array_stride, 4 * n)
                for a in range(state.arrays)]
    return ranks, layouts, regions


def trained(d):
    """with_adamw's ranks after one step: the ranks and the regions."""
    ranks, layouts, regions = with_adamw(d)
    n = layouts[0].padded_numel
    masters = [0.25 * (i % 7) - 0.5 for i in range(n)]
    for r, lay in zip(ranks, layouts):
        r.write_master_shard(lay, masters)
    assert on_all(ranks, "Unshard", step=1, backward=True) == [None, None]
    for r in ranks:
        r.write_full_grad([0.125 * (i % 5) - 0.25 for i in range(n)], FP32)
    assert on_all(ranks, "ReduceScatter", step=1, step_optimizer=True) == [None, None]
    return ranks, regions


def snapshot(rank, regions):
    return [bytes(rank.memory[o:o + n]) for o, n in regions]


def garble(rank, regions):
    for o, n in regions:
        rank.memory[o:o + n] = b"\x7f" * n


def test_save_then_load_gives_back_masters_and_optimizer_state(fsdpd, tmp_path):
    d = fsdpd()
    ranks, regions = trained(d)
    want = snapshot(ranks[0], regions)
    # fsdpctl makes a relative DIR absolute, as the daemon wants it.
    out = d.fsdpctl("checkpoint", "save", "j", "ckpt", cwd=tmp_path)
    step_dir = tmp_path / "ckpt" / "step-1"
    assert out.returncode == 0 and out.stdout == f"job 'j': step 1 saved in {step_dir}\n", out
    saved = checkpoint(d, "SaveCheckpoint", tmp_path / "ckpt")  # the same step again
    assert (saved.path, saved.step) == (str(step_dir), 1)
    assert sorted(p.name for p in step_dir.iterdir()) == ["host-0.bin", "host-0.json",
                                                            "manifest.json"]
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert (manifest["format"], manifest["job"], manifest["step"]) == (1, "j", 1)
    meta = json.loads((step_dir / "host-0.json").read_text())
    (unit,) = meta["units"]
    assert (meta["optimizer"], unit["name"], unit["optimizer_steps"]) == ("ADAMW", "u", 1)
    assert [b["what"] for b in unit["blocks"]] == ["masters", "state0", "state1"]
    data = (step_dir / "host-0.bin").read_bytes()
    masters = unit["blocks"][0]
    assert data[masters["offset"]:masters["offset"] + masters["bytes"]] == want[0]

    garble(ranks[0], regions)
    out = d.fsdpctl("--json", "checkpoint", "load", "j", tmp_path / "ckpt")  # the newest
    assert json.loads(out.stdout) == {"path": str(step_dir), "step": 1}, out
    assert snapshot(ranks[0], regions) == want
    # The next step goes on from there.
    assert on_all(ranks, "Unshard", step=2, backward=True) == [None, None]


def test_a_flipped_byte_is_data_loss_naming_the_file_and_range(fsdpd, tmp_path):
    d = fsdpd()
    ranks, regions = trained(d)
    checkpoint(d, "SaveCheckpoint", tmp_path)
    step_dir = tmp_path / "step-1"
    meta = json.loads((step_dir / "host-0.json").read_text())
    block = meta["units"][0]["blocks"][1]  # exp_avg
    data = bytearray((step_dir / "host-0.bin").read_bytes())
    data[block["offset"] + 5] ^= 0x10
    (step_dir / "host-0.bin").write_bytes(bytes(data))
    garble(ranks[0], regions)
    garbled = snapshot(ranks[0], regions)
    code, details = refused(lambda: checkpoint(d, "LoadCheckpoint", step_dir))
    assert code == grpc.StatusCode.DATA_LOSS
    assert (f"{step_dir}/host-0.bin bytes [{block['offset']}, "
            f"{block['offset'] + block['bytes']}) (unit 'u''s state0) do not match their "
            "checksum") in details, details
    assert snapshot(ranks[0], regions) == garbled  # checked before anything was written


def test_refusals_name_what_is_wrong(fsdpd, tmp_path):
    d = fsdpd()
    trained(d)
    checkpoint(d, "SaveCheckpoint", tmp_path)
    manifest = tmp_path / "step-1" / "manifest.json"
    good = manifest.read_text()
    cases = [
        (lambda: checkpoint(d, "SaveCheckpoint", "relative/dir"),
         grpc.StatusCode.INVALID_ARGUMENT,
         "SaveCheckpoint: field 'path' = 'relative/dir': expected an absolute path"),
        (lambda: checkpoint(d, "LoadCheckpoint", tmp_path, job="nope"),
         grpc.StatusCode.NOT_FOUND, "LoadCheckpoint: field 'job' = 'nope': no such job here"),
        (lambda: checkpoint(d, "LoadCheckpoint", tmp_path / "empty"),
         grpc.StatusCode.NOT_FOUND, f"checkpoint: no directory {tmp_path / 'empty'}"),
    ]
    for call, code, text in cases:
        got, details = refused(call)
        assert got == code and text in details, details
    (tmp_path / "step-7").mkdir()  # no manifest: not a checkpoint, and not the newest
    manifest.write_text(json.dumps(dict(json.loads(good), format=2)))
    got, details = refused(lambda: checkpoint(d, "LoadCheckpoint", tmp_path / "step-1"))
    assert got == grpc.StatusCode.FAILED_PRECONDITION and \
        "is of format 2, this fsdpd reads 1" in details, details
    # Another job's checkpoint loads where the caller names it with its own rights (issue 30
    # item 4: a new launch is a new job): a step directory, or a directory holding only
    # another job's checkpoints; the daemon's log says whose it was.
    # test_checkpoint_habits.py tries the rest (the job's own first, checkpoint.dir/<job>/).
    manifest.write_text(json.dumps(dict(json.loads(good), job="other")))
    assert checkpoint(d, "LoadCheckpoint", tmp_path / "step-1").step == 1
    assert checkpoint(d, "LoadCheckpoint", tmp_path).step == 1
    poll(lambda: "checkpoint of step 1 of job 'other' loaded" in d.stderr(), 5,
         what="the load's log line")
    manifest.write_text(good)
    assert checkpoint(d, "LoadCheckpoint", tmp_path).step == 1


def test_a_unit_laid_out_otherwise_is_refused(fsdpd, tmp_path):
    d = fsdpd()
    trained(d)
    checkpoint(d, "SaveCheckpoint", tmp_path)
    meta_path = tmp_path / "step-1" / "host-0.json"
    meta = json.loads(meta_path.read_text())
    meta["units"][0]["numel"] += 1
    meta_path.write_text(json.dumps(meta))
    code, details = refused(lambda: checkpoint(d, "LoadCheckpoint", tmp_path))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "unit 'u' has numel 18, the job's 17" in details, details


def read_safetensors(path):
    """The file by its format alone: u64 little-endian header length, JSON header, raw
    data; every tensor as (dtype, shape, bytes), checking that the data is covered exactly."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    meta = header.pop("__metadata__")
    tensors, end = {}, 0
    for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, stop = t["data_offsets"]
        assert begin == end, (name, begin, end)  # no gap, no overlap
        tensors[name] = (t["dtype"], t["shape"], data[begin:stop])
        end = stop
    assert end == len(data) and (8 + n) % 8 == 0
    return meta, tensors


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_export_writes_safetensors_from_the_files_alone(fsdpd, tmp_path, dtype):
    d = fsdpd()
    ranks, regions = trained(d)
    masters = array.array("f", snapshot(ranks[0], regions)[0])
    checkpoint(d, "SaveCheckpoint", tmp_path / "ckpt")
    d.stop()  # no daemon needed
    out = tmp_path / "model.safetensors"
    args = ["export", tmp_path / "ckpt", "--step", "1", "--out", out]
    r = run_fsdpctl(*args, *(["--dtype", dtype] if dtype != "fp32" else []))
    assert r.returncode == 0 and r.stdout == f"exported {out}\n", r
    meta, tensors = read_safetensors(out)
    assert meta == {"format": "pt", "job": "j", "step": "1"}
    assert list(tensors) == ["p0", "p1"]
    for name, shape, lo, hi in [("p0", [4, 3], 0, 12), ("p1", [5], 12, 17)]:
        kind, got_shape, data = tensors[name]
        values = masters[lo:hi]
        want = (values.tobytes() if dtype == "fp32"
                else struct.pack(f"<{hi - lo}H", *(bf16_bits(v) for v in values)))
        assert (kind, got_shape, data) == ({"fp32": "F32", "bf16": "BF16"}[dtype], shape, want)
    # A flipped byte in the masters: the export refuses, naming where.
    meta_json = json.loads((tmp_path / "ckpt" / "step-1" / "host-0.json").read_text())
    block = meta_json["units"][0]["blocks"][0]
    binary = tmp_path / "ckpt" / "step-1" / "host-0.bin"
    data = bytearray(binary.read_bytes())
    data[block["offset"]] ^= 1
    binary.write_bytes(bytes(data))
    r = run_fsdpctl(*args)
    assert r.returncode == 1 and "do not match their checksum" in r.stderr, r


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs, for a disk that fills up; skips where mounting is not allowed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_keeps_the_previous_checkpoint_and_training(fsdpd, small_disk):
    d = fsdpd()
    ranks, regions = trained(d)
    want = snapshot(ranks[0], regions)
    assert checkpoint(d, "SaveCheckpoint", small_disk).step == 1
    # Fill the disk, then a checkpoint of step 2 finds no room.
    filler = small_disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    assert on_all(ranks, "Unshard", step=2, backward=True) == [None, None]
    code, details = refused(lambda: d.call(
        "/fsdp.v1.Operator/SaveCheckpoint",
        operator_pb2.CheckpointRequest(job="j", path=str(small_disk), step=2),
        operator_pb2.CheckpointReply))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "No space left on device" in details, details
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "step-1"]
    filler.unlink()
    garble(ranks[0], regions)
    assert checkpoint(d, "LoadCheckpoint", small_disk).step == 1  # the previous one, whole
    assert snapshot(ranks[0], regions) == want
    n = len(want[0]) // 4
    for r in ranks:
        r.write_full_grad([0.0] * n, FP32)
    assert on_all(ranks, "ReduceScatter", step=2, step_optimizer=True) == [None, None]


@pytest.mark.skipif(not built_with("FSDP_FAILPOINTS"), reason="built without FSDP_FAILPOINTS")
@pytest.mark.parametrize("stage,step,survivor", [
    ("checkpoint-begun", 2, 1), ("checkpoint-blocks", 2, 1), ("checkpoint-written", 2, 1),
    ("checkpoint-renamed", 2, 2), ("checkpoint-written", 1, 1), ("checkpoint-renamed", 1, 1),
])
def test_a_daemon_killed_while_saving_leaves_a_checkpoint_whole(fsdpd, tmp_path, stage, step,
                                                                survivor):
    """The daemon dies (SIGKILL, a failpoint of the test build) at each stage of its second
    save, of a new step or of the same one again: a new daemon loads the newest complete
    checkpoint, the first one or, once renamed, the second, and every byte is as saved."""
    d = fsdpd(env={"FSDPD_FAILPOINT": f"{stage}:2"})
    ranks, regions = trained(d)
    want = snapshot(ranks[0], regions)
    checkpoint(d, "SaveCheckpoint", tmp_path)
    code, _ = refused(lambda: d.call(
        "/fsdp.v1.Operator/SaveCheckpoint",
        operator_pb2.CheckpointRequest(job="j", path=str(tmp_path), step=step),
        operator_pb2.CheckpointReply, timeout=30))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert d.proc.wait(timeout=10) == -9
    again = fsdpd(name="again")
    ranks, regions = trained(again)
    garble(ranks[0], regions)
    assert checkpoint(again, "LoadCheckpoint", tmp_path).step == survivor
    assert snapshot(ranks[0], regions) == want


def test_the_daemon_saves_every_n_steps_and_keeps_the_newest(fsdpd, tmp_path):
    """checkpoint.every_steps 2, keep 1: when both ranks have asked the forward's gather of
    steps 3 and 5, the job is saved as of steps 2 and 4 (holding the reduces of those steps,
    which write masters, until the snapshot is taken), and only the newest stays."""
    d = fsdpd("--set", f"checkpoint.dir={tmp_path}", "--set", "checkpoint.every_steps=2",
              "--set", "checkpoint.keep=1")
    ranks, regions = trained(d)
    want = snapshot(ranks[0], regions)

    def saved():  # written beside training: polled
        j = tmp_path / "j"
        return sorted(p.name for p in j.iterdir()) if j.exists() else []

    def ended(step):  # the save is over, not only its files there: the next is not skipped
        (job,) = json.loads(d.fsdpctl("--json", "status").stdout)["memory"]["jobs"]
        return job["checkpoint_state"] == "" and job["last_checkpoint_step"] == step

    for step in (3, 4):
        assert on_all(ranks, "Unshard", step=step) == [None, None]
    poll(lambda: ended(2), 10, what="step 2's save")
    assert saved() == ["step-2"]
    assert on_all(ranks, "Unshard", step=5) == [None, None]
    poll(lambda: ended(4), 10, what="step 4's save")
    assert saved() == ["step-4"]  # step 2's gone
    garble(ranks[0], regions)
    assert checkpoint(d, "LoadCheckpoint", tmp_path / "j").step == 4
    assert snapshot(ranks[0], regions) == want


def _train_step(ranks, regions, step):
    n = regions[0][1] // 4
    assert on_all(ranks, "Unshard", step=step, backward=True) == [None, None]
    for r in ranks:
        r.write_full_grad([0.0625 * (i % 3) - 0.0625 for i in range(n)], FP32)
    assert on_all(ranks, "ReduceScatter", step=step, step_optimizer=True) == [None, None]


@pytest.mark.skipif(not built_with("FSDP_FAILPOINTS"), reason="built without FSDP_FAILPOINTS")
@pytest.mark.parametrize("nth", [1, 3], ids=["at-open", "at-the-second-block"])
def test_a_filesystem_without_direct_io_gets_its_checkpoint_through_the_page_cache(
        fsdpd, tmp_path, nth):
    """A save writes its blocks with direct I/O. A filesystem that refuses it (EINVAL, made
    by a failpoint) when the file opens, or at the second block's write (the first block
    then lies direct, padded to 4 KiB), gets the rest through the page cache, and the
    checkpoint loads back bit for bit."""
    d = fsdpd(env={"FSDPD_FAILPOINT": f"checkpoint-direct:{nth}:fail"})
    ranks, regions = trained(d)
    want = snapshot(ranks[0], regions)
    checkpoint(d, "SaveCheckpoint", tmp_path)
    garble(ranks[0], regions)
    assert checkpoint(d, "LoadCheckpoint", tmp_path).step == 1
    assert snapshot(ranks[0], regions) == want


@pytest.mark.skipif(not built_with("FSDP_FAILPOINTS"), reason="built without FSDP_FAILPOINTS")
def test_a_save_is_written_while_training_goes_on(fsdpd, tmp_path):
    """The first save's write stalls 3 s (a failpoint) after its snapshot: meanwhile the job
    trains step 2 with the daemon's AdamW, and a second save waits for the first. The first
    checkpoint holds the job as it was at its snapshot, the second as after step 2."""
    d = fsdpd(env={"FSDPD_FAILPOINT": "checkpoint-begun:1:sleep-3000"})
    ranks, regions = trained(d)
    after_1 = snapshot(ranks[0], regions)
    first = save_later(d, tmp_path / "a")
    _train_step(ranks, regions, 2)  # queued after the snapshot, done before the write
    assert not first.done()
    after_2 = snapshot(ranks[0], regions)
    assert after_2 != after_1
    second = save_later(d, tmp_path / "b")
    (job,) = json.loads(d.fsdpctl("--json", "status").stdout)["memory"]["jobs"]
    assert job["checkpoint_state"] == "writing" and job["last_checkpoint_path"] == ""
    # A load reads through the staging memory the write is writing from.
    code, details = refused(lambda: checkpoint(d, "LoadCheckpoint", tmp_path / "a"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "job 'j' has a save under way: load once it ends" in details, details
    assert job["checkpoint_staging_bytes"] >= sum(n for _, n in regions), job
    assert first.result().step == 1
    assert second.result().step == 2
    (job,) = json.loads(d.fsdpctl("--json", "status").stdout)["memory"]["jobs"]
    assert job["checkpoint_state"] == "" and job["last_checkpoint_step"] == 2
    assert job["last_checkpoint_path"] == str(tmp_path / "b" / "step-2")
    assert f"checkpoint: last step 2 in {tmp_path / 'b' / 'step-2'}; staging" in \
        d.fsdpctl("status").stdout
    for where, want in (("a", after_1), ("b", after_2)):
        garble(ranks[0], regions)
        checkpoint(d, "LoadCheckpoint", tmp_path / where)
        assert snapshot(ranks[0], regions) == want, where


@pytest.mark.skipif(not built_with("FSDP_FAILPOINTS"), reason="built without FSDP_FAILPOINTS")
def test_a_snapshot_holds_the_reduces_and_lets_the_gathers_go_on(fsdpd, tmp_path):
    """A save's snapshot runs beside the work queue. Stalled 3 s (a failpoint), it lets the
    next step's gather through and holds its reduce (whose AdamW step would change the
    masters) until it ends: the checkpoint holds the job as of step 1, and step 2 then
    trains on."""
    d = fsdpd(env={"FSDPD_FAILPOINT": "checkpoint-snapshot:1:sleep-3000"})
    ranks, regions = trained(d)
    after_1 = snapshot(ranks[0], regions)
    saved = save_later(d, tmp_path)

    def save_state():
        (job,) = json.loads(d.fsdpctl("--json", "status").stdout)["memory"]["jobs"]
        return job["checkpoint_state"]
    poll(lambda: save_state() == "taking its snapshot", 10, what="the snapshot")
    assert on_all(ranks, "Unshard", step=2, backward=True) == [None, None]
    n = regions[0][1] // 4
    for r in ranks:
        r.write_full_grad([0.0625 * (i % 3) - 0.0625 for i in range(n)], FP32)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reduced = pool.submit(on_all, ranks, "ReduceScatter", step=2, step_optimizer=True)
        held = snapshot(ranks[0], regions)
        assert save_state() == "taking its snapshot", "the gather waited for the snapshot"
        assert held == after_1 and not reduced.done()
        assert reduced.result(timeout=30) == [None, None]
    assert saved.result().step == 1
    after_2 = snapshot(ranks[0], regions)
    assert after_2 != after_1
    garble(ranks[0], regions)
    checkpoint(d, "LoadCheckpoint", tmp_path)
    assert snapshot(ranks[0], regions) == after_1


@pytest.mark.skipif(not built_with("FSDP_FAILPOINTS"), reason="built without FSDP_FAILPOINTS")
def test_a_load_reads_beside_the_queue_that_serves_the_other_jobs(fsdpd, tmp_path):
    """A load's files are read beside the data plane's queue: stalled 3 s (a failpoint, as a
    slow disk or a hostile file would), it holds no other job's collectives, and then loads
    the job's state whole."""
    d = fsdpd(env={"FSDPD_FAILPOINT": "checkpoint-load:1:sleep-3000"})
    ranks, regions = trained(d)
    want = snapshot(ranks[0], regions)
    checkpoint(d, "SaveCheckpoint", tmp_path)
    garble(ranks[0], regions)
    load = d.channel().unary_unary(
        "/fsdp.v1.Operator/LoadCheckpoint",
        request_serializer=operator_pb2.CheckpointRequest.SerializeToString,
        response_deserializer=operator_pb2.CheckpointReply.FromString)
    loaded = load.future(operator_pb2.CheckpointRequest(job="j", path=str(tmp_path)), timeout=30)
    time.sleep(0.5)  # the read is under way, stalled
    start = time.monotonic()
    others = [Rank(d, r, 2, job="other") for r in range(2)]
    for r in others:
        r.register(shapes=((64,),), param_dtype=FP32, requires_grad=True)
    assert on_all(others, "Unshard", step=1, backward=True) == [None, None]
    assert on_all(others, "ReduceScatter", step=1) == [None, None]
    assert time.monotonic() - start < 2 and not loaded.done(), "the other job waited"
    assert loaded.result().step == 1
    assert snapshot(ranks[0], regions) == want


@pytest.mark.skipif(not built_with("FSDP_FAILPOINTS"), reason="built without FSDP_FAILPOINTS")
def test_a_save_that_finds_another_jobs_step_in_its_place_at_the_end_leaves_it(fsdpd, tmp_path):
    """Job j's save of step 1 stalls before its rename (a failpoint); meanwhile job k saves
    its step 1 into the same directory. j's save, looking again at the end, finds k's there
    and fails naming it: k's checkpoint stays whole (before, j's exchanged it out and
    deleted it)."""
    d = fsdpd(env={"FSDPD_FAILPOINT": "checkpoint-written:1:sleep-3000"})
    trained(d)
    others = [Rank(d, r, 2, job="k") for r in range(2)]
    for r in others:
        r.register(shapes=((64,),), param_dtype=FP32, requires_grad=True)
    assert on_all(others, "Unshard", step=1, backward=True) == [None, None]
    assert on_all(others, "ReduceScatter", step=1) == [None, None]
    stalled = save_later(d, tmp_path)
    time.sleep(0.5)  # j's save is written and stalled before its rename
    assert checkpoint(d, "SaveCheckpoint", tmp_path, job="k").step == 1
    k_files = {p.name: p.read_bytes() for p in (tmp_path / "step-1").iterdir()}
    with pytest.raises(grpc.RpcError) as e:
        stalled.result()
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
    assert "job 'k'" in e.value.details(), e.value.details()
    assert {p.name: p.read_bytes() for p in (tmp_path / "step-1").iterdir()} == k_files


class TwoUnits:
    """Two ranks of job 'j' with units 'u' and 'v' and AdamW in the daemon, both trained
    step 1; a first save into dir/a stalled 3 s in its write (the daemon's failpoint), and a
    second into dir/b asked meanwhile, waiting for it."""

    def __init__(self, d, tmp_path):
        self.d = d
        self.ranks = ranks = [Rank(d, r, 2) for r in range(2)]
        self.layouts = {}
        for u in ("u", "v"):
            for r in ranks:
                self.layouts[u] = r.register(unit=u, shapes=SHAPES, param_dtype=FP32,
                                             requires_grad=True)
        self.regions = []
        for state in set_optimizer(ranks[0], trainer_pb2.ADAMW, group(**ADAMW)).units:
            n = self.layouts[state.unit].padded_numel
            self.regions += [(self.layouts[state.unit].master_offset, 4 * n),
                             (state.steps_offset, 8)]
            self.regions += [(state.arrays_offset + a * state.array_stride, 4 * n)
                             for a in range(state.arrays)]
        for u in ("u", "v"):
            self.train(u, 1)
        self.first = save_later(d, tmp_path / "a")
        poll(lambda: self.save_state() == "writing", 10, what="the first save's write")
        self.second = save_later(d, tmp_path / "b")
        poll(lambda: "waits for the checkpoint under way" in d.stderr(), 10,
             what="the second save")

    def train(self, unit, step):
        n = self.layouts[unit].padded_numel
        assert on_all(self.ranks, "Unshard", unit=unit, step=step, backward=True) == [None] * 2
        for r in self.ranks:
            r.write_full_grad([0.125 * (i % 5) - 0.25 for i in range(n)], FP32, unit=unit)
        assert on_all(self.ranks, "ReduceScatter", unit=unit, step=step,
                      step_optimizer=True) == [None, None]

    def save_state(self):
        (job,) = json.loads(self.d.fsdpctl("--json", "status").stdout)["memory"]["jobs"]
        return job["checkpoint_state"]

    def loads_back(self, path, step, want):
        garble(self.ranks[0], self.regions)
        assert checkpoint(self.d, "LoadCheckpoint", path).step == step
        assert snapshot(self.ranks[0], self.regions) == want


@pytest.mark.skipif(not built_with("FSDP_FAILPOINTS"), reason="built without FSDP_FAILPOINTS")
def test_a_save_that_waited_is_taken_whole_at_the_next_step_boundary(fsdpd, tmp_path):
    """A save asked while another is written waits for it. The job has since reduced unit
    'u' of step 2 and not unit 'v': the waiting save does not copy that mix of steps 1 and
    2, but waits for the step boundary (every rank asking the forward's gather of step 3)
    and holds step 2 whole."""
    t = TwoUnits(fsdpd(env={"FSDPD_FAILPOINT": "checkpoint-begun:1:sleep-3000"}), tmp_path)
    t.train("u", 2)
    assert t.first.result().step == 1
    poll(lambda: t.save_state() == "waiting for the step boundary", 10,
         what="the second save waiting for the boundary")
    t.train("v", 2)
    after_2 = snapshot(t.ranks[0], t.regions)
    assert not t.second.done()
    assert on_all(t.ranks, "Unshard", unit="u", step=3) == [None, None]
    assert t.second.result().step == 2
    t.loads_back(tmp_path / "b", 2, after_2)


@pytest.mark.skipif(not built_with("FSDP_FAILPOINTS"), reason="built without FSDP_FAILPOINTS")
def test_a_save_that_waited_holds_the_step_the_job_is_between(fsdpd, tmp_path):
    """The job trained the whole of step 2 while the second save waited: it holds step 2 at
    once (its reply says so), not step 1 as asked, which is gone."""
    t = TwoUnits(fsdpd(env={"FSDPD_FAILPOINT": "checkpoint-begun:1:sleep-3000"}), tmp_path)
    for u in ("u", "v"):
        t.train(u, 2)
    after_2 = snapshot(t.ranks[0], t.regions)
    assert t.first.result().step == 1
    assert t.second.result().step == 2
    t.loads_back(tmp_path / "b", 2, after_2)


@pytest.mark.skipif(not built_with("FSDP_FAILPOINTS"), reason="built without FSDP_FAILPOINTS")
def test_a_save_that_waits_for_a_boundary_that_does_not_come_ends(fsdpd, tmp_path):
    """The job stopped inside step 2 while the second save waited: that save waits for the
    step boundary as long as a collective may take (store.collective_timeout), then ends
    with DEADLINE_EXCEEDED naming why; the job goes on."""
    d = fsdpd("--set", "store.collective_timeout=2s",
              env={"FSDPD_FAILPOINT": "checkpoint-begun:1:sleep-3000"})
    t = TwoUnits(d, tmp_path)
    t.train("u", 2)
    assert t.first.result().step == 1
    with pytest.raises(grpc.RpcError) as info:
        t.second.result()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
    assert "job 'j' came to no step boundary within store.collective_timeout (2000 ms)" in \
        info.value.details(), info.value.details()
    assert t.save_state() == ""
    t.train("v", 2)
    assert not (tmp_path / "b").exists() or not list((tmp_path / "b").glob("step-*"))


def test_a_stop_abandons_a_paced_write(fsdpd, tmp_path):
    """A save paced to 256 KiB/s (checkpoint.write_rate) would write its 12 MiB for 48 s:
    SIGTERM stops it at its next chunk, the save fails with ABORTED naming the stop, nothing
    of it is left, and the daemon exits 0 at once."""
    d = fsdpd("--set", "checkpoint.write_rate=256KiB")
    ranks = [Rank(d, r, 2) for r in range(2)]
    for r in ranks:
        r.register(shapes=((1024, 1024),), param_dtype=FP32, requires_grad=True)
    set_optimizer(ranks[0], trainer_pb2.ADAMW, group(**ADAMW))
    saves = tmp_path / "saves"
    saving = save_later(d, saves)
    poll(lambda: list(saves.glob("step-*.partial/host-0.bin.tmp")), 10, what="the write")
    start = time.monotonic()
    d.send_signal(signal.SIGTERM)
    with pytest.raises(grpc.RpcError) as info:
        saving.result()
    assert info.value.code() == grpc.StatusCode.ABORTED, info.value
    assert "abandoned by the daemon's stop" in info.value.details(), info.value.details()
    assert d.wait() == 0
    assert time.monotonic() - start < 20  # not the 48 s the write would take
    assert list(saves.iterdir()) == []


def test_a_stop_hurries_a_paced_save_and_saves_after_it(fsdpd, tmp_path):
    """checkpoint.on_stop with a save under way, paced to 256 KiB/s (its 12 MiB would take
    48 s): SIGTERM lifts the pacing, so that save ends at the disk's speed, then the stop's
    own save of the job is written, at the disk's speed too, and the daemon exits 0, well
    within checkpoint.stop_timeout (60 s)."""
    saves = tmp_path / "saves"
    d = fsdpd("--set", "checkpoint.write_rate=256KiB", "--set", f"checkpoint.dir={saves}")
    ranks = [Rank(d, r, 2) for r in range(2)]
    for r in ranks:
        r.register(shapes=((1024, 1024),), param_dtype=FP32, requires_grad=True)
    set_optimizer(ranks[0], trainer_pb2.ADAMW, group(**ADAMW))
    assert on_all(ranks, "Unshard", step=1, backward=True) == [None, None]
    assert on_all(ranks, "ReduceScatter", step=1, step_optimizer=True) == [None, None]
    asked = tmp_path / "asked"
    saving = save_later(d, asked)
    poll(lambda: list(asked.glob("step-*.partial/host-0.bin.tmp")), 10, what="the write")
    start = time.monotonic()
    d.send_signal(signal.SIGTERM)
    assert saving.result().step == 1
    assert d.wait(timeout=40) == 0
    assert time.monotonic() - start < 20  # not the 48 s of either paced write
    assert (asked / "step-1" / "manifest.json").exists()
    assert (saves / "j" / "step-1" / "manifest.json").exists()


def test_a_stop_abandons_host_0s_wait_for_the_other_hosts_files(fsdpd, tmp_path):
    """Two hosts, a save asked of host 0 alone: host 0 writes its files and waits for host
    1's, up to store.collective_timeout (60 s here). SIGTERM ends the wait at once: the save
    fails with ABORTED naming the stop, no checkpoint is made, and the daemon exits 0."""
    from test_cluster import attach, start_cluster
    c = start_cluster(fsdpd, 2, extra=["--set", "store.collective_timeout=60s"])
    for host in attach(c):
        for r in host:
            r.register(shapes=((64,),), param_dtype=FP32, requires_grad=True)
    saves = tmp_path / "saves"
    saving = save_later(c.daemons[0], saves)
    poll(lambda: list(saves.glob("step-*.partial/host-0.json")), 10, what="host 0's files")
    start = time.monotonic()
    c.daemons[0].send_signal(signal.SIGTERM)
    with pytest.raises(grpc.RpcError) as info:
        saving.result()
    assert info.value.code() == grpc.StatusCode.ABORTED, info.value
    assert ("waiting for the other hosts' files in" in info.value.details() and
            "abandoned by the daemon's stop" in info.value.details()), info.value.details()
    assert c.daemons[0].wait() == 0
    assert time.monotonic() - start < 20  # not the 60 s the wait would take
    assert not [p for p in saves.iterdir() if not p.name.endswith(".partial")]


def test_a_save_removes_what_older_saves_that_died_left_in_its_directory(fsdpd, tmp_path):
    """A directory named by the save, not checkpoint.dir: what a save of an older step that
    died left there (step-0.j.partial/) goes once a save of step 1 completes; a newer step's
    is not this save's to judge, and stays, as does what another job's saves left."""
    d = fsdpd()
    ranks = [Rank(d, r, 2) for r in range(2)]
    for r in ranks:
        r.register(shapes=((64,),), param_dtype=FP32, requires_grad=True)
    assert on_all(ranks, "Unshard", step=1, backward=True) == [None, None]
    assert on_all(ranks, "ReduceScatter", step=1) == [None, None]
    saves = tmp_path / "saves"
    for stale in ("step-0.j.partial", "step-9.j.partial", "step-0.other.partial"):
        (saves / stale).mkdir(parents=True)
        (saves / stale / "host-0.json").write_text("{}")
    assert checkpoint(d, "SaveCheckpoint", saves).step == 1
    assert sorted(p.name for p in saves.iterdir()) == ["step-0.other.partial", "step-1",
                                                       "step-9.j.partial"]


def test_a_save_keeps_to_the_write_rate(fsdpd, tmp_path):
    """checkpoint.write_rate 8MiB: a save of 12 MiB of blocks (a unit of 1 Mi fp32 masters
    and AdamW's two arrays) lasts 1.5 s at least, and loads back bit for bit."""
    d = fsdpd("--set", "checkpoint.write_rate=8MiB")
    ranks = [Rank(d, r, 2) for r in range(2)]
    layouts = [r.register(shapes=((1024, 1024),), param_dtype=FP32, requires_grad=True)
               for r in ranks]
    (state,) = set_optimizer(ranks[0], trainer_pb2.ADAMW, group(**ADAMW)).units
    n = layouts[0].padded_numel
    regions = [(layouts[0].master_offset, 4 * n), (state.steps_offset, 8)]
    regions += [(state.arrays_offset + a * state.array_stride, 4 * n)
                for a in range(state.arrays)]
    assert on_all(ranks, "Unshard", step=1, backward=True) == [None, None]
    for r in ranks:
        r.write_full_grad([0.125 * (i % 5) - 0.25 for i in range(n)], FP32)
    assert on_all(ranks, "ReduceScatter", step=1, step_optimizer=True) == [None, None]
    want = snapshot(ranks[0], regions)
    start = time.monotonic()
    checkpoint(d, "SaveCheckpoint", tmp_path)
    assert time.monotonic() - start >= 1.5 - 0.01  # 12 MiB at 8 MiB/s
    garble(ranks[0], regions)
    assert checkpoint(d, "LoadCheckpoint", tmp_path).step == 1
    assert snapshot(ranks[0], regions) == want


@pytest.mark.skipif(not built_with("FSDP_FAILPOINTS"), reason="built without FSDP_FAILPOINTS")
def test_a_scheduled_save_keeps_to_the_disk_share(fsdpd, tmp_path):
    """checkpoint.disk_share 20 and a save every step: the first block's write takes 1 s (a
    failpoint stalls it, as a slow disk would), so the save of step 1, written while the job
    goes on, waits until its writes are a fifth of its time: 5 s at least, where back to
    back it would end after about 1 s. It loads back bit for bit. A save asked by a call
    (SaveCheckpoint), which its caller waits for, writes back to back: the same stall, and
    it ends well before 5 s."""
    options = ("--set", "checkpoint.disk_share=20")
    stall = {"FSDPD_FAILPOINT": "checkpoint-write:1:sleep-1000"}
    d = fsdpd(*options, "--set", f"checkpoint.dir={tmp_path}", "--set",
              "checkpoint.every_steps=1", env=stall)
    ranks, regions = trained(d)
    want = snapshot(ranks[0], regions)

    def ended():
        (job,) = json.loads(d.fsdpctl("--json", "status").stdout)["memory"]["jobs"]
        return job["checkpoint_state"] == "" and job["last_checkpoint_step"] == 1

    start = time.monotonic()
    assert on_all(ranks, "Unshard", step=2) == [None, None]  # step 1's boundary: the save
    poll(ended, 30, what="the scheduled save")
    assert time.monotonic() - start >= 5 - 0.01
    garble(ranks[0], regions)
    assert checkpoint(d, "LoadCheckpoint", tmp_path / "j").step == 1
    assert snapshot(ranks[0], regions) == want

    asked = fsdpd(*options, env=stall, name="asked")
    trained(asked)
    start = time.monotonic()
    checkpoint(asked, "SaveCheckpoint", tmp_path / "asked")
    assert time.monotonic() - start < 4


def test_a_job_that_starts_finds_no_unfinished_save_of_a_run_before(fsdpd, tmp_path):
    """Files that a save which died left in checkpoint.dir/<job>/step-S.<job>.partial/ would count
    as a host's part of a new save of step S: host 0 removes them when the job starts on it,
    before any step of it can be saved. Complete checkpoints stay."""
    job_dir = tmp_path / "j"
    stale = job_dir / "step-2.j.partial"
    stale.mkdir(parents=True)
    (stale / "host-1.json").write_text("{}")
    (stale / "host-1.bin").write_bytes(bytes(64))
    (job_dir / "step-1").mkdir()
    (job_dir / "step-1" / "manifest.json").write_text("{}")
    d = fsdpd("--set", f"checkpoint.dir={tmp_path}")
    two_ranks(d)
    assert sorted(p.name for p in job_dir.iterdir()) == ["step-1"]
    assert (job_dir / "step-1" / "manifest.json").read_text() == "{}"


def test_the_configured_directory_may_go_through_a_link(fsdpd, tmp_path):
    """checkpoint.dir is the operator's: a link in it (a /var on another disk) is followed,
    where a path a caller names is refused one (test_checkpoint_access)."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    options = ("--set", f"checkpoint.dir={tmp_path / 'link' / 'saves'}",
               "--set", "checkpoint.resume=latest")
    d = fsdpd(*options)
    ranks, regions = trained(d)
    want = snapshot(ranks[0], regions)
    d.stop()
    assert (tmp_path / "real" / "saves" / "j" / "step-1" / "manifest.json").exists()
    again = fsdpd(*options, name="again")
    ranks, layouts, regions = with_adamw(again)
    assert [lay.reduced_step for lay in layouts] == [1, 1]
    assert on_all(ranks, "Unshard", step=2) == [None, None]
    assert snapshot(ranks[0], regions) == want


def test_a_stopped_daemon_saves_and_a_restarted_one_resumes(fsdpd, tmp_path):
    """checkpoint.on_stop: SIGTERM between steps saves the job at once and the daemon exits 0.
    With checkpoint.resume = latest a new daemon takes the job up again: its units report
    step 1 as reduced when the ranks register, and before the first gather the masters and
    AdamW's state are the saved ones, bit for bit."""
    saves = tmp_path / "not" / "made"  # the daemon makes it
    options = ("--set", f"checkpoint.dir={saves}", "--set", "checkpoint.resume=latest")
    d = fsdpd(*options)
    ranks, regions = trained(d)
    want = snapshot(ranks[0], regions)
    d.stop()
    assert (saves / "j" / "step-1" / "manifest.json").exists()
    assert "saving 1 job (checkpoint.on_stop) before stopping" in d.stderr()

    again = fsdpd(*options, name="again")
    ranks, layouts, regions = with_adamw(again)
    assert [lay.reduced_step for lay in layouts] == [1, 1]
    assert snapshot(ranks[0], regions) != want  # loaded at the first gather, not before
    assert on_all(ranks, "Unshard", step=2) == [None, None]
    assert snapshot(ranks[0], regions) == want
    assert "resumes from" in again.stderr()


@pytest.mark.skipif(not built_with("FSDP_FAILPOINTS"), reason="built without FSDP_FAILPOINTS")
def test_a_jobs_start_looks_for_its_checkpoint_beside_the_queue(fsdpd, tmp_path):
    """A job new to the daemon looks in checkpoint.dir/<job>/ for what to resume from beside
    the data plane's queue: stalled 3 s there (a failpoint, as a slow disk would), its
    registrations wait, and meanwhile another job registers and trains. Then the job's
    registrations end, with the saved step as reduced, and it resumes."""
    options = ("--set", f"checkpoint.dir={tmp_path}", "--set", "checkpoint.resume=latest")
    d = fsdpd(*options)
    ranks, regions = trained(d)
    want = snapshot(ranks[0], regions)
    d.stop()
    again = fsdpd(*options, name="again", env={"FSDPD_FAILPOINT": "checkpoint-look:1:sleep-3000"})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = pool.submit(with_adamw, again)
        time.sleep(0.5)  # j's look is under way, stalled
        start = time.monotonic()
        others = [Rank(again, r, 2, job="other") for r in range(2)]
        for r in others:
            r.register(shapes=((64,),), param_dtype=FP32, requires_grad=True)
        assert on_all(others, "Unshard", step=1, backward=True) == [None, None]
        assert on_all(others, "ReduceScatter", step=1) == [None, None]
        assert time.monotonic() - start < 2 and not started.done(), "the other job waited"
        ranks, layouts, regions = started.result(timeout=30)
    assert [lay.reduced_step for lay in layouts] == [1, 1]
    assert on_all(ranks, "Unshard", step=2) == [None, None]
    assert snapshot(ranks[0], regions) == want


def test_a_resume_that_cannot_load_fails_the_job_naming_why(fsdpd, tmp_path):
    """The checkpoint to resume from holds a unit of another size: the first gather fails
    naming it, rather than training from the trainers' initial values."""
    d = fsdpd("--set", f"checkpoint.dir={tmp_path}")
    trained(d)
    d.stop()
    again = fsdpd("--set", f"checkpoint.dir={tmp_path}", "--set", "checkpoint.resume=latest",
                  name="again")
    ranks = [Rank(again, r, 2) for r in range(2)]
    for r in ranks:
        r.register(shapes=((6,),), requires_grad=True)
    errors = on_all(ranks, "Unshard", step=2)
    for e in errors:
        assert e is not None and e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
        assert "cannot resume: checkpoint.resume = latest:" in e.details(), e.details()
        assert "unit 'u' has numel 17, the job's 6" in e.details(), e.details()


def test_a_stop_waits_for_the_step_boundary(fsdpd, tmp_path):
    """Trainers with their own optimizer: after step 1's reduce they may still be writing
    its masters, so SIGTERM waits (serving) until every rank asks the gather of step 2, and
    the checkpoint holds what they wrote. A daemon whose trainers never get there stops
    after checkpoint.stop_timeout, saying so."""
    d = fsdpd("--set", f"checkpoint.dir={tmp_path}")
    ranks, layouts = two_ranks(d)
    n = layouts[0].padded_numel
    assert on_all(ranks, "Unshard", step=1, backward=True) == [None, None]
    for r in ranks:
        r.write_full_grad([1.0] * n, FP32)
    assert on_all(ranks, "ReduceScatter", step=1) == [None, None]
    d.send_signal(signal.SIGTERM)
    poll(lambda: "saves at its next step boundary" in d.stderr(), 10, what="the wait")
    stepped = [0.5 * i for i in range(n)]
    for r, lay in zip(ranks, layouts):
        r.write_master_shard(lay, stepped)  # the trainers' optimizer step
    assert d.running()
    assert on_all(ranks, "Unshard", step=2) == [None, None]
    assert d.wait(timeout=20) == 0
    again = fsdpd(name="again")
    ranks, layouts = two_ranks(again)
    region = [(layouts[0].master_offset, 4 * n)]
    assert checkpoint(again, "LoadCheckpoint", tmp_path / "j").step == 1
    assert snapshot(ranks[0], region) == [array.array("f", stepped).tobytes()]

    late = fsdpd("--set", f"checkpoint.dir={tmp_path / 'late'}",
                 "--set", "checkpoint.stop_timeout=300ms", name="late")
    ranks, layouts = two_ranks(late)
    assert on_all(ranks, "Unshard", step=1, backward=True) == [None, None]
    assert on_all(ranks, "ReduceScatter", step=1) == [None, None]
    late.send_signal(signal.SIGTERM)
    assert late.wait(timeout=20) == 0
    assert "stopping without 1 checkpoint not written within" in late.stderr()
    assert not (tmp_path / "late" / "j").exists()
