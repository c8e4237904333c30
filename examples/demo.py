"""make demo: start an fsdpd, train the small transformer with L trainer processes through
it, show what the daemon holds, and stop everything.

    .venv/bin/python examples/demo.py [--build build] [--ranks 2] [--steps 30] [--timeout 300]
                                      [train.py options: --lr 0.01 --global-batch 8 ...]

The daemon runs on a fresh run dir under $TMPDIR with its TCP health port disabled, so it
does not clash with `make run`. Trainers are examples/train.py with LOCAL_RANK,
LOCAL_WORLD_SIZE, FSDPD_SOCKET and FSDPD_JOB set as torchrun would. At the end the demo runs
`fsdpctl status` and `fsdpctl units` against the daemon (the job's units outlive its trainers,
store.job_retention), then stops the daemon with SIGTERM.

Exit status: 0 when every trainer exited 0 and the daemon stopped cleanly; 1 otherwise (a
trainer failed, the run passed --timeout, the daemon did not come up); 130 on Ctrl-C.
Whatever happens, the trainers and the daemon are killed and the run dir removed.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parents[1]
PYTHON = sys.executable  # .venv/bin/python, with torch (scripts/venv.sh)
JOB = "demo"


class Failed(Exception):
    pass


def _terminate(proc, grace=5.0):
    """SIGTERM, then SIGKILL after grace seconds; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt


def start_daemon(build, run_dir, log):
    socket = run_dir / "fsdpd.sock"
    argv = [str(build / "bin" / "fsdpd"), "--run-dir", str(run_dir), "--health-listen", "", "--metrics-listen", "",
            "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDPD_")}
    daemon = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
    deadline = time.monotonic() + 15
    while True:
        if daemon.poll() is not None:
            raise Failed(f"fsdpd exited with {daemon.returncode} at start")
        if socket.exists() and fsdpctl(build, socket, "health", quiet=True) == 0:
            return daemon, socket
        if time.monotonic() > deadline:
            _terminate(daemon)
            raise Failed("fsdpd did not answer a health check within 15 s")
        time.sleep(0.05)


def fsdpctl(build, socket, *args, quiet=False):
    r = subprocess.run([str(build / "bin" / "fsdpctl"), "--socket", str(socket), *args],
                       stdout=subprocess.DEVNULL if quiet else None,
                       stderr=subprocess.DEVNULL if quiet else None, timeout=20)
    return r.returncode


def run_trainers(build, socket, ranks, steps, timeout, extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDPD_")}
    env.update(PYTHONPATH=str(SOURCE_DIR / "python"), FSDPD_LIB=str(build / "lib" / "libfsdp.so"),
               FSDPD_SOCKET=str(socket), FSDPD_JOB=JOB, LOCAL_WORLD_SIZE=str(ranks),
               OMP_NUM_THREADS="1")
    procs = []
    try:
        for r in range(ranks):
            env["LOCAL_RANK"] = str(r)
            procs.append(subprocess.Popen(
                [PYTHON, str(SOURCE_DIR / "examples" / "train.py"), "--steps", str(steps),
                 *extra],
                stdin=subprocess.DEVNULL, env=dict(env)))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
            if failed:
                raise Failed("trainer " + ", ".join(f"rank {r} exited with {c}"
                                                    for r, c in failed))
            if time.monotonic() > deadline:
                raise Failed(f"trainers still running after {timeout:.0f} s")
            time.sleep(0.1)
        failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
        if failed:
            raise Failed("trainer " + ", ".join(f"rank {r} exited with {c}" for r, c in failed))
    finally:
        for p in procs:
            _terminate(p)


def main(argv=None):
    p = argparse.ArgumentParser(description="Train a small transformer through fsdpd.")
    p.add_argument("--build", default=os.environ.get("BUILD", "build"),
                   help="the build dir with bin/fsdpd, bin/fsdpctl, lib/libfsdp.so")
    p.add_argument("--ranks", type=int, default=2, help="trainer processes (default 2)")
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds the trainers may take together (default 300)")
    args, extra = p.parse_known_args(argv)  # the rest goes to train.py
    build = Path(args.build).resolve()
    for f in (build / "bin" / "fsdpd", build / "bin" / "fsdpctl", build / "lib" / "libfsdp.so"):
        if not f.exists():
            print(f"demo: {f} is missing: build first (make build)", file=sys.stderr)
            return 1

    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    tmp = Path(tempfile.mkdtemp(prefix="fsdpd-demo-"))
    run_dir = tmp / "run"  # made by fsdpd with its own mode
    log_path = tmp / "fsdpd.log"
    daemon = None
    status = 1
    try:
        with open(log_path, "wb") as log:
            daemon, socket = start_daemon(build, run_dir, log)
            print(f"fsdpd (pid {daemon.pid}) serving on {socket}; {args.ranks} trainers, "
                  f"job '{JOB}'", flush=True)
            run_trainers(build, socket, args.ranks, args.steps, args.timeout, extra)
            print(f"\n$ fsdpctl --socket {socket} status", flush=True)
            fsdpctl(build, socket, "status")
            print(f"\n$ fsdpctl --socket {socket} units", flush=True)
            fsdpctl(build, socket, "units")
            code = _terminate(daemon, grace=15)
            if code != 0:
                raise Failed(f"fsdpd exited with {code} on SIGTERM")
            status = 0
    except Failed as e:
        print(f"demo: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print("demo: interrupted", file=sys.stderr)
        status = 130
    finally:
        if daemon is not None:
            _terminate(daemon, grace=5)
        if status != 0 and log_path.exists() and log_path.stat().st_size:
            sys.stderr.write("--- fsdpd log ---\n" + log_path.read_text(errors="replace"))
        shutil.rmtree(tmp, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
