"""bench/bench_methods.py's bookkeeping (the runs themselves are hours: bench/, not tests): a run's
figures from its metrics, collapse events, the rows' mean and spread over seeds, the method
registry's overrides against the config schema."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from arl.config import load_config
from arl.metrics.logger import MetricsLogger

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_methods", ROOT / "bench" / "bench_methods.py")
bm = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bm  # dataclasses look their module up
spec.loader.exec_module(bm)


def _run(d: Path, successes, seed=0, dt=10.0):
    with MetricsLogger(d, tensorboard=False, progress=False) as lg:
        for i, v in enumerate(successes):
            lg.log(5 * i, {"success/heldout": v, "perf/train_tokens_per_s": 1000.0 + i}, wall_s=dt * i)
    (d / "run.json").write_text(json.dumps({"seed": seed, "method": "m", "lr": 1e-4}))


def test_collapse_events():
    assert bm.collapse_events([0.1, 0.5, 0.9, 0.5, 0.55, 0.95, 0.6, 0.2, 0.9]) == 2
    assert bm.collapse_events([0.4, 0.0, 0.4]) == 0  # the best never reached 0.5
    assert bm.collapse_events([0.6, 0.3, 0.6, 0.31]) == 1 and bm.collapse_events([0.7, 0.4, 0.7, 0.25]) == 2
    assert bm.collapse_events([]) == 0


def test_summarize_run_thresholds(tmp_path):
    _run(tmp_path, [0.1, 0.3, 0.55, 0.85, 0.4, 0.9])
    r = bm.summarize_run(tmp_path)
    assert (r["step_to_50"], r["wall_to_50"], r["step_to_80"], r["wall_to_80"]) == (10, 20.0, 15, 30.0)
    assert r["success_start"] == 0.1 and r["success_end"] == 0.9 and r["success_best"] == 0.9
    assert r["success_mean"] == pytest.approx(sum([0.1, 0.3, 0.55, 0.85, 0.4, 0.9]) / 6)
    assert r["collapses"] == 1 and r["train_tokens_per_s"] == pytest.approx(1002.5)
    assert r["stopped_at_step"] is None
    _run(tmp_path / "never", [0.0, 0.2])
    r = bm.summarize_run(tmp_path / "never")
    assert r["wall_to_50"] is None and r["step_to_80"] is None


def test_success_auc_holds_each_figure_to_the_budget():
    assert bm.success_auc([(0, 0.0, 0.0), (5, 50.0, 1.0)], 100.0) == pytest.approx(0.5)
    # stopped early at 0: it keeps its 0, so it ranks below a run that held 1.0 for the same 10 s
    assert bm.success_auc([(0, 0.0, 0.0), (5, 50.0, 1.0), (10, 60.0, 0.0)], 100.0) == pytest.approx(0.1)
    assert bm.success_auc([(0, 0.0, 0.2), (5, 50.0, 0.6)]) == pytest.approx(0.2)  # no budget: to the last
    assert bm.success_auc([(0, 0.0, 0.4)], None) == 0.4 and math.isnan(bm.success_auc([], 100.0))
    ranked = sorted([{"success_auc": 0.1, "success_end": 0.0}, {"success_auc": 0.5, "success_end": 1.0}],
                    key=bm._rank_key, reverse=True)
    assert ranked[0]["success_auc"] == 0.5


def test_success_auc_over_steps_and_generation_rate(tmp_path):
    """The step view: held over the first ``horizon`` steps, whatever the machine's speed; evaluations
    past the horizon do not count.  Generation tokens/s is the median (a collapsed step's near-empty
    rollout gives an absurd rate)."""
    ev = [(0, 0.0, 0.0), (5, 99.0, 1.0), (40, 300.0, 0.0)]
    assert bm.success_auc_steps(ev, 10) == pytest.approx(0.5)
    assert bm.success_auc_steps(ev, 30) == pytest.approx(25 / 30)  # the 0 at step 40 is past it
    assert bm.success_auc_steps(ev[:2], 30) == pytest.approx(25 / 30)  # the last figure holds
    with MetricsLogger(tmp_path, tensorboard=False, progress=False) as lg:
        for i, rate in enumerate([1000.0, 1200.0, 900.0, 180000.0]):
            lg.log(i, {"rollout/gen_tokens_per_s": rate, **({"success/heldout": 0.5} if i == 0 else {})},
                   wall_s=float(i))
    r = bm.summarize_run(tmp_path, step_horizon=3)
    assert r["gen_tokens_per_s"] == pytest.approx(1100.0) and r["steps"] == 3
    assert r["success_auc_steps"] == pytest.approx(0.5)


def test_a_stopped_run_counts_as_a_collapse(tmp_path):
    """The stall guard's stop (``stab/stopped`` in the step's record) is a collapse event."""
    with MetricsLogger(tmp_path, tensorboard=False, progress=False) as lg:
        lg.log(0, {"success/heldout": 0.1}, wall_s=0.0)
        lg.log(29, {"stab/stopped": 1.0, "stab/no_signal_streak": 20}, wall_s=100.0)
    r = bm.summarize_run(tmp_path)
    assert r["stopped_at_step"] == 29 and r["collapses"] == 1
    with MetricsLogger(tmp_path / "inside", tensorboard=False, progress=False) as lg:  # seen by the evals
        for i, v in enumerate([0.1, 0.9, 0.0]):
            lg.log(5 * i, {"success/heldout": v}, wall_s=10.0 * i)
        lg.log(29, {"stab/stopped": 1.0}, wall_s=100.0)
    assert bm.summarize_run(tmp_path / "inside")["collapses"] == 1


def test_method_row_spread(tmp_path):
    runs = []
    for seed, curve in enumerate(([0.1, 0.6, 0.9], [0.1, 0.2, 0.5], [0.1, 0.9, 0.9])):
        _run(tmp_path / str(seed), curve, seed=seed)
        runs.append(bm.summarize_run(tmp_path / str(seed)))
    row = bm.method_row("ipa_turn_credit", 4e-4, runs)
    assert row["seeds"] == [0, 1, 2]
    assert row["success_end"] == pytest.approx({"mean": 2.3 / 3, "min": 0.5, "max": 0.9, "n": 3})
    assert row["wall_to_80"]["reached"] == 2 and row["wall_to_80"]["mean"] == pytest.approx(15.0)
    assert row["wall_to_50"]["reached"] == 3
    bm.print_table([row])  # renders without error
    md = bm.markdown_table([row], {"ipa_turn_credit": {4e-4: runs[0], 8e-4: runs[1]},
                                   "sft_continue": {1e-3: runs[2]}}).splitlines()  # no rate grid: left out
    assert "lr 0.001" not in md[-3] and not md[-1].startswith("| sft_continue")
    assert md[0].startswith("| method | lr | seeds | held-out end | over the budget | over 30 steps |")
    assert md[2] == ("| ipa_turn_credit | 0.0004 | 3 | 0.77 [0.50-0.90] | 0.33 [0.15-0.50] | 0.62 [0.38-0.77] "
                     "| 13 [10-20] (3/3) | 15 [10-20] (2/3) | 8 [5-10] (2/3) | 0 | 10 [10-10] | 1001 [1001-1001] | - |")
    assert md[-1] == "| ipa_turn_credit | 0.35, 0.72, 0.90, 20.0 | 0.15, 0.38, 0.50, - |"
    assert json.loads(json.dumps(bm._clean({"a": float("nan"), "b": [float("inf"), 1.0]}))) == {"a": None, "b": [None, 1.0]}


@pytest.mark.parametrize("name", [m for m, v in bm.METHODS.items() if v.kind == "rl"])
def test_method_overrides_are_valid_config(name):
    """Every RL method's keys exist and pass the config's cross-checks (turn credit's loss levels)."""
    m = bm.METHODS[name]
    cfg = load_config(str(ROOT / "configs" / "tiny_cpu.yaml"), [*m.overrides, "sft.enabled=false"])
    assert cfg.stabilizers.turn_credit.enabled == ("turn_credit" in name)
    assert cfg.algo.uses_critic() == ("critic" in name)


def test_prune_run_keeps_the_records(tmp_path):
    _run(tmp_path, [0.1, 0.5])
    for d in ("checkpoints/step5/hf", "hf", "tb", "snapshots/sft10"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "model.safetensors").write_bytes(b"0" * 64)
    bm.prune_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "run.json"]
    assert bm.summarize_run(tmp_path)["success_end"] == 0.5


