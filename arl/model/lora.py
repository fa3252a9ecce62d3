"""LoRA adapters on the policy (``model.lora``; the peft library).

Only the adapters train: the base weights are frozen, so gradients and Adam state exist for the
adapters alone (for a 7B model at r=16 on every linear layer, ~40M of 7.6B parameters).  Three
consequences the rest of arl relies on:

* the reference policy for KL is the same model with its adapters disabled (``disable_adapter``):
  no second copy of the weights.  After an SFT warm start the adapters are merged into the base and
  fresh ones attached (``merge_and_rewrap``), so the adapter-free model is the SFT model, the policy
  RL starts from, as the reference must be;
* the HF export, and the engine under ``rollout.lora_sync: merged``, see ordinary merged weights
  (``merged_state_dict``: W + scale * B A per adapted layer, under the base model's Hugging Face
  names), so vLLM needs no LoRA support; under ``adapter`` the engine gets ``base_state_dict`` once
  and then the adapter alone (arl/rollout/lora_sync.py);
* the fused logprob head reads ``lm_head.weight`` directly, so the head may not carry an adapter.
"""
from __future__ import annotations

import fnmatch
from typing import Iterable

import torch

from ..config import LoRAConfig

ADAPTER = "default"  # peft's adapter name


def is_lora(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def hf_model(model):
    """The Hugging Face model under a peft wrapper (the model itself otherwise): what the packed
    forward and ``save_pretrained`` of full weights act on.  Its adapted layers stay adapted."""
    return model.get_base_model() if is_lora(model) else model


def _linear_names(model) -> list:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def target_modules(cfg: LoRAConfig, names: Iterable[str]) -> list:
    """The linear layers of ``names`` (module names of the HF model) the adapters go on; one-line
    errors for a pattern that matches nothing and for the output head."""
    names = list(names)
    if cfg.target_modules == "all-linear":
        out = [n for n in names if n.rsplit(".", 1)[-1] != "lm_head"]
    else:
        out = []
        for pat in cfg.target_modules:
            hit = [n for n in names if n.rsplit(".", 1)[-1] == pat or fnmatch.fnmatch(n, pat)]
            if not hit:
                leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
                raise ValueError(f"model.lora.target_modules: {pat!r} matches no linear layer of the model "
                                 f"(its linear layers: {', '.join(leaves)})")
            out += hit
    if any(n.rsplit(".", 1)[-1] == "lm_head" for n in out):
        raise ValueError("model.lora.target_modules: lm_head cannot carry an adapter (the fused logprob head reads "
                         "its weight directly)")
    if not out:
        raise ValueError("model.lora.target_modules: no linear layer to adapt")
    return sorted(set(out))


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig):
    """``model`` wrapped with fresh adapters (B = 0: the wrapped model computes what ``model`` did)."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules(cfg, _linear_names(model))
    pc = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets, bias="none")
    return get_peft_model(model, pc)


def merge_and_rewrap(model, cfg: LoRAConfig):
    """The adapters merged into the base weights, then fresh adapters on top (after SFT: the
    adapter-free model becomes the SFT model, RL's reference)."""
    return apply_lora(model.merge_and_unload(), cfg) if is_lora(model) else model


def _hf_name(peft_name: str) -> str:
    """``base_model.model.X.base_layer.weight`` -> ``X.weight``."""
    name = peft_name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def merged_state_dict(model) -> dict:
    """The merged weights under the base model's Hugging Face names (adapters folded in, no adapter
    tensors).  The tensors of unadapted parameters are the model's own (not copies)."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and ADAPTER in mod.lora_A:
            deltas[_hf_name(name) + ".weight"] = mod
    out = {}
    for k, v in model.state_dict().items():
        if ".lora_" in k:
            continue
        hf = _hf_name(k)
        mod = deltas.get(hf)
        out[hf] = v + mod.get_delta_weight(ADAPTER).to(v.dtype) if mod is not None else v
    return out


def base_state_dict(model) -> dict:
    """The base weights with the adapters off (what the adapter sync serves them on), under the
    base model's Hugging Face names: the model's own tensors, no copies."""
    return {_hf_name(k): v for k, v in model.state_dict().items() if ".lora_" not in k}
