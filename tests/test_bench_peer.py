"""bench_peer's two peers, checked for correctness (never for timings): verl's policy losses agree
with arl's C++ op where their semantics agree, and TRL's view of the toy task (template, tool
suffix, adapter) is token for token arl's."""
import asyncio
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def _importable(name):
    try:
        __import__(name)
        return None
    except Exception as e:  # verl imports ray, tensordict, omegaconf, ... at package import
        return f"{name} is not importable ({type(e).__name__}: {e}); bash install.sh --peer installs it"


VERL_MISSING = _importable("verl.trainer.ppo.core_algos")
TRL_MISSING = _importable("trl")


@pytest.fixture(scope="module")
def loss_batch():
    from bench_policy_loss import agentic_batch
    from peer_verl import spread_batch

    return spread_batch(agentic_batch(1 << 14, "cpu"), noise=0.5)


@pytest.mark.skipif(VERL_MISSING is not None, reason=str(VERL_MISSING))
@pytest.mark.parametrize("mode", ["vanilla", "gspo"])
def test_verl_loss_agrees_with_arl(loss_batch, mode):
    from peer_verl import agreement

    r = agreement(loss_batch, mode)
    assert r["loss_rel_diff"] <= 1e-5, r
    assert r["grad_rel_diff"] <= 1e-5, r
    assert r["grad_off_mask_max_abs"]["arl"] == 0.0 and r["grad_off_mask_max_abs"]["verl"] == 0.0


@pytest.mark.skipif(VERL_MISSING is not None, reason=str(VERL_MISSING))
def test_verl_grpo_advantages_and_gspo_dual_clip_difference(loss_batch):
    from peer_verl import ARL_CONFIGS, arl_fn, both_inputs, fwd_bwd, verl_advantages_agree

    arl_in, _, index, mask, _ = both_inputs(loss_batch)
    assert verl_advantages_agree(loss_batch, arl_in["advantages"], index, mask) <= 1e-6
    # the documented difference: arl's dual-clip also binds at the sequence level, verl's GSPO has none
    plain, _ = fwd_bwd(arl_fn(ARL_CONFIGS["gspo"]), loss_batch["logp"], arl_in)
    dual, _ = fwd_bwd(arl_fn(ARL_CONFIGS["gspo_dual_clip"]), loss_batch["logp"], arl_in)
    assert not torch.allclose(plain, dual)


@pytest.fixture(scope="module")
def peer_setup(tiny_model_dir):
    from arl.config import load_config

    cfg = load_config(None, [f"model.name_or_path={tiny_model_dir}"])
    return cfg, str(tiny_model_dir)


