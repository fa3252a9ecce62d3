"""How a LoRA policy reaches the engine (``rollout.lora_sync``; docs/lora.md).

Two modes, a registry (``LORA_SYNCS``) read by the trainer's sender (arl/trainer/sync.py), the
engine's arguments (arl/rollout/worker.py) and the preflight (arl/launch.py):

* ``merged``: the trainer folds the adapters into the base weights (W + scale * B A) and sends the
  whole model, like full fine-tuning; vLLM never sees an adapter.  Works for every model vLLM runs,
  over the file and the group path.
* ``adapter``: the trainer writes only the adapter (peft's format: a few MiB) into a directory per
  version and the engine serves it through vLLM's LoRA support (``enable_lora``,
  ``max_lora_rank`` from ``model.lora.r``): ``add_lora`` of a ``LoRARequest`` with a new id per
  sync, and every later request carries it.  The base weights go once, with the first sync of a
  run (after an SFT warm start ``merge_and_rewrap`` changed the base the engine loaded), and
  again only when the engine has not loaded them (a restarted engine).  File path only: the
  engine reads the adapter from trainer rank 0's /dev/shm.

Whether vLLM can serve adapters for a model is decided from vLLM's source, without importing it
(``vllm_serves_lora``: its model class implements ``SupportsLoRA``), before any process starts.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from ..model.resolve import resolve_model

# The mode ``rollout.lora_sync: null`` picks where it can work (LoRA, the file path, a model vLLM
# serves adapters for): the faster one measured by bench/bench_lora_sync.py (docs/lora.md).
LORA_SYNC_DEFAULT = "merged"

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks (0.32)
TINY_ARCHITECTURE = "Qwen2ForCausalLM"  # arl/model/tiny.py builds a Qwen2


@dataclass(frozen=True)
class LoraSyncMode:
    """What a mode needs: vLLM's LoRA in the engine, and which weight-sync paths carry it."""
    name: str
    engine_lora: bool
    paths: tuple  # rollout.weight_sync modes (resolved) it runs over


LORA_SYNCS: Dict[str, LoraSyncMode] = {
    "merged": LoraSyncMode("merged", engine_lora=False, paths=("file", "group")),
    "adapter": LoraSyncMode("adapter", engine_lora=True, paths=("file",)),
}


@dataclass(frozen=True)
class AdapterWeights:
    """``RolloutEngine.update_weights`` source of the adapter mode: serve the peft adapter in
    ``adapter_dir`` on the base weights in ``base_dir`` (loaded first unless the engine has them)."""
    adapter_dir: str
    base_dir: str


def vllm_lora_rank(r: int) -> int:
    """vLLM's ``max_lora_rank`` for adapters of rank ``r``: the smallest value vLLM accepts >= r."""
    for v in VLLM_LORA_RANKS:
        if v >= r:
            return v
    raise ValueError(f"model.lora.r: {r} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]}); "
                     "use rollout.lora_sync: merged")


def engine_lora_kwargs(r: int) -> dict:
    """vLLM arguments of an engine that serves one adapter at a time."""
    return {"enable_lora": True, "max_lora_rank": vllm_lora_rank(r), "max_loras": 1}


def _vllm_models_dir() -> Optional[Path]:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "model_executor" / "models"


def _parse(path: Path) -> Optional[ast.Module]:
    try:
        return ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return None


def _registry(models: Path) -> dict:
    """vLLM's architecture -> (module, class) of its text-generation models, read from registry.py."""
    tree = _parse(models / "registry.py")
    for node in (tree.body if tree else []):
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "_TEXT_GENERATION_MODELS" and isinstance(value, ast.Dict):
            try:
                return {ast.literal_eval(k): tuple(ast.literal_eval(v)) for k, v in zip(value.keys, value.values)}
            except ValueError:
                return {}
    return {}


def _supports_lora(models: Path, module: str, cls: str, depth: int = 0) -> bool:
    """Whether class ``cls`` of vLLM's ``models/<module>.py`` has ``SupportsLoRA`` among its bases,
    following bases defined in that module or imported from a sibling one."""
    tree = _parse(models / f"{module}.py")
    if tree is None or depth > 4:
        return False
    imports = {a.asname or a.name: (n.module or "").lstrip(".").rsplit(".", 1)[-1]
               for n in tree.body if isinstance(n, ast.ImportFrom) and n.level >= 1 for a in n.names}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for base in node.bases:
                name = ast.unparse(base).rsplit(".", 1)[-1]
                if name == "SupportsLoRA":
                    return True
                if name in imports and imports[name] not in ("interfaces", "interfaces_base"):
                    if _supports_lora(models, imports[name], name, depth + 1):
                        return True
                elif _supports_lora(models, module, name, depth + 1):
                    return True
            return False
    return False


@functools.lru_cache(maxsize=None)
def vllm_serves_lora(architecture: str) -> Optional[bool]:
    """Whether the installed vLLM serves LoRA adapters for ``architecture`` (config.json's
    ``architectures[0]``); None when its source cannot tell (not installed, unexpected layout)."""
    models = _vllm_models_dir()
    if models is None:
        return None
    reg = _registry(models)
    if not reg:
        return None
    if architecture not in reg:
        return False
    module, cls = reg[architecture]
    return _supports_lora(models, module, cls)


def model_architecture(name_or_path: str) -> Optional[str]:
    """``architectures[0]`` of the model's config.json; None when the model is not on this machine."""
    if name_or_path == "tiny":
        return TINY_ARCHITECTURE
    try:
        d = resolve_model(name_or_path)
        archs = json.loads((Path(d) / "config.json").read_text()).get("architectures") or [None]
    except (ValueError, OSError, json.JSONDecodeError):
        return None
    return archs[0]


def lora_sync_mode(cfg, check_model: bool = True) -> Optional[str]:
    """The run's LoRA sync mode: None without ``model.lora``; ``rollout.lora_sync`` when set (one-line
    ValueError where it cannot work); when null the default where it works, else merged.
    ``check_model``: ask vLLM's source whether it serves adapters for the model (skipped by the
    config's own cross-checks, which read no files)."""
    if cfg.model.lora is None:
        return None
    chosen = cfg.rollout.lora_sync
    path = cfg.rollout.sync_mode(cfg.layout.device, cfg.layout.colocate)
    mode = LORA_SYNCS[chosen or LORA_SYNC_DEFAULT]
    if path not in mode.paths:
        if chosen is not None:
            raise ValueError(f"rollout.lora_sync: {chosen} runs over rollout.weight_sync {' or '.join(mode.paths)} "
                             f"(the engine reads the adapter from trainer rank 0's /dev/shm), not {path}; set "
                             f"rollout.weight_sync: file or rollout.lora_sync: merged")
        return "merged"
    if mode.engine_lora and check_model:
        arch = model_architecture(cfg.model.name_or_path)
        if arch is not None and vllm_serves_lora(arch) is False:
            if chosen is not None:
                raise ValueError(f"rollout.lora_sync: {chosen}: vLLM serves no LoRA adapters for {arch} "
                                 f"({cfg.model.name_or_path}); use rollout.lora_sync: merged")
            return "merged"
    if mode.engine_lora and cfg.model.lora.r > VLLM_LORA_RANKS[-1]:
        if chosen is not None:
            vllm_lora_rank(cfg.model.lora.r)  # a rank vLLM cannot take: one line
        return "merged"
    return mode.name
