"""What the recipes share: a tiny model from a config, and the comparison with one process."""

import gc

import torch
import torch.distributed as dist
import transformers as tf


def llama(dtype=torch.float32):
    torch.manual_seed(0)  # the same weights on every rank (or load the same checkpoint)
    config = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return tf.LlamaForCausalLM(config).to(dtype)


def compare(what, out, one, valid=None, tolerance=1e-5):
    """Print this CP run against one process, on rank 0; every rank returns whether they agree.

    out: this rank's output (logits [B, L, V], loss: its share); one: the model's output on the whole
    batch in one process; valid: bool [B, S], the positions whose logits count (not padding).
    """
    r, L = dist.get_rank(), out.logits.shape[1]
    rows = slice(r * L, (r + 1) * L)  # this rank's tokens [r*L, (r+1)*L)
    apart = (out.logits - one.logits[:, rows]).abs()
    apart = (apart if valid is None else apart[valid[:, rows]]).max()
    dist.all_reduce(apart, op=dist.ReduceOp.MAX)
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)  # the ranks' shares add up to the loss
    # transformers computes the loss in float32 (it upcasts the logits): one process sums the tokens'
    # losses in one float32 sum, CP in n and adds them; each sum's rounding is a few float32 ulps
    loss_bound = tolerance + 4 * dist.get_world_size() * 2.0**-23 * abs(one.loss.item())
    equal = apart.item() <= tolerance and abs(loss.item() - one.loss.item()) <= loss_bound
    if r == 0:
        print(
            f"{what}: loss {loss.item():.6f} (one process {one.loss.item():.6f}), logits apart by "
            f"{apart.item():.1e} at most (tolerance {tolerance:g}): {'EQUAL' if equal else 'DIFFERENT'}"
        )
    return equal


def finish(equal):
    gc.collect()  # free gloo work held in reference cycles first: avoids an abort at exit
    dist.destroy_process_group()
    raise SystemExit(0 if equal else 1)
