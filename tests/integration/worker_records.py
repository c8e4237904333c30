"""The JSON records of the training workers (shard_model_worker.py) as the tests read them:
one line per step ({"step", "loss", ...}), a final line ({"final": true, "state": ...}), an
error line ({"error", "status"}). No gRPC here, so that the gpu tests, which run where
Debian's packages are not, use it too.
"""

import json


def finish(procs, timeout, expect_rc=0):
    """Each process's records, once all have exited (every one with expect_rc, or any code
    when expect_rc is None); kills what is left on the way out."""
    outs, texts = [], []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            texts.append(f"worker {len(texts)} exited {p.returncode}:\n{out}\n{err}")
            outs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
        if expect_rc is not None:
            assert all(p.returncode == expect_rc for p in procs), "\n".join(texts)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def losses(records):
    """{step: loss}."""
    return {r["step"]: r["loss"] for r in records if "step" in r}


def final(records):
    """The final full state dict: {name: flat list}."""
    return next(r["state"] for r in records if r.get("final"))
