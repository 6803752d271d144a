"""What this Linux machine's kernel says about its processes and sockets, read from /proc.

Owns :func:`listening_addresses` (every TCP socket listening on a port: what
``dsv41 serve`` really bound), :func:`descendants` (a process's whole tree: the
processes a Ray it started runs), :func:`process_title` and :func:`rss_bytes`. Each
returns nothing (empty, None) where /proc lacks the answer (another OS, a process that
just exited), never raises for that.

Must not import: ``ray``, ``torch``, ``cluster``, ``model``, ``actors``, or another
``deploy`` module.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

PROC = Path("/proc")


def listening_addresses(port: int) -> list[str]:
    """``host:port`` of every TCP socket of this machine listening on ``port`` (from
    /proc/net/tcp and tcp6)."""
    found = []
    for table in ("net/tcp", "net/tcp6"):
        try:
            rows = (PROC / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, _, hex_port = local.partition(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            # Each 32-bit word of the address is in host (little-endian) order.
            raw = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, len(address), 8))
            host = ipaddress.ip_address(raw)
            # A dual-stack socket bound to an IPv4 address shows it IPv4-mapped.
            host = getattr(host, "ipv4_mapped", None) or host
            found.append(f"[{host}]:{port}" if host.version == 6 else f"{host}:{port}")
    return found


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` in the process tree."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = set(), [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def process_title(pid: int) -> str | None:
    """A process's name: the title it gave itself (Ray's workers: ``ray::...``), else
    its program's file name (with the script's, or ``-m`` and the module's, for a
    Python program)."""
    try:
        argv = [part.decode(errors="replace") for part in (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")]
    except OSError:
        return None
    if argv[0].startswith("ray::"):
        return argv[0]
    program = Path(argv[0]).name
    if program.startswith("python") and len(argv) > 2 and argv[1] == "-m":
        return f"{program} -m {argv[2]}"
    if program.startswith("python") and len(argv) > 1 and argv[1]:
        return f"{program} {Path(argv[1]).name}"
    return program


def rss_bytes(pid: int) -> int | None:
    """A process's resident set size."""
    try:
        resident = int((PROC / str(pid) / "statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident * os.sysconf("SC_PAGE_SIZE")
