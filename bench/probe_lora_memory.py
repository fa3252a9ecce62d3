"""Probe: the peak resident set of one plain Hugging Face forward+backward (2048 random tokens, labels:
full logits) of SmolLM2-135M-Instruct, full fine-tuning vs peft LoRA (r=16, alpha=32, every linear
but the head: arl.model.lora.apply_lora), one process per arm, one thread.  No arl trainer, no
optimizer: it separates peft's activations from the rest of arl's step (docs/lora.md).

    python bench/probe_lora_memory.py full; python bench/probe_lora_memory.py lora
"""
import resource
import sys

import torch
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/2**20
lora = sys.argv[1] == "lora"
b0 = rss()
m = AutoModelForCausalLM.from_pretrained("models/smollm2-135m-instruct", dtype=torch.float32)
if lora:
    from arl.config import LoRAConfig
    from arl.model.lora import apply_lora
    m = apply_lora(m, LoRAConfig(r=16, alpha=32))
b1 = rss()
ids = torch.randint(0, 49152, (1, 2048))
out = m(input_ids=ids, labels=ids)
out.loss.backward()
b2 = rss()
print(sys.argv[1], f"base {b0:.2f} after load {b1:.2f} after fwd+bwd {b2:.2f} GiB (delta fwd+bwd {b2-b1:.2f})", flush=True)
