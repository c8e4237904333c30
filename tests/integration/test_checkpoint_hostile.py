"""A damaged or hostile checkpoint gets DATA_LOSS naming the file and the key, never a crash
or a hang (issue 29, item 2), through the daemon's LoadCheckpoint, checkpoint.resume = latest
and `fsdpctl export`: host files whose values are of the wrong type or describe more than
the files hold, manifest steps that are not non-negative integers, a FIFO or a link to
/dev/zero in place of a file, and an export whose output name someone planted a link at."""

import json
import os
import time

import grpc
import pytest

from fsdpd_harness import fsdpd, operator_pb2, run_fsdpctl  # noqa: F401
from test_checkpoint import garble, read_safetensors, snapshot, trained
from test_optimizer import refused
from test_unshard import Rank, on_all

# A refusal comes at once: far within this, which LoadCheckpoint's deadline is.
DEADLINE_S = 10


def load(d, path, job="j"):
    return d.call("/fsdp.v1.Operator/LoadCheckpoint",
                  operator_pb2.CheckpointRequest(job=job, path=str(path)),
                  operator_pb2.CheckpointReply, timeout=DEADLINE_S)


def save(d, path, job="j"):
    return d.call("/fsdp.v1.Operator/SaveCheckpoint",
                  operator_pb2.CheckpointRequest(job=job, path=str(path)),
                  operator_pb2.CheckpointReply, timeout=30)


def edit_json(path, edit):
    """path's JSON, changed by edit (which changes it in place)."""
    o = json.loads(path.read_text())
    edit(o)
    path.write_text(json.dumps(o))


def unit_set(key, value, param=None, block=None):
    """An edit of host-0.json: unit 0's key (of its parameter or block of that index)."""
    def edit(meta):
        o = meta["units"][0]
        if param is not None:
            o = o["params"][param]
        elif block is not None:
            o = o["blocks"][block]
        o[key] = value
    return edit


def huge_numel(meta):
    """A layout that holds together, but for the files: 2^62 elements."""
    meta["units"][0].update(numel=2**62, padded_numel=2**62, shard_numel=2**61)


# Each edit of host-0.json, and the words of the refusal besides the file's name.
HOST_EDITS = [
    ("blocks-not-array", unit_set("blocks", 5), "unit 'u': key 'blocks'"),
    ("blocks-object", unit_set("blocks", {"offset": 0}), "unit 'u': key 'blocks'"),
    ("params-not-array", unit_set("params", "x"), "unit 'u': key 'params'"),
    ("shape-not-array", unit_set("shape", 7, param=0), "unit 'u': parameter 'p0': key 'shape'"),
    ("shape-2^63", unit_set("shape", [2**63, 0], param=0), "unit 'u': parameter 'p0': 'shape'[0]"),
    ("shape-overflows", unit_set("shape", [2**32, 2**32, 2**32], param=0),
     "unit 'u': parameter 'p0': the product of the nonzero dimensions of 'shape' is past"),
    ("param-negative-offset", unit_set("offset", -1, param=1),
     "unit 'u': parameter 'p1': key 'offset'"),
    ("param-past-numel", unit_set("offset", 13, param=1), "unit 'u': parameter 'p1': its elements"),
    ("units-not-array", lambda m: m.update(units={"u": 1}), "key 'units'"),
    ("numel-2^62", huge_numel, "unit 'u': key 'numel'"),
    ("block-past-the-end", unit_set("offset", 1 << 40, block=0),
     "unit 'u': blocks[0] (masters): 'offset' + 'bytes'"),
    ("block-negative-offset", unit_set("offset", -4096, block=1), "unit 'u': blocks[1]"),
    ("block-bytes", unit_set("bytes", 2**62, block=0), "unit 'u': blocks[0] (masters): 'bytes'"),
    ("unit-twice", lambda m: m["units"].append(m["units"][0]), "unit 'u': listed twice"),
]


