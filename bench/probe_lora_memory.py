"""Probe: trainer memory of SmolLM2-135M-Instruct, full fine-tuning vs peft LoRA (r=16, alpha=32, every
linear but the head: arl.model.lora.apply_lora), outside arl's trainer (no optimizer), to separate
peft's part from the rest of arl's step (docs/lora.md).

    python bench/probe_lora_memory.py full    # peak RSS of one HF forward+backward, 2048 random tokens
    python bench/probe_lora_memory.py lora    # (one process per arm, one thread; labels: full logits)
    python bench/probe_lora_memory.py saved   # bytes autograd saves for the backward, both arms, T=512
"""
import resource
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from arl.config import LoRAConfig  # noqa: E402
from arl.model.lora import apply_lora  # noqa: E402

MODEL = "models/smollm2-135m-instruct"


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def load(arm: str):
    m = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    return apply_lora(m, LoRAConfig(r=16, alpha=32)) if arm == "lora" else m


def peak(arm: str, tokens: int = 2048) -> None:
    torch.set_num_threads(1)
    b0 = rss_gib()
    m = load(arm)
    b1 = rss_gib()
    ids = torch.randint(0, 49152, (1, tokens))
    m(input_ids=ids, labels=ids).loss.backward()
    b2 = rss_gib()
    print(arm, f"base {b0:.2f} after load {b1:.2f} after fwd+bwd {b2:.2f} GiB (delta fwd+bwd {b2 - b1:.2f})", flush=True)


def saved(tokens: int = 512) -> None:
    for arm in ("full", "lora"):
        m = load(arm)
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}
        seen = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                seen[s.data_ptr()] = s.nbytes()
            return t

        ids = torch.randint(0, 49152, (1, tokens))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(input_ids=ids, labels=ids)
        print(arm, f"saved for backward (unique non-parameter storages, T={tokens}): "
              f"{sum(seen.values()) / 2**20:.0f} MiB in {len(seen)} storages", flush=True)


if __name__ == "__main__":
    saved() if sys.argv[1] == "saved" else peak(sys.argv[1])
