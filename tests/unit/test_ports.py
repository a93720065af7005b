"""daemon/ports.py on this host's real kernel: real sockets, real /proc, a real TCPStore."""

from __future__ import annotations

import logging
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from ds3d.daemon.ports import FIRST_PORT, LAST_PORT, PortRules, hold_port

HOST = PortRules.of_host()


def _outside(rules: PortRules, port: int) -> bool:
    first, last = rules.ephemeral
    return FIRST_PORT <= port <= LAST_PORT and not first <= port <= last


def _tcp_store(port: int) -> dist.TCPStore:
    """What a worker of global rank 0 binds on MASTER_PORT (and the agent on its rendezvous
    port): a TCPStore server, on the wildcard address with SO_REUSEADDR."""
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def test_rules_parse_the_kernels_files():
    rules = PortRules.parse("32768\t60999\n", "8080,9000-9002,\n")
    assert rules.ephemeral == (32768, 60999)
    assert rules.reserved == {8080, 9000, 9001, 9002}
    assert PortRules.parse("1024 65000", "\n").reserved == frozenset()


def test_candidates_lie_outside_the_ephemeral_range_and_skip_reserved_ports():
    rules = PortRules((32768, 60999), frozenset({1024, 20000, 61000, 40000}))
    candidates = rules.candidates()
    assert candidates[0] == 1025 and candidates[-1] == 65535
    assert 32767 in candidates and 61001 in candidates
    assert not {20000, 61000, 32768, 60999, 45000} & set(candidates)
    assert len(candidates) == (32768 - 1024) + (65535 - 60999) - 3  # 40000 was inside anyway
    assert PortRules((1024, 65535)).candidates() == []


def test_a_held_port_is_outside_the_hosts_ephemeral_range_and_refused_to_others():
    assert HOST.candidates(), "this host's ephemeral range leaves no room: the tests need some"
    with hold_port() as held:
        assert _outside(HOST, held.port) and held.port not in HOST.reserved
        for family, addr in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0")):
            with socket.socket(family) as other, pytest.raises(OSError):
                other.bind((addr, held.port))
    with socket.socket() as after:  # released
        after.bind(("0.0.0.0", held.port))


def test_the_process_it_is_held_for_binds_and_serves_on_it():
    """The point of holding: TCPStore (MASTER_PORT, the c10d rendezvous) binds and listens on
    the port while the chooser still holds it, and a client reaches it."""
    with hold_port() as held:
        server = _tcp_store(held.port)
        server.set("key", "value")
        client = dist.TCPStore("127.0.0.1", held.port, is_master=False,
                               timeout=timedelta(seconds=10))
        assert client.get("key") == b"value"
        del client, server


def test_a_bound_port_is_skipped_and_reserved_ports_are_honoured():
    """Only two candidates left by the reserved ports: one served by a TCPStore, one free;
    every draw is the free one."""
    with hold_port() as taken_hold:
        taken = taken_hold.port
        server = _tcp_store(taken)
    with hold_port() as free_hold:
        free = free_hold.port
    rules = PortRules(HOST.ephemeral, frozenset(HOST.candidates()) - {taken, free})
    assert sorted(rules.candidates()) == sorted({taken, free})
    for _ in range(10):
        with hold_port(rules) as held:
            assert held.port == free
    del server


def test_no_room_outside_the_range_falls_back_to_a_held_kernel_port_with_one_warning(caplog):
    rules = PortRules((FIRST_PORT, LAST_PORT))
    with caplog.at_level(logging.WARNING, logger="ds3d.daemon.ports"):
        with hold_port(rules) as held:
            with socket.socket() as other, pytest.raises(OSError):
                other.bind(("127.0.0.1", held.port))
            server = _tcp_store(held.port)
            del server
    warnings = [r.getMessage() for r in caplog.records if r.name == "ds3d.daemon.ports"]
    assert len(warnings) == 1 and "no free port outside the kernel's ephemeral range" in \
        warnings[0] and "kernel-assigned" in warnings[0]


def test_every_candidate_taken_falls_back_too(caplog):
    with hold_port() as taken:
        rules = PortRules(HOST.ephemeral, frozenset(HOST.candidates()) - {taken.port})
        with caplog.at_level(logging.WARNING, logger="ds3d.daemon.ports"):
            with hold_port(rules) as held:
                assert held.port != taken.port
    assert sum(r.name == "ds3d.daemon.ports" for r in caplog.records) == 1


NAMESPACE_PROBE = r'''
import socket
from ds3d.daemon.ports import PortRules, hold_port

assert PortRules.of_host().ephemeral == (40000, 40009)
with hold_port() as drawn:
    assert not 40000 <= drawn.port <= 40009, drawn.port
held = hold_port(PortRules((1024, 65535)))  # the fallback: a kernel-assigned port, held
assert 40000 <= held.port <= 40009, held.port
server = socket.create_server(("127.0.0.1", 5000), backlog=64)
taken = []
for _ in range(20):  # until the kernel runs out: every bind(0) and connect it can serve
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
    except OSError:
        break
    taken.append(s)
for _ in range(20):
    c = socket.socket()
    try:
        c.connect(("127.0.0.1", 5000))
    except OSError:
        break
    taken.append(c)
ports = sorted(s.getsockname()[1] for s in taken)
assert ports and held.port not in ports, (held.port, ports)
print("ok", held.port, ports)
'''


def test_the_kernel_hands_no_held_port_to_bind0_or_connect():
    """In a network namespace of its own (unshare -rn) with a 10-port ephemeral range: the
    chooser draws outside it, and the fallback's held port is given to none of the bind(0)s and
    connects that exhaust the range."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare")
    proc = subprocess.run(
        ["unshare", "-rn", "sh", "-c", "ip link set lo up 2>/dev/null; echo '40000 40009' > "
         f"/proc/sys/net/ipv4/ip_local_port_range && exec {sys.executable} -c \"$0\"",
         NAMESPACE_PROBE], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 and "Operation not permitted" in proc.stderr:
        pytest.skip(f"no user namespaces here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr
