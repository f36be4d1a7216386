"""The dashboard in real headless Chromium (Debian's, driven by Playwright): against a live run
of a real coordinator and two real nodes, and against finished runs of 0 and 200 peers.

Screenshots go to the test's tmp_path, and also to $ECHO_SCREENSHOTS when it is set."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import sys
import time
from pathlib import Path

import pytest

from echo_coordinator.ledger import Ledger
from tests.support.runs import VENV_BIN, join_argv, spawn, wait_for, write_config
from tests.unit.protocols.factories import peer_id

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium")
# Chromium's own background connections are refused on a closed network; these keep it quiet.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed here (`make test-all` installs it)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield chromium
        chromium.close()


def screenshot(page, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    if out := os.environ.get("ECHO_SCREENSHOTS"):
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / path.name)


def table(page) -> dict[str, dict[str, str]]:
    """The peers table as shown: name -> column title -> cell text."""
    return page.evaluate("""() => {
        const heads = [...document.querySelectorAll('#peers thead th')].map((th) => th.textContent);
        return Object.fromEntries([...document.querySelectorAll('#peers tbody tr')].map((tr) => {
            const cells = [...tr.children].map((td) => td.textContent);
            return [cells[0], Object.fromEntries(heads.map((h, i) => [h, cells[i]]))];
        }));
    }""")


def shown_version(page) -> int:
    return int(page.evaluate("document.body.dataset.version ?? -1"))


def ledger_now(run_dir: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """Version and (accepted, tokens) per name, read from the ledger in one transaction."""
    db = sqlite3.connect(run_dir / "ledger.sqlite")
    try:
        with db:
            version = json.loads(db.execute("SELECT value FROM run WHERE key = 'version'").fetchone()[0])
            peers = {name: (a, t) for name, a, t in db.execute("SELECT name, accepted, tokens FROM peers")}
    finally:
        db.close()
    return version, peers


def no_sideways_scroll(page) -> bool:
    return page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")


def test_live_run_in_chromium(tmp_path, tiny_model, processes, browser):  # noqa: F811
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.toml", tiny_model, run_dir, steps=40,
                          extra="dashboard_port = 0\neval_every = 1\neval_prompts = 4")
    coordinator = spawn(processes, [sys.executable, "-m", "echo_coordinator.cli", "start", "--config", str(config)],
                        tmp_path / "coordinator.log")
    argv = join_argv(run_dir, coordinator)
    url = (run_dir / "dashboard.txt").read_text().strip()
    assert f"dashboard: {url}" in (tmp_path / "coordinator.log").read_text()
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(url)
    page.wait_for_selector("#no-peers:not([hidden])")  # before anyone joins
    screenshot(page, tmp_path, "dashboard-waiting")
    for name in ("n1", "n2"):
        spawn(processes, [str(VENV_BIN / argv[0]), *argv[1:], "--name", name, "--data-dir", str(tmp_path / name),
                          "--threads", "1"], tmp_path / f"{name}.log")

    # Live: the page moves to a trained version by itself (no reload), and then shows exactly
    # the ledger's numbers for the version it shows.
    page.wait_for_function("Number(document.body.dataset.version) >= 2", timeout=180_000)
    deadline = time.monotonic() + 30
    while True:
        version, ledger = ledger_now(run_dir)
        rows = table(page)
        shown = {name: (int(r["accepted"]), int(r["tokens"])) for name, r in rows.items()}
        if shown_version(page) == version and shown == ledger:
            break
        assert time.monotonic() < deadline, f"page shows v{shown_version(page)} {shown}, ledger v{version} {ledger}"
        time.sleep(0.5)
    assert set(shown) == {"n1", "n2"} and all(a > 0 for a, _ in shown.values())
    # The backend column: the backend and the node's announced hardware ("llama_cpp · x86_64, 1 cores, ...").
    assert all(r["backend"].startswith("llama_cpp · ") and "cores" in r["backend"] for r in rows.values())
    assert all(r["batch"] == "8" for r in rows.values())  # each node's --parallel, llama.cpp's default
    # Each key's share of abandoned training leases (selective reporting's measure, issue 36 point 4).
    assert all(re.fullmatch(r"\d+\.\d %|–", r["abandoned"]) for r in rows.values()), rows
    total = sum(a for a, _ in shown.values())
    for name, r in rows.items():  # shares as the ledger gives them, to the page's rounding
        assert r["share"] == f"{100 * ledger[name][0] / total:.1f} %"
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    points = page.evaluate("document.querySelector('#reward-chart polyline').getAttribute('points').split(' ').length")
    assert points >= version  # one point per trained step shown
    # Held-out accuracy: a point per finished evaluation, and the answers credited per peer.
    evals = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if "eval_version" in x]
    page.wait_for_selector("#eval-chart polyline")
    assert evals and sum(int(r["eval answers"]) for r in table(page).values()) >= 4 * len(evals) - 4
    assert page.locator("#share-chart text", has_text="n1").count() == 1
    assert page.locator("#capacity .card").count() >= 6
    assert steps and page.locator("#state").text_content() == "running"

    # A new step lands: the table follows without a reload.
    page.wait_for_function(f"Number(document.body.dataset.version) > {version}", timeout=120_000)
    page.wait_for_function("""(total) => {  // the "accepted" column found by its title, not its place
        const col = [...document.querySelectorAll('#peers thead th')].findIndex((th) => th.textContent === 'accepted');
        return [...document.querySelectorAll('#peers tbody tr')]
            .reduce((s, tr) => s + Number(tr.children[col].textContent), 0) > total;
    }""", arg=total, timeout=10_000)

    # Sorting (by the server: the table changes when its answer comes), and a peer's own page.
    first_name = "document.querySelector('#peers tbody tr td').textContent === '{}'"
    page.locator("#peers th", has_text="name").click()
    page.wait_for_function(first_name.format("n1"), timeout=5_000)
    assert [r for r in table(page)] == ["n1", "n2"]
    page.locator("#peers th", has_text="name").click()
    page.wait_for_function(first_name.format("n2"), timeout=5_000)
    assert [r for r in table(page)] == ["n2", "n1"]
    page.locator("#peers tbody tr", has_text="n1").click()
    page.wait_for_selector("#detail:not([hidden])")
    page.wait_for_function("document.querySelectorAll('#detail-chart circle').length >= 1")
    screenshot(page, tmp_path, "dashboard-live")

    page.set_viewport_size(PHONE)
    page.wait_for_timeout(2500)  # a poll redraws the charts at the new width
    assert no_sideways_scroll(page)
    screenshot(page, tmp_path, "dashboard-live-phone")
    page.close()
    coordinator.terminate()


def finished_run(run_dir: Path, peers: int, steps: int = 5) -> None:
    run_dir.mkdir(parents=True)
    ledger = Ledger(run_dir / "ledger.sqlite")
    ledger.set_run(run_id="run-finished", mode="async", version=steps if peers else 0, steps=steps, staleness=4,
                   samples_per_step=64, model="SmolLM2-135M-Instruct.Q4_1.gguf", task="arithmetic")
    now = time.time()
    for i in range(peers):
        node_id = f"{i:026d}"
        for v in range(1, steps + 1):
            ledger.credit(node_id, peer_id(f"{i}"), f"volunteer-{i:03d}", 1 + i % 7, 20 + i, now=now - 60 * (steps - v), version=v)
        if i % 10 == 0:
            ledger.reject(node_id, peer_id(f"{i}"), f"volunteer-{i:03d}", "stale", 2, now=now)
    if peers:
        ledger.reject("f" * 26, peer_id("X"), '<img src=x onerror="document.body.dataset.pwned=1">', "bad_sampling", 16, now)
    ledger.close()
    with open(run_dir / "metrics.jsonl", "w") as f:
        for v in range(steps if peers else 0):
            f.write(json.dumps(dict(version=v, samples=64, reward_mean=0.2 + 0.1 * v, step_seconds=30.0,
                                    wait_seconds=5.0, time=now - 60 * (steps - v), staleness_histogram={"0": 40, "1": 24},
                                    mismatch_kl=0.002, tis_clipped_fraction=0.01)) + "\n")


@pytest.mark.parametrize("peers", [0, 1, 1000])
def test_finished_run_with_many_or_no_peers(tmp_path, processes, browser, peers):  # noqa: F811
    run_dir = tmp_path / "run"
    finished_run(run_dir, peers)
    server = spawn(processes, [str(VENV_BIN / "echo-coordinator"), "dashboard", "--data-dir", str(run_dir), "--port", "0"],
                   tmp_path / "dashboard.log")
    log = tmp_path / "dashboard.log"
    wait_for(lambda: "http://" in log.read_text(), 30, "the dashboard URL", [server])
    url = log.read_text().split("dashboard of ")[1].split(": ", 1)[1].split()[0]
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(url)
    page.wait_for_function("document.body.dataset.version !== undefined")
    state = page.locator("#state").text_content()
    if peers == 0:
        assert state == "stopped" and page.locator("#no-peers").is_visible()
        assert page.locator("#reward-chart text", has_text="no steps yet").count() == 1
    else:
        assert state == "finished"
        rows = table(page)
        assert len(rows) == min(50, peers + 1)  # one page: the server sorts, filters and pages
        first = next(iter(rows.values()))
        assert int(first["accepted"]) == max(int(r["accepted"]) for r in rows.values())  # sorted by accepted
        assert page.locator("#share-chart text", has_text="others").count() == (peers > 8)
        hostile = '<img src=x onerror="document.body.dataset.pwned=1">'
        if peers > 50:
            assert page.locator("#page-range").text_content() == f"1–50 of {peers + 1}"
            page.locator("#next-page").click()
            page.wait_for_function("document.querySelector('#page-range').textContent.startsWith('51–')")
            assert not set(table(page)) & set(rows)  # the next 50
            page.locator("#peers th", has_text="name").click()  # sorted by name on the server, from the first page
            page.wait_for_function("document.querySelector('#page-range').textContent.startsWith('1–')")
            assert list(table(page))[:2] == [hostile, "volunteer-000"]
            page.locator("#peer-filter").fill("volunteer-99")
            page.wait_for_function("document.querySelector('#page-range').textContent === '1–10 of 10 found'")
            assert list(table(page)) == [f"volunteer-{i}" for i in range(990, 1000)]
            page.locator("#peer-filter").fill("")
            page.wait_for_function(f"document.querySelector('#page-range').textContent === '1–50 of {peers + 1}'")
            rows = table(page)
        assert hostile in rows and page.evaluate("document.body.dataset.pwned") is None  # shown as text, never run
    screenshot(page, tmp_path, f"dashboard-{peers}-peers")
    page.set_viewport_size(PHONE)
    page.wait_for_timeout(2500)
    assert no_sideways_scroll(page)
    screenshot(page, tmp_path, f"dashboard-{peers}-peers-phone")
    page.close()
