"""The benchmark data set: fixed random token sequences, the same for every contender.

The model is the examples' GPT (``examples/gpt.py``).
"""

import torch
from torch.utils.data import Dataset

from examples.gpt import GPTConfig


class RandomTokens(Dataset):
    """``num_samples`` fixed random sequences; item i is ``(inputs, targets)``, targets shifted by one.

    The tokens come from a generator seeded with ``seed``, so every contender and every rank
    sees the same data set regardless of the global RNG state.
    """

    def __init__(self, num_samples: int, cfg: GPTConfig = GPTConfig(), seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(cfg.vocab_size, (num_samples, cfg.seq_len + 1), generator=gen)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self.tokens[i]
        return seq[:-1], seq[1:]
