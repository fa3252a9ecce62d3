"""Config loading, one-line errors, and --dry-run on every shipped config."""
import glob
import os
import subprocess
import sys

import pytest

from arl.config import WANDB_PIN, ConfigError, load_config
from arl.train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
CONFIGS += sorted(glob.glob(os.path.join(ROOT, "examples", "*", "*.yaml")))  # the examples' recipes too
try:  # examples/gym needs the gym extra (bash install.sh --gym)
    import gymnasium  # noqa: F401
except ImportError:
    CONFIGS = [c for c in CONFIGS if os.sep + "gym" + os.sep not in c]
try:  # examples/mcp needs the mcp extra (bash install.sh --mcp)
    import mcp  # noqa: F401
except ImportError:
    CONFIGS = [c for c in CONFIGS if os.sep + "mcp" + os.sep not in c]
try:  # examples/openenv needs the OpenEnv venv (bash install.sh --openenv)
    from arl.env.openenv_client import openenv_python

    openenv_python()
except ValueError:
    CONFIGS = [c for c in CONFIGS if os.sep + "openenv" + os.sep not in c]
try:  # examples/verifiers needs the verifiers venv (bash install.sh --verifiers)
    from arl.env.verifiers_client import verifiers_python

    verifiers_python()
except ValueError:
    CONFIGS = [c for c in CONFIGS if os.sep + "verifiers" + os.sep not in c]


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_dry_run_passes_on_every_shipped_config(path, capsys):
    assert main(["--config", path, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "config OK" in out and "processes:" in out and "memory estimate per trainer rank" in out
    assert "trainer rank 0" in out or "trainer ranks 0-" in out  # launcher: ray lists ranks per node


def test_gpu_config_layout_assigns_every_gpu_once(capsys):
    assert main(["--config", os.path.join(ROOT, "configs", "qwen2.5-7b_8gpu.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "  trainers: 1 placement group, PACK, 4 bundle(s) {CPU: 1, GPU: 1}" in out
    assert "  engines: 1 placement group(s), STRICT_PACK, 1 bundle {CPU: 1, GPU: 4} each" in out
    assert "  node 0 (any role; 8 GPUs, ? CPUs): trainer ranks 0-3, engine 0  [8/8 GPUs used]" in out


@pytest.mark.slow  # python -m arl.train in a subprocess
def test_dry_run_from_the_command_line():
    out = subprocess.run([sys.executable, "-m", "arl.train", "--dry-run", "trainer.zero_stage=3"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "ZeRO-3" in out.stdout, out.stderr


@pytest.mark.parametrize("overrides,msg", [
    (["trainer.zero_stag=2"], "trainer.zero_stag: unknown key (allowed: backend,"),
    (["trainer.zero_stage=5"], "trainer.zero_stage: Input should be 0, 1, 2 or 3"),
    (["loss.ratio_level=turn"], "loss.ratio_level: Input should be 'token', 'sequence' or 'chunk'"),
    (["loss.clip_low=1.5"], "loss.clip_low: 1.5 must be in [0, 1)"),
    (["loss.surrogate=ppo"], "loss.surrogate: unknown 'ppo'; registered: "),
    (["loss.kl_estimator=k4"], "loss.kl_estimator: unknown 'k4'; registered: k1, k2, k3"),
    (["loss.clip_hi=0.3"], "loss.clip_hi: unknown key (allowed: advantages_in_pass, agg_constant,"),
    (["rollout.group_size=0"], "rollout.group_size: Input should be greater than or equal to 1"),
    (["loss.kl_beta=0.1"], "loss.kl_beta > 0 needs trainer.reference_model: true"),
    (["rollout.max_total_tokens=99999"], "exceeds trainer.micro_batch_tokens"),
    (["layout.launcher=torchrun"], "layout.launcher: moved to launcher (auto: Ray; torchrun and the deepspeed"),
    (["layout.hostfile=h"], "layout.hostfile: moved to a Ray cluster: ray start on each node, then ray.address"),
    (["trainer"], "expected key.sub=value"),
    (["trainer.steps.x=1"], "trainer.steps.x: steps is not a section"),  # the built-in default sets steps
    (["trainer.keep_last=0"], "trainer.keep_last: Input should be greater than or equal to 1"),
    (["logging.wandb={name: x}"], "logging.wandb.project: Field required"),
    (["logging.wandb={project: p, mode: disabled}"], "logging.wandb.mode: Input should be 'online' or 'offline'"),
])
def test_bad_configs_fail_with_one_line(overrides, msg):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_loss_without_a_kernel_runs_on_the_reference_and_the_dry_run_says_so(monkeypatch, capsys):
    """A surrogate registered as one torch function (here ppo_clip under another name, no kernel):
    auto takes the reference, an explicit kernel is a one-line config error."""
    from arl.ops.policy_loss import available_backends, spec

    monkeypatch.setitem(spec.SURROGATES, "ppo_mirror", spec.SURROGATES["ppo_clip"])
    cpu = "cpu" in available_backends()  # the C++ op built here
    assert main(["--dry-run", "loss.surrogate=ppo_mirror"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("loss:"))
    assert line == ("loss: ppo_mirror has no fused backend (cpu does not cover surrogate 'ppo_mirror'): torch reference"
                    if cpu else "loss: cpu not available here: torch reference")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["loss.surrogate=ppo_mirror", "trainer.backend=cpu"])
    assert str(e.value).endswith("trainer.backend: 'cpu' does not run loss.surrogate 'ppo_mirror'; use auto (the "
                                 "torch reference where no kernel covers the loss) or reference")
    if cpu:
        assert main(["--dry-run"]) == 0
        assert "loss: ppo_clip: cpu (the fastest cpu kernel covering the loss options)" in capsys.readouterr().out


def test_the_cispo_main_job_is_the_main_job_with_cispo_on_the_reference(capsys):
    path = os.path.join(ROOT, "configs", "tiny_cpu_cispo.yaml")
    assert main(["--config", path, "--dry-run"]) == 0
    assert "loss: cispo has no fused backend" in capsys.readouterr().out
    got, main_job = load_config(path).model_dump(), load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml")).model_dump()
    assert got["loss"] == {**main_job["loss"], "surrogate": "cispo"}
    for d in (got, main_job):
        del d["loss"], d["output_dir"], d["trainer"]["steps"], d["trainer"]["max_wall_s"]
    assert got == main_job


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(str(bad))
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "missing.yaml"))


def test_cli_reports_config_errors_on_one_line(capsys):
    assert main(["--dry-run", "trainer.zero_stag=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("arl.train: config error: trainer.zero_stag: unknown key") and "\n" not in err


def test_too_big_for_the_gpu_is_caught_by_dry_run(capsys):
    path = os.path.join(ROOT, "configs", "qwen2.5-7b_8gpu.yaml")
    assert main(["--config", path, "--dry-run", "trainer.zero_stage=0", "layout.gpu_memory_gib=40"]) == 2
    assert "exceeds layout.gpu_memory_gib" in capsys.readouterr().err


def test_builtin_default_is_the_readme_main_job():
    # `python -m arl.train` without --config must run what the README's main line runs
    assert load_config(None).model_dump() == load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml")).model_dump()


def test_print_config_is_the_resolved_config_and_loads_back(tmp_path, capsys):
    """``--print-config``: every key with its value (defaults included), as YAML that is itself a
    valid config giving the same run."""
    assert main(["--print-config", "trainer.steps=7", "rollout.over_cap=mask"]) == 0
    text = capsys.readouterr().out
    for key in ("seed:", "output_dir:", "stabilizers:", "dynamic_sampling:", "log_ratio_clamp:", "over_cap: mask",
                "steps: 7", "stall:\n    patience: 20\n    action: stop"):
        assert key in text, key
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    assert load_config(str(path)).model_dump() == load_config(None, ["trainer.steps=7",
                                                                      "rollout.over_cap=mask"]).model_dump()


def test_one_error_formatter_for_every_section():
    """Sections report through one formatter: nested keys joined into one dotted path, unknown keys
    with the keys allowed there, and the same line whether built alone or inside the config."""
    from arl.config import StabilizerConfig, TinyModelConfig

    with pytest.raises(ConfigError, match=r"^stabilizers\.curriculum\.x: unknown key \(allowed: enabled, until_step"):
        load_config(None, ["stabilizers.curriculum.x=1"])
    with pytest.raises(ValueError, match=r"^StabilizerConfig: curriculum\.x: unknown key"):
        StabilizerConfig(curriculum={"x": 1})
    with pytest.raises(ConfigError, match=r"^model\.tiny\.hidden: 30 must be divisible by heads"):
        load_config(None, ["model.tiny.hidden=30"])
    with pytest.raises(ValueError, match="hidden"):
        TinyModelConfig(hidden=30, heads=4)


def test_wandb_without_the_package_is_a_dry_run_error(monkeypatch, capsys):
    """logging.wandb set but wandb not installed: one line at config time (so --dry-run catches it),
    with the pip line; off (the default) needs no wandb."""
    import arl.config.log_config as log_config

    monkeypatch.setattr(log_config, "find_spec", lambda name: None)
    assert load_config(None).logging.wandb is None
    assert main(["--dry-run", "logging.wandb={project: p}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"arl.train: config error: logging.wandb: the wandb package is not installed (pip install {WANDB_PIN})"
