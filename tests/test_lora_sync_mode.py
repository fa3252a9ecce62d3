"""``rollout.lora_sync`` without an engine (arl/rollout/lora_sync.py, arl/trainer/adapter_sync.py): the
mode each config resolves to, its one-line errors before any process starts, the engine arguments it
adds, and the adapter sender's files and orders (the engine side: tests/test_lora_sync.py, slow)."""
import json
import os
import queue

import pytest
import torch

from arl.config import ConfigError, LoRAConfig, load_config
from arl.rollout.engine_args import check_engine_kwargs
from arl.rollout.lora_sync import (LORA_SYNC_DEFAULT, LORA_SYNCS, AdapterWeights, lora_sync_mode, vllm_lora_rank,
                                   vllm_serves_lora)
from arl.rollout.worker import engine_kwargs

LORA = "model.lora={r: 16}"


def test_modes_resolve():
    assert LORA_SYNC_DEFAULT in LORA_SYNCS
    assert lora_sync_mode(load_config(None, [])) is None  # full fine-tuning: no LoRA sync at all
    assert lora_sync_mode(load_config(None, [LORA])) == LORA_SYNC_DEFAULT
    for mode in LORA_SYNCS:
        assert lora_sync_mode(load_config(None, [LORA, f"rollout.lora_sync={mode}"])) == mode
    # null over the group path (GPU's default): the adapter path cannot run there, so merged
    assert lora_sync_mode(load_config(None, [LORA, "rollout.weight_sync=group"])) == "merged"


def test_adapter_mode_sets_vllm_lora_and_owns_its_arguments():
    adapter = load_config(None, ["model.lora={r: 10}", "rollout.lora_sync=adapter"])
    kw = engine_kwargs(adapter)
    assert kw["enable_lora"] is True and kw["max_lora_rank"] == 16 and kw["max_loras"] == 1
    assert "enable_lora" not in engine_kwargs(adapter, serve_adapters=False)  # arl.eval: a merged export
    assert "enable_lora" not in engine_kwargs(load_config(None, [LORA, "rollout.lora_sync=merged"]))
    with pytest.raises(ValueError, match="rollout.engine_kwargs.enable_lora: arl sets this vLLM argument from "
                                         "rollout.lora_sync"):
        check_engine_kwargs({"enable_lora": True})
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 16, 17, 512)] == [1, 8, 8, 16, 32, 512]
    with pytest.raises(ValueError, match="model.lora.r: 600 is above vLLM's largest max_lora_rank"):
        vllm_lora_rank(600)


@pytest.mark.parametrize("overrides, match", [
    (["rollout.lora_sync=adapter"], "rollout.lora_sync: adapter needs model.lora"),
    (["rollout.lora_sync=merged"], "rollout.lora_sync: merged needs model.lora"),
    ([LORA, "rollout.lora_sync=adapter", "rollout.weight_sync=group"],
     "rollout.lora_sync: adapter runs over rollout.weight_sync file .* not group"),
])
def test_config_errors_are_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)


def test_vllm_lora_support_read_from_its_source():
    assert vllm_serves_lora("Qwen2ForCausalLM") and vllm_serves_lora("LlamaForCausalLM")  # tiny, SmolLM2
    assert vllm_serves_lora("GPT2LMHeadModel") is False  # vLLM 0.32's GPT-2 implements no SupportsLoRA
    assert vllm_serves_lora("NoSuchForCausalLM") is False


def test_a_model_vllm_serves_no_adapters_for(tmp_path):
    """Explicit adapter: one line, before any process starts (the preflight); null: merged."""
    from arl.prepare import preflight

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    cfg = load_config(None, [f"model.name_or_path={tmp_path}", LORA, "rollout.lora_sync=adapter"])
    with pytest.raises(ValueError, match="rollout.lora_sync: adapter: vLLM serves no LoRA adapters for "
                                         "GPT2LMHeadModel") as e:
        preflight(cfg)
    assert "\n" not in str(e.value)
    assert lora_sync_mode(load_config(None, [f"model.name_or_path={tmp_path}", LORA])) == "merged"


class _Link:
    engines = 1

    def __init__(self):
        self.orders = queue.Queue()

    def broadcast(self, msg):
        self.orders.put(msg)


def test_adapter_sender_writes_base_once_and_an_adapter_per_version(tiny_qwen_dir, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from arl.model.lora import apply_lora
    from arl.procs import free_port
    from arl.trainer.adapter_sync import AdapterSender
    from arl.trainer.sync import make_sender

    from sync_drive import LoRATrainer

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    cfg = load_config(None, ["model.lora={r: 8}", "rollout.lora_sync=adapter", "rollout.staleness=0"])
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32), LoRAConfig(r=8))
    link = _Link()
    sender = make_sender(cfg, LoRATrainer(model), 0, link, None)
    assert isinstance(sender, AdapterSender) and sender.mode == "file"
    try:
        got = []
        for v in (1, 2, 3):
            sender(v, {"chooser": v})
            kind, source, version, chooser = link.orders.get_nowait()
            assert kind == "weights" and version == v and chooser == {"chooser": v}
            assert isinstance(source, AdapterWeights) and sender.last == (source, v, chooser)
            got.append(source)
        assert len({s.base_dir for s in got}) == 1
        base = load_file(f"{got[0].base_dir}/model.safetensors")
        assert not [k for k in base if "lora" in k or "base_layer" in k]  # the base under the HF names
        adapter = load_file(f"{got[-1].adapter_dir}/adapter_model.safetensors")
        assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
        assert json.loads(open(f"{got[-1].adapter_dir}/adapter_config.json").read())["r"] == 8
        # staleness 0: the orders older than version - 1 are taken, their adapters gone
        assert not os.path.exists(got[0].adapter_dir)
    finally:
        sender.close()
    assert not os.path.exists(got[-1].adapter_dir)


@pytest.fixture
def tiny_qwen_dir(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    m = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    m.save_pretrained(tmp_path / "m")
    return str(tmp_path / "m")
