"""Recipe: a padded batch under CP (labels -100 on padding), equal to one process.

    torchrun --standalone --nproc-per-node 2 -m examples.recipes.padding

Row 1 of the batch is right-padded by 100 tokens: `attention_mask` 0 and `labels` -100 there.
`hf.shard_batch` shards both, shifts the labels over the *global* sequence (the last token of
rank 0 predicts the first of rank 1) and counts the valid ones over all ranks, so the ranks' loss
shares add up to one process's mean loss; each attention layer gathers the padding mask with its
keys. Logits at padding positions are not compared (no loss reads them).
"""

import torch
import torch.distributed as dist

from examples.recipes.common import compare, finish, llama
from torch_impl import hf


def main():
    dist.init_process_group("gloo")  # "nccl" with one GPU per rank
    group = dist.group.WORLD  # CP over every rank
    ids = torch.randint(0, 128, (2, 512), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, -100:] = 0  # row 1: 412 tokens, then padding
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    model = hf.parallelize(llama(), group)
    out = model(**hf.shard_batch(batch, group))
    out.loss.backward()  # this rank's share; sum the gradients over ranks (hf.apply_fsdp / apply_ddp)

    one = llama()(**batch)  # the same model in one process, the whole batch
    finish(compare("padding (row 1 padded by 100 of 512)", out, one, valid=mask.bool()))


if __name__ == "__main__":
    main()
