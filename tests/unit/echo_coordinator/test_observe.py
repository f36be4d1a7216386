"""What the dashboard, the API, /metrics and `status` read: a real service, SQLite ledger and
metrics file, served by the real HTTP server on 127.0.0.1."""

import asyncio
import contextlib
import json
import socket
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from echo_coordinator import observe, web
from echo_coordinator.ledger import Ledger
from tests.support.runs import stopped_run
from echo_coordinator.observe import RunView
from echo_coordinator.report import read_report
from protocols.signing import fingerprint, generate_key, public_bytes
from tests.unit.echo_coordinator.service.test_run_service import NOW, answer_batch, lease_request, push, service  # noqa: F401
from tests.unit.protocols.factories import peer_id

STEP = dict(version=0, mode="sequential", samples=4, reward_mean=0.75, step_seconds=20.0, wait_seconds=15.0, time=NOW,
            mismatch_kl=0.01, tis_clipped_fraction=0.02, staleness_histogram={"0": 4}, rejected_by_reason={})


@pytest.fixture
def run_dir(tmp_path, service):  # noqa: F811
    """One trained step from one node (a lease issued at NOW, pushed 4 s later) and one refusal."""
    service.ledger.set_run(run_id="run-1", mode="sequential", version=0, steps=10, samples_per_step=4, staleness=4,
                           model="tiny.gguf", task="arithmetic")
    node, cheat = generate_key(), generate_key()
    service.open_step([10, 11])
    service.throughput.published_version(0, NOW - 1)
    lease = service.handle_lease(lease_request(node, name="alice", backend="llama_cpp", parallel=16), peer_id("A"), now=NOW)
    push(service, answer_batch(service, node, lease), peer_id("A"), now=NOW + 4)
    service.take_batch()
    service.commit_step(0)
    service.publish([])
    service.gate.advance(1)
    service.ledger.set_run(version=1)
    service.ledger.reject(fingerprint(public_bytes(cheat)), peer_id("C"), "<img src=x onerror=alert(1)>", "bad_sampling", 4)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(STEP) + "\n")
    return tmp_path, fingerprint(public_bytes(node))


def test_run_and_peers_from_ledger_metrics_and_live_state(run_dir, service):  # noqa: F811
    path, alice = run_dir
    view = RunView(path, service.ledger, live=service.live)
    run = view.run(now=NOW + 5)
    assert (run["version"], run["steps"], run["steps_left"], run["state"]) == (1, 10, 9, "running")
    assert run["live"]
    assert run["eta_seconds"] == 9 * 20.0 and run["samples_per_second"] == 4 / 20.0
    assert run["trainer_busy"] == pytest.approx(0.25) and run["reward_mean"] == 0.75
    assert run["rejections_by_reason"] == {"bad_sampling": 4}
    cap = run["capacity"]  # 4 samples in 4 s against 4 samples per 5 s of training
    assert cap["produced"] == pytest.approx(1.0, rel=0.01) and cap["needed"] == pytest.approx(0.8)
    assert cap["bottleneck"] == "trainer" and cap["predicted_busy"] == pytest.approx(5 / 9, rel=0.01)
    peers = {p["name"]: p for p in view.peers(now=NOW + 5)}
    a = peers["alice"]
    assert (a["node_id"], a["accepted"], a["share"], a["backend"], a["version_lag"]) == (alice, 4, 1.0, "llama_cpp", 1)
    assert a["parallel"] == 16  # the batch it says it decodes, for the dashboard's batch column
    assert a["tokens_per_second"] == pytest.approx(2.0, rel=0.01) and a["trust"] == "new"  # 8 tokens in 4 s
    assert a["abandoned"] == 0.0  # its one lease answered (selective reporting's measure, issue 36 point 4)
    assert peers["<img src=x onerror=alert(1)>"]["rejected_by_reason"] == {"bad_sampling": 4}
    detail = view.peer(alice, now=NOW + 5)
    assert [(h["version"], h["samples"], h["tokens"]) for h in detail["history"]] == [(1, 4, 8)]
    assert view.peer("nobody") is None


