"""Shared by the ecosystem-env tests (gym, mcp, openenv): a scripted bisection player for the
guess-the-number games, and an example config's 3-step training run on the tests' tiny model."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from arl.rollout.engine import Sample

ROOT = Path(__file__).resolve().parents[1]


class BinarySearch:
    """Guesses by bisection from the game's "Higher."/"Lower." (read back from the prompt); ``say``
    formats the guess as the game expects it."""

    def __init__(self, tok, high=20, say="{}"):
        self.tok, self.high, self.say = tok, high, say

    async def generate_one(self, tokens, sampling):
        text = self.tok.decode(tokens)
        lo, hi = 1, self.high
        for guess, said in re.findall(r"(\d+)\D*?(Higher|Lower)\.", text.split("higher or lower.", 1)[1]):
            lo, hi = (int(guess) + 1, hi) if said == "Higher" else (lo, int(guess) - 1)
        out = self.say.format((lo + hi) // 2)
        ids = self.tok.encode(out, add_special_tokens=False)
        return Sample(ids, [0.0] * len(ids), out, "stop")


def three_rl_steps(example: str, tmp_path, tiny_model_dir, *overrides) -> Path:
    """``examples/<example>/config.yaml`` as shipped but on the tiny model: 3 RL steps of 2 tasks x 4
    samples, held-out evaluations (4 tasks) at steps 0 and 3; checks the run's records and returns
    its output directory."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "arl.train", "--config", str(ROOT / "examples" / example / "config.yaml"),
           f"model.name_or_path={tiny_model_dir}", "model.arch=null", f"output_dir={out}", "trainer.steps=3",
           "env.eval_tasks=4", "trainer.eval_every=3", "rollout.tasks_per_step=2", "rollout.group_size=4",
           "logging.progress=false", "logging.tensorboard=false", *overrides]
    res = subprocess.run(cmd, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                         text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert sorted(recs) == [0, 1, 2, 3] and "success/heldout" in recs[0] and "success/heldout" in recs[3]
    assert all(recs[s]["rollout/num_trajectories"] == 8 and recs[s]["fault/reward_exception"] == 0 for s in (1, 2, 3))
    return out