@pytest.fixture
def saved(fsdpd, tmp_path):
    """A daemon whose job 'j' (AdamW, one step) is saved in tmp_path/ckpt/step-1: the daemon,
    the step directory, its files' good bytes, the ranks' memory regions (garbled since)."""
    d = fsdpd()
    ranks, regions = trained(d)
    save(d, tmp_path / "ckpt")
    step_dir = tmp_path / "ckpt" / "step-1"
    good = {p.name: p.read_bytes() for p in step_dir.iterdir()}
    garble(ranks[0], regions)
    return d, step_dir, good, ranks, regions


def restore(step_dir, good):
    for name, data in good.items():
        p = step_dir / name
        if p.is_symlink() or p.exists() and not p.is_file():
            os.unlink(p)
        p.write_bytes(data)


def refused_at_once(call):
    start = time.monotonic()
    code, details = refused(call)
    assert time.monotonic() - start < DEADLINE_S / 2, details
    return code, details


def other_job(d):
    """Job 'k' beside 'j': its two ranks, registered."""
    ranks = [Rank(d, r, 2, job="k") for r in range(2)]
    for r in ranks:
        r.register(shapes=((8,),), requires_grad=True)
    return ranks


def test_host_files_of_the_wrong_types_and_sizes_are_data_loss_naming_file_and_key(saved):
    d, step_dir, good, ranks, regions = saved
    garbled = snapshot(ranks[0], regions)
    k = other_job(d)
    for name, edit, words in HOST_EDITS:
        restore(step_dir, good)
        edit_json(step_dir / "host-0.json", edit)
        code, details = refused_at_once(lambda: load(d, step_dir.parent))
        assert code == grpc.StatusCode.DATA_LOSS, (name, details)
        assert f"{step_dir}/host-0.json: {words}" in details, (name, details)
        assert d.running(), name
    assert snapshot(ranks[0], regions) == garbled  # nothing was written
    assert on_all(k, "Unshard", step=1) == [None, None]  # the other job goes on
    restore(step_dir, good)
    assert load(d, step_dir.parent).step == 1


@pytest.mark.parametrize("step", [-5, "abc", 1.5, 2**64])
def test_a_manifest_step_that_is_not_a_non_negative_integer_is_refused(saved, step):
    d, step_dir, good, _, _ = saved
    edit_json(step_dir / "manifest.json", lambda m: m.update(step=step))
    code, details = refused_at_once(lambda: load(d, step_dir))
    assert code == grpc.StatusCode.DATA_LOSS, details
    assert f"{step_dir}/manifest.json: key 'step' is missing or not a non-negative integer" \
        in details, details
    # Under its parent it is no complete checkpoint, and never the newest.
    code, details = refused_at_once(lambda: load(d, step_dir.parent))
    assert code == grpc.StatusCode.NOT_FOUND, details


@pytest.mark.parametrize("name", ["manifest.json", "host-0.json", "host-0.bin"])
def test_a_fifo_or_a_link_to_dev_zero_in_place_of_a_file_is_refused_at_once(saved, name):
    d, step_dir, good, _, _ = saved
    k = other_job(d)
    rss_before = d.rss_mb()
    for kind in ("fifo", "/dev/zero", "link to a good copy"):
        restore(step_dir, good)
        path = step_dir / name
        os.unlink(path)
        if kind == "fifo":
            os.mkfifo(path)
        else:
            copy = step_dir.parent / "copy"
            copy.write_bytes(good[name])
            os.symlink("/dev/zero" if kind == "/dev/zero" else copy, path)
        code, details = refused_at_once(lambda: load(d, step_dir))
        what = "not a regular file" if kind == "fifo" else "a symbolic link"
        assert code == grpc.StatusCode.DATA_LOSS, (kind, details)
        assert f"{step_dir}/{name} is {what}" in details, (kind, details)
    assert d.rss_mb() < rss_before + 64  # nothing read from /dev/zero
    assert on_all(k, "Unshard", step=1) == [None, None]
    assert d.stop() == 0  # SIGTERM is heeded: nothing hangs in a read


