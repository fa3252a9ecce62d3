"""The trainer's side of ``rollout.lora_sync: adapter`` (arl/rollout/lora_sync.py): per sync, trainer
rank 0 writes only the LoRA adapter (peft's format: ``adapter_model.safetensors`` +
``adapter_config.json``) into a directory per version under /dev/shm, and orders the engines to
serve it (``AdapterWeights``); the base weights (adapters off) are written once, at the first sync.

Versions, staleness and the restart answer are the merged file path's (arl/trainer/sync.py): the
same directory per version, the same clean-up, the same ``last`` order.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

from safetensors.torch import save_file

from ..model.tied import untied_state
from ..rollout.colocate import trainer_turn_ends
from ..rollout.engine import write_sync_weights
from ..rollout.lora_sync import AdapterWeights
from . import faults

ADAPTER_FILE = "adapter_model.safetensors"  # the names vLLM's LoRA loader (and peft) read


def write_adapter(state: dict, peft_config, directory: Path) -> Path:
    """An adapter directory vLLM's ``LoRARequest`` loads: the tensors and peft's config."""
    directory.mkdir(parents=True, exist_ok=True)
    peft_config.save_pretrained(str(directory))
    tmp = directory / (ADAPTER_FILE + ".tmp")
    save_file(state, str(tmp))
    tmp.replace(directory / ADAPTER_FILE)
    return directory


class AdapterSender:
    """Called like ``WeightSender`` (every rank; rank 0 writes and orders), over the file path only."""

    mode = "file"  # what arl/trainer/restarts.py reads: a restarted engine is answered with ``last``

    def __init__(self, cfg, trainer, rank: int, link, weights_dir: Path, tied: bool):
        self.cfg, self.tr, self.rank, self.link = cfg, trainer, rank, link
        self.weights_dir, self.tied = weights_dir, tied
        self.base_sent = False  # the base weights go with the first sync
        self.base_dir: Optional[str] = None  # rank 0: where they are
        self.last: Optional[tuple] = None  # (AdapterWeights, version, chooser state) of the last sync

    def __call__(self, version: int, chooser_state: Optional[dict]) -> None:
        # under ZeRO-3 both reads gather the parameters: every rank takes the same branch
        base = None
        if not self.base_sent:  # the base the adapters sit on (after SFT: the merged SFT model)
            base = self.tr.full_state_dict(to_cpu=True, copy=False, adapters=False)
            self.base_sent = True
        adapter = self.tr.adapter_state()
        self.tr.park()  # trainer.offload.while_generating (arl/trainer/park.py)
        trainer_turn_ends(self.cfg, self.tr.device)
        if self.rank != 0:
            return
        if base is not None:
            self.base_dir = str(write_sync_weights(untied_state(base, self.tied), self.weights_dir / "base"))
        d = write_adapter(*adapter, self.weights_dir / f"v{version}")
        # as the merged path: orders older than staleness + 1 versions are taken, their files go
        for old in self.weights_dir.glob("v*"):
            if old.name[1:].isdigit() and int(old.name[1:]) < version - self.cfg.rollout.staleness - 1:
                shutil.rmtree(old, ignore_errors=True)
        faults.reached("sync")
        source = AdapterWeights(str(d), self.base_dir)
        self.last = (source, version, chooser_state)
        self.link.broadcast(("weights", source, version, chooser_state))

    def close(self) -> None:
        shutil.rmtree(self.weights_dir, ignore_errors=True)
