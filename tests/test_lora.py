"""LoRA (arl/model/lora.py): target selection and its one-line errors, merged weights against peft's
own merge, the layout's adapter count against peft's, and on one gloo rank the trainer step: only
the adapters move, the merged export computes the trainer's logprobs, and the adapters-off reference
is the base model."""
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from arl.config import ArchConfig, ConfigError, LoRAConfig, OptimConfig, load_config
from arl.layout import decoder_linear_names, lora_param_count, plan
from arl.model.lora import apply_lora, hf_model, merged_state_dict, target_modules

from two_rank import random_chunk_ids, tiny_qwen

NAMES = decoder_linear_names(ArchConfig(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab_size=64))


def test_targets_and_their_errors():
    allx = target_modules(LoRAConfig(), NAMES)
    assert len(allx) == 14 and "lm_head" not in allx
    assert target_modules(LoRAConfig(target_modules=["q_proj", "v_proj"]), NAMES) == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj"]
    assert len(target_modules(LoRAConfig(target_modules=["model.layers.1.mlp.*"]), NAMES)) == 3
    with pytest.raises(ValueError, match="'qproj' matches no linear layer of the model") as e:
        target_modules(LoRAConfig(target_modules=["qproj"]), NAMES)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="lm_head cannot carry an adapter"):
        target_modules(LoRAConfig(target_modules=["lm_head"]), NAMES)


def test_dry_run_refuses_a_target_that_matches_nothing():
    with pytest.raises(ValueError, match="model.lora.target_modules: 'qproj' matches no linear layer"):
        plan(load_config("configs/tiny_cpu.yaml", ["model.lora={target_modules: [qproj]}"]))
    with pytest.raises(ConfigError, match="model.lora.r"):
        load_config("configs/tiny_cpu.yaml", ["model.lora={r: 0}"])


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "down_proj"]])
def test_layout_counts_the_adapters_peft_makes(targets):
    lora = LoRAConfig(r=4, target_modules=targets)
    m = apply_lora(tiny_qwen(), lora)
    trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
    a = ArchConfig(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab_size=64)
    assert lora_param_count(a, lora) == trainable
    assert all(".lora_" in n for n, p in m.named_parameters() if p.requires_grad)


