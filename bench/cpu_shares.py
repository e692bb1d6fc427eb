"""Where a benchmark point's CPU time went, by process: the server under test, its engine, Ray's own daemons,
the load generator, the rest of the machine.

A served figure on emulated cores is bounded by the host's CPUs, which the emulated cores, the serving processes
and the load generator share; what each used during a point tells the serving path's cost from the compiled
calls' (docs/guides/benchmarks.md, Generation over HTTP). ``snapshot()`` before and after a point, then
``shares(before, after, seconds, server_pid)``: per kind, the CPU used as a percentage of one CPU.
"""

from __future__ import annotations

import os

import psutil

from . import servers

# The kind of a process, from its command line, in the order tried; a process of the server's tree that matches
# none is "server, other".
KINDS = [("engine process", "generation.process.worker"), ("replicas", "ray::ServeReplica"),
         ("Ray Serve controller and proxies", "ray::ServeController"), ("Ray Serve controller and proxies", "ray::Proxy"),
         ("Ray Serve controller and proxies", "ray::HAProxy"), ("Ray daemons", "/ray/"), ("Ray daemons", "ray::")]


def snapshot() -> dict[int, tuple[str, float]]:
    """pid -> (command line, CPU seconds so far) of every process that can be read."""
    found = {}
    for proc in psutil.process_iter():
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                found[proc.pid] = (" ".join(proc.cmdline()) or proc.name(), times.user + times.system)
        except (psutil.Error, OSError):
            continue
    return found


def kind_of(cmdline: str, in_server: bool, me: int, pid: int) -> str:
    if pid == me:
        return "load generator"
    for kind, marker in KINDS:
        if marker in cmdline:
            return kind  # Ray's daemons leave the server's process group, and some its tree: matched by name
    return "server, other" if in_server else "rest of the machine"


def shares(before: dict, after: dict, seconds: float, server_pid: int | None) -> dict[str, float]:
    """Per kind, the CPU its processes used between the two snapshots, in percent of one CPU (a process seen only
    after counts from 0), and "total"."""
    server = set(servers._pids(server_pid)) if server_pid is not None else set()
    me, used = os.getpid(), {}
    for pid, (cmdline, cpu) in after.items():
        start = before.get(pid, (None, 0.0))[1]
        kind = kind_of(cmdline, pid in server, me, pid)
        used[kind] = used.get(kind, 0.0) + max(cpu - start, 0.0)
    result = {kind: 100 * cpu / seconds for kind, cpu in sorted(used.items(), key=lambda kv: -kv[1]) if cpu > 0}
    result["total"] = sum(result.values())
    return result


def text(found: dict[str, float]) -> str:
    """'engine process 145%, replicas 4%, ...; total 171% of 2 CPUs'."""
    parts = [f"{kind} {percent:.0f}%" for kind, percent in found.items() if kind != "total" and percent >= 0.5]
    return ", ".join(parts) + f"; total {found.get('total', 0):.0f}% of {os.cpu_count()} CPUs"
