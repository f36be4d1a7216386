"""A home network behind NAT, made of Linux network namespaces, for tests:

    WAN 10.77.0.0/24                      home 192.168.77.0/24
    [wan: coordinator, public nodes] ---- [router: NAT] ---- [home: a volunteer]
          10.77.0.1              10.77.0.254   192.168.77.1        192.168.77.2

The home namespace reaches the WAN through the router's masquerade; nothing on the WAN can
dial into it (no route, and the router forwards no ports). Every address is inside namespaces
this process made; `Network.close` removes them (their veth links go with them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

WAN_IP, ROUTER_WAN_IP, ROUTER_HOME_IP, HOME_IP = "10.77.0.1", "10.77.0.254", "192.168.77.1", "192.168.77.2"


class Unavailable(Exception):
    """Namespaces cannot be made here; the message says why."""


def _run(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise Unavailable(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.stdout.strip()}")


@dataclass
class Network:
    prefix: str

    @property
    def wan(self) -> str:
        return f"{self.prefix}-wan"

    @property
    def router(self) -> str:
        return f"{self.prefix}-rtr"

    @property
    def home(self) -> str:
        return f"{self.prefix}-home"

    def exec(self, namespace: str, args: list[str]) -> list[str]:
        """`args` run inside `namespace`."""
        return ["ip", "netns", "exec", namespace, *args]

    @classmethod
    def make(cls) -> Network:
        if os.geteuid() != 0:
            raise Unavailable("network namespaces need root")
        for tool in ("ip", "iptables"):
            if shutil.which(tool) is None:
                raise Unavailable(f"{tool} is not installed (make test installs iproute2 and iptables)")
        net = cls(f"e{os.getpid() % 100000}")
        try:
            net._build()
        except Unavailable:
            net.close()
            raise
        return net

    def _build(self) -> None:
        p, wan, rtr, home = self.prefix, self.wan, self.router, self.home
        for ns in (wan, rtr, home):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "add", f"{p}w0", "type", "veth", "peer", "name", f"{p}w1")
        _run("ip", "link", "set", f"{p}w0", "netns", wan)
        _run("ip", "link", "set", f"{p}w1", "netns", rtr)
        _run("ip", "link", "add", f"{p}h0", "type", "veth", "peer", "name", f"{p}h1")
        _run("ip", "link", "set", f"{p}h0", "netns", home)
        _run("ip", "link", "set", f"{p}h1", "netns", rtr)
        for ns, dev, address in ((wan, f"{p}w0", WAN_IP), (rtr, f"{p}w1", ROUTER_WAN_IP),
                                 (rtr, f"{p}h1", ROUTER_HOME_IP), (home, f"{p}h0", HOME_IP)):
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
        _run("ip", "-n", home, "route", "add", "default", "via", ROUTER_HOME_IP)
        _run("ip", "netns", "exec", rtr, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _run("ip", "netns", "exec", rtr, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", f"{p}w1", "-j", "MASQUERADE")

    def close(self) -> None:
        for ns in (self.wan, self.router, self.home):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
