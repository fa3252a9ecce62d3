"""Probe: does this machine's vLLM serve peft LoRA adapters (``enable_lora``, ``LoRARequest`` from a
directory), and do its logprobs equal the trainer's?  The tests' tiny model (tied embeddings), r=8
adapters on every linear but the head with random B (so they matter), one adapter directory per
"weight version"; against the same engine given the merged weights (arl's path today).  Per path:
the time to make the new weights live (merged: ``write_sync_weights`` + ``update_weights``;
adapter: ``save_pretrained`` of the adapter + the first request that loads it; each with its first
sampled request), and the worst
|engine - trainer| logprob over sampled continuations.  Last stdout line: JSON.

    python bench/probe_vllm_lora.py
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


async def main() -> dict:
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind

    from arl.config import LoRAConfig, TinyModelConfig
    from arl.model.lora import apply_lora, merged_state_dict
    from arl.model.packed import packed_logprobs
    from arl.model.tiny import build_tiny_model
    from arl.rollout import VLLMEngine
    from arl.rollout.engine import write_sync_weights

    d = build_tiny_model(config=TinyModelConfig(vocab_size=512, intermediate=256, tie_word_embeddings=True),
                         envs=("toy_lookup",))
    model = apply_lora(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), LoRAConfig(r=8, alpha=16))
    tmp = Path(tempfile.mkdtemp(prefix="arl-vllm-lora-"))
    t0 = time.perf_counter()
    eng = VLLMEngine(d, seed=0, max_model_len=512, max_num_seqs=8,
                     engine_kwargs={"enable_lora": True, "max_lora_rank": 8, "max_loras": 1})
    res = {"probe": "vllm_lora", "engine_start_s": time.perf_counter() - t0, "versions": []}
    prompt = [1, 5, 9, 13, 17, 21, 25]

    async def sample(lora, seed):
        p = SamplingParams(max_tokens=12, temperature=1.0, logprobs=0, seed=seed,
                           output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in eng.llm.generate({"prompt_token_ids": prompt}, p, request_id=f"p{time.time_ns()}",
                                          lora_request=lora):
            final = out
        o = final.outputs[0]
        return list(o.token_ids), [next(iter(x.values())).logprob for x in o.logprobs]

    def worst(pairs):
        w = 0.0
        base = model.get_base_model().eval()
        for ids, lps in pairs:
            full = torch.tensor(prompt + ids)
            with torch.no_grad():
                lp = packed_logprobs(base, full, torch.tensor([0, len(full)], dtype=torch.int32))[0][len(prompt):]
            w = max(w, float((lp - torch.tensor(lps)).abs().max()))
        return w

    for version in (1, 2, 3):
        with torch.no_grad():  # a "training step": new random adapters
            for n, p in model.named_parameters():
                if ".lora_" in n:
                    p.normal_(0, 0.05)
        t = time.perf_counter()
        adir = tmp / f"adapter-v{version}"
        model.save_pretrained(str(adir), safe_serialization=True)
        req = LoRARequest(f"v{version}", version, str(adir))
        first = await sample(req, 1)  # loads the adapter
        adapter_s = time.perf_counter() - t
        a_pairs = [first, await sample(req, 2)]
        t = time.perf_counter()
        wdir = write_sync_weights({k: v.detach().clone() for k, v in merged_state_dict(model).items()},
                                  tmp / f"merged-v{version}")
        await eng.update_weights(str(wdir), version)
        m_first = await sample(None, 1)
        merged_s = time.perf_counter() - t
        m_pairs = [m_first, await sample(None, 2)]
        res["versions"].append({"version": version, "adapter_worst_abs_diff": worst(a_pairs),
                                "merged_worst_abs_diff": worst(m_pairs), "adapter_live_s": adapter_s,
                                "merged_live_s": merged_s})
        # the engine back to the base weights for the next version's adapter
        await eng.update_weights(str(d), version)
        print(res["versions"][-1], flush=True)
    await eng.close()
    return res


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