def test_continued_sft_functions_pickle_for_spawn():
    """Continued SFT starts its evaluation server and ranks by spawn, which pickles functions by
    module name: the loader must give the importable module, not a copy from a file spec."""
    import pickle

    mod = bm._sft_continue()
    for fn in (mod.eval_server, mod.sft_rank):
        assert pickle.loads(pickle.dumps(fn)) is fn


def test_table_only_builds_from_finished_runs(tmp_path, monkeypatch, capsys):
    """``--table-only`` starts no run: the table comes from the finished runs in ``--out``, and the
    ones not run yet are listed as missing, not silently dropped."""
    for name, lr, seed, curve in (("grpo_token", "0.0002", 0, [0.0, 0.5, 0.9]),
                                  ("grpo_token", "0.0004", 0, [0.0, 0.1, 0.0]),
                                  ("ipa_chunk", "0.0002", 0, [0.0, 0.2, 0.6]),
                                  ("grpo_token", "0.0002", 1, [0.0, 0.8, 1.0])):
        d = tmp_path / name / f"lr{lr}" / f"seed{seed}"
        d.mkdir(parents=True)
        _run(d, curve, seed=seed)
    (tmp_path / "ipa_chunk" / "lr0.0004" / "seed0").mkdir(parents=True)  # unfinished: no run.json
    monkeypatch.setattr(bm, "run_method", lambda *a, **k: pytest.fail("--table-only started a run"))
    monkeypatch.setattr(sys, "argv", ["bench_methods.py", "--out", str(tmp_path), "--table-only",
                                      "--methods", "grpo_token,ipa_chunk", "--lrs", "2e-4,4e-4",
                                      "--seeds", "0,1,2", "--top", "1"])
    bm.main()
    table = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["method"] for r in table["rows"]] == ["grpo_token", "ipa_chunk"]
    assert table["rows"][0]["seeds"] == [0, 1] and table["rows"][0]["lr"] == 2e-4
    assert table["missing"] == ["ipa_chunk/lr0.0004/seed0", "grpo_token/lr0.0002/seed2"]
    assert (tmp_path / "table.md").is_file() and (tmp_path / "curves.png").is_file()


