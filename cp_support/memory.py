"""The process's resident-set high-water mark, resettable (Linux /proc), for peak-memory figures."""

import gc
import re


def _status_kib(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def reset_peak():
    """Set the high-water mark (VmHWM) to the current resident set (VmRSS); returns it, in MiB."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") / 1024


def peak_mib():
    """The resident set's high-water mark since the last reset_peak (or the process start), in MiB."""
    return _status_kib("VmHWM") / 1024
