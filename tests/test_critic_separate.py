"""The separate critic's fast checks (no DeepSpeed engine; the trainer on ranks: test_critic_separate_ds.py):
its config (one-line errors), the dry-run plan's count of the second model, and the copy it trains."""
import pytest
import torch

from arl.config import ConfigError, load_config

from two_rank import tiny_qwen

GAE = ["algo.advantage=gae"]


def test_config_options_and_one_line_errors():
    cfg = load_config("configs/tiny_cpu.yaml", GAE + ["critic.model=separate", "critic.warmup_steps=3"])
    assert cfg.critic.model == "separate" and cfg.critic.warmup_steps == 3
    base = load_config("configs/tiny_cpu.yaml", GAE)
    assert base.critic.model == "shared" and base.critic.warmup_steps == 0  # the defaults: unchanged behaviour
    bad = {
        ("critic.model=separate",): "critic.model: set, but the critic is off",  # without gae
        ("critic.model=separate", "critic.warmup_steps=2"): "critic.model: set, but the critic is off",
        (*GAE, "critic.warmup_steps=2"): "critic.warmup_steps: needs critic.model: separate",
        (*GAE, "critic.warmup_steps=-1"): "critic.warmup_steps",
        (*GAE, "critic.model=twin"): "critic.model",
        (*GAE, "critic.model=separate", "model.lora.r=8"): "critic.model: separate does not take model.lora",
        (*GAE, "critic.epochs=2"): "critic.epochs: needs critic.model: separate",
        (*GAE, "critic.model=separate", "critic.epochs=0"): "critic.epochs",
    }
    for ov, msg in bad.items():
        with pytest.raises(ConfigError, match=msg) as e:
            load_config("configs/tiny_cpu.yaml", list(ov))
        assert "\n" not in str(e.value), ov


def test_dry_run_plan_counts_the_second_model():
    from arl.layout import arch_of, param_count, plan

    shared = plan(load_config("configs/tiny_cpu.yaml", GAE))
    sep_cfg = load_config("configs/tiny_cpu.yaml", GAE + ["critic.model=separate", "critic.warmup_steps=2"])
    sep = plan(sep_cfg)
    a = arch_of(sep_cfg)
    P = param_count(a)
    Pc = P - (0 if a.tie_word_embeddings else a.vocab_size * a.hidden) + a.hidden + 1  # no lm_head, plus the head
    per_param = 4 + 12 / 2  # fp32 weights, ZeRO-2 over 2 ranks
    b = sep.trainer_bytes
    assert b["critic model (ZeRO-2)"] == pytest.approx(per_param * Pc)
    assert b["critic activations"] == b["activations (micro-batch)"] > 0
    assert "critic head+grads+optim" not in b
    off = shared.trainer_bytes["total (fused)"] - shared.trainer_bytes["critic head+grads+optim"]
    assert b["total (fused)"] == pytest.approx(off + b["critic model (ZeRO-2)"] + b["critic activations"])
    text = sep.render()
    assert "critic: a separate model" in text and "critic.warmup_steps: the first 2 steps" in text
    assert "critic.epochs" not in text
    four = plan(load_config("configs/tiny_cpu.yaml", GAE + ["critic.model=separate", "critic.epochs=4"])).render()
    assert "critic.epochs: 4 critic passes per step (3 more critic forwards" in four
    # ZeRO-3 partitions the second model over the ranks as it does the policy
    z3 = plan(load_config("configs/tiny_cpu.yaml", GAE + ["critic.model=separate", "trainer.zero_stage=3"]))
    assert z3.trainer_bytes["critic model (ZeRO-3)"] == pytest.approx(16 / 2 * Pc)


def test_the_critic_is_a_copy_without_lm_head_and_with_a_zero_head():
    from arl.config import CriticConfig
    from arl.algo.critic import VALUE_HEAD, Critic
    from arl.algo.critic_model import CriticModel

    policy = tiny_qwen()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    cm = CriticModel(Critic(CriticConfig(model="separate")), policy, lr=1e-3)
    names = dict(cm.module.named_parameters())
    assert not any(n.startswith("lm_head") for n in names)
    assert torch.equal(names[f"{VALUE_HEAD}.weight"], torch.zeros(1, 32)) and float(names[f"{VALUE_HEAD}.bias"].detach()) == 0
    for n, p in names.items():  # the trunk starts at the policy's weights, in its own tensors
        if not n.startswith(VALUE_HEAD):
            assert torch.equal(p, before[n]) and p.data_ptr() != policy.state_dict()[n].data_ptr(), n
    assert not hasattr(policy, VALUE_HEAD) and set(policy.state_dict()) == set(before)  # the policy as it was
