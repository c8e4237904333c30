"""fsdpd speaks systemd's notify protocol: READY with STATUS and MAINPID once serving,
WATCHDOG pings at least twice per WATCHDOG_USEC, RELOADING then READY around a SIGHUP reload,
STOPPING when SIGTERM starts the drain; and journald's, a job's lines carrying its fields. A
datagram socket stands in for systemd."""

import os
import signal
import socket
import threading
import time

import pytest

from fsdpd_harness import fsdpd, poll, trainer_pb2  # noqa: F401  (fsdpd is a pytest fixture)


class NotifySocket:
    """Collects sd_notify datagrams, each split into its KEY=VALUE lines."""

    def __init__(self, path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.messages = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            self.messages.append((time.monotonic(), dict(
                line.split("=", 1) for line in data.decode().splitlines() if "=" in line)))

    def with_key(self, key):
        return [(t, m) for t, m in list(self.messages) if key in m]

    def close(self):
        self._stop = True
        self._thread.join()
        self.sock.close()


def test_notify_ready_watchdog_reload_stopping(fsdpd, tmp_path):
    notify = NotifySocket(tmp_path / "notify.sock")
    try:
        watchdog_usec = 300_000
        d = fsdpd(env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": str(watchdog_usec)})

        ready = poll(lambda: notify.with_key("READY"), 5, what="READY=1")
        _, first = ready[0]
        assert first["READY"] == "1"
        assert first["MAINPID"] == str(d.pid)
        assert first["STATUS"] == f"serving on unix:{d.socket_path}"

        # Pings come at least twice per watchdog period: 5 of them within 3 periods.
        pings = poll(lambda: len(notify.with_key("WATCHDOG")) >= 5 and notify.with_key("WATCHDOG"),
                     3 * watchdog_usec / 1e6 + 2, what="5 WATCHDOG=1 pings")
        gaps = [b[0] - a[0] for a, b in zip(pings, pings[1:])]
        assert max(gaps) < watchdog_usec / 1e6, f"watchdog pings too far apart: {gaps}"

        d.send_signal(signal.SIGHUP)
        poll(lambda: notify.with_key("RELOADING"), 5, what="RELOADING=1")
        poll(lambda: len(notify.with_key("READY")) >= 2, 5, what="READY=1 after the reload")
        d.assert_serving()

        assert d.stop(signal.SIGTERM) == 0
        stopping = notify.with_key("STOPPING")
        assert stopping and stopping[0][1]["STATUS"] == "draining"
    finally:
        notify.close()


def test_no_watchdog_pings_without_watchdog(fsdpd, tmp_path):
    notify = NotifySocket(tmp_path / "notify.sock")
    try:
        d = fsdpd("--set", "daemon.housekeeping_interval=10ms", env={"NOTIFY_SOCKET": notify.path})
        poll(lambda: notify.with_key("READY"), 5, what="READY=1")
        time.sleep(0.2)
        assert notify.with_key("WATCHDOG") == []
        assert d.stop(signal.SIGTERM) == 0
    finally:
        notify.close()


JOURNAL = "/run/systemd/journal/socket"


@pytest.mark.skipif(os.path.exists(JOURNAL) or os.geteuid() != 0,
                    reason="a journal runs here (or no root to stand one in)")
def test_under_journald_a_jobs_lines_carry_its_fields(fsdpd, tmp_path):
    """Under journald (JOURNAL_STREAM names its stderr) a line about a job is a journal entry
    with the fields JOB, UNIT, STEP, RANK and CODE beside MESSAGE and PRIORITY: a session's
    end says its job and rank, a collective's timeout its job, unit, step, the missing rank
    and ABORTED. Plain lines keep the stream, with their priority. A datagram socket at
    journald's path stands in for it."""
    import grpc
    from test_unshard import FP32, Rank
    made = [p for p in ("/run/systemd", "/run/systemd/journal") if not os.path.isdir(p)]
    for p in made:
        os.mkdir(p, 0o755)
    journal = NotifySocket(JOURNAL)
    try:
        log = tmp_path / "fsdpd0.stderr"  # the harness's name for it, made first to know it
        log.touch()
        st = os.stat(log)
        d = fsdpd("--set", "store.collective_timeout=300ms",
                  "--set", "daemon.housekeeping_interval=20ms",
                  env={"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert "<6>" in d.stderr() and "fsdpd: info:" not in d.stderr()
        ranks = [Rank(d, r, 2) for r in range(2)]
        for r in ranks:
            r.register(shapes=((8,),), param_dtype=FP32)
        with pytest.raises(grpc.RpcError):
            ranks[0].op("Unshard", step=1)
        d.call("/fsdp.v1.Trainer/Detach", trainer_pb2.DetachRequest(session_id=ranks[1].session),
               trainer_pb2.DetachReply)
        entries = lambda: [m for _, m in list(journal.messages)  # noqa: E731
                           if "SYSLOG_IDENTIFIER" in m]
        poll(lambda: any(m.get("RANK") == "1" and "JOB" in m and "UNIT" not in m
                         for m in entries()), 10, what="the session's end in the journal")
        timeout = next(m for m in entries() if m.get("CODE") == "ABORTED")
        assert {k: timeout[k] for k in ("JOB", "UNIT", "STEP", "RANK", "PRIORITY",
                                        "SYSLOG_IDENTIFIER")} == \
            {"JOB": "j", "UNIT": "u", "STEP": "1", "RANK": "1", "PRIORITY": "4",
             "SYSLOG_IDENTIFIER": "fsdpd"}
        assert "did not ask to unshard in time" in timeout["MESSAGE"]
        end = next(m for m in entries() if m.get("RANK") == "1" and "UNIT" not in m)
        assert end["JOB"] == "j" and "ended: detached" in end["MESSAGE"], end
    finally:
        journal.close()
        os.unlink(JOURNAL)
        for p in reversed(made):
            os.rmdir(p)
