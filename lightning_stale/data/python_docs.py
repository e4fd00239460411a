"""Characters of Python's own help texts (``pydoc_data.topics``): language-model data with no
download, for the small GPT of `lightning_stale.models.GPT`."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from lightning_stale.data.base import InMemoryDataModule, seeded_split


def python_docs_topics() -> dict[str, str]:
    """The help text of every topic of ``help()`` (about 465,000 characters in 79 topics), as
    the standard library ships it in ``pydoc_data.topics``."""
    from pydoc_data.topics import topics

    return dict(topics)


class CharWindows(Dataset):
    """Fixed context windows of a token stream: item i is ``(tokens[o:o+T], tokens[o+1:o+T+1])``
    for the i-th offset o, so every target is the next character of its input (nanoGPT's
    ``get_batch``, with the offsets drawn once so the dataset is map-style and samplers work)."""

    def __init__(self, tokens: torch.Tensor, block_size: int, num_windows: int,
                 seed: int) -> None:
        if len(tokens) <= block_size + 1:
            raise ValueError(f"a split of {len(tokens)} characters is too short for windows of "
                             f"block_size={block_size} (need more than block_size + 1)")
        self.tokens, self.block_size = tokens, int(block_size)
        generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(len(tokens) - block_size, (num_windows,), generator=generator)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.offsets[index])
        chunk = self.tokens[start:start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class PythonDocsDataModule(InMemoryDataModule):
    """Character-level next-token prediction on the text of ``pydoc_data.topics``.

    The vocabulary is every character of the text (sorted; about 110), so ``num_classes`` is its
    size and ``input_shape`` is ``(block_size,)``; both are known at construction. Whole topics
    go to train or val (a seeded split of the sorted topic names, so no window straddles the
    two); each split is its topics' texts joined by blank lines. Windows start at random offsets
    drawn once per split from ``seed``: ``train_windows`` for training (one epoch), ``val_windows``
    for validation, which test and predict reuse.

    Args:
        block_size: context length T (characters per window).
        batch_size: windows per mini-batch.
        val_fraction: share of the topics held out for validation.
        train_windows, val_windows: windows per split.
        num_workers, seed, drop_last: as `InMemoryDataModule`.
    """

    def __init__(self, block_size: int = 64, batch_size: int = 32, val_fraction: float = 0.1,
                 train_windows: int = 8192, val_windows: int = 512, num_workers: int = 0,
                 seed: int = 0, drop_last: bool = True) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed,
                         drop_last=drop_last)
        for name, value in (("block_size", block_size), ("train_windows", train_windows),
                            ("val_windows", val_windows)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
        self.block_size, self.val_fraction = int(block_size), float(val_fraction)
        self.train_windows, self.val_windows = int(train_windows), int(val_windows)
        self.topics = python_docs_topics()
        self.chars = sorted(set("".join(self.topics.values())))
        self.index = {char: i for i, char in enumerate(self.chars)}
        self.input_shape = (self.block_size,)
        self.num_classes = len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[char] for char in text], dtype=torch.long)

    def decode(self, tokens: torch.Tensor) -> str:
        return "".join(self.chars[int(token)] for token in tokens)

    def split_topics(self) -> tuple[list[str], list[str]]:
        """(train, val) topic names: the same for the same seed."""
        names = sorted(self.topics)
        train, val, _ = seeded_split(len(names), self.val_fraction, 0.0, self.seed)
        return [names[i] for i in sorted(train.tolist())], [names[i] for i in sorted(val.tolist())]

    def _build_splits(self) -> tuple[CharWindows, CharWindows, CharWindows]:
        train_names, val_names = self.split_topics()

        def windows(names: list[str], count: int, seed: int) -> CharWindows:
            text = "\n\n".join(self.topics[name] for name in names)
            return CharWindows(self.encode(text), self.block_size, count, seed)

        val_set = windows(val_names, self.val_windows, self.seed + 1)
        return windows(train_names, self.train_windows, self.seed), val_set, val_set
