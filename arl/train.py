"""Entry point: ``python -m arl.train --config configs/X.yaml [key.sub=value ...] [--dry-run]``.

``--dry-run`` validates the config, finds the model (``model.name_or_path``: a local directory or a
hub id in the local HF cache, never the network), loads the task dataset, makes the environment
(tools, reward function) and resets its first task, checks the SFT demonstrations and
``rollout.engine_kwargs``, and prints the process layout, the device assignment, a memory estimate
and the vLLM engine arguments without starting any engine or process. A model this machine does not
have fails the dry run, unless the config gives ``model.arch``: that is how a big run is planned on
a machine without its weights, so the dry run then only warns (the run itself still fails at once).
``--print-config`` prints the resolved config (every key, defaults included) as YAML;
``--help-config [SECTION|SECTION.key]`` prints the config reference (keys, types, defaults,
descriptions; docs/config.md).

The run's processes (``launcher``, auto by default): Ray actors placed on a local cluster that
this process starts and stops, or on the cluster ``ray.address`` (or RAY_ADDRESS) names
(``arl.cluster``), every layout; ``launcher: local`` spawns them from this process without Ray
(``arl.launch``: the CPU layout and the colocated GPU node).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cluster.launcher import join_address, launch_ray
from .cluster.placement import placement
from .config import ConfigError, dump_config, load_config
from .config.reference import select, table
from .launch import launch
from .layout import plan
from .prepare import preflight
from .model.resolve import arch_mismatches, resolve_model
from .config.trainer_checks import in_pass_estimator
from .ops.policy_loss.api import choose_backend
from .procs import RunFailed
from .rollout.engine_args import render_engine_args
from .rollout.worker import engine_args
from .trainer.checkpoints import set_aside_latest
from .trainer.resume import resume_from


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m arl.train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="YAML config (default: the built-in tiny CPU run, equal to configs/tiny_cpu.yaml)")
    ap.add_argument("--dry-run", action="store_true", help="validate, print layout + memory estimate, exit")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config (all keys) as YAML, exit")
    ap.add_argument("--help-config", nargs="?", const="", default=None, metavar="SECTION|SECTION.key",
                    help="print the config reference (keys, types, defaults, descriptions) of every section, one "
                         "section or one key, exit")
    ap.add_argument("--resume", action="store_const", const="last", default=None,
                    help="continue from the last complete checkpoint in output_dir (one line if there is none); "
                         "'--resume auto': continue when there is one, else start fresh: the same command again "
                         "after a crash continues the run. A config that differs from the checkpoint's in the model, "
                         "trainer layout, algorithm or batch shape is one line naming the keys (arl/trainer/resume.py)")
    ap.add_argument("--resume-auto", dest="resume", action="store_const", const="auto", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=10 loss.ratio_level=chunk")
    return ap.parse_args(_resume_auto(sys.argv[1:] if argv is None else list(argv)))


def _resume_auto(argv: list) -> list:
    """``--resume auto`` / ``--resume=auto`` as one option: ``--resume`` alone takes no value (the
    overrides after it stay overrides)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--resume=auto" or (argv[i] == "--resume" and argv[i + 1:i + 2] == ["auto"]):
            out.append("--resume-auto")
            i += 1 if argv[i] == "--resume=auto" else 2
            continue
        out.append(argv[i])
        i += 1
    return out


