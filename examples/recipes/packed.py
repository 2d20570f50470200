"""Recipe: packed documents under CP (position_ids restart at each document), equal to one process.

    torchrun --standalone --nproc-per-node 2 -m examples.recipes.packed

One row holds four documents of 100, 180, 32 and 200 tokens; `position_ids` restart at 0 at each.
transformers isolates the documents (no token attends to another document) only when the model
gets **no** `attention_mask` and makes no KV cache: then `torch_impl.hf` gathers the positions once
per forward and every attention layer drops other documents' keys. Passing an `attention_mask`,
even all ones, turns the isolation off, in one process and under CP alike: the row is one causal
sequence again. Both are shown. (Labels are not split at document boundaries here: the last token
of a document predicts the first of the next, as in one process.)
"""

import torch
import torch.distributed as dist

from examples.recipes.common import compare, finish, llama
from torch_impl import hf


def main():
    dist.init_process_group("gloo")  # "nccl" with one GPU per rank
    group = dist.group.WORLD  # CP over every rank
    ids = torch.randint(0, 128, (1, 512), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in (100, 180, 32, 200)])[None]  # [1, 512]
    packed = {"input_ids": ids, "position_ids": positions, "labels": ids}
    model = hf.parallelize(llama(), group)
    one = llama()

    equal = True
    for what, batch in [
        ("packed, documents isolated", packed),
        ("packed with an attention_mask (not isolated)", packed | {"attention_mask": torch.ones_like(ids)}),
    ]:
        out = model(**hf.shard_batch(batch, group))
        equal &= compare(what, out, one(**batch, use_cache=False))
    finish(equal)


if __name__ == "__main__":
    main()
