"""What every benchmark writes: its rows, its arguments, and a stamp saying which code ran where.

`benchmarks.report` reads these files back and writes the figures of docs/benchmarks.md from them,
so that a figure in the docs is never older than the run it comes from.
"""

import datetime
import json
import os
import platform
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args):
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu():
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def _memory_gib():
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        return None
    return round(kib / 2**20)


def stamp():
    """The commit (and whether code outside docs/ differed from it), the machine and the versions."""
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs")
    return {
        "commit": _git("rev-parse", "--short=12", "HEAD"),
        "modified": bool(changed),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {
            "cpu": _cpu(),
            "cores": os.cpu_count(),
            "memory_gib": _memory_gib(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": _command(),
    }


def _command():
    """How this process was started: `python -m module args`, or torchrun's line under torchrun."""
    command = " ".join([f"-m {_module(sys.argv[0])}", *sys.argv[1:]])
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return f"torchrun --nproc-per-node {os.environ['LOCAL_WORLD_SIZE']} {command}"
    return f"python {command}"


def _module(path):
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    return rel.removesuffix(".py").removesuffix("/__main__").replace(os.sep, ".")


def write(path, args, rows):
    """{"stamp", "args", "rows"} as JSON at `path`."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"stamp": stamp(), "args": vars(args), "rows": rows}, f, indent=1)
        f.write("\n")


def read(path):
    with open(path) as f:
        return json.load(f)
