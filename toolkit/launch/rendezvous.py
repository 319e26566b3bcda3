"""Multi-node rendezvous that explains itself.

torchrun's own rendezvous fails late and quietly across machines: a node that cannot reach the main
node waits 15 minutes before it says so, and nodes launched with different profiles (num_machines,
mixed precision, script arguments) either hang or train on silently different terms. So, before it hands
a multi-node job to torchrun, `toolkit launch` runs a short handshake of its own on the same address and
port: every machine's launcher connects to machine 0's, states what it is about to launch, and machine 0
answers "agreed" or the one sentence that says who differs and how. Only then does torchrun start.

Gloo has a second trap: it binds to the address this host's name resolves to, which is often 127.0.0.1,
and then tells the other nodes to connect there. `pin_gloo_interface` picks the interface that routes to
the main node instead, unless GLOO_SOCKET_IFNAME already names one.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import shlex
import socket
import struct
import sys
import time
from dataclasses import asdict, dataclass

from toolkit.errors import UserError
from toolkit.launch.profiles import Profile

MULTI_NODE_PORT = 29500  # a multi-node profile without a port: torchrun's and accelerate's default
PREFIX = "toolkit/handshake/"
FIRST_TRY_S = 2.0  # the first connection to machine 0's store; a slow but real store gets the rest of the timeout
_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface


def resolve_host(host: str) -> str:
    """The IPv4 address of `host` (a name or an address)."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror:
        raise UserError(f"cannot resolve the main node's address {host!r}; check main_process_ip.") from None


def local_addresses() -> dict[str, str]:
    """{IPv4 address: interface name} for every interface of this host that has one."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # interface without an IPv4 address
                continue
            found[socket.inet_ntoa(packed[20:24])] = name
    return found


def check_main_host(main_process_ip: str) -> str:
    """Machine 0 hosts the rendezvous: its main address must be one of this host's. Returns the address."""
    address = resolve_host(main_process_ip)
    if address not in local_addresses():
        raise UserError(f"machine_rank 0 hosts the rendezvous but main_process_ip {main_process_ip} is not an "
                        "address of this host; run machine 0 there or fix main_process_ip.")
    return address


def route_to(address: str) -> tuple[str | None, str | None]:
    """(this host's address, interface) it would use to reach `address`; (None, None) without a route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((address, 9))  # UDP: picks the route, sends nothing
        except OSError:
            return None, None
        mine = sock.getsockname()[0]
    return mine, local_addresses().get(mine)


def pin_gloo_interface(main_address: str | None, environ=os.environ) -> str | None:
    """Point gloo at the interface that reaches the main node, unless the user chose one; returns it."""
    if environ.get("GLOO_SOCKET_IFNAME") or not main_address:
        return None
    name = route_to(resolve_host(main_address))[1]
    if name and name != "lo":
        environ["GLOO_SOCKET_IFNAME"] = name
        return name
    return None


@dataclass(frozen=True)
class NodeView:
    """What one machine's launcher is about to start; every machine must agree on all but the first two."""

    machine_rank: int
    host: str
    num_machines: int
    num_processes: int
    rdzv_backend: str
    engine: str
    mixed_precision: str
    torch: str
    command: str  # the script and its arguments


def _store(address: str, port: int, is_master: bool, timeout: float):
    from torch.distributed import TCPStore

    return TCPStore(address, port, None, is_master, timeout=datetime.timedelta(seconds=timeout),
                    wait_for_workers=False)


def _connect(address: str, port: int, timeout: float):
    """A client of machine 0's handshake store, saying every 10 s that it is still trying."""
    deadline, said = time.monotonic() + timeout, 0.0
    while True:
        try:
            with socket.create_connection((address, port), timeout=2) as probe:
                _refuse_foreign_service(probe, address, port)
                break
        except OSError:
            waited = timeout - (deadline - time.monotonic())
            if waited >= timeout:
                raise UserError(
                    f"could not reach the main node at {address}:{port} within {timeout:g} s; start machine 0 "
                    "first, check main_process_ip, and open that port in its firewall."
                ) from None
            if waited - said >= 10:
                said = waited
                print(f"[toolkit] still waiting for the main node at {address}:{port} "
                      f"({waited:.0f} of {timeout:g} s)", file=sys.stderr, flush=True)
            time.sleep(0.5)
    # A short first try: a service that answers but is not a store fails torch's ping at once, and the
    # client would otherwise retry against it until the whole timeout ran out.
    first = min(FIRST_TRY_S, max(1.0, deadline - time.monotonic()))
    for attempt_timeout in (first, None):
        try:
            with _cpp_logs_silenced():
                return _store(address, port, False, attempt_timeout or max(1.0, deadline - time.monotonic()))
        except RuntimeError as error:  # torch's DistNetworkError/DistStoreError: it answered, not as a store
            if attempt_timeout is None or "Ping failed" in str(error) or time.monotonic() >= deadline:
                raise UserError(f"{address}:{port} accepts connections but does not answer as the main node's "
                                f"rendezvous store ({type(error).__name__}); another service may hold that port: "
                                "pick another main_process_port.") from None


