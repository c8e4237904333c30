"""The metrics endpoint (metrics.listen: HTTP, GET /metrics, daemon/metrics/http.h) through a
real fsdpd: what two local ranks did (gathers, reduces, the bytes the gathers made, the
daemon's own work as histograms, the calls by method and status code, a refused one
included) is what the exposition says, and promtool, Prometheus's own checker, accepts the
exposition; a real Prometheus server scraping the daemon reads the same back through its
query API. Anything but GET /metrics is refused; an empty metrics.listen serves none, and an
address that cannot be listened on stops the start naming it."""

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import grpc
import pytest

from fsdpd_harness import fsdpd, poll, run_fsdpd  # noqa: F401
from test_peers import free_ports
from test_unshard import BF16, Rank, on_all

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(d):
    with urllib.request.urlopen(d.metrics_url, timeout=5) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        return r.read().decode()


def samples(text):
    """{(name, ((label, value), ...)): value} of every sample line."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = tuple(sorted(LABEL.findall(m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def value(found, name, **labels):
    return found.get((name, tuple(sorted(labels.items()))))


def calls(found, method, code):
    """fsdpd_rpc_calls_total of method and code, over every endpoint."""
    return sum(v for (name, labels), v in found.items()
               if name == "fsdpd_rpc_calls_total" and ("method", method) in labels and
               ("code", code) in labels)


def train(d, steps):
    """Two local ranks of job j, unit u (bf16 copies: the gather casts), `steps` steps of a
    backward Unshard and a ReduceScatter; the layout."""
    ranks = [Rank(d, r, 2) for r in range(2)]
    layouts = [r.register(shapes=((37, 11),), param_dtype=BF16, requires_grad=True)
               for r in ranks]
    for step in range(1, steps + 1):
        assert on_all(ranks, "Unshard", step=step, backward=True) == [None, None]
        assert on_all(ranks, "ReduceScatter", step=step) == [None, None]
    return ranks, layouts[0]


def test_the_metrics_say_what_the_ranks_did(fsdpd):
    d = fsdpd()
    ranks, lay = train(d, 3)
    # A refused call: no gradient buffer is lent now.
    with pytest.raises(grpc.RpcError) as e:
        ranks[0].op("ReduceScatter", step=3)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    text = scrape(d)
    found = samples(text)
    unit = dict(fsdp_job="j", unit="u")
    assert value(found, "fsdpd_unit_gathers_total", **unit) == 3
    assert value(found, "fsdpd_unit_reduces_total", **unit) == 3
    assert value(found, "fsdpd_unit_gathered_bytes_total", **unit) == 3 * lay.numel * 2
    assert value(found, "fsdpd_unit_optimizer_steps_total", **unit) == 0
    for work in ("gather", "reduce"):
        assert value(found, "fsdpd_unit_work_seconds_count", work=work, **unit) == 3
        assert value(found, "fsdpd_unit_work_seconds_bucket", work=work, le="+Inf", **unit) == 3
        assert value(found, "fsdpd_unit_work_seconds_sum", work=work, **unit) > 0
        # The queue's wait apart from the work's own time, one observation each.
        assert value(found, "fsdpd_unit_queue_seconds_count", work=work, **unit) == 3
        assert value(found, "fsdpd_unit_queue_seconds_sum", work=work, **unit) >= 0
    assert calls(found, "/fsdp.v1.Trainer/Unshard", "OK") == 6
    assert calls(found, "/fsdp.v1.Trainer/ReduceScatter", "OK") == 6
    assert calls(found, "/fsdp.v1.Trainer/ReduceScatter", "FAILED_PRECONDITION") == 1
    assert value(found, "fsdpd_sessions") == 2 and value(found, "fsdpd_jobs") == 1
    assert value(found, "fsdpd_job_memory_bytes", fsdp_job="j", memory="read_write") > 0
    # The ranks still hold the last step's copy (from the job's pool: the unit reshards after
    # forward); the gradient buffers went back with the reduces; nobody waited.
    pools = {k: value(found, "fsdpd_pool_buffers_lent", fsdp_job="j", pool=k)
             for k in ("copies", "host_sums", "gradients")}
    assert pools == {"copies": 1, "host_sums": 0, "gradients": 0}
    assert value(found, "fsdpd_pool_bytes", fsdp_job="j", pool="copies") >= lay.numel * 2
    assert value(found, "fsdpd_pool_waits_total", fsdp_job="j", pool="gradients") == 0
    # Prometheus's own checker of the format and its conventions.
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr


def test_anything_but_get_metrics_or_the_page_is_refused(fsdpd):
    d = fsdpd()
    base = d.metrics_url.rsplit("/", 1)[0]
    for url, method, code in ((base + "/nope", "GET", 404), (base + "/metrics", "POST", 405)):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(url, method=method, data=b"" if
                                                          method == "POST" else None), timeout=5)
        assert e.value.code == code
        if code == 405:
            assert e.value.headers["Allow"] == "GET, HEAD"
    assert scrape(d).startswith("# HELP fsdpd_build_info")  # and it goes on serving


def test_an_empty_address_serves_none_and_a_taken_one_stops_the_start(fsdpd, tmp_path):
    d = fsdpd("--metrics-listen", "")
    assert d.metrics_url is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = "127.0.0.1:%d" % taken.getsockname()[1]
        r = run_fsdpd("--run-dir", tmp_path / "run", "--health-listen", "",
                      "--metrics-listen", address)
    assert r.returncode == 1
    assert f"cannot listen on {address} for the metrics endpoint: Address already in use" in \
        r.stderr, r.stderr


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="Debian's prometheus is missing: scripts/setup.sh --test installs it")
def test_a_prometheus_server_scrapes_the_daemon(fsdpd, tmp_path):
    """Prometheus scrapes the daemon every second; its query API gives back the counts of
    the steps the ranks took, and the daemon's target is up. (A training job is the label
    fsdp_job: `job` is Prometheus's own, the scrape job's.)"""
    d = fsdpd()
    target = d.metrics_url.split("//", 1)[1].rsplit("/", 1)[0]
    (port,) = free_ports(1)
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                      "scrape_configs:\n  - job_name: fsdpd\n    static_configs:\n"
                      f"      - targets: ['{target}']\n")
    server = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    try:
        train(d, 2)

        def query(q):
            url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    result = json.loads(r.read())["data"]["result"]
            except (urllib.error.URLError, ConnectionError):
                return None
            return [float(x["value"][1]) for x in result]
        poll(lambda: query('fsdpd_unit_reduces_total{job="fsdpd",fsdp_job="j",unit="u"}')
             == [2.0], 60,
             interval=0.5, what="Prometheus to scrape two reduces")
        assert query('fsdpd_unit_gathers_total{unit="u"}') == [2.0]
        assert query('up{job="fsdpd"}') == [1.0]
        assert query('sum(fsdpd_rpc_calls_total{method="/fsdp.v1.Trainer/Unshard",code="OK"})') \
            == [4.0]
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_stalled_job_is_not_serving_in_its_health_and_the_metrics(fsdpd):
    """Rank 0 of job j asks for a gather that rank 1 never asks for: past health.stall_after
    the job's health service fsdp.job.j is NOT_SERVING (a Watch sees it turn, and back),
    while the daemon's own stays SERVING; the metrics show the stall and its age, the log
    what it waits for. When rank 1 asks, the job goes on and is SERVING again."""
    import threading
    from fsdpd_harness import NOT_SERVING, SERVING
    d = fsdpd("--set", "health.stall_after=300ms", "--set", "daemon.housekeeping_interval=50ms")
    ranks = [Rank(d, r, 2) for r in range(2)]
    for r in ranks:
        r.register(shapes=((8,),), param_dtype=BF16)
    watch = d.watch("fsdp.job.j")
    seen = [next(watch).status]
    assert seen == [SERVING]
    first = threading.Thread(target=ranks[0].op, args=("Unshard",), kwargs=dict(step=1))
    first.start()
    seen.append(next(watch).status)
    assert seen[-1] == NOT_SERVING
    assert d.check("fsdp.job.j") == NOT_SERVING and d.check("") == SERVING
    with pytest.raises(grpc.RpcError) as e:
        d.check("fsdp.job.nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    found = samples(scrape(d))
    assert value(found, "fsdpd_job_stalled", fsdp_job="j") == 1
    assert value(found, "fsdpd_job_oldest_wait_seconds", fsdp_job="j") >= 0.3
    assert "job 'j' unit 'u' step 1: its gather has waited" in d.stderr()
    assert "for local rank(s) 1 (health.stall_after)" in d.stderr()
    ranks[1].op("Unshard", step=1)
    first.join(10)
    seen.append(next(watch).status)
    watch.cancel()
    assert seen == [SERVING, NOT_SERVING, SERVING]
    assert value(samples(scrape(d)), "fsdpd_job_stalled", fsdp_job="j") == 0


def test_a_prefetch_waiting_for_a_copy_is_no_stall(fsdpd):
    """Forward prefetch with one copy at a time: after the ranks' gather of unit a, the
    daemon's prefetch of b waits for a's copy to come back. It began then, not at the loop's
    time 0: the job is neither stalled nor NOT_SERVING while it waits (health.stall_after
    5 s), and its oldest wait is its own."""
    import time
    from fsdpd_harness import SERVING, trainer_pb2
    d = fsdpd("--set", "health.stall_after=5s", "--set", "daemon.housekeeping_interval=50ms")
    ranks = [Rank(d, r, 2) for r in range(2)]
    for r in ranks:
        for unit in ("a", "b"):
            r.register(unit=unit, shapes=((8,),), param_dtype=BF16)
    d.call("/fsdp.v1.Trainer/SetSchedule", trainer_pb2.SetScheduleRequest(
        session_id=ranks[0].session, max_inflight=1, forward_order=["a", "b"],
        forward_prefetch=1), trainer_pb2.SetScheduleReply)
    assert on_all(ranks, "Unshard", unit="a", step=1) == [None, None]
    time.sleep(0.3)  # housekeeping ticks while b's prefetch waits for a's copy
    found = samples(scrape(d))
    assert value(found, "fsdpd_job_stalled", fsdp_job="j") == 0
    assert value(found, "fsdpd_job_oldest_wait_seconds", fsdp_job="j") < 5
    assert d.check("fsdp.job.j") == SERVING
    assert "health.stall_after" not in d.stderr()
    for r in ranks:
        r.op("Reshard", unit="a", step=1)
    assert on_all(ranks, "Unshard", unit="b", step=1) == [None, None]


def page(d):
    with urllib.request.urlopen(d.metrics_url.rsplit("/", 1)[0] + "/", timeout=5) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/html; charset=utf-8"
        assert r.headers["Content-Security-Policy"] == \
            "default-src 'none'; style-src 'unsafe-inline'"
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        return r.read().decode()


def test_the_status_page_shows_the_jobs_units_and_their_last_steps(fsdpd, tmp_path):
    """The page at / on the metrics port: the daemon, job j with its ranks attached, its
    units (a name a page must escape among them, escaped) with their gathers and reduces,
    and the last steps' timeline as SVG, a row a rank and one for the daemon's work, each
    operation titled; a stalled job says why. Headless Chromium renders it (the screenshot
    is left in the test's directory)."""
    import threading
    d = fsdpd("--set", "health.stall_after=200ms", "--set", "daemon.housekeeping_interval=50ms")
    ranks = [Rank(d, r, 2) for r in range(2)]
    odd = "<b>a&b</b>"
    for r in ranks:
        r.register(shapes=((37, 11),), param_dtype=BF16, requires_grad=True)
        r.register(unit=odd, shapes=((8,),), param_dtype=BF16, requires_grad=True)
    for step in (1, 2):
        for unit in ("u", odd):
            assert on_all(ranks, "Unshard", unit=unit, step=step, backward=True) == [None, None]
            assert on_all(ranks, "ReduceScatter", unit=unit, step=step) == [None, None]
    text = page(d)
    assert "<h1>fsdpd " in text and "<h2>Job j</h2>" in text
    assert "2 of 2 local ranks attached" in text
    assert "<tr><td>u</td><td>407</td><td>2</td><td>2</td><td>2</td>" in text, text
    assert "&lt;b&gt;a&amp;b&lt;/b&gt;" in text and odd not in text
    svg = text[text.index("<svg"):text.index("</svg>")]
    assert ">rank 0<" in svg and ">rank 1<" in svg and ">daemon work<" in svg
    for what in ("gather", "reduce"):
        assert [svg.count(f"rank {r}'s {what} of u step") for r in (0, 1)] == [2, 2] and \
            svg.count(f"<title>the daemon's {what} of u step") == 2, (what, svg)
    first = threading.Thread(target=ranks[0].op, args=("Unshard",), kwargs=dict(step=3))
    first.start()
    poll(lambda: "stalled: " in page(d), 10, what="the page to say the job stalls")
    assert "for local rank(s) 1" in page(d)
    chromium = shutil.which("chromium")
    if chromium:
        shot = tmp_path / "status-page.png"
        r = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                            f"--screenshot={shot}", "--window-size=1280,900",
                            d.metrics_url.rsplit("/", 1)[0] + "/"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and shot.stat().st_size > 10000, r.stderr
        print(f"status page screenshot: {shot}")
    ranks[1].op("Unshard", step=3)
    first.join(10)


def test_the_peers_are_in_the_metrics(fsdpd):
    """Two daemons as two hosts: each says the other is up, with a heartbeat's round trip,
    and names no series for itself; one host alone has no peer series. A gather of a unit
    sharded over both: each host's ring sent the other its half of the fp32 copy."""
    from test_cluster import attach, start_cluster
    c = start_cluster(fsdpd, 2, extra=["--set", "peer.heartbeat_interval=100ms"])
    hosts = attach(c)
    layout = [r.register(shapes=((37, 11),)) for rs in hosts for r in rs][0]
    assert on_all([r for rs in hosts for r in rs], "Unshard", step=1) == [None] * 4
    for h, d in enumerate(c.daemons):
        other = str(1 - h)
        poll(lambda: value(samples(scrape(d)), "fsdpd_peer_rtt_seconds", host=other), 10,
             what="a heartbeat's round trip")
        found = samples(scrape(d))
        assert value(found, "fsdpd_peer_up", host=other) == 1
        assert 0 < value(found, "fsdpd_peer_rtt_seconds", host=other) < 5
        assert value(found, "fsdpd_peer_up", host=str(h)) is None
        assert value(found, "fsdpd_unit_ring_sent_bytes_total", fsdp_job="j", unit="u") == \
            layout.padded_numel // 2 * 4
    alone = fsdpd(name="alone")
    assert "fsdpd_peer_up" not in scrape(alone)


def test_checkpoints_are_in_the_metrics(fsdpd, tmp_path):
    """A save and a load through fsdpctl: each counted by outcome, with the bytes of the
    job's state (the same both ways) and their time; a load of a corrupted checkpoint is a
    failed one."""
    d = fsdpd()
    train(d, 1)
    saves = tmp_path / "saves"
    r = d.fsdpctl("checkpoint", "save", "j", str(saves))
    assert r.returncode == 0, r.stderr
    r = d.fsdpctl("checkpoint", "load", "j", str(saves))
    assert r.returncode == 0, r.stderr
    found = samples(scrape(d))
    job = {"fsdp_job": "j"}
    assert value(found, "fsdpd_checkpoint_saves_total", outcome="ok", **job) == 1
    assert value(found, "fsdpd_checkpoint_saves_total", outcome="failed", **job) == 0
    assert value(found, "fsdpd_checkpoint_loads_total", outcome="ok", **job) == 1
    saved = value(found, "fsdpd_checkpoint_bytes_total", op="save", **job)
    assert saved >= 37 * 11 * 4 and value(found, "fsdpd_checkpoint_bytes_total", op="load",
                                          **job) == saved
    assert value(found, "fsdpd_checkpoint_seconds_total", op="save", **job) > 0
    assert value(found, "fsdpd_checkpoint_seconds_total", op="load", **job) > 0
    (step,) = saves.glob("step-*")
    (blob,) = step.glob("host-0.bin")
    data = bytearray(blob.read_bytes())
    data[0] ^= 0xFF  # a block no longer matches its checksum
    blob.write_bytes(bytes(data))
    r = d.fsdpctl("checkpoint", "load", "j", str(saves))
    assert r.returncode == 1 and "DATA_LOSS" in r.stderr + r.stdout, r.stderr
    found = samples(scrape(d))
    assert value(found, "fsdpd_checkpoint_loads_total", outcome="failed", **job) == 1
