"""Free TCP ports for the tests' servers, gloo stores and Ray heads."""

from __future__ import annotations

import random
import socket

#: ports free_port hands out: below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``, 32768-60999 by
#: default), from which every outgoing connection (Ray, vLLM, gloo) takes its local port. A port bound to 0 comes from
#: that range, and another process's connection could take it before the test's server listened: in a clean-clone
#: CI run a gloo store failed with EADDRINUSE on such a port (tests/patches/test_verl091_mbridge.py, 5 errors).
FREE_PORTS = (20000, 32000)
_RNG = random.Random()  # its own generator, seeded from the OS: a test seeding `random` does not repeat ports


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, drawn at random from ``FREE_PORTS`` (outside the
    ephemeral range) and checked by binding it."""
    for _ in range(200):
        port = _RNG.randrange(*FREE_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {FREE_PORTS} after 200 tries")
