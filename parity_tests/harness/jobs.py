"""`torchrun` jobs for the tests, each with a time limit (the main job, the recipes)."""

import os
import subprocess
import sys

import pytest

LAUNCH_TIMEOUT_S = 240
# the console script: `python -m torch.distributed.run` starts its workers twice as slowly here
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def torchrun(module, args, nproc, launcher=("--standalone",)):
    """`torchrun ... -m module args`, started: a Popen whose output (stdout and stderr) `finish` reads."""
    command = [TORCHRUN, *launcher, "--nproc-per-node", str(nproc), "-m", module, *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout=LAUNCH_TIMEOUT_S):
    """(exit code, output) of a started job; the test fails if it runs past `timeout` seconds."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout}s:\n{out[-3000:]}")
    return proc.returncode, out
