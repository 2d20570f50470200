"""What the Trainer and SFTTrainer recipes share: a word-level tokenizer built in memory, and tiny
datasets of random words (rows of different lengths)."""

import torch

WORDS = (
    "the a cat dog bird fish sat ran flew swam on under mat tree sky sea fast slow red blue green big "
    "small old new and then but so it was is saw"
).split()
SPECIAL = ("<pad>", "<eos>", "<unk>")


def tokenizer():
    """A PreTrainedTokenizerFast over WORDS (ids 3 ..), <pad> 0, <eos> 1, <unk> 2: no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate((*SPECIAL, *WORDS))}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def sentences(n, shortest, longest, seed):
    """n strings of shortest .. longest random words."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (n,), generator=gen)
    return [
        " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (int(k),), generator=gen)) for k in lengths
    ]


def token_rows(n, shortest, longest, seed):
    """A list of {"input_ids", "labels"} rows of shortest .. longest tokens (labels: the ids)."""
    ids = tokenizer()(sentences(n, shortest, longest, seed))["input_ids"]
    return [{"input_ids": row, "labels": list(row)} for row in ids]


def pad_rows(rows, pad_id=0):
    """A Trainer data collator: rows padded on the right to the longest, attention_mask 0 and
    labels -100 on the padding."""
    S = max(len(row["input_ids"]) for row in rows)

    def padded(key, fill):
        return torch.tensor([row[key] + [fill] * (S - len(row[key])) for row in rows])

    mask = torch.tensor([[1] * len(row["input_ids"]) + [0] * (S - len(row["input_ids"])) for row in rows])
    return {
        "input_ids": padded("input_ids", pad_id),
        "attention_mask": mask,
        "labels": padded("labels", -100),
    }
