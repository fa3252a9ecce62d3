"""--dry-run's sequence-parallel plan (arl/layout.py): per-rank activations and the longest trajectory."""
from __future__ import annotations

import re
from pathlib import Path

from arl.config import load_config
from arl.layout import plan

ROOT = Path(__file__).resolve().parents[1]


def _sp_lines(config: str, *overrides: str) -> list:
    notes = plan(load_config(str(ROOT / "configs" / config), list(overrides))).render().splitlines()
    i = next(k for k, line in enumerate(notes) if line.startswith("sequence parallel"))
    return notes[i:i + 5]


def test_qwen25_7b_plan_over_sp_1_2_4_8():
    head, *rows = _sp_lines("qwen2.5-7b_8gpu.yaml")
    assert "heads 28, kv heads 4, 4 trainer ranks" in head
    assert [r.split()[0] for r in rows] == ["SP=1", "SP=2", "SP=4", "SP=8"]
    assert "not possible: 28 attention heads do not split over 8 ranks" in rows[3]
    act = [float(re.search(r"activations\s+([\d.]+) GiB", r).group(1)) for r in rows[:3]]
    longest = [int(re.search(r"~(\d+)k tokens", r).group(1)) for r in rows[:3]]
    assert act[1] <= 0.6 * act[0] and act[2] <= 0.6 * act[1]  # each rank holds T/SP tokens' activations
    assert longest[1] >= 1.8 * longest[0] and longest[2] >= 1.8 * longest[1]
    assert "data parallel 4" in rows[0] and "data parallel 1" in rows[2]


def test_cpu_plan_has_no_gpu_budget_and_names_uneven_splits():
    head, *rows = _sp_lines("tiny_cpu.yaml")
    assert all("longest" not in r for r in rows)
    assert "needs a multiple of 4 trainer ranks; kv heads expanded to 4" in rows[2]


def test_config_refuses_what_has_no_sp_path():
    import pytest

    from arl.config import ConfigError

    cfg = str(ROOT / "configs" / "tiny_cpu.yaml")
    for overrides, why in [(["trainer.sequence_parallel=3"], "3 must divide trainer.world_size \\(2\\)"),
                           (["trainer.sequence_parallel=2", "trainer.share_prefix=true"], "share_prefix: true"),
                           (["trainer.sequence_parallel=2", "algo.advantage=gae", "critic.model=separate"],
                            "critic.model: separate")]:
        with pytest.raises(ConfigError, match=f"trainer.sequence_parallel: .*{why}"):
            load_config(cfg, overrides)
    load_config(cfg, ["trainer.sequence_parallel=2", "algo.advantage=gae"])  # the shared value head has one
    on = load_config(cfg, ["trainer.sequence_parallel=2"])
    assert not on.shares_prefix()  # auto resolves off beside SP: no tree path there
