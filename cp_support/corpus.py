"""Real text without a download: the standard library's own source, as byte tokens."""

from pathlib import Path
import sysconfig

import torch


class Corpus:
    """Byte tokens of the standard library's own .py files (sorted by name), cut into rows of S."""

    def __init__(self, seq_len):
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        data = b"".join(f.read_bytes() for f in files)
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len, self.rows = seq_len, len(data) // seq_len
        if self.rows == 0:
            raise ValueError(f"`--seq-len` {seq_len} is longer than the corpus ({len(data)} bytes)")

    def batch(self, first_row, rows):
        """input_ids and labels [rows, S]: rows first_row, first_row + 1, ... (wrapping around)."""
        index = (torch.arange(first_row, first_row + rows) % self.rows)[:, None] * self.seq_len
        ids = self.tokens[index + torch.arange(self.seq_len)]
        return {"input_ids": ids, "labels": ids.clone()}
