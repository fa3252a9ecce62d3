"""Checkpoints that survive being killed (arl/trainer/checkpoints.py, ``write_checkpoint``): the
writer is killed at every stage of checkpoint 2 -- in the middle of DeepSpeed's save, after it, after
the HF export, after the rollouts, after the rename, after ``latest_step``, in the rotation -- and
the loader then finds a whole checkpoint (1, or 2 once ``latest_step`` names it) and the resumed
run writes checkpoint 2 over the leftovers.  A full disk is one line naming the directory and the
free space, and leaves checkpoint 1 as it was.  The writers here are stand-ins that write real files
(DeepSpeed's own save, on the trainer, is in the resume tests of tests/test_train_e2e.py)."""
import errno
import os
import pickle

import pytest

from arl.trainer import checkpoints as ck
from arl.trainer import faults
from arl.trainer.faults import CKPT_STAGES


class _Killed(BaseException):
    """The writer's process ends here: nothing after it runs (no except/finally of arl's catches it)."""


def _payload(step: int) -> bytes:
    return f"weights of step {step}".encode() * 100


class _Writer:
    """Stand-ins for DeepSpeed's save (two files per tag, like a model and an optimizer file) and the
    HF export; ``die_in_save``: killed between DeepSpeed's two files."""

    def __init__(self, die_in_save=False, fail=None):
        self.die_in_save, self.fail = die_in_save, fail

    def save_state(self, step):
        def save(directory, tag):
            d = os.path.join(directory, tag)
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "mp_rank_00_model_states.pt"), "wb") as f:
                f.write(_payload(step))
            if self.die_in_save:
                raise _Killed
            if self.fail is not None:
                raise self.fail
            with open(os.path.join(d, "optim_states.pt"), "wb") as f:
                f.write(_payload(step) + b"adam")
        return save

    @staticmethod
    def export(step):
        def export(path):
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "model.safetensors"), "wb") as f:
                f.write(_payload(step))
        return export

    @staticmethod
    def extras(step):
        def extras(staged):
            ck.save_rollouts(staged, [f"batch {step + 1}"])
            (staged / ck.CONFIG_FILE).write_text("{}")
        return extras


def _write(d, step, writer=None, keep_last=1):
    w = writer or _Writer()
    ck.write_checkpoint(d, step, 0, w.save_state(step), w.export(step), w.extras(step), keep_last, lambda: None)


def _assert_whole(d, step):
    """Checkpoint ``step`` as the loader sees it: every file there, each of step ``step``."""
    s = d / ck.checkpoint_tag(step)
    assert (s / "mp_rank_00_model_states.pt").read_bytes() == _payload(step)
    assert (s / "optim_states.pt").read_bytes() == _payload(step) + b"adam"
    assert (s / ck.HF_DIR / "model.safetensors").read_bytes() == _payload(step)
    assert ck.load_rollouts(s) == [f"batch {step + 1}"]
    assert (s / ck.CONFIG_FILE).exists()


def test_a_whole_checkpoint_and_its_pointers(tmp_path):
    d = tmp_path / "checkpoints"
    _write(d, 1)
    _write(d, 2)
    assert ck.latest_checkpoint(d) == 2 and ck.checkpoint_steps(d) == [2]  # keep_last 1: step 1 went
    assert (d / ck.DS_LATEST_FILE).read_text() == "step2"  # DeepSpeed's pointer, moved by arl
    assert sorted(p.name for p in d.iterdir()) == ["latest", "latest_step", "step2"]  # no temporary left
    _assert_whole(d, 2)


@pytest.mark.parametrize("stage", ["in-deepspeed", *CKPT_STAGES])
def test_killed_at_every_stage_leaves_a_whole_checkpoint(tmp_path, monkeypatch, stage):
    d = tmp_path / "checkpoints"
    _write(d, 1)
    writer = _Writer(die_in_save=stage == "in-deepspeed")

    def reached(s):
        if s == stage:
            raise _Killed

    with monkeypatch.context() as m:
        m.setattr(faults, "checkpoint_stage", reached)
        with pytest.raises(_Killed):
            _write(d, 2, writer)
    # the loader: the newest checkpoint latest_step names, whole (2 only once latest_step moved to it)
    latest = ck.latest_checkpoint(d)
    assert latest == (2 if stage in ("latest", "rotating") else 1)
    assert latest in ck.checkpoint_steps(d) and set(ck.checkpoint_steps(d)) <= {1, 2}
    for s in ck.checkpoint_steps(d):  # every visible checkpoint is whole (2: before or after latest_step moved)
        _assert_whole(d, s)
    # the resumed run writes checkpoint 2 again (or 3 after it): the leftovers go, the result is whole
    _write(d, 2)
    _write(d, 3)
    assert ck.latest_checkpoint(d) == 3 and ck.checkpoint_steps(d) == [3]
    assert sorted(p.name for p in d.iterdir()) == ["latest", "latest_step", "step3"]
    _assert_whole(d, 3)


