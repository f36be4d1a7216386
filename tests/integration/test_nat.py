"""A volunteer behind NAT (tests/support/netns.py): it can dial the coordinator but cannot be
dialled. It finds that out from the coordinator's probe, joins as a DHT client holding a relay
reservation at the coordinator, trains like any node (leases, pushes and updates all go out
from it), and still serves peers: a later public node, told by the coordinator to reach it
through the relay, fetches the base model from it over the direct connection it dials back
(`Endpoint._dial_back`; bulk data through the relay is reset after a few MB). Skips, saying why,
where network namespaces cannot be made."""

import re
import shlex
import subprocess
import sys

import pytest

from tests.support.runs import spawn, wait_for
from tests.support.netns import HOME_IP, WAN_IP, Network, Unavailable
from tests.support.tiny_model import build_tiny_checkpoint

STEPS = 4
FETCHED = re.compile(r"fetched the base model .*: ([\d.]+) MB from (\d+) peers, ([\d.]+) MB from the coordinator")


@pytest.fixture
def network():
    try:
        net = Network.make()
    except Unavailable as e:
        pytest.skip(f"no network namespaces here: {e}")
    yield net
    net.close()


def dials(net: Network, namespace: str, host: str, port: int) -> bool:
    """Whether a TCP connection from `namespace` to host:port is accepted by a listener there."""
    script = ("import socket,sys; s=socket.socket(); s.settimeout(2)\n"
              "try: s.connect((sys.argv[1], int(sys.argv[2]))); print('yes')\n"
              "except OSError: print('no')")
    out = subprocess.run(net.exec(namespace, [sys.executable, "-c", script, host, str(port)]),
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip() == "yes"


def test_a_node_behind_nat_trains_and_serves_through_the_relay(tmp_path, network, processes):
    net = network
    # The topology itself: home reaches the WAN, the WAN cannot reach home (a listener there that
    # home itself reaches). The listeners listen until killed.
    listener = subprocess.Popen(net.exec(net.wan, [sys.executable, "-c", "import socket,time; s=socket.socket(); "
                                                   f"s.bind(('{WAN_IP}', 4999)); s.listen(); time.sleep(600)"]))
    home_listener = subprocess.Popen(net.exec(net.home, [sys.executable, "-c", "import socket,time; s=socket.socket(); "
                                                         f"s.bind(('{HOME_IP}', 4998)); s.listen(); time.sleep(600)"]))
    try:
        wait_for(lambda: dials(net, net.home, WAN_IP, 4999), 60, "the WAN listener")
        wait_for(lambda: dials(net, net.home, HOME_IP, 4998), 60, "the home listener")
        assert not dials(net, net.wan, HOME_IP, 4998)
    finally:
        listener.kill()
        home_listener.kill()

    # hidden 128: a 6.7 MB q8_0 base, two 4 MiB chunks
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny-qwen2", "qwen2", hidden_size=128)
    run_dir = tmp_path / "run"
    (tmp_path / "run.toml").write_text(f"""
[run]
model = "{checkpoint}"
node_quant = "q8_0"
task = "tests.support.envs:LetterE"
mode = "async"
steps = {STEPS}
prompts_per_step = 2
group_size = 4
max_new_tokens = 8
min_nodes = 2
host = "{WAN_IP}"
port = 0
data_dir = "{run_dir}"
trainer_upload_copies = 1
dashboard = false

[trainer]
lora_rank = 4
learning_rate = 0.01
threads = 1
""")
    coordinator = spawn(processes, net.exec(net.wan, [sys.executable, "-m", "echo_coordinator.cli", "start", "--config",
                                                      str(tmp_path / "run.toml")]), tmp_path / "coordinator.log")
    wait_for((run_dir / "join.txt").exists, 180, "the join line", [coordinator])
    argv = shlex.split((run_dir / "join.txt").read_text())
    assert f"/ip4/{WAN_IP}/" in argv[2]
    def node(name, namespace):
        args = [sys.executable, "-m", "echo_node.cli", *argv[1:], "--name", name, "--data-dir", str(tmp_path / name),
                "--threads", "1"]
        return spawn(processes, net.exec(namespace, args), tmp_path / f"{name}.log")

    def log(name):
        path = tmp_path / f"{name}.log"
        return path.read_text() if path.exists() else ""

    behind = node("behind", net.home)
    wait_for(lambda: "joined run" in log("behind"), 180, "the node behind NAT to join", [coordinator, behind])
    assert "cannot be dialled directly" in log("behind")
    wait_for(lambda: "reachable through the relay" in log("behind"), 90, "the relay reservation", [coordinator, behind])
    public = node("public", net.wan)  # fetches the base: the coordinator sends one copy, the rest is relayed
    for proc in (coordinator, behind, public):  # the extra DHT peers are stopped by the fixture
        assert proc.wait(timeout=300) == 0, log("behind")[-2000:] + log("public")[-2000:]

    assert "cannot be dialled" not in log("public")
    for name in ("behind", "public"):
        assert f"finished at version {STEPS}" in log(name), log(name)  # updates reached both
    fetched = {name: FETCHED.search(log(name)) for name in ("behind", "public")}
    assert fetched["behind"] and float(fetched["behind"][3]) > 6  # from the coordinator, dialled out
    # The public node got the whole base from the node behind NAT.
    assert fetched["public"] and float(fetched["public"][1]) > 6 and float(fetched["public"][3]) == 0.0, log("public")
