"""``Shard``: which part of every Llama weight one tensor-parallel rank holds, and reads.

The split is Megatron's, as vLLM and SGLang make it:

- q/k/v and gate/up are column-parallel: each rank holds whole heads (and a slice of the MLP's
  intermediate features), so attention and the SwiGLU need no communication;
- o_proj and down_proj are row-parallel: each rank multiplies its own input features, and the
  partial sums are all-reduced (``worker.parallel.group``); a row-parallel bias lives on rank 0
  only;
- the embedding and the lm head are split by vocabulary: a rank embeds only the tokens of its
  range (zeros elsewhere, then an all-reduce), and scores only its range (gathered on rank 0);
- KV heads are split when there are at least as many as ranks, else each rank keeps the one KV
  head its query heads read (replicated across the ranks that share it);
- norms are replicated.

``read`` takes a tensor's rows or columns straight from a safetensors file, so a rank reads
only its share of each matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.blocks import ceil_div

# Hugging Face names (the part after ``model.layers.N.``) split by rows (column-parallel:
# output features) and by columns (row-parallel: input features).
_BY_ROWS_Q = ("self_attn.q_proj",)
_BY_ROWS_KV = ("self_attn.k_proj", "self_attn.v_proj")
_BY_ROWS_MLP = ("mlp.gate_proj", "mlp.up_proj")
_BY_COLUMNS = ("self_attn.o_proj", "mlp.down_proj")
_BY_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``, over a model of ``n_heads`` query heads, ``n_kv_heads`` KV
    heads of ``head_dim``, ``intermediate_size`` MLP features and ``vocab_size`` tokens."""

    rank: int
    size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")
        if self.size not in valid_sizes(self.n_heads, self.n_kv_heads, self.intermediate_size):
            raise ValueError(
                f"tensor parallel size {self.size} does not split the model's "
                f"{self.n_heads} query heads, {self.n_kv_heads} KV heads and "
                f"{self.intermediate_size} MLP features evenly; sizes that do: "
                + ", ".join(
                    map(str, valid_sizes(self.n_heads, self.n_kv_heads, self.intermediate_size))
                )
            )

    @classmethod
    def of(cls, spec, rank: int = 0, size: int = 1) -> Shard:
        """The shard of a ``worker.model.llama.ModelSpec``; ValueError if ``size`` does not fit
        it."""
        return cls(
            rank=rank,
            size=size,
            n_heads=spec.n_heads,
            n_kv_heads=spec.n_kv_heads,
            head_dim=spec.head_dim,
            intermediate_size=spec.intermediate_size,
            vocab_size=spec.vocab_size,
        )

    @property
    def local_heads(self) -> int:
        """Query heads on this rank."""
        return self.n_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        """KV heads on this rank: a share of them, or one replicated head."""
        return max(1, self.n_kv_heads // self.size)

    @property
    def kv_start(self) -> int:
        """The first KV head this rank holds: the one its first query head reads."""
        group = self.n_heads // self.n_kv_heads  # query heads per KV head
        return self.rank * self.local_heads // group

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def vocab_part(self) -> int:
        """Tokens per rank's range; the last range may be shorter (the gather pads it)."""
        return ceil_div(self.vocab_size, self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """[start, end) of this rank's vocabulary."""
        start = min(self.rank * self.vocab_part, self.vocab_size)
        return start, min(start + self.vocab_part, self.vocab_size)

    def rows(self, name: str) -> tuple[int, int] | None:
        """The rows of weight (or bias) ``name`` this rank holds, or None if not split by rows."""
        stem = _stem(name)
        hd = self.head_dim
        if name in _BY_VOCAB:
            return self.vocab_range
        if stem in _BY_ROWS_Q:
            start = self.rank * self.local_heads
            return start * hd, (start + self.local_heads) * hd
        if stem in _BY_ROWS_KV:
            return self.kv_start * hd, (self.kv_start + self.local_kv_heads) * hd
        if stem in _BY_ROWS_MLP:
            start = self.rank * self.local_intermediate
            return start, start + self.local_intermediate
        return None

    def columns(self, name: str) -> tuple[int, int] | None:
        """The input columns of weight ``name`` this rank holds, or None if not split so."""
        stem = _stem(name)
        if not name.endswith(".weight") or stem not in _BY_COLUMNS:
            return None
        width = self.local_heads * self.head_dim if "self_attn" in stem else self.local_intermediate
        return self.rank * width, (self.rank + 1) * width

    def read(self, handle, name: str, dtype: torch.dtype) -> torch.Tensor:
        """This rank's part of tensor ``name`` from a safetensors ``safe_open`` handle, reading
        only that part. A row-parallel bias is rank 0's alone (zeros elsewhere): the all-reduce
        adds it once."""
        if self.size == 1:
            return handle.get_tensor(name).to(dtype)
        part = handle.get_slice(name)
        rows, columns = self.rows(name), self.columns(name)
        if rows is not None:
            return part[rows[0] : rows[1]].to(dtype)
        if columns is not None:
            return part[:, columns[0] : columns[1]].to(dtype)
        tensor = part[:].to(dtype)
        if _stem(name) in _BY_COLUMNS and name.endswith(".bias") and self.rank:
            return torch.zeros_like(tensor)  # not in place: the read may share its memory
        return tensor


def valid_sizes(n_heads: int, n_kv_heads: int, intermediate_size: int) -> list[int]:
    """Every tensor-parallel size that splits these heads and features evenly."""
    return [
        size
        for size in range(1, n_heads + 1)
        if n_heads % size == 0
        and intermediate_size % size == 0
        and (n_kv_heads % size == 0 or size % n_kv_heads == 0)
    ]


def _stem(name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``self_attn.q_proj``."""
    parts = name.split(".")
    return ".".join(parts[3:-1]) if name.startswith("model.layers.") else ".".join(parts[:-1])
