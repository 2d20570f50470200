"""The main job: the CP hybrid block equals the single-process block, on 2 and 4 gloo ranks."""

import pytest
import torch
import torch.nn.functional as F

from examples import demo
from examples import hybrid_block as hb
from parity_tests.harness import bounds
from parity_tests.harness.workers import group_ranks
from parity_tests.transport import torch_cases


def naive_block(block, x, positions, valid):
    """The block written over the whole sequence with no torch_impl at all: explicit padding and
    S x S masks. Checks that the group=None path of the block is the block it claims to be."""
    S, K, W = x.shape[1], block.kernel, block.window
    x = x + F.conv1d(F.pad(x.transpose(1, 2), (K - 1, 0)), block.conv.weight, groups=x.shape[2]).transpose(
        1, 2
    )
    i, j = torch.arange(S)[:, None], torch.arange(S)[None]
    q, k, v = block.local_attn.split(x)
    x = x + block.local_attn.attend(q, k, v, ((j <= i) & (j > i - W))[None])
    q, k, v = block.global_attn.split(x)
    mask = (positions[:, None, :] <= positions[:, :, None]) & valid[:, None, :]
    return x + block.global_attn.attend(q, k, v, mask)


def test_single_process_block_is_the_naive_block():
    block = hb.make_block(16, 2, 4, 7, torch.float64)
    x, _, positions, valid = hb.make_inputs(2, 20, 16, 3, torch.float64)
    torch.testing.assert_close(block(x, None, positions, valid), naive_block(block, x, positions, valid))


@pytest.mark.parametrize(
    "grouping,window,batch",
    [
        (("block", 2), 5, 1),  # the window within one earlier shard (L = 12)
        (("block", 4), 5, 2),
        (("block", 4), 20, 1),  # W - 1 = 19 tokens: spans two earlier shards (L = 6)
        (("strided", 4), 20, 2),
    ],
    ids=str,
)
def test_cp_block_equals_single_process_block(pool, grouping, window, batch):
    n = len(group_ranks(grouping)[0])
    config = {"dim": 16, "heads": 2, "kernel": 4, "window": window, "dtype": "float32"}
    seq_len, pad = 24, 3
    results = pool.run(grouping, torch_cases.hybrid_block, config, batch, seq_len, pad)

    block = hb.make_block(16, 2, 4, window, torch.float32)
    x, cotangent, positions, valid = hb.make_inputs(batch, seq_len, 16, pad, torch.float32)
    reference = hb.forward_backward(block, x, cotangent, None, positions, valid)
    for group_results in results:
        diffs = hb.max_differences(reference, group_results)
        assert len(diffs) == 2 + len(list(block.parameters()))
        # float32 (examples/demo.py's tolerance): a conv of K = 4 taps and two attentions summing up
        # to 24 keys in another order, over values of order 1: a few hundred float32 ulps
        worst = max(diffs, key=diffs.get)
        bounds.check(diffs[worst], demo.TOLERANCE["float32"], f"{worst} ({diffs})")
    assert n == len(results[0])


def test_demo_end_to_end_with_figure(tmp_path, capsys):
    figure = tmp_path / "routing.png"
    args = ["--world", "2", "--seq-len", "32", "--window", "20", "--dim", "8", "--heads", "2", "--reps", "1"]
    assert demo.main([*args, "--figure", str(figure)]) == 0
    out = capsys.readouterr().out
    assert "EQUAL: largest difference" in out and "sliding_window_attention" in out
    assert figure.stat().st_size > 10_000
