"""The recipes (examples/recipes/, in docs/hf.md and docs/trainer.md), run as a user runs them:
under torchrun, on gloo.

Each recipe compares its CP run with one process and exits 1 when they differ (the data-parallel
one compares every gradient to 1e-6 of its largest entry: DDP wrapped as it is, `--wrap ddp-as-is`,
is 0.5 apart); here every one must print EQUAL. Every launch has a time limit.
"""

import re

import pytest

from parity_tests.harness import bounds, jobs


def launch(module, nproc, *args):
    return jobs.finish(jobs.torchrun(f"examples.recipes.{module}", args, nproc), timeout=180)


@pytest.mark.parametrize(
    "module,nproc,args,says",
    [
        ("data_parallel", 4, ["--wrap", "fsdp2"], ["EQUAL (fsdp2)"]),
        ("padding", 2, [], ["padding (row 1 padded by 100 of 512)", "EQUAL"]),
        ("packed", 2, [], ["packed, documents isolated", "(not isolated)", "EQUAL"]),
        ("deepseek", 2, [], ["DeepSeek V3.2", "EQUAL"]),
    ],
    ids=["data_parallel-fsdp2", "padding", "packed", "deepseek"],  # DDP: test_hf_inputs, in the pool
)
def test_recipe_equals_one_process(module, nproc, args, says):
    code, out = launch(module, nproc, *args)
    assert code == 0 and "DIFFERENT" not in out and all(s in out for s in says), out[-3000:]
    assert "torch_impl.hf.parallelize: " in out and "inputs checked across ranks: yes" in out
    found = re.search(r"(?:apart by|largest difference) (\S+)(?: at most)? \(tolerance (\S+)\)", out)
    assert found, out[-3000:]
    bounds.check(float(found[1]), float(found[2]), "the recipe's own comparison")  # for the margins