def test_a_node_with_work_accepted_is_listed_before_its_first_credit(tmp_path, service):  # noqa: F811
    """Credit (the ledger row) comes when a step that trained on the work ends, minutes into a run:
    until then the peers table listed nobody while capacity counted the producing node."""
    service.ledger.set_run(run_id="run-1", mode="sequential", version=0, steps=10, samples_per_step=4, staleness=4,
                           model="tiny.gguf", task="arithmetic")
    node, idle = generate_key(), generate_key()
    service.open_step([10, 11])
    lease = service.handle_lease(lease_request(node, name="bob"), peer_id("B"), now=NOW)
    push(service, answer_batch(service, node, lease), peer_id("B"), now=NOW + 4)
    service.handle_lease(lease_request(idle, name="idle"), peer_id("I"), now=NOW + 5)  # asked, produced nothing
    view = RunView(tmp_path, service.ledger, live=service.live)
    (bob,) = view.peers(now=NOW + 5)
    assert (bob["name"], bob["node_id"], bob["accepted"], bob["trust"]) == ("bob", fingerprint(public_bytes(node)), 0, "new")
    assert bob["samples_per_second"] > 0 and view.run(now=NOW + 5)["peers_active"] == 1


def test_metrics_file_is_read_on_and_half_lines_wait(run_dir, service):  # noqa: F811
    path, _ = run_dir
    view = RunView(path, service.ledger)
    assert len(view.steps()) == 1
    with open(path / "metrics.jsonl", "a") as f:
        f.write(json.dumps(dict(STEP, version=1))[:20])  # a step being written
        f.flush()
        assert len(view.steps()) == 1
        f.write(json.dumps(dict(STEP, version=1))[20:] + "\n")
    assert [s["version"] for s in view.steps()] == [0, 1]
    run = view.run(now=NOW)
    assert run["state"] == "stopped" and run["capacity"]["bottleneck"] == "unknown"  # no live process
    # A stopped run has no ETA, and nobody is active in it, however recently they were seen.
    assert not run["live"] and run["eta_seconds"] is None and run["peers_active"] == 0


@contextlib.contextmanager
def serving(view: RunView):
    """The real dashboard server for `view` on 127.0.0.1, in a thread; yields its URL."""
    sock = web.bind("127.0.0.1", 0)
    loop = asyncio.new_event_loop()
    task = loop.create_task(web.serve(view, sock))

    def run():
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(task)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/"
    loop.call_soon_threadsafe(task.cancel)
    thread.join(5)


@pytest.fixture
def server(run_dir, service):  # noqa: F811
    path, alice = run_dir
    with serving(RunView(path, service.ledger, live=service.live)) as url:
        yield url, alice, path


def get(url: str, method: str = "GET") -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5) as r:
            return r.status, r.read(), r.headers["content-type"]
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers["content-type"]


def test_http_api(server):
    base, alice, path = server
    status, body, kind = get(base + "api/run")
    assert status == 200 and kind == "application/json" and json.loads(body)["version"] == 1
    peers = json.loads(get(base + "api/peers")[1])
    assert {p["name"] for p in peers} == {"alice", "<img src=x onerror=alert(1)>"}
    assert json.loads(get(base + f"api/peers/{alice}")[1])["history"][0]["samples"] == 4
    assert get(base + "api/peers/nobody")[0] == 404
    assert get(base + "api/run", method="POST")[0] == 405  # read-only
    assert get(base + "nothing")[0] == 404
    status, page, kind = get(base)
    assert status == 200 and kind.startswith("text/html") and b"Echo swarm" in page


def test_page_fetches_nothing_from_elsewhere(server):
    page = get(server[0])[1].decode()
    assert "src=" not in page and "href=" not in page and "@import" not in page
    assert "innerHTML" not in page  # peer names and reasons are set as text only


def test_prometheus_text(server):
    base, alice, _ = server
    status, body, kind = get(base + "metrics")
    assert status == 200 and kind.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert families["echo_version"].samples[0].value == 1
    assert families["echo_steps_target"].samples[0].value == 10
    assert families["echo_trainer_busy_ratio"].samples[0].value == pytest.approx(0.25)
    accepted = {s.labels["node_id"]: s.value for s in families["echo_peer_accepted_samples"].samples
                if s.name.endswith("_total")}
    assert accepted[alice] == 4
    refused = [s for s in families["echo_rejected_samples"].samples if s.name.endswith("_total")]
    assert [(s.labels["reason"], s.value) for s in refused] == [("bad_sampling", 4)]
    # The refused key, never a contributor, has no series of its own.
    assert {s.labels["node_id"] for f in families.values() for s in f.samples if "node_id" in s.labels} == {alice}


