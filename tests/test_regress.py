"""bench/regress.py's judging and reading, on stand-in benches (no timing is measured here)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def regress():
    spec = importlib.util.spec_from_file_location("regress", ROOT / "bench" / "regress.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["regress"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def test_judge_band_and_floor(regress):
    up = regress.Metric("r", "r", True, 0.20, floor=1.5)
    assert regress.judge(up, 1.70, 2.0) is None            # 15% below: inside the band
    assert "below the baseline" in regress.judge(up, 1.55, 2.0)  # 22.5% below
    assert "floor" in regress.judge(up, 1.45, 1.5)         # inside the band, under the floor
    down = regress.Metric("m", "a", False, 0.10, over="b")
    assert regress.judge(down, 1.09, 1.0) is None
    assert "above the baseline" in regress.judge(down, 1.2, 1.05)  # resident memory 14% up
    assert regress.judge(up, 1.6, None) is None            # no baseline yet: only the floor


def test_metric_reads_paths_and_ratios(regress):
    out = {"a": 3.0, "shapes": {"x": {"peak_mb": {"arl": 2012.8, "raw": 133.3}}}}
    assert regress.Metric("a", "a", True, 0.1).read(out) == 3.0
    m = regress.Metric("p", "shapes.x.peak_mb.arl", False, 0.1, over="shapes.x.peak_mb.raw")
    assert m.read(out) == pytest.approx(2012.8 / 133.3)
    with pytest.raises(KeyError, match="no 'shapes.y.z'"):
        regress.Metric("q", "shapes.y.z", True, 0.1).read(out)


def _fake_repo(tmp_path: Path, body: str) -> Path:
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "bench_trainer.py").write_text(body)
    return tmp_path


def test_run_check_reads_the_last_json_line(regress, tmp_path):
    repo = _fake_repo(tmp_path, "print('warming up')\nimport json; print(json.dumps({'x': 2.5, 'y': 0.5}))\n")
    check = regress.Check("c", ("bench/bench_trainer.py",), (regress.Metric("ratio", "x", True, 0.2, over="y"),))
    assert regress.run_check(check, repo)["values"] == {"ratio": 5.0}


@pytest.mark.parametrize("body,why", [
    ("import sys; sys.exit('bench: broke')", "exited 1: bench: broke"),
    ("print('{not json')", "unreadable result"),
    ("print('{\"other\": 1}')", "no 'x'"),
])
def test_a_failing_bench_is_one_line_not_a_fall(regress, tmp_path, body, why):
    repo = _fake_repo(tmp_path, body + "\n")
    check = regress.Check("c", ("bench/bench_trainer.py",), (regress.Metric("x", "x", True, 0.2),))
    r = regress.run_check(check, repo)
    assert "values" not in r and why in r["error"] and "\n" not in r["error"]


def test_main_flags_what_fell_and_exits_1(regress, tmp_path, monkeypatch, capsys):
    repo = _fake_repo(tmp_path, "import json; print(json.dumps({'x': 1.0}))\n")
    check = regress.Check("c", ("bench/bench_trainer.py",), (regress.Metric("x", "x", True, 0.2),))
    monkeypatch.setattr(regress, "CHECKS", (check,))
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"metrics": {"x": {"value": 2.0}}}))
    rc = regress.main(["--repo", str(repo), "--baseline", str(base)])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and not out["ok"] and [f["metric"] for f in out["fell"]] == ["x"]
    base.write_text(json.dumps({"metrics": {"x": {"value": 1.1}}}))
    assert regress.main(["--repo", str(repo), "--baseline", str(base)]) == 0


def test_committed_baseline_names_every_metric(regress):
    doc = json.loads((ROOT / "bench" / "results" / "regress_baseline.json").read_text())
    names = {m.name for c in regress.CHECKS for m in c.metrics}
    assert names == set(doc["metrics"]) and doc["command"] and doc["machine"]
