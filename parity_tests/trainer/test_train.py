"""examples.train under torchrun: DP x CP training equals one process, step by step.

Each test launches real `torchrun` jobs (gloo, 4 processes on this machine, or two launchers with
--nnodes 2 standing for two nodes) with a short sequence and few steps, and reads the job's metrics
file. Every launch has a time limit.
"""

import json
import re
import shutil
import socket
import subprocess
import sys

import pytest

from parity_tests.harness import bounds, jobs
from parity_tests.harness.jobs import LAUNCH_TIMEOUT_S

SMALL = ["--seq-len", "512", "--window", "200"]  # L = 128 at CP 4: the window spans two shards


def torchrun(args, nproc=4, launcher=("--standalone",)):
    return jobs.torchrun("examples.train", args, nproc, launcher)


def run(args, **kwargs):
    return jobs.finish(torchrun(args, **kwargs))


def check_verdict(out):
    """The job's own comparison with one process (examples.train's docstring derives its
    tolerance), kept for the margins report: its largest loss difference against its tolerance."""
    found = re.search(r"EQUAL: largest difference (\S+) \(tolerance (\S+) for", out)
    assert found, out[-3000:]
    bounds.check(float(found[1]), float(found[2]), "the job's largest loss difference")


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--cp", "4", "--steps", "3", "--layout", "head_tail"], marks=pytest.mark.slow),
        ["--dp", "2", "--cp", "2", "--model", "lfm2", "--ac", "--dtype", "float64", "--steps", "3"],
        pytest.param(
            ["--dp", "2", "--cp", "2", "--model", "deepseek_v32", "--dtype", "float64", "--steps", "1"],
            marks=pytest.mark.slow,
        ),
        ["--cp", "2", "--model", "qwen3_5", "--dtype", "float64", "--steps", "2", "--layout", "head_tail"],
        ["--dp", "2", "--cp", "2", "--model", "qwen3_5", "--ac", "--dtype", "float64", "--steps", "2"],
        pytest.param(
            ["--cp", "2", "--model", "qwen3_5", "--compile", "--ac", "--dtype", "float64", "--steps", "2"],
            marks=pytest.mark.slow,
        ),
    ],
    ids=[
        "gemma3-cp4-head_tail",
        "lfm2-dp2-cp2-ac-float64",
        "deepseek_v32-dp2-cp2-float64",
        "qwen3_5-cp2-head_tail-float64",
        "qwen3_5-dp2-cp2-ac-float64",
        "qwen3_5-cp2-compiled-ac-float64",
    ],
)
def test_training_equals_one_process(tmp_path, args):
    metrics = tmp_path / "metrics.json"
    size = {flag: int(args[args.index(flag) + 1]) if flag in args else 1 for flag in ("--dp", "--cp")}
    code, out = run(
        [*args, *SMALL, "--reference", "--metrics", str(metrics), "--figure", str(tmp_path / "f.png")],
        nproc=size["--dp"] * size["--cp"],
    )
    assert code == 0 and "EQUAL: largest difference" in out, out[-3000:]
    check_verdict(out)
    m = json.loads(metrics.read_text())
    steps = int(args[args.index("--steps") + 1])
    assert m["losses"].keys() == m["reference_losses"].keys() == {str(s + 1) for s in range(steps)}
    assert (tmp_path / "f.png").stat().st_size > 10_000
    if "head_tail" in args:  # the all-gather baseline is contiguous only
        assert f"Applied CP over {args[args.index('--cp') + 1]} ranks (torch_impl, layout head_tail)" in out
        assert m["received_per_layer"].keys() == {"torch_impl"}
        return
    ours, base = m["received_per_layer"]["torch_impl"], m["received_per_layer"]["allgather"]
    assert len(ours) == size["--dp"] * size["--cp"]  # per rank, per layer: never more than the baseline's
    assert all(a <= b for rank in zip(ours, base, strict=True) for a, b in zip(*rank, strict=True))
    if "lfm2" not in args and "qwen3_5" not in args:  # DeepSeek's latents: less in all (LFM2's and
        assert sum(map(sum, ours)) < sum(map(sum, base))  # Qwen3.5's attention is global: the same)