def test_merged_weights_equal_peft_merge():
    base = tiny_qwen()
    plain_names = set(base.state_dict())
    m = apply_lora(base, LoRAConfig(r=4, alpha=8.0))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # B starts at 0: give the adapters something to merge
    merged = merged_state_dict(m)
    assert set(merged) == plain_names
    ids = torch.randint(0, 64, (1, 12))
    want = m(input_ids=ids).logits
    ref = tiny_qwen()
    ref.load_state_dict(merged)
    torch.testing.assert_close(ref(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    peft_merged = m.merge_and_unload().state_dict()
    for k, v in merged.items():
        torch.testing.assert_close(v, peft_merged[k], rtol=0, atol=1e-6)
    assert hf_model(base) is base


def _micro_batches(world=1, rank=0):
    from arl.config import StabilizerConfig
    from arl.data import Trajectory
    from arl.data.packer import PackerConfig, pack_step
    from arl.ops.policy_loss import LossConfig
    from arl.stabilizers import Stabilizers

    rng = np.random.default_rng(0)
    trajs = []
    for i in range(8):
        L = int(rng.integers(12, 40))
        trajs.append(Trajectory(tokens=rng.integers(0, 64, L), chunk_ids=random_chunk_ids(rng, L),
                                rollout_logp=np.full(L, -4.2, np.float32), reward=float(i % 2), group_id=i // 4))
    loss = LossConfig(ratio_level="chunk", kl_beta=0.1)
    stab = Stabilizers(StabilizerConfig(), loss)
    prep = stab.prepare(trajs, loss)
    packed = pack_step(prep.trajectories, PackerConfig(token_budget=96, num_ranks=world), loss,
                       advantages=prep.advantages)
    stab.apply(packed, prep, loss)
    return packed.ranks[rank], loss


def _frozen_base_holds_nothing(tr, keep: dict) -> dict:
    """What a LoRA trainer holds besides its weights: gradients and Adam state of the adapters alone,
    no second copy of a base weight (a tensor of a base weight's shape that is not the weight; the
    state dicts in ``keep`` excepted)."""
    import gc

    named = dict(tr.module.named_parameters())
    base = {n: p for n, p in named.items() if ".lora_" not in n}
    in_opt = {id(p) for g in tr._torch_opt.param_groups for p in g["params"]}
    own = {p.untyped_storage().data_ptr() for p in named.values()}
    own |= {t.untyped_storage().data_ptr() for t in keep.values()}
    shapes = {tuple(p.shape) for p in base.values() if p.dim() == 2}
    copies = [tuple(o.shape) for o in gc.get_objects() if torch.is_tensor(o) and tuple(o.shape) in shapes
              and o.untyped_storage().data_ptr() not in own]
    return {"base_grads": [n for n, p in base.items() if p.grad is not None],
            "base_in_optimizer": [n for n, p in base.items() if id(p) in in_opt],
            "optimizer_state_of": sorted(n for n, p in named.items() if p in tr._torch_opt.state),
            "adapters": sorted(n for n in named if ".lora_" in n), "base_copies": copies}


def _worker(rank, world, port, result_dir):
    from arl.trainer import PolicyTrainer
    from arl.trainer.dist import init_distributed, set_rank_env

    set_rank_env(rank, world, port)
    init_distributed("cpu")
    mbs, loss = _micro_batches()
    res = {}
    for stage in (0, 3):
        tr = PolicyTrainer(apply_lora(tiny_qwen(), LoRAConfig(r=4)), optim=OptimConfig(lr=1e-2, grad_clip=1e6),
                           zero_stage=stage, total_steps=10)
        r = res[stage] = {"trainable": sorted(n for n, p in tr.module.named_parameters() if p.requires_grad)}
        r["before"] = tr.full_state_dict()
        r["ref_off"] = tr.ref_logprobs(mbs)  # adapters off: at B = 0 the base itself
        for _ in range(3):
            r["metrics"] = tr.rl_step(mbs, None, loss, ref_logps=tr.ref_logprobs(mbs))
        if stage == 0:
            r["memory"] = _frozen_base_holds_nothing(tr, keep=r["before"])
            # the weight sync's view: the unadapted weights are the live ones, not copies
            live = {p.data_ptr() for p in tr.module.parameters()}
            r["sync_copies"] = [k for k, v in tr.full_state_dict(copy=False).items()
                                if not k.endswith("proj.weight") and v.data_ptr() not in live]
        r["after"] = tr.full_state_dict()
        r["ref_off_after"] = tr.ref_logprobs(mbs)
        r["logp"] = tr.old_logprobs(mbs)
        tr.export_hf(os.path.join(result_dir, f"hf{stage}"))
    # the same reference as a separately loaded base model
    base = PolicyTrainer(apply_lora(tiny_qwen(), LoRAConfig(r=4)), optim=OptimConfig(lr=1e-2), zero_stage=0,
                         total_steps=10, ref_model=tiny_qwen())
    res["ref_model"] = base.ref_logprobs(mbs)
    torch.save(res, os.path.join(result_dir, "res.pt"))


@pytest.mark.slow
def test_lora_trainer_step_one_rank(tmp_path):
    from transformers import AutoModelForCausalLM

    from arl.procs import free_port
    from arl.trainer.policy import PolicyTrainer  # noqa: F401  (imports deepspeed here too)

    mp.spawn(_worker, args=(1, free_port(), str(tmp_path)), nprocs=1, join=True)
    res = torch.load(tmp_path / "res.pt", weights_only=False)
    mbs, _ = _micro_batches()
    for stage in (0, 3):
        r = res[stage]
        assert r["trainable"] and all(".lora_" in n for n in r["trainable"])
        moved = [k for k in r["before"] if not torch.equal(r["before"][k], r["after"][k])]
        assert moved and all(k.endswith("proj.weight") for k in moved), moved  # only adapted layers change
        assert np.isfinite(r["metrics"]["loss"]) and r["metrics"]["skipped_no_signal"] == 0.0
        for a, b in zip(r["ref_off"], r["ref_off_after"]):  # the reference does not move with the adapters
            if a is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        # the exported merged model computes the trainer's logprobs (what the engine is given)
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / f"hf{stage}", dtype=torch.float32)
        assert (tmp_path / f"hf{stage}" / "adapter" / "adapter_config.json").exists()
        from arl.model.packed import packed_logprobs

        for mb, lp in zip(mbs, r["logp"]):
            if lp is not None:
                want = packed_logprobs(hf, mb.token_ids, mb.cu_seqlens)[0]
                torch.testing.assert_close(want, lp, rtol=0, atol=1e-4)
    mem = res[0]["memory"]  # the frozen base costs its weights alone (docs/lora.md)
    assert mem["base_grads"] == [] and mem["base_in_optimizer"] == [] and mem["base_copies"] == [], mem
    assert mem["optimizer_state_of"] == mem["adapters"]
    assert res[0]["sync_copies"] == []
    for a, b in zip(res[0]["ref_off"], res["ref_model"]):  # adapters off == the base loaded on its own
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_layout_counts_heads_wider_than_hidden_over_heads(tmp_path):
    """``model.arch.head_dim`` (Qwen3-0.6B: 128 with hidden 1024 and 16 heads): the plan's parameter
    and adapter counts are those of the model transformers builds, and arch_mismatches compares it
    with config.json (unset: hidden / heads)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from arl.layout import param_count
    from arl.model.resolve import arch_mismatches

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    m = Qwen2ForCausalLM(cfg)
    a = ArchConfig(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab_size=64,
                   tie_word_embeddings=True, head_dim=16)
    assert param_count(a) == sum(p.numel() for p in m.parameters())
    assert param_count(a.model_copy(update={"head_dim": None})) < param_count(a)  # 8-wide heads
    lora = LoRAConfig(r=4)
    assert lora_param_count(a, lora) == sum(p.numel() for p in apply_lora(m, lora).parameters() if p.requires_grad)
    cfg.save_pretrained(tmp_path)
    assert arch_mismatches(a, tmp_path) == []
    assert arch_mismatches(a.model_copy(update={"head_dim": None}), tmp_path) == ["head_dim=8 (head_dim=16)"]