def test_table_dir_takes_the_table_and_leaves_the_runs(tmp_path, monkeypatch, capsys):
    """``--table-dir``: the table and its curves go there (the committed summary), the runs stay
    in ``--out`` (an ignored folder): nothing of a run is written beside the table."""
    runs, tables = tmp_path / "runs", tmp_path / "results"
    d = runs / "grpo_token" / "lr0.0002" / "seed0"
    d.mkdir(parents=True)
    _run(d, [0.0, 0.5, 0.9])
    monkeypatch.setattr(bm, "run_method", lambda *a, **k: pytest.fail("--table-only started a run"))
    monkeypatch.setattr(sys, "argv", ["bench_methods.py", "--out", str(runs), "--table-dir", str(tables),
                                      "--table-only", "--methods", "grpo_token", "--lrs", "2e-4", "--seeds", "0"])
    bm.main()
    capsys.readouterr()
    assert sorted(p.name for p in tables.iterdir()) == ["curves.png", "curves_step.png", "table.json", "table.md"]
    assert not (runs / "table.json").exists()
    import json
    table = json.loads((tables / "table.json").read_text())
    assert table["runs_dir"] == str(runs)  # the runs are named once, as <method>/lr<lr>/seed<seed> under it
    assert "dir" not in table["grid"]["grpo_token"]["0.0002"]
