"""The keys and values of the tokens a model has already read, so that generation runs one new token per step
instead of the whole window (docs/export.md#sampling).

`sample.generate` makes a `KVCache` and passes it to `GPT.forward`, which hands layer i's `LayerCache` to its
attention: the attention appends the step's keys and values and attends over all of them (causally only when the
step's queries and keys are the same tokens, the first call). Positions continue after `KVCache.length`.
"""
from __future__ import annotations

import torch


class LayerCache:
    """One layer's keys and values, (B, H, size, d) buffers allocated at the first update in its dtype and device."""

    def __init__(self, size: int) -> None:
        self.size, self.length = size, 0
        self.keys = self.values = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, H, T, d) and return every key and value so far (the inputs themselves on the first call)."""
        end = self.length + k.size(2)  # at most size: GPT.forward refuses positions past block_size first
        if self.keys is None:
            self.keys = k.new_empty(*k.shape[:2], self.size, k.size(3))
            self.values = v.new_empty(*v.shape[:2], self.size, v.size(3))
        self.keys[:, :, self.length:end] = k
        self.values[:, :, self.length:end] = v
        first, self.length = self.length == 0, end
        return (k, v) if first else (self.keys[:, :, :end], self.values[:, :, :end])


class KVCache(list):
    """One LayerCache per layer, each for up to `size` positions (the model's block_size)."""

    def __init__(self, n_layer: int, size: int) -> None:
        super().__init__(LayerCache(size) for _ in range(n_layer))

    @property
    def length(self) -> int:
        """Tokens read so far: the position of the next one."""
        return self[0].length


def for_model(config) -> KVCache | None:
    """A cache for a GPT of this config (train_gpt.GPTConfig); None for relational attention, whose layers keep no
    keys or values (it reruns the window)."""
    return KVCache(config.n_layer, config.block_size) if config.attention == "standard" else None
