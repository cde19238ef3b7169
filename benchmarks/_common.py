"""Helpers shared by the benchmark scripts: percentiles, peak RSS, child-process measurement."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import numpy as np


def percentiles(seconds: list[float]) -> dict[str, float]:
    ms = np.array(seconds) * 1000
    return {
        "p50": float(np.percentile(ms, 50)),
        "p99": float(np.percentile(ms, 99)),
        "p99.9": float(np.percentile(ms, 99.9)),
        "n": len(ms),
    }


def peak_rss_mb() -> float:
    """This process's peak resident memory. Linux's VmHWM belongs to the address space, so a child
    started by a large parent does not report the parent's peak (``ru_maxrss`` survives exec)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_child(script: str, *args: str, env: dict | None = None) -> dict:
    """Run one measurement in a fresh process (so its peak RSS is its own) and parse its JSON line."""
    out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])
