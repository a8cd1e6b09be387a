"""CPU time and memory of a process, from /proc (Linux)."""
from __future__ import annotations

import os
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcSample:
    cpu_s: float  # user + system, this process only
    rss_mib: float
    peak_rss_mib: float  # VmHWM: the high-water mark since the process started
    nice: int  # a component at a higher nice value than the others gets less of a busy machine


def sample(pid: int) -> ProcSample | None:
    """None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    nice = int(fields[16])  # field 19
    mem = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            mem[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return ProcSample((utime + stime) / _TICKS, mem.get("VmRSS", 0.0), mem.get("VmHWM", 0.0), nice)


def machine_cpu_s() -> float:
    """CPU seconds spent by the whole machine (all processes, every core) since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        first = f.readline().split()
    # user nice system idle iowait irq softirq steal: everything but idle and iowait is busy time.
    values = [int(v) for v in first[1:9]]
    return (sum(values) - values[3] - values[4]) / _TICKS
