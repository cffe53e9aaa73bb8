"""Peak resident memory of this process, per stage: Linux ``/proc/self/status`` ``VmHWM`` (the
resident-set high-water mark), reset to the current resident set by writing ``5`` to
``/proc/self/clear_refs`` (Linux >= 4.0), so the peak read after a stage is that stage's own.
Processes the stage starts (engine workers) are counted by ``RUSAGE_CHILDREN`` (the largest waited-for
child). ``None`` where ``/proc`` is not there (macOS)."""

from __future__ import annotations

import resource
import sys


def reset_peak() -> bool:
    """Reset this process's ``VmHWM``; whether it could be."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int | None:
    """This process's resident-set peak (``VmHWM``) in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def children_peak_bytes() -> int:
    """The largest resident-set peak of any child process waited for so far (``RUSAGE_CHILDREN``)."""
    kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return kb if sys.platform == "darwin" else kb * 1024


class StagePeak:
    """``with StagePeak() as p: ...`` then ``p.fields()``: ``peak_rss_gb`` (this process, the stage's own
    when ``VmHWM`` could be reset) and ``child_peak_rss_gb`` (a child started in the stage that held more
    than any before)."""

    def __enter__(self) -> StagePeak:
        self.reset = reset_peak()
        self.children0 = children_peak_bytes()
        self.peak: int | None = None
        self.children = 0
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = peak_bytes()
        self.children = children_peak_bytes()

    def fields(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.peak is not None and self.reset:
            out["peak_rss_gb"] = round(self.peak / 2**30, 3)
        if self.children > self.children0:
            out["child_peak_rss_gb"] = round(self.children / 2**30, 3)
        return out