@pytest.mark.slow  # builds TRL's GRPO trainer
@pytest.mark.skipif(TRL_MISSING is not None, reason=str(TRL_MISSING))
def test_trl_sees_arls_token_sequence(peer_setup, tmp_path):
    """TRL's prompt and its tool suffix are the ids arl's episode uses; its stop set holds arl's stops."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from arl.rollout.episode import ChatFormat
    from peer_trl import ToyLookupTRL, answer_reward, task_rows, trl_tokenizer, turn_end_ids

    cfg, model_dir = peer_setup
    rows = task_rows(cfg, 1)
    assert [r["seed"] for r in rows] == list(range(cfg.rollout.tasks_per_step))  # arl's first batch
    tok = trl_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = turn_end_ids(tok)[1:]
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    args = GRPOConfig(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2,
                      max_steps=1, bf16=False, use_cpu=True, report_to=[], save_strategy="no")
    trainer = GRPOTrainer(model=model, args=args, processing_class=tok, reward_funcs=[answer_reward],
                          train_dataset=Dataset.from_list(rows), environment_factory=lambda: ToyLookupTRL(cfg))
    assert set(turn_end_ids(tok)) <= set(trainer.eos_token_ids)

    fmt = ChatFormat(AutoTokenizer.from_pretrained(model_dir))
    env = ToyLookupTRL(cfg)
    row = rows[3]
    trl_prompt = tok.apply_chat_template(row["prompt"], tools=[env.lookup], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    assert trl_prompt == fmt.prompt_ids(env._env.system_prompt, row["prompt"][-1]["content"])
    suffix = trainer._get_tool_suffix_ids([{"role": "tool", "name": "lookup", "content": "k03"}])
    assert suffix == fmt.observation_ids("k03")  # after a turn that ended at </tool_call>, as in arl


@pytest.mark.skipif(TRL_MISSING is not None, reason=str(TRL_MISSING))
def test_trl_adapter_plays_arls_episode(peer_setup):
    """The adapter's tool answers and reward are arl's env's, for the expert's turns and a wrong answer."""
    from arl.rollout.worker import env_factory
    from peer_trl import ToyLookupTRL, answer_reward

    cfg, _ = peer_setup
    ref = env_factory(cfg)()
    loop = asyncio.new_event_loop()
    task = loop.run_until_complete(ref.reset(5))
    expert = ref.expert_turns()
    envs = [ToyLookupTRL(cfg), ToyLookupTRL(cfg)]
    msgs = []
    for env in envs:
        env.reset(seed=5, prompt=[{"role": "user", "content": task}])
    for k in ref.chain:
        obs = [env.lookup(k) for env in envs]
        assert obs[0] == obs[1] == loop.run_until_complete(ref.step(f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{k}"}}}}</tool_call>')).observation
        msgs.append({"role": "tool", "content": obs[0]})
    good = msgs + [{"role": "assistant", "content": expert[-1]}]
    bad = msgs + [{"role": "assistant", "content": "<answer>v00</answer>" if expert[-1] != "<answer>v00</answer>"
                   else "<answer>v01</answer>"}]
    assert answer_reward([good, bad], envs) == [1.0, 0.0]
    with pytest.raises(ValueError, match="not the env's task"):
        envs[0].reset(seed=6, prompt=[{"role": "user", "content": task}])


BFCL_MISSING = _importable("bfcl_eval")


@pytest.mark.skipif(TRL_MISSING is not None or BFCL_MISSING is not None, reason=str(TRL_MISSING or BFCL_MISSING))
def test_trl_bfcl_peer_gets_arls_prompts_and_bfcls_verdicts(tiny_model_dir):
    """bench/peer_trl_bfcl.py: TRL's text prompts are arl's rendering of the split's train rows (its
    tokenization of them gives arl's ids), in arl's row order, rows whose prompt alone reaches
    rollout.max_total_tokens left out; the reward is BFCL's verdict through arl's env: the ground
    truth scores 1, prose 0."""
    from peer_trl_bfcl import BfclJudge, check_prompt_ids, task_rows
    from transformers import AutoTokenizer

    from arl.config import load_config
    from arl.env.bfcl.split import train_rows

    big = ["rollout.max_total_tokens=16384", "trainer.micro_batch_tokens=16384"]  # the tiny vocabulary's long prompts
    cfg = load_config(os.path.join(ROOT, "examples/bfcl/config.yaml"), big)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    judge = BfclJudge(cfg, str(tiny_model_dir))
    rows, left_out = task_rows(cfg, judge, tok, steps=2)
    assert [r["seed"] for r in rows] == list(range(8)) and not left_out
    check_prompt_ids(tok, rows)
    split = train_rows(os.path.join(ROOT, "examples/bfcl/split.json"))
    assert split[0]["question"][0][-1]["content"] in rows[0]["prompt"]
    judge._loop.run_until_complete(judge._env.reset(0))
    truth = judge._env.expert_turns()[0]
    assert judge.reward(0, truth) == 1.0 and judge.reward(0, "I would call a function here.") == 0.0
    lens = sorted(len(tok.encode(r["prompt"])) for r in rows)
    short = load_config(os.path.join(ROOT, "examples/bfcl/config.yaml"),
                        big[:1] + [f"rollout.max_total_tokens={lens[3]}", "rollout.max_turn_tokens=16"])
    kept, dropped = task_rows(short, judge, tok, steps=1)
    assert dropped and all(len(tok.encode(r["prompt"])) < lens[3] for r in kept)
