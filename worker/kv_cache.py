"""``KVCache``: the paged K/V pool, one tensor holding every layer's blocks.

Block ``b`` holds positions ``[0, block_size)`` of whatever row's block table names it. Each
layer's K (or V) is seen flat, as ``(num_blocks * block_size, n_kv_heads, head_dim)``, so a
token's home is one index: ``block * block_size + offset``.
"""

from __future__ import annotations

import torch


class KVCache:
    """The K/V pool: (num_layers, 2, num_blocks, block_size, n_kv_heads, head_dim)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, 2, num_blocks, block_size, n_kv_heads, head_dim)
        # empty, not zeros: pages are touched only when used, so a large pool costs nothing up
        # front. Blocks are zeroed as rows receive them (zero_blocks).
        self.pool = torch.empty(shape, dtype=dtype, device=device)
        flat = (num_layers, 2, num_blocks * block_size, n_kv_heads, head_dim)
        self._flat = self.pool.view(flat)

    def zero_blocks(self, blocks: list[int]) -> None:
        """Zero blocks as they join a row. The pool starts uninitialized; a padded read of a
        block's unwritten tail must see finite numbers, which a zero attention weight cancels."""
        if blocks:
            index = torch.tensor(blocks, dtype=torch.long, device=self.pool.device)
            self.pool.index_fill_(2, index, 0.0)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each (num_blocks * block_size, n_kv_heads, head_dim)."""
        return self._flat[index, 0], self._flat[index, 1]

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Memory one block takes across all layers, K and V."""
        element = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * n_kv_heads * head_dim * element

    @staticmethod
    def blocks_for_budget(budget: int, bytes_per_block: int, max_model_len: int, block_size: int):
        """How many blocks fit in ``budget`` bytes; ValueError if not even one request of
        ``max_model_len`` tokens fits."""
        num_blocks = budget // bytes_per_block
        needed = -(-max_model_len // block_size)
        if num_blocks < needed:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds {num_blocks} blocks, but one request of "
                f"max_model_len={max_model_len} needs {needed} ({needed * bytes_per_block} bytes)"
            )
        return num_blocks
