"""Which interface and address this node uses to reach the Ray head, from ``ip`` output.

* ``ip route get ADDR`` prints e.g. ``10.0.0.7 via 10.0.0.1 dev eth0 src 10.0.0.5 uid 0`` (remote),
  or ``local 10.0.0.5 dev lo table local src 10.0.0.5 uid 0`` when ADDR is one of this host's own
  addresses (this node is the head).
* ``ip -o addr show`` prints one line per address: ``2: eth0    inet 10.0.0.5/24 brd ... scope global eth0``.

For a local ADDR the route names ``lo``; the interface that really holds the address comes from
``ip -o addr show`` (``eth0`` for the host's own IP, ``lo`` for 127.0.0.1).
"""

from __future__ import annotations

import ipaddress
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass


class NetError(RuntimeError):
    """Network facts cannot be resolved (one-line message)."""


@dataclass(frozen=True)
class Route:
    """Parsed ``ip route get`` answer: whether ADDR is local, the outgoing device and source address."""

    local: bool
    dev: str
    src: str


def parse_route_get(text: str) -> Route:
    """Parse the first line of ``ip route get ADDR``.

    Raises:
        NetError: no ``dev`` in the answer.
    """
    line = text.strip().splitlines()[0] if text.strip() else ""
    tokens = line.split()
    fields = {tokens[i]: tokens[i + 1] for i in range(len(tokens) - 1) if tokens[i] in ("dev", "src", "via")}
    if "dev" not in fields:
        raise NetError(f"cannot read 'ip route get' output: {line!r}")
    return Route(local=bool(tokens) and tokens[0] == "local", dev=fields["dev"], src=fields.get("src", ""))


def parse_addr_show(text: str) -> dict[str, list[str]]:
    """``{interface: [addresses]}`` from ``ip -o addr show`` (IPv4 and IPv6, prefix stripped)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^\d+:\s+(\S+?)(?:@\S+)?\s+inet6?\s+([0-9a-fA-F:.]+)/\d+", line)
        if m:
            out.setdefault(m.group(1), []).append(m.group(2))
    return out


def _ip(*args: str) -> str:
    exe = shutil.which("ip")
    if exe is None:
        raise NetError("'ip' (iproute2) not found on PATH; give --ifname and --master-addr as an IP")
    proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=10, check=False)
    if proc.returncode != 0:
        msg = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise NetError(msg)
    return proc.stdout


def resolve_host(host: str) -> str:
    """IP address of ``host`` (an IP is returned unchanged).

    Raises:
        NetError: the name does not resolve.
    """
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise NetError(f"cannot resolve master address {host!r}: {exc}") from None
    v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
    return str((v4 or [infos[0][4][0]])[0])


@dataclass(frozen=True)
class NodeNet:
    """How this node talks to the head: is it the head, interface name, this node's IP on it."""

    is_local: bool
    ifname: str
    node_ip: str


def node_net(master_ip: str) -> NodeNet:
    """Route to ``master_ip`` from this node (runs ``ip route get`` and, if local, ``ip -o addr show``).

    Raises:
        NetError: no route ("unreachable"), or the interface holding a local address is not found.
    """
    try:
        route = parse_route_get(_ip("route", "get", master_ip))
    except NetError as exc:
        raise NetError(f"master {master_ip} is unreachable from this node: {exc}") from None
    if not route.local:
        return NodeNet(False, route.dev, route.src)
    addrs = parse_addr_show(_ip("-o", "addr", "show"))
    for dev, ips in addrs.items():
        if master_ip in ips:
            return NodeNet(True, dev, master_ip)
    raise NetError(f"{master_ip} is local but no interface holds it (ip -o addr show)")


def interface_ips(ifname: str) -> list[str]:
    """Addresses of ``ifname``; raises :class:`NetError` when the interface does not exist."""
    addrs = parse_addr_show(_ip("-o", "addr", "show"))
    if ifname not in addrs:
        known = ", ".join(sorted(addrs)) or "none"
        raise NetError(f"interface {ifname!r} not found or has no address (have: {known})")
    return addrs[ifname]


def tcp_reachable(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """True when a TCP connection to ``host:port`` opens within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
