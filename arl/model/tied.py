"""Tied input/output embeddings (``tie_word_embeddings``: the output head *is* the input embedding,
one parameter under two names), as most small instruct models have (SmolLM2, Qwen2.5-0.5B).

A tied model's ``state_dict()`` lists the parameter twice (``model.embed_tokens.weight`` and
``lm_head.weight``).  Written to disk it is one tensor (what ``save_pretrained`` of the original
model writes; ``from_pretrained`` ties the head again), and the weight sync sends it once: the
engine loads it under both names (``tie_head``; why the engine needs both: arl/rollout/weight_sync.py).
"""
from __future__ import annotations

from typing import Iterable, Iterator, Tuple

import torch

# Hugging Face names of the input embedding and the output head (Llama, Qwen2, Mistral, Gemma, ...)
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def is_tied(model) -> bool:
    """A Hugging Face model whose output head is its input embedding (the same parameter)."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and emb is not None and head.weight is emb.weight


def untied_state(state: dict, tied: bool) -> dict:
    """``state`` without the head's duplicate name when ``tied`` (one tensor on disk and on the
    wire); a model whose embedding goes by another name keeps both."""
    if tied and EMBED in state:
        state.pop(HEAD, None)
    return state


def tie_head(named: Iterable[Tuple[str, torch.Tensor]], tied: bool) -> Iterator[Tuple[str, torch.Tensor]]:
    """The weights as a tied model's loader needs them: the embedding given under both names, any
    ``lm_head.weight`` of the source dropped, so both always hold the same tensor.  Untied, or no
    ``model.embed_tokens.weight`` in the source: unchanged.  Streams (holds at most the head)."""
    head, embed_seen = None, False
    for name, t in named:
        if tied and name == HEAD:
            if not embed_seen:
                head = t  # dropped if the embedding follows, else given back at the end
            continue
        yield name, t
        if tied and name == EMBED:
            embed_seen = True
            yield HEAD, t
    if head is not None and not embed_seen:
        yield HEAD, head
