"""Ports that ds3d chooses for another process to bind later, with no window for anyone else.

Why: bind(0) + close (torch elastic's `get_free_port`, the usual `free_port` helpers) gives a
port of the kernel's ephemeral range and lets it go. Until the process it is meant for binds it
(a worker's TCPStore on MASTER_PORT: seconds later, after the fork, its configuration and
process-group init), any bind(0) or outgoing connect on the host (NCCL's bootstrap sockets,
another job's agent, a parallel test) may be handed the same port, and the intended binder fails
with EADDRINUSE: a worker-group restart for nothing.

`hold_port` closes that window twice over:

* the port is drawn at random (`SystemRandom`: processes that seeded `random` alike still draw
  apart) from 1024-65535 outside the ephemeral range (/proc/sys/net/ipv4/ip_local_port_range)
  and outside the ports reserved for services that bind them by number
  (/proc/sys/net/ipv4/ip_local_reserved_ports): the kernel never hands such a port to a
  bind(0) or a connect;
* it is held, not released: bound on the wildcard address that TCPStore binds (`::` dual-stack,
  else `0.0.0.0`), without SO_REUSEADDR, so that the bind itself verifies that no socket on any
  address of the host has the port; SO_REUSEADDR is set after the bind, and the socket never
  listens, so the process it is meant for (TCPStore sets SO_REUSEADDR) binds and listens on it
  while it is held, while a bind without SO_REUSEADDR (another ds3d chooser's) fails and the
  kernel skips it for bind(0) and connect. Only a process that binds this very port by number
  with SO_REUSEADDR could still take it first.

Where nothing outside the ephemeral range can be held (the range covers it all, or every draw
is taken), it falls back to a kernel-assigned port with one warning: torch's behaviour, except
that the port is still held, and a held port is not handed to a later bind(0) either.
"""

from __future__ import annotations

import logging
import random
import socket
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

FIRST_PORT = 1024  # below: the well-known services' ports, bindable by root alone
LAST_PORT = 65535
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
RESERVED_PORTS_FILE = Path("/proc/sys/net/ipv4/ip_local_reserved_ports")
TRIES = 64

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PortRules:
    """The host's rules for ports handed out by the kernel: `ephemeral` (first, last),
    inclusive, is where bind(0) and connect take theirs; `reserved` are kept for services that
    bind them by number. ds3d chooses among the others (`candidates`)."""

    ephemeral: tuple[int, int]
    reserved: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, port_range: str, reserved: str) -> PortRules:
        """From the two files' text: "32768\\t60999" and "8080,9000-9010" (empty: none)."""
        first, last = (int(p) for p in port_range.split())
        ports: set[int] = set()
        for item in reserved.replace("\n", "").split(","):
            if item.strip():
                lo, _, hi = item.partition("-")
                ports.update(range(int(lo), int(hi or lo) + 1))
        return cls((first, last), frozenset(ports))

    @classmethod
    def of_host(cls) -> PortRules:
        """This host's rules; where /proc cannot be read, every port counts as ephemeral (so
        `hold_port` falls back to a kernel-assigned port, and says so)."""
        try:
            port_range = EPHEMERAL_RANGE_FILE.read_text()
        except OSError:
            return cls((FIRST_PORT, LAST_PORT))
        try:
            reserved = RESERVED_PORTS_FILE.read_text()
        except OSError:
            reserved = ""
        return cls.parse(port_range, reserved)

    def candidates(self) -> list[int]:
        """The ports no bind(0) or connect on this host can be given: 1024-65535 outside the
        ephemeral range and not reserved."""
        first, last = self.ephemeral
        return [p for p in (*range(FIRST_PORT, first), *range(last + 1, LAST_PORT + 1))
                if p not in self.reserved]


class HeldPort:
    """A port bound by this process (see the module docstring) until `close()`: the process it
    was chosen for binds and listens on it meanwhile (with SO_REUSEADDR, as TCPStore does)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.port: int = sock.getsockname()[1]

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> HeldPort:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def hold_port(rules: PortRules | None = None, tries: int = TRIES) -> HeldPort:
    """A random port outside the ephemeral range, held (see the module docstring); after
    `tries` draws taken by others, or none to draw from, a held kernel-assigned port."""
    rules = rules or PortRules.of_host()
    candidates = rules.candidates()
    for port in random.SystemRandom().sample(candidates, min(tries, len(candidates))):
        sock = _bind_wildcard(port)
        if sock is not None:
            return HeldPort(sock)
    first, last = rules.ephemeral
    log.warning("ds3d ports: no free port outside the kernel's ephemeral range %d-%d (%s; "
                "%d reserved, %d candidates, %d tried): using a kernel-assigned port from that "
                "range instead, held all the same", first, last, EPHEMERAL_RANGE_FILE,
                len(rules.reserved), len(candidates), min(tries, len(candidates)))
    sock = _bind_wildcard(0)
    if sock is None:
        raise OSError("ds3d ports: the kernel assigned no port to bind(0)")
    return HeldPort(sock)


def _bind_wildcard(port: int) -> socket.socket | None:
    """A socket bound on the wildcard address at `port` (0: the kernel's choice), SO_REUSEADDR
    set only after the bind; None if some socket of the host has the port."""
    dual = socket.has_dualstack_ipv6()
    sock = socket.socket(socket.AF_INET6 if dual else socket.AF_INET, socket.SOCK_STREAM)
    try:
        if dual:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::" if dual else "0.0.0.0", port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    except OSError:  # EADDRINUSE, or EACCES where a policy forbids the port
        sock.close()
        return None
    return sock