def test_status_reads_the_live_dashboard(server):
    base, alice, path = server
    (path / "dashboard.txt").write_text(base + "\n")
    report = read_report(path)
    assert report["live"] and report["run_id"] == "run-1" and report["progress"]["version"] == 1
    assert {p["backend"] for p in report["peers"]} == {"llama_cpp", ""}
    (path / "dashboard.txt").write_text("http://127.0.0.1:9/\n")  # a stale file: read the directory instead
    report = read_report(path)
    assert not report["live"] and report["progress"]["state"] == "stopped"
    # A stopped run whose port another run now serves: that run's numbers are not this one's.
    report = read_report(stopped_run(path / "other", base, steps=3))
    assert not report["live"] and report["run_id"] == "run-2" and report["progress"]["steps"] == 3


def test_status_of_a_stopped_run_that_the_dashboard_command_serves_says_not_running(run_dir, service):  # noqa: F811
    """`echo-coordinator dashboard DIR` serves a stopped run at the URL `status` asks: what it
    serves is that run, but nothing of it is live."""
    path, _ = run_dir
    with serving(RunView(path, service.ledger)) as url:
        (path / "dashboard.txt").write_text(url + "\n")
        report = read_report(path)
    assert not report["live"] and report["progress"]["state"] == "stopped"
    assert report["progress"]["eta_seconds"] is None and report["progress"]["peers_active"] == 0


