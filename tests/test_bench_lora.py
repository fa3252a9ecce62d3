"""bench/bench_lora.py's pure parts (the runs themselves are an hour: bench/, not tests): argument
parsing, each arm's overrides against the config schema, the figures of an arm from its metrics
records, the comparison, the JSON and the Markdown table."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from arl.config import load_config

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_lora", ROOT / "bench" / "bench_lora.py")
bl = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bl
spec.loader.exec_module(bl)


def _recs(successes: dict, peak: float, over: float, trainable: float, sync: float, load: float, steps: int = 15):
    recs = [{"step": 0, "success/heldout": successes.get(0), "wall_s": 0.0}]
    for s in range(1, steps + 1):
        r = {"step": s, "wall_s": 10.0 * s, "mem/trainer_rss_peak_gib": peak * s / steps,
             "mem/trainer_peak_over_base_gib": over * s / steps, "mem/params": 1.35e8, "mem/params_trainable": trainable,
             "time/sync_s": sync + 0.01 * (s % 3), "rollout/weights_load_s_max": load, "time/step_s": 80.0,
             "perf/train_tokens_per_s": 500.0}
        if s in successes:
            r["success/heldout"] = successes[s]
        recs.append(r)
    return recs


def test_parse_args_defaults_and_quick():
    a = bl.parse_args([])
    assert (a.steps, a.eval_every, a.arms, a.quick, a.lora_r, a.lora_alpha) == (15, 5, ["full", "lora"], False, 16, 32.0)
    assert a.config == "configs/smollm2_tools_cpu.yaml" and a.full_lr is None
    q = bl.parse_args(["--quick", "--arms", "lora", "--set", "trainer.cpu_threads=1"])
    assert (q.steps, q.eval_every, q.arms) == (2, 1, ["lora"])
    assert bl.common_overrides(q)[0] == "seed=0" and "trainer.steps=2" in bl.common_overrides(q)
    assert bl.common_overrides(q)[-1] == "trainer.cpu_threads=1"  # --set comes last: it wins
    with pytest.raises(SystemExit):
        bl.parse_args(["--arms", "qlora"])
    with pytest.raises(SystemExit):
        bl.parse_args(["--steps", "0"])
    for bad in ("lora_adapter", "qlora=5", "lora=0"):
        with pytest.raises(SystemExit):
            bl.parse_args(["--arm-steps", bad])
    assert a.record is None and bl.parse_args(["--record", "15step_lr3e-4_seed1"]).record == "15step_lr3e-4_seed1"
    with pytest.raises(SystemExit):
        bl.parse_args(["--record", "../x"])  # a tag, not a path: the record stays in bench/results/lora


def test_arm_steps_shortens_one_arm(tmp_path):
    a = bl.parse_args(["--arm-steps", "lora_adapter=5"])
    assert a.arm_steps == {"lora_adapter": 5}
    steps = {arm: bl.run_config(a.config, tmp_path / arm, bl.arm_overrides(arm, a, tmp_path / "hf", 2e-5)).trainer.steps
             for arm in bl.ARMS}
    assert steps == {"full": 15, "lora": 15, "lora_adapter": 5}


@pytest.mark.parametrize("arm", bl.ARMS)
def test_arm_overrides_validate(arm, tmp_path):
    a = bl.parse_args(["--lora-lr", "3e-4"])
    start = tmp_path / "hf"
    cfg = bl.run_config(a.config, tmp_path / arm, [*bl.common_overrides(a), *bl.arm_overrides(arm, a, start, 2e-5)])
    assert cfg.model.name_or_path == str(start) and not cfg.sft.enabled and cfg.trainer.steps == 15
    assert cfg.trainer.eval_every == 5 and cfg.seed == 0
    assert cfg.model.gradient_checkpointing  # both arms: the activations would hide LoRA's saving
    assert cfg.trainer.max_wall_s is None  # compared at the same steps: no arm ends early on the clock
    off = bl.arm_overrides(arm, bl.parse_args(["--no-grad-ckpt"]), start, 2e-5)
    assert not bl.run_config(a.config, tmp_path / "off", off).model.gradient_checkpointing
    if arm in bl.LORA_SYNC:
        assert cfg.model.lora.r == 16 and cfg.model.lora.alpha == 32.0 and cfg.trainer.optim.lr == 3e-4
        assert cfg.rollout.lora_sync == {"lora": "merged", "lora_adapter": "adapter"}[arm]
    else:
        assert cfg.model.lora is None and cfg.trainer.optim.lr == 2e-5
    # the base config is the same for every arm but for these keys (and the LoRA arms' rollout.lora_sync)
    base = load_config(str(ROOT / a.config), [f"output_dir={tmp_path / arm}"])
    assert cfg.env == base.env and cfg.loss == base.loss
    assert cfg.rollout.model_copy(update={"lora_sync": base.rollout.lora_sync}) == base.rollout


def test_arm_figures():
    f = bl.arm_figures(_recs({0: 0.5, 5: 0.6, 10: 0.7, 15: 0.8}, peak=4.0, over=3.0, trainable=1.35e8, sync=0.5,
                             load=0.2))
    assert f["heldout"] == {0: 0.5, 5: 0.6, 10: 0.7, 15: 0.8} and f["steps"] == 15
    assert f["peak_rss_gib"] == 4.0 and f["peak_over_base_gib"] == 3.0  # the largest, not the last seen
    assert f["params_trainable"] == 1.35e8 and f["sync_engine_load_s"] == 0.2
    assert f["sync_trainer_s"] == pytest.approx(0.51)  # the median over steps
    empty = bl.arm_figures([{"step": 0}])
    assert empty["peak_rss_gib"] is None and empty["sync_trainer_s"] is None and empty["heldout"] == {}


def test_compare_and_result():
    full = bl.arm_figures(_recs({0: 0.5, 5: 0.6, 10: 0.7, 15: 0.9}, 4.0, 3.0, 1.35e8, 0.5, 0.2))
    lora = bl.arm_figures(_recs({0: 0.5, 5: 0.55, 10: 0.75, 15: 0.8}, 2.5, 1.2, 4.9e6, 0.6, 0.2))
    c = bl.compare(full, lora, [5, 10, 15])
    assert c["heldout_diff"][5] == pytest.approx(-0.05) and c["heldout_diff"][15] == pytest.approx(-0.1)
    assert c["success_within_10_points"] is True  # exactly 10 points still counts
    assert c["memory_ratio_over_base"] == pytest.approx(0.4) and c["memory_at_most_half"] is True
    assert c["memory_ratio_rss"] == pytest.approx(2.5 / 4.0)
    worse = bl.arm_figures(_recs({5: 0.3, 10: 0.7, 15: 0.9}, 3.9, 2.0, 4.9e6, 0.6, 0.2))
    c2 = bl.compare(full, worse, [5, 10, 15])
    assert c2["success_within_10_points"] is False and c2["memory_at_most_half"] is False
    short = bl.arm_figures(_recs({5: 0.6}, 2.5, 1.2, 4.9e6, 0.6, 0.2, steps=5))
    assert bl.compare(full, short, [5, 10, 15])["success_within_10_points"] is None  # not measured: no verdict

    args = bl.parse_args([])
    res = bl.build_result({"full": full, "lora": lora}, args, {"full": 2e-5, "lora": 2e-4}, {"date": "2026-12-04"})
    line = json.dumps(res)
    back = json.loads(line)
    assert back["eval_steps"] == [5, 10, 15] and back["compare"]["success_within_10_points"] is True
    assert back["sync"]["lora"]["adapter"] == bl.NOT_RUN and back["sync"]["full"]["adapter"] == "n/a (no adapter)"
    assert back["sync"]["lora"]["merged"]["trainer_s"] == pytest.approx(0.61)
    assert back["sync"]["full"]["merged"]["trainer_s"] == pytest.approx(0.51)
    assert back["arms"]["lora"]["heldout"]["15"] == 0.8 and back["date"] == "2026-12-04"
    md = bl.markdown(back)
    assert md.count("\n") == 6 and "| lora | 0.0002 | 4,900,000 | 0.55 | 0.75 | 0.80 |" in md
    assert f"LoRA sync, adapter mode: {bl.NOT_RUN}" in md
    # the lora_adapter arm (rollout.lora_sync: adapter): both LoRA sync modes measured, side by side
    adapter = bl.arm_figures(_recs({5: 0.55, 10: 0.75, 15: 0.8}, 2.5, 1.2, 4.9e6, 0.05, 0.03))
    both = json.loads(json.dumps(bl.build_result({"full": full, "lora": lora, "lora_adapter": adapter}, args,
                                                 {"full": 2e-5, "lora": 2e-4, "lora_adapter": 2e-4}, {})))
    assert both["sync"]["lora"]["adapter"]["trainer_s"] == pytest.approx(0.06)
    assert both["sync"]["lora"]["merged"]["trainer_s"] == pytest.approx(0.61)
    assert "adapter mode" not in bl.markdown(both) and "| lora_adapter | 0.0002 |" in bl.markdown(both)


def test_result_one_arm_and_quick_steps():
    args = bl.parse_args(["--quick", "--arms", "full"])
    full = bl.arm_figures(_recs({0: 0.5, 1: 0.5, 2: 0.25}, 4.0, 3.0, 1.35e8, 0.5, 0.2, steps=2))
    res = bl.build_result({"full": full}, args, {"full": 2e-5}, {})
    assert res["eval_steps"] == [1, 2] and "compare" not in res and res["quick"] is True
    odd = bl.parse_args(["--steps", "7", "--eval-every", "5"])
    assert bl.build_result({"full": full}, odd, {"full": 2e-5}, {})["eval_steps"] == [5, 7]
