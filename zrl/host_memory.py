"""Host memory of this process: handing freed heap memory back to the OS, and measuring the peak.

Weight sync streams the policy through host memory bucket by bucket; both ends trim the heap between
buckets (`release_host_memory`) so that a process holds what is live, and the sync reports its peak
(`HostPeakMemory`). The rollout engine's weight loader (serving/worker_ext.py) trims between decoder
layers the same way.
"""

from __future__ import annotations

import ctypes

try:
    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim  # noqa: B018  (glibc only)
except (OSError, AttributeError):
    _LIBC = None


def release_host_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim; a no-op elsewhere).

    Between buckets the loader has freed what it copied, but glibc keeps freed chunks it cannot reuse
    for the next, differently sized allocations, and the process would grow by about the model's size
    over one sync although it never holds more than a bucket or two: trimming keeps its footprint to
    what is live.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class HostPeakMemory:
    """Peak resident memory of this process above its level at entry, over a `with` block (Linux).

    Resets the kernel's high-water mark (writing 5 to /proc/self/clear_refs) on entry and reads it
    (VmHWM) on exit; `peak_extra_bytes` is -1 where the kernel does not offer this. Freed heap memory
    is returned to the OS first: otherwise how much of the block's allocations reuse memory the heap
    still held at entry (invisible to VmRSS) varies from call to call, and so would the peak.
    """

    def __enter__(self) -> "HostPeakMemory":
        self.peak_extra_bytes = -1
        release_host_memory()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._start = _status_bytes("VmRSS")
        except OSError:
            self._start = None
        return self

    def __exit__(self, *exc) -> None:
        if self._start is not None:
            self.peak_extra_bytes = max(0, _status_bytes("VmHWM") - self._start)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise OSError(f"/proc/self/status has no {field}")
