"""A GGUF block-quantized weight as the loader hands it to the model: the file's own bytes, row by row.

Ember serves GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K tensors in their own blocks, so the weights in
memory take the bytes of the file (`ember::linear_gguf`, engine/quant/gguf_blocks.py). A GGUF tensor's row (one
output feature) is a run of whole blocks, so everything the loader does to a weight's rows (llama.cpp's Q/K
permutation undone, q|k|v and gate|up stacked) moves whole rows of bytes and never touches a value.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.quant.format import QuantizedTensor

# The types ember::linear_gguf runs; every other type is dequantized at load (the log names those tensors).
NATIVE_GGUF_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))


@dataclass
class GGUFTensor:
    raw: torch.Tensor  # uint8 [N, row_bytes]: the file's rows, N output features
    qtype: GGMLQuantizationType
    n_cols: int  # K, the input features

    def __post_init__(self) -> None:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        if self.raw.dtype != torch.uint8 or self.raw.dim() != 2:
            raise ValueError(f"{self.qtype.name}: expected uint8 rows [N, bytes], got {self.raw.dtype} "
                             f"{tuple(self.raw.shape)}")
        if self.n_cols <= 0 or self.n_cols % block or self.raw.shape[1] != self.n_cols // block * type_size:
            raise ValueError(f"{self.qtype.name}: {self.raw.shape[1]} bytes per row do not hold {self.n_cols} "
                             f"values in blocks of {block} ({type_size} bytes each)")

    @property
    def source(self) -> str:
        return self.qtype.name

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.raw.shape[0]), self.n_cols

    @property
    def layout(self) -> tuple[GGMLQuantizationType, int]:
        """Weights with the same layout stack along N into one weight (one kernel call, one stream)."""
        return self.qtype, self.n_cols

    def rows(self, index: torch.Tensor) -> GGUFTensor:
        return GGUFTensor(self.raw[index].contiguous(), self.qtype, self.n_cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from engine.quant import gguf_blocks

        return gguf_blocks.dequantize(self.raw, int(self.qtype), self.n_cols, dtype)


def concat_gguf_rows(parts: list[GGUFTensor]) -> GGUFTensor:
    if len({p.layout for p in parts}) != 1:
        raise ValueError("only GGUF weights of one type and width can be stacked")
    return GGUFTensor(torch.cat([p.raw for p in parts]), parts[0].qtype, parts[0].n_cols)


# What the loader hands the model for a quantized weight: a GGUF's own blocks, or Ember's format (MoE experts).
AnyQuantized = QuantizedTensor | GGUFTensor
