"""fsdpd speaks systemd's notify protocol: READY with STATUS and MAINPID once serving,
WATCHDOG pings at least twice per WATCHDOG_USEC, RELOADING then READY around a SIGHUP reload,
STOPPING when SIGTERM starts the drain. A datagram socket stands in for systemd."""

import signal
import socket
import threading
import time

from fsdpd_harness import fsdpd, poll  # noqa: F401  (fsdpd is a pytest fixture)


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