def test_the_stage_names_are_the_kill_points(tmp_path, monkeypatch):
    """Every stage in CKPT_STAGES is reached by a checkpoint that rotates (the test above kills at
    each), in this order."""
    seen = []
    monkeypatch.setattr(faults, "checkpoint_stage", seen.append)
    d = tmp_path / "checkpoints"
    _write(d, 1)
    seen.clear()
    _write(d, 2)
    assert tuple(seen) == CKPT_STAGES


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")])
def test_a_full_disk_is_one_line_and_the_previous_checkpoint_stays(tmp_path, error):
    """ENOSPC while DeepSpeed writes (torch's zip writer loses the errno: its own text is kept)."""
    d = tmp_path / "checkpoints"
    _write(d, 1)
    with pytest.raises(ck.CheckpointError) as e:
        _write(d, 2, _Writer(fail=error))
    msg = str(e.value)
    assert "\n" not in msg and str(d) in msg and "GiB free" in msg and "step 1 checkpoint is intact" in msg
    if isinstance(error, OSError):
        assert "no space left on device" in msg
    else:
        assert "unexpected pos" in msg
    assert ck.latest_checkpoint(d) == 1 and ck.checkpoint_steps(d) == [1]
    assert sorted(p.name for p in d.iterdir()) == ["latest", "latest_step", "step1"]  # the staged files went
    _assert_whole(d, 1)


def test_latest_step_naming_a_missing_checkpoint_is_one_line(tmp_path):
    d = tmp_path / "checkpoints"
    _write(d, 1)
    (d / ck.LATEST_FILE).write_text("7")
    with pytest.raises(ValueError, match="names step 7, but .*step7 is missing"):
        ck.latest_checkpoint(d)


def test_rollouts_round_trip(tmp_path):
    ck.save_rollouts(tmp_path, [1, 2])
    assert pickle.loads((tmp_path / ck.ROLLOUTS_FILE).read_bytes()) == [1, 2] == ck.load_rollouts(tmp_path)


def _deepspeed_kills(_index, port, result_dir):
    """One DeepSpeed rank (ZeRO-2): checkpoint 1, then checkpoint 2 killed at every stage, each time
    loaded into a fresh trainer from what ``latest_step`` names."""
    import torch

    from arl.config import OptimConfig
    from arl.procs import exit_process
    from arl.trainer import PolicyTrainer
    from arl.trainer.dist import init_distributed, set_rank_env

    from two_rank import tiny_qwen

    set_rank_env(0, 1, port)
    init_distributed("cpu")
    d = os.path.join(result_dir, "checkpoints")

    def trainer(seed):
        return PolicyTrainer(tiny_qwen(seed), optim=OptimConfig(lr=1e-2), zero_stage=2, total_steps=10)

    def write(tr, step):
        ck.write_checkpoint(d, step, 0, lambda dd, tag: tr.save_checkpoint(dd, tag=tag, client_state={"step": step}),
                            lambda p: tr.export_hf(p), lambda s: ck.save_rollouts(s, [step]), 1, lambda: None)

    # two different models stand in for the policies of steps 1 and 2
    first, second = trainer(1), trainer(2)
    weights = {1: first.full_state_dict(), 2: second.full_state_dict()}
    write(first, 1)
    seen = []
    for stage in CKPT_STAGES:
        def reached(s, stage=stage):
            if s == stage:
                raise _Killed
        faults.checkpoint_stage = reached
        try:
            write(second, 2)
        except _Killed:
            pass
        faults.checkpoint_stage = lambda s: None
        latest = ck.latest_checkpoint(d)
        back = trainer(0)
        state = back.load_checkpoint(d, tag=ck.checkpoint_tag(latest))
        same = all(torch.equal(v, weights[latest][k]) for k, v in back.full_state_dict().items())
        seen.append((stage, latest, int(state["step"]), same,
                     ck.load_rollouts(os.path.join(d, ck.checkpoint_tag(latest)))))
        write(first, 1)  # back to checkpoint 1 as the newest for the next stage's kill
    torch.save(seen, os.path.join(result_dir, "seen.pt"))
    exit_process(0)


@pytest.mark.slow  # one DeepSpeed rank
def test_deepspeed_checkpoint_killed_at_every_stage_loads_the_previous(tmp_path):
    import torch
    import torch.multiprocessing as mp

    from arl.procs import free_port

    mp.spawn(_deepspeed_kills, args=(free_port(), str(tmp_path)), nprocs=1, join=True)
    seen = torch.load(tmp_path / "seen.pt")
    assert [s[0] for s in seen] == list(CKPT_STAGES)
    for stage, latest, step, same, rollouts in seen:
        assert latest == (2 if stage in ("latest", "rotating") else 1), stage
        assert step == latest and same and rollouts == [latest], stage  # DeepSpeed's state and ours, whole