def _check_model(cfg) -> str:
    """The dry run's model line; raises the one-line error when the model is not on this machine
    and the config has no ``model.arch`` to plan with."""
    if cfg.model.name_or_path == "tiny":
        return "model OK: tiny (built locally)"
    try:
        found = resolve_model(cfg.model.name_or_path)
    except ValueError as e:
        if cfg.model.arch is None:
            raise
        print(f"arl.train: warning: {e}; the estimate below uses model.arch, the run itself needs the model",
              file=sys.stderr)
        return f"model: {cfg.model.name_or_path} not on this machine (planned from model.arch)"
    wrong = arch_mismatches(cfg.model.arch, found) if cfg.model.arch is not None else []
    if wrong:  # the memory estimate below is of the planned model, not of this one
        print(f"arl.train: warning: model.arch differs from {found}/config.json: {', '.join(wrong)}", file=sys.stderr)
    return f"model OK: {found}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.help_config is not None:
        try:
            print(table(select(args.help_config)))
        except ValueError as e:
            print(f"arl.train: --help-config: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
        layout = plan(cfg)
        placed = placement(cfg)  # a placement that cannot fit the cluster fails here, one line
    except (ConfigError, ValueError) as e:
        print(f"arl.train: config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    try:  # a bad dataset, environment, reward function or SFT source fails here, before any process
        start = resume_from(cfg, args.resume)  # first: an incompatible checkpoint, before the slower checks
        checks = preflight(cfg)
    except ValueError as e:
        print(f"arl.train: config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        try:
            model_line = _check_model(cfg)
        except ValueError as e:
            print(f"arl.train: config error: {e}", file=sys.stderr)
            return 2
        print(f"config OK: {args.config or '<built-in default>'}")
        print(resume_line(start))
        print(launcher_line(cfg))
        print(loss_line(cfg))
        print(model_line)
        print("\n".join(checks))
        print(layout.render())
        print(placed.render())
        print(render_engine_args(engine_args(cfg)))
        return 0
    if cfg.model.name_or_path != "tiny":
        try:  # before any process starts: a missing model is one line, not a crash in every rank
            resolve_model(cfg.model.name_or_path)
        except ValueError as e:
            print(f"arl.train: config error: {e}", file=sys.stderr)
            return 2
    # what the run starts from (skipped dataset rows included)
    print("\n".join(f"arl.train: {line}" for line in [*checks, launcher_line(cfg), loss_line(cfg), resume_line(start)]),
          flush=True)
    if start is None:  # an earlier run's checkpoint is not this run's to roll back or restart to
        set_aside_latest(Path(cfg.output_dir) / "checkpoints")
    if cfg.launcher_used() == "ray":  # trainer ranks and engines as Ray actors (arl/cluster)
        try:
            run_dir = launch_ray(cfg, resume=start is not None)
        except (RuntimeError, ValueError) as e:  # the failing actor's own traceback is in the log above
            print(f"arl.train: {e}", file=sys.stderr)
            return 1
    else:
        try:
            run_dir = launch(cfg, resume=start is not None)
        except RunFailed as e:
            print(f"arl.train: run failed: {e}", file=sys.stderr)
            return 1
    print(f"arl.train: done; metrics in {run_dir / 'metrics.jsonl'}, model in {run_dir / 'hf'}")
    return 0


def resume_line(start) -> str:
    return "resume: a fresh run" if start is None else f"resume: from the step {start} checkpoint"


def loss_line(cfg) -> str:
    """Which policy-loss backend the trainer runs (``trainer.backend``; auto: chosen for the
    layout's device on this machine), and why."""
    est = in_pass_estimator(cfg)
    adv = f"; advantages: {est} in the pass" if est else ""
    if cfg.trainer.backend != "auto":
        return f"loss: {cfg.loss.surrogate}: {cfg.trainer.backend} (trainer.backend){adv}"
    name, why = choose_backend(cfg.loss, cfg.layout.device, est)
    return (f"loss: {why}" if name == "reference" else f"loss: {cfg.loss.surrogate}: {name} ({why})") + adv


def launcher_line(cfg) -> str:
    """Which launcher runs the processes, and why when ``auto`` chose it."""
    used, address = cfg.launcher_used(), join_address(cfg)
    if used == "ray":
        where = f"joins the Ray cluster at {address}" if address else \
            "starts a local Ray cluster (token auth, no dashboard) and stops it at the end"
    else:
        where = "this process spawns the trainer ranks and rollout engines"
    why = " (auto: Ray)" if cfg.launcher == "auto" else ""
    return f"launcher: {used}{why}: {where}"


if __name__ == "__main__":
    sys.exit(main())
