"""Two real network hosts on one machine: Linux network namespaces joined by a veth pair.

Each namespace has its own interfaces, addresses, routes and ports, so a process inside one reaches the
other only over the veth link, exactly as across two machines on one switch. Host 0 is 10.0.0.1 (the
main_process_ip of accelerate_configs/multi_node.yaml) and host 1 is 10.0.0.2. Each host also gets its own
/etc/hosts (`ip netns exec` mounts /etc/netns/NAME/hosts over it) naming both hosts, as a cluster's DNS
would. Needs root and iproute2; `make_hosts()` raises HostsUnavailable with the reason otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

ADDRESSES = ("10.0.0.1", "10.0.0.2")


class HostsUnavailable(Exception):
    pass


@dataclass
class Hosts:
    names: tuple[str, str]  # namespace names
    hostnames: tuple[str, str]  # what each host is called in the other's /etc/hosts
    addresses: tuple[str, str] = ADDRESSES

    def prefix(self, host: int) -> list[str]:
        """Put this in front of a command to run it on host 0 or 1."""
        return ["ip", "netns", "exec", self.names[host]]

    def pids(self, host: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.names[host]], check=False, capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def kill(self, host: int):
        """SIGKILL every process on the host, as if the machine went down."""
        for pid in self.pids(host) if os.path.exists(f"/run/netns/{self.names[host]}") else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self):
        for host in (0, 1):  # whatever still runs on a host goes with it
            self.kill(host)
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


def _sh(*cmd: str):
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode:
        raise HostsUnavailable(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.returncode}")


def make_hosts(tag: str | None = None) -> Hosts:
    """Create the two hosts; the caller removes them with `hosts.remove()`."""
    if os.geteuid() != 0:
        raise HostsUnavailable("network namespaces need root")
    if shutil.which("ip") is None:
        raise HostsUnavailable("iproute2's `ip` is not installed")
    tag = tag or str(os.getpid())
    names = (f"tk{tag}a", f"tk{tag}b")
    hosts = Hosts(names, (f"node-{tag}-0", f"node-{tag}-1"))
    hosts.remove()  # leftovers of a killed run with the same tag
    try:
        for name in names:
            _sh("ip", "netns", "add", name)
        _sh("ip", "link", "add", f"{names[0]}0", "type", "veth", "peer", "name", f"{names[1]}0")
        for name, address in zip(names, ADDRESSES):
            _sh("ip", "link", "set", f"{name}0", "netns", name)
            _sh("ip", "-n", name, "addr", "add", f"{address}/24", "dev", f"{name}0")
            _sh("ip", "-n", name, "link", "set", f"{name}0", "up")
            _sh("ip", "-n", name, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / name
            etc.mkdir(parents=True, exist_ok=True)
            lines = ["127.0.0.1 localhost"] + [f"{a} {h}" for a, h in zip(ADDRESSES, hosts.hostnames)]
            (etc / "hosts").write_text("\n".join(lines) + "\n")
    except HostsUnavailable:
        hosts.remove()
        raise
    return hosts


def hosts_or_skip():
    """Two hosts for a module's tests (`hosts = pytest.fixture(scope="module", name="hosts")(hosts_or_skip)`):
    made, yielded, removed after the module; where they cannot be made (not root, no iproute2) the tests skip
    and say why."""
    import pytest

    try:
        made = make_hosts()
    except HostsUnavailable as reason:
        print(f"SKIP two-host tests: {reason}")
        pytest.skip(f"two network hosts cannot be made here: {reason}")
    try:
        yield made
    finally:
        made.remove()
