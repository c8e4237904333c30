"""fsdpd.torch.shard_model against a real fsdpd: L = 2 rank processes train a small
deterministic model (Linear/tanh/Linear/tanh/Linear, wrap={nn.Linear}, plus a root parameter)
with SGD through the daemon, each on its 4 rows of an 8-row batch; a separate process trains
the same model on the whole batch alone. The mean of the ranks' losses at every step and the
final parameters (the ranks' master shards put together, padding dropped) equal the
single-process run within 1e-5 relative (fp32).

Every use of torch and the package runs in a child process with /usr/bin/python3 (see
test_python_client.py for why).
"""

import json
import os
import subprocess
import textwrap

import pytest

from fsdpd_harness import BUILD_DIR, SOURCE_DIR, fsdpd  # noqa: F401

PYTHON = "/usr/bin/python3"
LIB = BUILD_DIR / "lib" / "libfsdp.so"
DAEMON_ARGS = ("--set", "memory.job_limit=256MiB")
CHILD_TIMEOUT = 60
L = 2
STEPS = 5


def _sanitized_build():
    try:
        cache = (BUILD_DIR / "CMakeCache.txt").read_text()
    except FileNotFoundError:
        return False
    return "FSDP_SANITIZE:BOOL=ON" in cache


def _have_torch():
    return subprocess.run([PYTHON, "-c", "import torch"], capture_output=True).returncode == 0


pytestmark = [
    pytest.mark.skipif(_sanitized_build(),
                       reason="ASan/UBSan build: libfsdp.so would need libasan preloaded into "
                              "/usr/bin/python3"),
    pytest.mark.skipif(not _have_torch(),
                       reason="torch is not importable with /usr/bin/python3 "
                              "(apt-get install python3-torch)"),
]

WORKER = textwrap.dedent(r'''
    import json, os, sys
    import torch
    from torch import nn

    STEPS = int(sys.argv[2])

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 7), nn.Tanh())
            self.head = nn.Linear(7, 3)
            self.scale = nn.Parameter(torch.tensor([1.5]))   # left over: the root unit's
            self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)  # stays local
            self.register_buffer("shift", torch.full((3,), 0.25))

        def forward(self, x):
            return self.head(self.body(x)) * self.scale * self.frozen + self.shift

    def build():
        torch.manual_seed(1234)
        net = Net()
        g = torch.Generator().manual_seed(99)
        x = torch.randn(8, 6, generator=g)
        y = torch.randn(8, 3, generator=g)
        return net, x, y

    def names_in_order(net):
        return [n for n, p in net.named_parameters() if p.requires_grad]

    torch.set_num_threads(1)
    mode = sys.argv[1]
    net, x, y = build()
    losses = []
    if mode == "reference":
        opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
        for step in range(STEPS):
            loss = ((net(x) - y) ** 2).mean()
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
        params = {n: p.detach().reshape(-1).tolist() for n, p in net.named_parameters()}
        print(json.dumps({"losses": losses, "params": params}))
    else:
        import fsdpd, fsdpd.torch
        client = fsdpd.Client()
        rank, world = client.rank, client.local_world_size
        rows = slice(rank * 4, rank * 4 + 4)  # equal slices: the mean of means is the mean
        model = fsdpd.torch.shard_model(net, client, wrap={nn.Linear})
        shards = list(model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            loss = ((model(x[rows]) - y[rows]) ** 2).mean()
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
        units = [{"name": u.name, "numel": u.numel, "shard": u.shard,
                  "param_names": u.param_names, "param_offsets": u.param_offsets,
                  "master_shard": u.master_shard.tolist()} for u in model.units]
        out = {"rank": rank, "losses": losses, "units": units,
               "shards_are_masters": all(p.data_ptr() == u.master_shard.data_ptr()
                                         for p, u in zip(shards, model.units)),
               "frozen_local": net.frozen.numel() == 3 and not net.frozen.requires_grad}
        client.close()
        print(json.dumps(out))
''')


def _env(d):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FSDPD_") and k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=str(SOURCE_DIR / "python"), FSDPD_LIB=str(LIB),
               FSDPD_SOCKET=str(d.socket_path) if d else "", FSDPD_JOB="shardmodel",
               LOCAL_WORLD_SIZE=str(L), OMP_NUM_THREADS="1")
    return env


def _run_all(procs):
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=CHILD_TIMEOUT)
            assert p.returncode == 0, f"worker exited {p.returncode}:\n{err}"
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def _close(a, b, rel=1e-5):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-6)


def test_two_ranks_train_like_one_process(fsdpd, tmp_path):
    d = fsdpd(*DAEMON_ARGS)
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    procs = []
    for r in range(L):
        env = _env(d)
        env["LOCAL_RANK"] = str(r)
        procs.append(subprocess.Popen([PYTHON, str(path), "rank", str(STEPS)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=tmp_path))
    procs.append(subprocess.Popen([PYTHON, str(path), "reference", str(STEPS)], env=_env(None),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=tmp_path))
    *ranks, ref = _run_all(procs)

    # Module order: the root (scale), body.0, body.2, head; frozen and buffers not sharded.
    names = [[u["name"] for u in o["units"]] for o in ranks]
    assert names == [["root", "body.0", "body.2", "head"]] * L, names
    assert ranks[0]["units"][0]["param_names"] == ["scale"]
    assert ranks[0]["units"][1]["param_names"] == ["body.0.weight", "body.0.bias"]
    for r, o in enumerate(ranks):
        assert o["rank"] == r and o["shards_are_masters"] and o["frozen_local"]
        assert [u["shard"] for u in o["units"]] == [r] * len(o["units"])

    # Loss per step: the mean over ranks equals the whole batch's.
    for step in range(STEPS):
        mean = sum(o["losses"][step] for o in ranks) / L
        assert _close(mean, ref["losses"][step]), (step, mean, ref["losses"][step])
    assert ref["losses"][-1] < ref["losses"][0]  # it trained

    # Final parameters: the masters put together equal the single process's parameters.
    for i, unit in enumerate(ranks[0]["units"]):
        flat = [v for o in ranks for v in o["units"][i]["master_shard"]][:unit["numel"]]
        offsets = unit["param_offsets"] + [unit["numel"]]
        for j, pname in enumerate(unit["param_names"]):
            got = flat[offsets[j]:offsets[j + 1]]
            want = ref["params"][pname]
            assert len(got) == len(want), pname
            bad = [(k, g, w) for k, (g, w) in enumerate(zip(got, want)) if not _close(g, w)]
            assert not bad, f"{pname}: {bad[:5]}"
