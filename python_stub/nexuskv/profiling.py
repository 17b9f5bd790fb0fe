"""Measurement helpers shared by the benchmarks and the tests."""

from __future__ import annotations

import datetime
import os
import platform

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # keep torch.profiler's start/stop log lines off stderr


def peak_allocated_bytes(fn) -> int:
    """Peak bytes allocated through torch's CPU allocator while fn runs (what exists
    before the call is not counted; the output is).

    Accumulates the profiler's raw allocation records ("[memory]" events: +bytes at each
    allocation, -bytes at each free) in time order.  prof.events() is not used: there each
    op event carries the sum of every allocation inside its time range, so an allocation made
    by a nested op (aten::empty inside nexuskv::nq_decompress) is counted once per nesting
    level, which doubles most peaks."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    recs = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
    live = peak = 0
    for _, n in recs:
        live += n
        peak = max(peak, live)
    return peak


def machine_info(threads: int) -> dict:
    """What a benchmark ran on: CPU model, cores, threads, torch and nexuskv versions, load."""
    import torch

    from . import __version__

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu_model": cpu, "cpu_count": os.cpu_count(), "threads": threads, "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "nexuskv": __version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "load_1min_at_start": os.getloadavg()[0],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