@contextlib.contextmanager
def _cpp_logs_silenced():
    """torch's TCPStore client logs every failed try on file descriptor 2 with a C++ stack trace (~20 lines
    each, several a second); its last error is all we need, said in one sentence above. The launcher runs no
    other thread while it connects, so nothing of ours is lost."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _refuse_foreign_service(probe: socket.socket, address: str, port: int):
    """A torch.distributed store never speaks first: bytes on connect mean another service holds the port
    (torch would retry against it for half a minute and print C++ stack frames)."""
    probe.settimeout(0.3)
    try:
        greeting = probe.recv(64)
    except (socket.timeout, OSError):
        return
    if greeting:
        raise UserError(f"{address}:{port} is held by another service (it answered {greeting[:20]!r} on connect), not "
                        "the main node's rendezvous store; pick another main_process_port.")


def _disagreement(views: list[NodeView]) -> str | None:
    main = views[0]
    for view in views[1:]:
        for field in ("num_machines", "num_processes", "rdzv_backend", "engine", "mixed_precision", "torch",
                      "command"):
            if getattr(view, field) != getattr(main, field):
                return (f"machine {view.machine_rank} ({view.host}) was launched with {field} "
                        f"{getattr(view, field)!r} but machine 0 ({main.host}) with {getattr(main, field)!r}; "
                        "every machine must launch the same profile, engine and script.")
    return None


def _wait_for(store, keys: list[str], timeout: float) -> list[str]:
    """Poll until every key is set or `timeout` passes; returns the keys still missing."""
    deadline = time.monotonic() + timeout
    while True:
        missing = [key for key in keys if not store.check([key])]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.2)


def handshake(view: NodeView, address: str, port: int, timeout: float):
    """Meet the other machines' launchers at address:port; raise UserError unless all agree."""
    mine = json.dumps(asdict(view))
    if view.machine_rank == 0:
        store = _store(address, port, True, timeout)
        store.set(PREFIX + "0", mine)
        keys = [f"{PREFIX}{r}" for r in range(view.num_machines)]
        missing = _wait_for(store, keys, timeout)
        if missing:
            verdict = (f"machine(s) {', '.join(key[len(PREFIX):] for key in missing)} of {view.num_machines} did not "
                       f"reach {address}:{port} within {timeout:g} s; start `toolkit launch --machine_rank R` there, "
                       "or check num_machines and the firewall.")
        else:
            verdict = _disagreement([NodeView(**json.loads(store.get(key))) for key in keys]) or "agreed"
        store.set(PREFIX + "verdict", verdict)
        arrived = [key[len(PREFIX):] for key in keys[1:] if key not in missing]
        _wait_for(store, [f"{PREFIX}ack{r}" for r in arrived], 30)  # the store lives until all have read it
        del store
    else:
        store = _connect(address, port, timeout)
        key = f"{PREFIX}{view.machine_rank}"
        taken = store.compare_set(key, "", mine).decode()
        if taken != mine:
            other = json.loads(taken)["host"]
            raise UserError(f"machine_rank {view.machine_rank} is already taken by {other}; give each machine its own.")
        if _wait_for(store, [PREFIX + "verdict"], timeout + 30):
            raise UserError(f"the main node at {address}:{port} did not confirm the topology within {timeout:g} s; "
                            "is a job already running there?")
        verdict = store.get(PREFIX + "verdict").decode()
        store.set(f"{PREFIX}ack{view.machine_rank}", "1")
        del store
    if verdict != "agreed":
        raise UserError(verdict)


def meet_other_machines(profile: Profile, engine: str, script_and_args: list[str], timeout: float):
    """The launchers of all machines agree on what they start before torchrun joins them (the handshake above)."""
    import torch

    view = NodeView(
        machine_rank=profile.machine_rank, host=socket.gethostname(), num_machines=profile.num_machines,
        num_processes=profile.num_processes, rdzv_backend=profile.rdzv_backend, engine=engine,
        mixed_precision=profile.mixed_precision, torch=torch.__version__.split("+")[0],
        command=shlex.join(script_and_args))
    address, port = resolve_host(profile.main_process_ip), profile.main_process_port or MULTI_NODE_PORT
    if profile.machine_rank == 0:
        check_main_host(profile.main_process_ip)
    print(f"[toolkit] machine {profile.machine_rank} of {profile.num_machines}: meeting the others at "
          f"{address}:{port} (timeout {timeout:g} s)", file=sys.stderr, flush=True)
    handshake(view, address, port, timeout)