def test_the_api_answers_only_requests_for_its_own_address(server):
    """DNS rebinding: a page on evil.example points its name at 127.0.0.1; the browser then sends
    `Host: evil.example`, and the dashboard must not answer it."""
    base = server[0]
    request = urllib.request.Request(base + "api/peers", headers={"Host": "evil.example"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=5)
    assert e.value.code == 400
    assert get(base + "api/peers")[0] == 200
    assert web.allowed_hosts("0.0.0.0") == ["*"] and "evil.example" not in web.allowed_hosts("127.0.0.1")


def test_port_in_use_falls_back_to_a_free_one():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    sock = web.bind("127.0.0.1", port)
    assert sock.getsockname()[1] not in (port, 0)
    sock.close()
    taken.close()
    with pytest.raises(OSError, match="dashboard cannot listen"):
        web.bind("203.0.113.1", 0)  # not an address of this machine


def test_status_command_renders_the_directory(run_dir, service):  # noqa: F811
    from typer.testing import CliRunner

    from echo_coordinator.cli import app

    path, alice = run_dir
    service.ledger.reject(fingerprint(public_bytes(generate_key())), peer_id("M"), "[blink]mallory[/blink]", "bad_lease", 1)
    out = CliRunner().invoke(app, ["status", "--data-dir", str(path)], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "version 1 / 10" in out.output and "(not running)" in out.output
    assert "alice" in out.output and "bad_sampling 4" in out.output
    assert "[blink]mallory[/blink]" in out.output  # a peer's name is text, never Rich markup
    report = json.loads(CliRunner().invoke(app, ["status", "--data-dir", str(path), "--json"]).output)
    assert {"run_id", "mode", "version", "steps", "peers"} <= set(report)  # the keys it always had, and more
    assert report["progress"]["capacity"]["bottleneck"] == "unknown" and not report["live"]
    # At 80 columns: fewer columns, each whole (every column squeezed to two letters was unreadable).
    narrow = CliRunner().invoke(app, ["status", "--data-dir", str(path)], env={"COLUMNS": "80"}).output
    header = next(line for line in narrow.splitlines() if "accepted" in line)
    assert all(word in header for word in ("name", "share", "accepted", "rejected", "tokens/s", "last seen"))
    assert "node_id" not in narrow and "alice" in narrow
    assert max(len(line) for line in narrow.splitlines() if "│" in line or "┃" in line) <= 80
    missing = CliRunner().invoke(app, ["status", "--data-dir", str(path / "nothing")])
    assert missing.exit_code == 1 and "no run found" in missing.output


@pytest.fixture
def crowd(tmp_path):
    """A stopped run's ledger of 120 credited peers (peer i has i + 1 samples) and 5 only refused."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.set_run(run_id="crowd", mode="async", version=3, steps=3, samples_per_step=4, staleness=2)
    for i in range(120):
        ledger.credit(f"{i:016x}", peer_id(str(i)), f"volunteer-{i:03d}", i + 1, 10 * i, now=NOW, version=1)
    for i in range(5):
        ledger.reject(f"f{i:015x}", peer_id(f"x{i}"), f"junk-{i}", "bad_sampling", 2, now=NOW)
    yield RunView(tmp_path, ledger)
    ledger.close()


def test_the_peers_table_is_sorted_filtered_and_paged_by_the_server(crowd):
    """Issue 37 point 5: a run of a thousand volunteers sends the page one page of rows."""
    with serving(crowd) as base:
        def ask(query: str) -> dict:
            status, body, _ = get(base + "api/peer-page" + query)
            assert status == 200, body
            return json.loads(body)

        first = ask("")
        assert (first["total"], first["matched"], first["offset"], len(first["rows"])) == (125, 125, 0, 50)
        assert [p["accepted"] for p in first["rows"][:3]] == [120, 119, 118]
        # Pages never overlap and cover every row, even where values tie (the refused keys' 0s).
        seen = [p["node_id"] for offset in range(0, 125, 50) for p in ask(f"?offset={offset}")["rows"]]
        assert len(seen) == len(set(seen)) == 125
        assert ask("?offset=5000")["offset"] == 100  # past the end: the last page
        names = [p["name"] for p in ask("?sort=name&order=asc&limit=3")["rows"]]
        assert names == ["junk-0", "junk-1", "junk-2"]
        found = ask("?q=VOLUNTEER-11&sort=accepted&order=asc")
        assert found["matched"] == 10 and [p["name"] for p in found["rows"]][:2] == ["volunteer-110", "volunteer-111"]
        assert ask(f"?q={120:016x}")["matched"] == 0 and ask(f"?q={119:016x}")["rows"][0]["name"] == "volunteer-119"
        # Nobody live: no throughput, sorted last either way.
        assert ask("?sort=tokens_per_second&order=asc&limit=1")["rows"][0]["tokens_per_second"] is None
        # The share chart: the 8 largest of every row, the rest as one bar.
        assert [b["name"] for b in first["shares"]][:2] == ["volunteer-119", "volunteer-118"]
        assert first["others"]["peers"] == 112 and len(first["shares"]) == 8
        assert sum(b["share"] for b in first["shares"]) + first["others"]["share"] == pytest.approx(1.0)
        for bad in ("?sort=__class__", "?order=up", "?limit=0", "?limit=201", "?offset=-1", "?offset=1e3",
                    "?limit=%C2%B2", "?q=" + "x" * 101):
            status, body, _ = get(base + "api/peer-page" + bad)
            assert status == 400 and json.loads(body)["error"], bad


def test_a_long_runs_charts_are_thinned_to_a_readable_number_of_points(tmp_path, service):  # noqa: F811
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for v in range(2000):
            f.write(json.dumps(dict(STEP, version=v)) + "\n")
    service.ledger.set_run(run_id="run-1", mode="sequential", version=2000, steps=2000, samples_per_step=4)
    history = RunView(tmp_path, service.ledger).run(now=NOW)["history"]
    assert len(history) == observe.CHART_POINTS and history[-1]["version"] == 1999
    assert {b["version"] - a["version"] for a, b in zip(history, history[1:])} == {4}  # evenly spaced


def test_status_lists_the_top_peers_of_a_crowd(crowd):
    """A run of a thousand volunteers is not a thousand lines of `status`."""
    from typer.testing import CliRunner

    from echo_coordinator.cli import app

    out = CliRunner().invoke(app, ["status", "--data-dir", str(crowd.data_dir)], env={"COLUMNS": "200"}).output
    listed = [line for line in out.splitlines() if "volunteer-" in line or "junk-" in line]
    assert len(listed) == 20 and "volunteer-119" in listed[0]  # most accepted first
    assert "... and 105 more peers" in out
    every = CliRunner().invoke(app, ["status", "--data-dir", str(crowd.data_dir), "--top", "0"], env={"COLUMNS": "200"})
    assert sum("volunteer-" in line or "junk-" in line for line in every.output.splitlines()) == 125