def test_a_daemon_resuming_from_a_hostile_newest_step_starts_and_names_it(fsdpd, tmp_path):
    """checkpoint.resume = latest with a host file whose blocks are not an array: the daemon
    starts (it aborted at every start: a crash loop), fails the job's first gather naming the
    file and the key, logs it, and serves other jobs."""
    options = ("--set", f"checkpoint.dir={tmp_path}", "--set", "checkpoint.resume=latest")
    d = fsdpd(*options)
    trained(d)
    d.stop()
    host_json = tmp_path / "j" / "step-1" / "host-0.json"
    edit_json(host_json, unit_set("blocks", 5))

    again = fsdpd(*options, name="again")
    ranks = [Rank(again, r, 2) for r in range(2)]
    for r in ranks:
        r.register(shapes=((4, 3), (5,)), requires_grad=True)
    words = f"{host_json}: unit 'u': key 'blocks' is missing or not an array"
    for e in on_all(ranks, "Unshard", step=2):
        assert e is not None and "cannot resume" in e.details(), e
        assert words in e.details(), e.details()
    assert words in again.stderr()
    assert on_all(other_job(again), "Unshard", step=1) == [None, None]
    assert again.running()


def test_a_damaged_newest_manifest_is_named_not_passed_over(fsdpd, tmp_path):
    """checkpoint.resume = latest with the newest step's manifest damaged: the job does not
    start anew (nor from an older step) without a word; its first gather fails naming the
    manifest."""
    options = ("--set", f"checkpoint.dir={tmp_path}", "--set", "checkpoint.resume=latest")
    d = fsdpd(*options)
    trained(d)
    d.stop()
    (tmp_path / "j" / "step-1" / "manifest.json").write_text('{"format": 1, "job": ')
    again = fsdpd(*options, name="again")
    ranks = [Rank(again, r, 2) for r in range(2)]
    for r in ranks:
        r.register(shapes=((4, 3), (5,)), requires_grad=True)
    for e in on_all(ranks, "Unshard", step=2):
        assert e is not None and "cannot resume" in e.details(), e
        assert "step-1/manifest.json is not JSON" in e.details(), e.details()
    assert again.running()


def export(step_dir, out):
    return run_fsdpctl("export", step_dir, "--out", out, timeout=DEADLINE_S)


@pytest.mark.parametrize("name,edit,words", HOST_EDITS)
def test_export_refuses_hostile_host_files(saved, tmp_path, name, edit, words):
    d, step_dir, good, _, _ = saved
    d.stop()
    edit_json(step_dir / "host-0.json", edit)
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "model.safetensors"
    r = export(step_dir, out)
    assert r.returncode == 1, r  # an error, not a signal
    assert f"{step_dir}/host-0.json: {words}" in r.stderr, r.stderr
    assert list((tmp_path / "out").iterdir()) == []  # nothing written, nothing left


def test_export_never_writes_through_a_planted_link(saved, tmp_path):
    """A link at OUT.tmp (where the export wrote first) or at OUT itself: the victim it names
    is left as it was, OUT is the export's own regular file."""
    d, step_dir, _, _, _ = saved
    d.stop()
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "model.safetensors"
    victim = tmp_path / "out" / "victim"
    victim.write_text("secret")
    os.symlink(victim, tmp_path / "out" / "model.safetensors.tmp")
    assert export(step_dir, out).returncode == 0
    assert victim.read_text() == "secret" and out.is_file() and not out.is_symlink()
    out.unlink()
    os.symlink(victim, out)
    assert export(step_dir, out).returncode == 0
    assert victim.read_text() == "secret" and out.is_file() and not out.is_symlink()
    meta, tensors = read_safetensors(out)
    assert {n: t[1] for n, t in tensors.items()} == {"p0": [4, 3], "p1": [5]}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "model.safetensors", "model.safetensors.tmp", "victim"]
