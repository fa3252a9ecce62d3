"""``--resume`` / ``--resume auto`` (arl/trainer/resume.py): which checkpoint a run starts from, and
the one line of a config its checkpoint differs from -- decided by the driver, on checkpoint
directories laid out as the trainer writes them.  The driver killed with SIGKILL and started again
with the same command: tests/test_train_e2e.py."""
import json
from pathlib import Path

import pytest

from arl.config import load_config
from arl.train import parse_args
from arl.trainer.checkpoints import CONFIG_FILE, LATEST_FILE
from arl.trainer.resume import config_mismatch, resume_from

ROOT = Path(__file__).resolve().parents[1]


def _cfg(out, *overrides):
    return load_config(str(ROOT / "configs" / "tiny_cpu.yaml"), [f"output_dir={out}", *overrides])


def _checkpoint(cfg, step):
    """A checkpoint of ``cfg`` at ``step`` as the trainer publishes it (its config inside)."""
    d = Path(cfg.output_dir) / "checkpoints"
    (d / f"step{step}").mkdir(parents=True)
    (d / f"step{step}" / CONFIG_FILE).write_text(cfg.model_dump_json())
    (d / LATEST_FILE).write_text(str(step))


def test_parse_resume_modes():
    assert parse_args([]).resume is None
    assert parse_args(["--resume"]).resume == "last"
    assert parse_args(["--resume", "auto", "trainer.steps=3"]).resume == "auto"
    a = parse_args(["--resume=auto", "x.y=1"])
    assert a.resume == "auto" and a.overrides == ["x.y=1"]
    a = parse_args(["--resume", "trainer.steps=3"])  # bare --resume takes no value: the override stays one
    assert a.resume == "last" and a.overrides == ["trainer.steps=3"]


def test_auto_starts_fresh_without_a_checkpoint_and_resumes_with_one(tmp_path, capsys):
    cfg = _cfg(tmp_path / "run")
    assert resume_from(cfg, "auto") is None
    with pytest.raises(ValueError, match=r"--resume: no complete checkpoint in .*checkpoints \(--resume auto starts"):
        resume_from(cfg, "last")
    _checkpoint(cfg, 2)
    # what may change on resume: the steps, the learning rate, logging, evaluation
    later = _cfg(tmp_path / "run", "trainer.steps=9", "trainer.optim.lr=3e-4", "logging.progress=false",
                 "env.eval_tasks=2")
    assert resume_from(later, "auto") == 2 == resume_from(later, "last")
    # no flag: a fresh run, with one line saying it writes over the earlier run's checkpoint
    assert resume_from(cfg, None) is None
    assert "holds the step 2 checkpoint of an earlier run; this run starts fresh and sets its latest_step aside" in capsys.readouterr().out


def test_a_half_written_checkpoint_is_not_resumed(tmp_path):
    """Only what latest_step names counts: a staged directory of a killed writer is never read."""
    cfg = _cfg(tmp_path / "run")
    _checkpoint(cfg, 2)
    (Path(cfg.output_dir) / "checkpoints" / ".step4.partial").mkdir()
    assert resume_from(cfg, "auto") == 2


@pytest.mark.parametrize("override,keys", [
    (["model.tiny.hidden=64"], ["model.tiny.hidden: 128 -> 64"]),
    (["trainer.world_size=1"], ["trainer.world_size: 2 -> 1"]),
    (["algo.advantage=rloo", "rollout.group_size=2"], ["algo.advantage: \"grpo\" -> \"rloo\"",
                                                        "rollout.group_size: 8 -> 2"]),
    (["loss.clip_high=0.3"], ["loss.clip_high: 0.28 -> 0.3"]),
])
def test_an_incompatible_config_is_one_line_naming_the_keys(tmp_path, override, keys):
    saved = _cfg(tmp_path / "run")
    _checkpoint(saved, 3)
    now = _cfg(tmp_path / "run", *override)
    expect = {k.split(":")[0] for k in keys}
    assert {d.split(":")[0] for d in config_mismatch(json.loads(saved.model_dump_json()), now)} == expect
    for mode in ("auto", "last"):
        with pytest.raises(ValueError) as e:
            resume_from(now, mode)
        msg = str(e.value)
        assert "\n" not in msg and "the step 3 checkpoint" in msg and "another config" in msg
        for k in keys:
            assert k in msg, msg


def test_the_cli_says_it_in_one_line(tmp_path, capsys):
    """Through ``arl.train``'s command line (``--dry-run``): the resume decision is a line of the dry
    run, an incompatible config a one-line config error (exit 2) before any check of the run."""
    from arl.train import main

    cfg = _cfg(tmp_path / "run")
    _checkpoint(cfg, 2)
    base = ["--config", str(ROOT / "configs" / "tiny_cpu.yaml"), f"output_dir={tmp_path / 'run'}"]
    assert main(base + ["trainer.world_size=1", "--dry-run", "--resume", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("arl.train: config error: --resume: the step 2 checkpoint"), err
    assert "trainer.world_size: 2 -> 1" in err[0]
    assert main(base + ["--dry-run", "--resume", "auto"]) == 0
    assert "resume: from the step 2 checkpoint" in capsys.readouterr().out