@pytest.mark.slow
def test_pure_data_parallelism_and_one_process_train(tmp_path):
    """--cp 1: no CP (the model's own attention), FSDP2 over dp ranks; and a plain `python -m
    examples.train`, one process without torchrun. Both equal the reference."""
    code, out = run(["--dp", "2", "--cp", "1", "--steps", "2", *SMALL, "--reference"], nproc=2)
    assert code == 0 and "No CP (--cp 1)" in out and "EQUAL" in out, out[-3000:]
    check_verdict(out)
    command = [sys.executable, "-m", "examples.train", "--steps", "2", *SMALL, "--reference"]
    command += ["--figure", str(tmp_path / "f.png")]
    one = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert one.returncode == 0 and "1 rank = dp 1 x cp 1" in one.stdout and "EQUAL" in one.stdout, one.stdout[
        -3000:
    ]


@pytest.mark.slow
def test_compiled_layers_with_activation_checkpointing_train():
    """Inductor + checkpointing in the job, under head_tail (the contiguous layout's compiled layers:
    test_hf's compile tests)."""
    args = ["--cp", "2", "--compile", "--ac", "--layout", "head_tail", "--steps", "2", *SMALL, "--reference"]
    code, out = run(args, nproc=2)
    assert code == 0 and "Applied torch.compile(fullgraph=True)" in out and "EQUAL" in out, out[-3000:]
    check_verdict(out)


def test_a_difference_over_the_tolerance_fails_the_job():
    """One process without torchrun, against a tolerance below zero: DIFFERENT, exit 1."""
    command = [
        sys.executable,
        "-m",
        "examples.train",
        "--steps",
        "1",
        *SMALL,
        "--reference",
        "--tolerance",
        "-1",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode != 0 and "DIFFERENT: largest difference" in done.stdout, done.stdout[-3000:]


def test_resume_continues_exactly(tmp_path):
    """A 2-step run (cp 2, its FSDP2 over the CP ranks) saving after every step; its step-2
    checkpoint removed, a run resumed from step 1 to step 2: the uninterrupted run's losses, to the
    bit. (DP x CP checkpoints: the same code, over the flattened mesh.)"""
    ckpt = tmp_path / "ckpt"
    common = ["--cp", "2", *SMALL, "--steps", "2", "--save-dir", str(ckpt)]
    code, out = run([*common, "--save-every", "1", "--metrics", str(tmp_path / "full.json")], nproc=2)
    assert code == 0, out[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000001", "step-000002"]
    shutil.rmtree(ckpt / "step-000002")
    code, out = run([*common, "--resume", "--metrics", str(tmp_path / "resumed.json")], nproc=2)
    assert code == 0, out[-3000:]
    assert "Resumed from" in out and "after step 1" in out
    full = json.loads((tmp_path / "full.json").read_text())["losses"]
    resumed = json.loads((tmp_path / "resumed.json").read_text())["losses"]
    assert resumed == {step: loss for step, loss in full.items() if int(step) > 1}


def test_two_nodes_on_one_machine(tmp_path):
    """Two torchrun launchers with --nnodes 2 and a c10d rendezvous on 127.0.0.1, one process
    each: the CP group spans the two nodes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}")
    args = ["--cp", "2", "--steps", "2", *SMALL, "--reference"]
    nodes = [torchrun(args, nproc=1, launcher=launcher) for _ in range(2)]
    results = [jobs.finish(node) for node in nodes]
    assert all(code == 0 for code, _ in results), [out[-2000:] for _, out in results]
    assert sum("EQUAL: largest difference" in out for _, out in results) == 1  # global rank 0's node
    check_verdict("".join(out for _, out in results))
