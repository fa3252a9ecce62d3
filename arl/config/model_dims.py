"""``model.arch``: the dimensions of a model that is not on this machine, for ``--dry-run``'s plan."""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field


class ArchConfig(BaseModel):
    """Dimensions of a model that is not available offline, for --dry-run memory estimates."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    hidden: int = Field(description="Hidden size of the planned model.")
    layers: int = Field(description="Transformer layers of the planned model.")
    heads: int = Field(description="Attention heads of the planned model.")
    kv_heads: int = Field(description="Key/value heads of the planned model.")
    intermediate: int = Field(description="MLP intermediate size of the planned model.")
    vocab_size: int = Field(description="Vocabulary size of the planned model.")
    tie_word_embeddings: bool = Field(False, description="The planned model's lm_head shares the input embedding.")
    head_dim: Optional[int] = Field(None, ge=1, description="Size of one attention head; default hidden / heads "
                                    "(Qwen3-0.6B: 128 with hidden 1024 and 16 heads).")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads
