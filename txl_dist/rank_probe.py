"""Is that rank still there? A probe rank to rank, answered within milliseconds by a live process.

Each rank listens on a TCP port of its own (any interface, a port the system picks) and answers every probe
with its token (rank and pid), from a thread of the watched process: a stopped or hung process never answers
(its kernel may still accept the connection), and where the process has ended nothing listens, so the
connection is refused. The watchdog publishes the port and this host's addresses in the rendezvous store; a
rank that saw a collective fail probes its suspects at all their addresses at once (txl_dist/watchdog.py).

Probes do not go through the store: they add no load to it, and they work when the store's host is the rank
that was lost. The token makes an answer count only from the process probed, not from whatever else listens
at that port on another address (a container bridge has the same address on every host).

Uses only the standard library and psutil (a DeepSpeed dependency) for the host's interface addresses.
"""
from __future__ import annotations

import errno
import ipaddress
import selectors
import socket
import threading
import time

PROBE = b"?"
ACCEPT_POLL_S = 0.5
"""How often the answering thread looks up from accept() to see whether it should stop."""
MAX_ADDRESSES = 16


def token(rank: int, pid: int) -> bytes:
    """What the process of `rank` with `pid` answers."""
    return f"txl-rank {rank} pid {pid}".encode()


class ProbeServer:
    """The listening socket of one rank and the loop that answers on it."""

    def __init__(self, answer: bytes):
        self.answer = answer
        self.sock = _listen()
        self.sock.settimeout(ACCEPT_POLL_S)
        self.port: int = self.sock.getsockname()[1]

    def addresses(self, route_to: str) -> list[str]:
        """The addresses other hosts may reach this one by: the one on the route to `route_to` (the store)
        first, then every interface's; loopback and link-local left out (a prober on this machine adds
        loopback itself), IPv6 only when the socket takes it."""
        found = [a for a in [outgoing_address(route_to)] if a]
        try:
            import psutil

            found += [a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
                      if a.family in (socket.AF_INET, socket.AF_INET6)]
        except Exception:  # noqa: BLE001 - the route's address alone still serves a flat network
            pass
        kept: list[str] = []
        for a in found:
            try:
                ip = ipaddress.ip_address(a)
            except ValueError:
                continue
            if ip.is_loopback or ip.is_link_local or a in kept:
                continue
            if ip.version == 6 and self.sock.family != socket.AF_INET6:
                continue
            kept.append(a)
        return kept[:MAX_ADDRESSES]

    def serve(self, stopping: threading.Event) -> None:
        """Answer probes until `stopping` is set or the socket is closed."""
        while not stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(1.0)
                    if conn.recv(1) == PROBE:
                        conn.sendall(self.answer)
                except OSError:
                    pass  # the prober gave up, or it was not one

    def close(self) -> None:
        self.sock.close()


def _listen() -> socket.socket:
    """A listening socket on every interface: IPv4 and IPv6 where the system has both."""
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128)
        except OSError:
            pass
    return socket.create_server(("0.0.0.0", 0), backlog=128)


def outgoing_address(host: str) -> str | None:
    """This host's address on the route to `host` (IPv4 or IPv6), or None when there is none."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, target in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(target)  # a UDP connect sends nothing: it only picks the outgoing address
                return s.getsockname()[0]
        except OSError:
            continue
    return None


def probe(targets: dict[int, list[tuple[str, int]]], answers: dict[int, bytes], wait_s: float) -> dict[int, str]:
    """Probe every rank at each of its (address, port) targets at once, for at most `wait_s`. Per rank:
    'answered' (its token came back), 'its process ended' (refused at every target), 'it never said where to
    probe it' (no target), or 'no answer within N s to a probe' (stopped, hung, or its host unreachable)."""
    sel = selectors.DefaultSelector()
    refused: dict[int, int] = {r: 0 for r in targets}
    answered: set[int] = set()
    received: dict[socket.socket, bytes] = {}
    for rank, addresses in targets.items():
        for host, port in addresses:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            code = sock.connect_ex((host, port))
            if code in (0, errno.EINPROGRESS):
                sel.register(sock, selectors.EVENT_WRITE, rank)
                continue
            refused[rank] += code == errno.ECONNREFUSED
            sock.close()
    deadline = time.monotonic() + wait_s
    while sel.get_map() and time.monotonic() < deadline:
        for key, events in sel.select(timeout=max(0.0, deadline - time.monotonic())):
            sock, rank = key.fileobj, key.data
            done = rank in answered
            if not done and events & selectors.EVENT_WRITE:
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    refused[rank] += code == errno.ECONNREFUSED
                    done = True
                else:
                    try:
                        sock.send(PROBE)
                        sel.modify(sock, selectors.EVENT_READ, rank)
                        received[sock] = b""
                    except OSError:
                        done = True
            elif not done:
                try:
                    data = sock.recv(256)
                except OSError:
                    data = b""
                received[sock] += data
                if received[sock] == answers[rank]:
                    answered.add(rank)
                done = not data or rank in answered
            if done:
                sel.unregister(sock)
                sock.close()
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    sel.close()
    results = {}
    for rank, addresses in targets.items():
        if rank in answered:
            results[rank] = "answered"
        elif not addresses:
            results[rank] = "it never said where to probe it"
        elif refused[rank] == len(addresses):
            results[rank] = "its process ended"
        else:
            results[rank] = f"no answer within {wait_s:.0f} s to a probe"
    return results
