"""Planted-bug tests (issue #54) for LoRA: the adapters' scale, the adapter sync's files and the
rank that still goes to vLLM.  Expectations worked out by hand, never from the code under test."""
import json

import pytest
import torch

from arl.config import LoRAConfig, load_config
from arl.model.lora import apply_lora, merged_state_dict
from arl.rollout.lora_sync import lora_sync_mode, vllm_lora_rank


class _Proj(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 2, bias=False)

    def forward(self, x):
        return self.proj(x)


def test_lora_update_is_scaled_by_alpha_over_r():
    """Plant: the adapters' scale from ``r`` instead of ``alpha`` (peft's lora_alpha = r: scale 1).
    r 2, alpha 8: W + 4 * B A."""
    torch.manual_seed(0)
    m = apply_lora(_Proj(), LoRAConfig(r=2, alpha=8.0, target_modules=["proj"]))
    layer = m.base_model.model.proj
    with torch.no_grad():
        layer.base_layer.weight.copy_(torch.tensor([[1.0, 0.0, 2.0], [0.0, -1.0, 0.5]]))
        layer.lora_A["default"].weight.copy_(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]))  # [r, in]
        layer.lora_B["default"].weight.copy_(torch.tensor([[0.5, 0.0], [0.0, 0.25]]))  # [out, r]
    # B A = [[0.5, 0, 0], [0, 0.25, 0.25]]; times 4: [[2, 0, 0], [0, 1, 1]]
    want = torch.tensor([[3.0, 0.0, 2.0], [0.0, 0.0, 1.5]])
    assert torch.equal(merged_state_dict(m)["proj.weight"], want)
    x = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.allclose(m(x), torch.tensor([[9.0, 4.5]]))  # the adapted forward is the merged one


def test_rank_512_is_served_as_an_adapter():
    """Plant: rank 512 (vLLM's largest max_lora_rank) falling back to merged (an off-by-one)."""
    assert vllm_lora_rank(512) == 512 and vllm_lora_rank(511) == 512
    for r in (320, 512):
        cfg = load_config(None, [f"model.lora={{r: {r}}}", "rollout.lora_sync=adapter"])
        assert lora_sync_mode(cfg, check_model=False) == "adapter"
    with pytest.raises(ValueError, match="model.lora.r: 513 is above vLLM's largest max_lora_rank"):
        lora_sync_mode(load_config(None, ["model.lora={r: 513}", "rollout.lora_sync=adapter"]), check_model=False)


class _PeftConfig:
    def save_pretrained(self, d):
        with open(f"{d}/adapter_config.json", "w") as f:
            json.dump({"r": 2}, f)


class _Trainer:
    """What AdapterSender reads of a PolicyTrainer; counts the base reads."""

    device = torch.device("cpu")

    def __init__(self):
        self.base_reads = 0

    def full_state_dict(self, to_cpu=True, copy=True, adapters=True):
        assert adapters is False  # the adapter sender reads the base only
        self.base_reads += 1
        return {"proj.weight": torch.zeros(2, 3)}

    def adapter_state(self):
        return {"base_model.model.proj.lora_A.weight": torch.ones(2, 3)}, _PeftConfig()

    def park(self):
        pass


class _Link:
    engines = 1

    def __init__(self):
        self.orders = []

    def broadcast(self, msg):
        self.orders.append(msg)


def test_adapter_sync_sends_the_base_once_and_keeps_the_orders_in_flight(tmp_path, monkeypatch):
    """Plants: the adapter sync rewriting the base weights every sync; its clean-up deleting one
    version too many.  staleness 1: after syncing v, the orders of versions >= v - 2 may still be
    taken (staleness + 1 versions back), so exactly those directories remain."""
    import arl.trainer.adapter_sync as adapter_sync

    writes = []
    real = adapter_sync.write_sync_weights
    monkeypatch.setattr(adapter_sync, "write_sync_weights", lambda state, d, *a: writes.append(d) or real(state, d, *a))
    cfg = load_config(None, ["model.lora={r: 8}", "rollout.lora_sync=adapter", "rollout.staleness=1"])
    tr, link = _Trainer(), _Link()
    sender = adapter_sync.AdapterSender(cfg, tr, 0, link, tmp_path, tied=False)
    kept = {}
    for v in range(1, 6):
        sender(v, None)
        kept[v] = sorted(p.name for p in tmp_path.glob("v*"))
    assert kept[1] == ["v1"] and kept[2] == ["v1", "v2"] and kept[3] == ["v1", "v2", "v3"]
    assert kept[4] == ["v2", "v3", "v4"] and kept[5] == ["v3", "v4", "v5"]
    assert tr.base_reads == 1 and writes == [tmp_path / "base"]
    assert {o[1].base_dir for o in link.orders} == {str(tmp_path / "base")}
    assert [o[1].adapter_dir for o in link.orders] == [str(tmp_path / f"v{v}") for v in range(1, 6)]
