"""What every launcher prepares before a process starts: the model directory, the SFT
demonstrations, the preflight checks (``--dry-run``'s too), the stabilizers' judges for the rollout
side and the run directory with its config."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

from transformers import AutoTokenizer

from .config import TrainConfig
from .data import load_demonstrations
from .env import check_env, env_class, env_kwargs
from .env.door import check_door
from .env.tool_parsers import PARSERS
from .model.resolve import resolve_model
from .model.tiny import build_tiny_model
from .rollout.engine_args import check_engine_kwargs
from .rollout.episode import ChatFormat
from .rollout.expert import sft_demonstrations, sft_source
from .rollout.lora_sync import lora_sync_mode
from .rollout.worker import RolloutHooks, task_set
from .stabilizers import DynamicSampler, IPAResampler


def model_dir_for(cfg: TrainConfig) -> str:
    """The model directory: ``model.name_or_path`` (a local directory, or a hub id from the local
    HF cache: ``resolve_model``), or the locally built tiny model."""
    if cfg.model.name_or_path != "tiny":
        return resolve_model(cfg.model.name_or_path)
    return str(build_tiny_model(config=cfg.model.tiny, seed=cfg.seed, envs=(cfg.env.name,),
                                env_kwargs={cfg.env.name: tiny_corpus_kwargs(cfg)}))


def tiny_corpus_kwargs(cfg: TrainConfig) -> dict:
    """The configured env's constructor arguments for the tiny model's corpus: the run's own, which
    ``--dry-run`` makes the env with (without them an env with a required argument, MCP's ``command``,
    would fail only when the run builds the model), less a vLLM tool parser: it reads the model's
    tokenizer, the one this corpus is for (the corpus is the env's prompts and tasks, not its calls)."""
    kwargs = env_kwargs(cfg.env)
    if isinstance(kwargs.get("parser"), str) and kwargs["parser"] not in PARSERS:
        del kwargs["parser"]
    return kwargs


def sft_demos(cfg: TrainConfig, model_dir: str) -> list:
    if sft_source(cfg) is None:
        return []
    return sft_demonstrations(cfg, ChatFormat(AutoTokenizer.from_pretrained(model_dir)))


def _parser_model_dir(cfg: TrainConfig) -> Optional[str]:
    """The model directory when the tool-call format is vLLM's (its parsers read the tokenizer)."""
    name = cfg.env.tool_parser or cfg.env.kwargs.get("parser")
    return model_dir_for(cfg) if isinstance(name, str) and name not in PARSERS else None


def _local_tokenizer(cfg: TrainConfig):
    """The model's tokenizer when the model is on this machine (not the tiny model: its template
    writes no tool calls), else None: the dry run may plan a model that is not converted yet."""
    if cfg.model.name_or_path == "tiny":
        return None
    try:
        return AutoTokenizer.from_pretrained(resolve_model(cfg.model.name_or_path))
    except Exception:  # not here (the dry run warns about that itself) or not loadable
        return None


def renders_tools(tokenizer) -> bool:
    """Whether the model's chat template renders tools (else the prompt teaches the Hermes format)."""
    return ChatFormat(tokenizer).supports_tools


def preflight(cfg: TrainConfig) -> list:
    """What ``--dry-run`` checks, and every launcher before it starts a process: the task dataset
    loads, the environment (with its reward function and tools) is made and resets its first task,
    the SFT demonstrations have a source, ``rollout.engine_kwargs`` names only vLLM engine arguments
    arl does not set itself.  Returns one line per check; one-line ValueError at the first failure."""
    lines = []
    check_engine_kwargs(cfg.rollout.engine_kwargs)  # by name against vLLM's EngineArgs (nothing imported)
    if cfg.rollout.engine_kwargs:
        lines.append(f"engine OK: rollout.engine_kwargs {', '.join(cfg.rollout.engine_kwargs)} are vLLM engine "
                     "arguments")
    lora_sync = lora_sync_mode(cfg)  # adapter for a model vLLM serves no adapters for: one line, now
    if lora_sync is not None:
        lines.append(f"lora sync OK: {lora_sync} (rollout.lora_sync: {cfg.rollout.lora_sync or 'null, the default'})")
    tasks = task_set(cfg)
    needs = env_class(cfg.env.name).needs_task
    if tasks is None and needs:
        raise ValueError(f"env.dataset: environment {cfg.env.name!r} plays tasks from data; give env.dataset")
    if tasks is not None:
        lines.append(f"tasks OK: {tasks.describe()}")
    check_env(cfg.env.name, env_kwargs(cfg.env, _parser_model_dir(cfg)),
              task=tasks.train_row(0) if tasks is not None else None)
    lines.append(f"env OK: {cfg.env.name} (made with its kwargs, first task reset)")
    source, demos = sft_source(cfg), None
    if source == "dataset":
        demos = load_demonstrations(cfg.sft.dataset, key="sft.dataset")
        lines.append(f"sft OK: {len(demos)} demonstrations in {cfg.sft.dataset}")
    elif source == "expert":
        lines.append(f"sft OK: demonstrations from the {cfg.env.name!r} expert")
    # the user's demonstrations and reward function, tried once (a bug here must not look like a
    # model that never succeeds)
    lines += check_door(cfg.env.name, env_kwargs(cfg.env, _parser_model_dir(cfg)),
                        tasks.train_row(0) if tasks is not None else None,
                        tasks.origin(0) if tasks is not None else "seed 0", demos, str(cfg.sft.dataset),
                        tokenizer=_local_tokenizer(cfg), renders_tools=renders_tools)
    return lines


def rollout_hooks(cfg: TrainConfig) -> RolloutHooks:
    """The stabilizers' judges the rollout side acts on (picklable, for spawned processes)."""
    s = cfg.stabilizers
    return RolloutHooks(
        make_sampler=functools.partial(DynamicSampler, s.dynamic_sampling) if s.dynamic_sampling.enabled else None,
        start_chooser=IPAResampler(s.ipa) if s.ipa.enabled else None)


def write_config(cfg: TrainConfig) -> Path:
    """The run directory, with the resolved config in it (config.json)."""
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    return run_dir
