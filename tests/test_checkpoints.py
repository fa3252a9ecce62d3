"""Checkpoint rotation (``trainer.keep_last``) on a checkpoint directory laid out as the trainer
writes it; the trainer's own use is run end to end in tests/test_train_e2e.py."""
import pytest

from arl.trainer.checkpoints import checkpoint_steps, latest_checkpoint, rotate_checkpoints


def _ckpt_dir(tmp_path, steps, latest):
    d = tmp_path / "checkpoints"
    for s in steps:
        (d / f"step{s}" / "hf").mkdir(parents=True)
        (d / f"step{s}" / "mp_rank_00_model_states.pt").write_text("x")
    (d / "latest_step").write_text(str(latest))
    (d / "latest").write_text(f"step{latest}")  # DeepSpeed's pointer and helper script: never touched
    (d / "zero_to_fp32.py").write_text("")
    (d / "step_notes").mkdir()  # not a checkpoint name: left alone
    return d


@pytest.mark.parametrize("keep,left", [(None, [2, 4, 6, 8]), (1, [8]), (2, [6, 8]), (4, [2, 4, 6, 8]), (9, [2, 4, 6, 8])])
def test_keep_last_keeps_the_newest(tmp_path, keep, left):
    d = _ckpt_dir(tmp_path, [2, 4, 6, 8], latest=8)
    deleted = rotate_checkpoints(d, keep, current=8)
    assert checkpoint_steps(d) == left and sorted(deleted + left) == [2, 4, 6, 8]
    assert latest_checkpoint(d) == 8 and (d / "step8" / "hf").is_dir()
    assert (d / "latest").exists() and (d / "zero_to_fp32.py").exists() and (d / "step_notes").is_dir()


def test_the_checkpoint_just_written_is_never_deleted(tmp_path):
    """An output_dir reused by a fresh run may hold an earlier run's later checkpoints: they are
    not counted as newer than the one just written, and not deleted either."""
    d = _ckpt_dir(tmp_path, [1, 2, 10, 20], latest=2)
    assert rotate_checkpoints(d, 1, current=2) == [1]
    assert checkpoint_steps(d) == [2, 10, 20]
    assert rotate_checkpoints(d, 1, current=2) == []  # idempotent


def test_bad_keep_last(tmp_path):
    with pytest.raises(ValueError, match="trainer.keep_last: must be >= 1"):
        rotate_checkpoints(_ckpt_dir(tmp_path, [1], latest=1), 0, current=1)
    assert checkpoint_steps(tmp_path / "missing") == [] and latest_checkpoint(tmp_path / "missing") is None
