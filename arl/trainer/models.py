"""The models of a trainer rank: the policy (from the model directory) and the frozen reference."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from transformers import AutoModelForCausalLM

from ..config import TrainConfig
from ..model.lora import apply_lora
from .dist import barrier

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_of(cfg: TrainConfig) -> torch.dtype:
    return DTYPES[cfg.model.dtype]


def load_policy(cfg: TrainConfig, model_dir: str, state: Optional[dict] = None) -> torch.nn.Module:
    """The policy from ``model_dir`` (its weights replaced by ``state``, HF names, when given), with
    fresh LoRA adapters under ``model.lora``."""
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype_of(cfg))
    if state is not None:
        m.load_state_dict(state)
    if cfg.model.gradient_checkpointing:  # activations of one layer at a time (the layout's estimate)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return apply_lora(m, cfg.model.lora) if cfg.model.lora is not None else m


def reference_model(cfg: TrainConfig, model, model_dir: str, rank: int, fresh: bool, sft_done: bool):
    """The frozen reference policy for the KL term (``trainer.reference_model``): the policy RL starts
    from.  After an SFT warm start that is the SFT model, saved once to ``<output_dir>/reference`` so a
    resumed run (whose policy has moved on) loads the same reference; without SFT it is the model
    directory itself.  None when the run has no reference model, and under LoRA, whose reference is
    the policy with its adapters off (``PolicyTrainer.ref_logprobs``)."""
    if not cfg.trainer.reference_model or cfg.model.lora is not None:
        return None
    ref_dir = Path(cfg.output_dir) / "reference"
    if fresh and sft_done:
        if rank == 0:
            model.save_pretrained(str(ref_dir), safe_serialization=True)
        barrier()
    saved = (ref_dir / "config.json").exists()
    sft_run = cfg.sft.enabled and cfg.sft.steps > 0
    if not fresh and sft_run and not saved:
        raise ValueError(f"--resume: the reference model of this run ({ref_dir}) is missing")
    # a fresh run without SFT starts from model_dir, whatever an earlier run left in output_dir
    src = ref_dir if saved and (sft_done or (not fresh and sft_run)) else Path(model_dir)
    return AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype_of(cfg))
