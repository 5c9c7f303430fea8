"""Rows of whole examples: packed (several per row) or one per row, with positions and masked targets.

An example of n tokens (a chat, a prompt + completion, a document) fills n - 1 positions of a
row: its inputs are its tokens but the last, its targets the tokens after each (``IGNORE_INDEX``
where the mask does not count them), so the last token is only ever a target and no target
crosses into the next example. Positions restart at 0 at each example; the free end of a row is
padding, its own run of positions from 0, with ``IGNORE_INDEX`` targets. An example longer than
``seq_len + 1`` tokens is cut to its first ``seq_len + 1`` (``long_examples="truncate"``, counted)
or refused (``"refuse"``); one left without a counted target (a reply cut off) is dropped, counted.

Packing is greedy in example order: an example goes into the current row if it fits, else it
starts the next row. The layout depends only on the data and ``seq_len``, never on the number of
processes; each epoch visits the rows in an order drawn from (seed, epoch), as TokenRows does, so
step k reads the same rows in every layout and a resumed run continues where it stopped.
Counted targets per row are computed once (``counts``), so every rank knows the global batch's
count without a collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from paratrain.data.sources import DataError
from paratrain.data.tokenfile import document_split

if TYPE_CHECKING:  # the data layer imports torch only when a batch is built
    import torch

IGNORE_INDEX = -100  # torch's default ignore_index: a target the loss does not count
EMPTY = -1  # a row index past a whole file's last row: a padding row, nothing counted


def layout(lengths: np.ndarray, seq_len: int, packing: bool) -> list[tuple[int, int]]:
    """Rows as [first, last) example ranges; each example fills ``min(n, seq_len + 1) - 1`` slots."""
    slots = np.minimum(lengths, seq_len + 1) - 1
    rows, first, used = [], 0, 0
    for i, s in enumerate(slots.tolist()):
        if i > first and (not packing or used + s > seq_len):
            rows.append((first, i))
            first, used = i, 0
        used += s
    if len(slots) > first:
        rows.append((first, len(slots)))
    return rows


class PackedRows:
    """The rows of an example corpus: ``train_batch``/``val_batch`` give (x, y, positions)."""

    def __init__(self, tokens: np.ndarray, doc_ends: np.ndarray, seq_len: int, val_fraction: float,
                 seed: int, *, mask: np.ndarray | None = None, packing: bool = True,
                 long_examples: str = "truncate", pad_id: int = 0, whole: bool = False):
        self.tokens, self.mask, self.seq_len, self.seed, self.pad_id = tokens, mask, seq_len, seed, pad_id
        self.whole = whole  # an evaluation file: every example is a validation row, none trains
        starts = np.concatenate([[0], np.asarray(doc_ends[:-1], dtype=np.int64)])
        lengths = np.asarray(doc_ends, dtype=np.int64) - starts
        keep = lengths >= 2  # a one-token example has no target
        self.truncated = self._check_long(lengths[keep], long_examples)
        self.starts, self.lengths = starts[keep], np.minimum(lengths[keep], seq_len + 1)
        per = self._per_example()
        # An example left with no counted target (its reply cut off by truncation) would only cost compute,
        # and a global batch of such examples would have nothing to divide by: it is dropped, and counted.
        self.without_targets = int((per == 0).sum())
        self.starts, self.lengths, per = self.starts[per > 0], self.lengths[per > 0], per[per > 0]
        if len(self.starts) == 0:
            raise DataError("the corpus has no example with a counted target (two tokens or more, a reply "
                            "within --seq-len + 1 tokens): nothing to learn from")
        val_first = 0 if whole else self._val_first(np.cumsum(self.lengths), val_fraction)
        self.train_rows = layout(self.lengths[:val_first], seq_len, packing)
        val = layout(self.lengths[val_first:], seq_len, packing)
        self.val_rows = [(a + val_first, b + val_first) for a, b in val] or self.train_rows
        self.n_train, self.n_val = len(self.train_rows), len(self.val_rows)
        cum = np.concatenate([[0], np.cumsum(per)])  # counted targets before each example
        self.train_counts = self._counts(cum, self.train_rows)
        self.val_counts = self._counts(cum, self.val_rows)
        self._perm_epoch, self._perm = -1, None

    def _check_long(self, lengths: np.ndarray, policy: str) -> int:
        long = lengths > self.seq_len + 1
        if policy == "refuse" and long.any():
            raise DataError(f"{int(long.sum())} example(s) are longer than --seq-len + 1 = "
                            f"{self.seq_len + 1} tokens (the longest: {int(lengths.max())}): raise "
                            "--seq-len, shorten them, or pass --long-examples truncate")
        return int(long.sum())

    @staticmethod
    def _val_first(ends: np.ndarray, val_fraction: float) -> int:
        split = document_split(ends, val_fraction)
        return split.get("val_first_document", len(ends))

    def _per_example(self) -> np.ndarray:
        """Counted targets of each example: its mask after the first token, in one pass over the mask."""
        if self.mask is None:
            return self.lengths - 1
        # Sums over [start + 1, start + n) and the gaps between (every other segment): one reduceat.
        bounds = np.stack([self.starts + 1, self.starts + self.lengths], axis=1).ravel()
        ends_at_file_end = bounds[-1] == len(self.mask)
        sums = np.add.reduceat(self.mask, bounds[:-1] if ends_at_file_end else bounds, dtype=np.int64)
        return sums[0::2]

    @staticmethod
    def _counts(cum: np.ndarray, rows: list[tuple[int, int]]) -> np.ndarray:
        return np.asarray([cum[b] - cum[a] for a, b in rows], dtype=np.int64)

    def _row(self, first: int, last: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        y = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        pos = np.zeros(self.seq_len, dtype=np.int64)
        at = 0
        for i in range(first, last):
            a, n = int(self.starts[i]), int(self.lengths[i])
            ids = self.tokens[a:a + n].astype(np.int64)
            x[at:at + n - 1], pos[at:at + n - 1] = ids[:-1], np.arange(n - 1)
            y[at:at + n - 1] = ids[1:] if self.mask is None else np.where(self.mask[a + 1:a + n] > 0, ids[1:],
                                                                           IGNORE_INDEX)
            at += n - 1
        pos[at:] = np.arange(self.seq_len - at)  # padding: its own run from 0
        return x, y, pos

    def _order(self, epoch: int):
        import torch

        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n_train, generator=gen), epoch
        return self._perm

    def train_indices(self, step: int, global_batch: int, rows: slice | None = None) -> list[int]:
        """Indices into ``train_rows`` of rows ``rows`` of the global batch at ``step``."""
        positions = range(step * global_batch, (step + 1) * global_batch)[rows or slice(None)]
        return [int(self._order(p // self.n_train)[p % self.n_train]) for p in positions]

    def val_indices(self, index: int, global_batch: int, rows: slice | None = None) -> list[int]:
        """Indices into ``val_rows``; the held-out split wraps around, a whole file does not: past
        its last row come ``EMPTY`` rows (padding, nothing counted), so each row counts once."""
        positions = range(index * global_batch, (index + 1) * global_batch)[rows or slice(None)]
        if self.whole:
            return [p if p < self.n_val else EMPTY for p in positions]
        return [p % self.n_val for p in positions]

    def n_val_batches(self, global_batch: int) -> int:
        """Validation batches that visit every validation row once."""
        return -(-self.n_val // global_batch)

    def _batch(self, table: list[tuple[int, int]], indices: list[int]) -> tuple[torch.Tensor, ...]:
        import torch

        parts = [self._row(*table[i]) if i != EMPTY else self._row(0, 0) for i in indices]
        return tuple(torch.from_numpy(np.stack([p[k] for p in parts])) for k in range(3))

    def train_batch(self, step: int, global_batch: int,
                    rows: slice | None = None) -> tuple[torch.Tensor, ...]:
        """(x, y, positions) of rows ``rows`` (default: all) of the global batch at ``step``."""
        return self._batch(self.train_rows, self.train_indices(step, global_batch, rows))

    def val_batch(self, index: int, global_batch: int, rows: slice | None = None) -> tuple[torch.Tensor, ...]:
        return self._batch(self.val_rows, self.val_indices(index, global_batch, rows))

    def train_units(self, step: int, global_batch: int) -> int:
        """Counted targets of the whole global batch at ``step``."""
        return int(self.train_counts[self.train_indices(step, global_batch)].sum())

    def val_units(self, index: int, global_batch: int) -> int:
        return int(sum(int(self.val_counts[i]) for i in self.val_indices(index, global_batch) if i != EMPTY))

    def info(self) -> dict:
        """For run.json: the row layout and how many examples were cut."""
        return {"packing_rows": {"train": self.n_train, "val": self.n_val}, "examples": len(self.starts),
                "counted_tokens": {"train": int(self.train_counts.sum()), "val": int(self.val_counts.sum())},
                "truncated_examples": self.truncated, "examples_without_targets": self.without_targets,
                "seq_len": self.seq_len}
