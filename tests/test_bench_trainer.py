"""bench/bench_trainer.py --quick runs end to end and reports every figure the issue asks for (keys,
never values: timings are not asserted); bench_logprob's peak memory leaves out what the call returns."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"raw", "naive", "arl", "arl_with_old_pass", "arl_recompute_head", "arl_naive_head"}
PHASES = {"forward", "head+loss", "backward", "optimizer", "old_logp_pass", "other", "total"}


# the tests read one --quick run of every shape: on one pytest worker, so that it runs once (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("bench_trainer")


@pytest.fixture(scope="module")
def quick_all():
    """``bench_trainer.py --quick`` over every shape (the calc shape at its smallest), its JSON line."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "bench/bench_trainer.py", "--quick", "--shapes", "main,large,calc,main_share",
                          "--calc-groups", "4", "--calc-tasks", "1", "--calc-layers", "1"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # trains in a benchmark subprocess
def test_bench_trainer_quick_reports_its_keys(quick_all):
    res = quick_all
    for key in ("efficiency_vs_raw", "speedup_vs_naive", "old_logp_pass_saved", "fused_head_step_time_ratio",
                "efficiency_vs_raw_large", "peak_mb", "targets", "shapes"):
        assert key in res, key
    assert set(res["peak_mb"]) == VARIANTS
    assert set(res["shapes"]) == {"main", "large", "calc_g4", "main_share"}
    for shape in (res["shapes"]["main"], res["shapes"]["large"]):
        assert set(shape["step_s"]) == set(shape["tokens_per_s"]) == set(shape["peak_mb"]) == VARIANTS
        assert set(shape["breakdown_s"]) == PHASES
        assert shape["tokens"] > 0 and shape["micro_batches"] >= 1
        assert shape["naive_loss_rel_diff"] <= 1e-3  # the naive step computes arl's loss


@pytest.mark.slow  # trains in a benchmark subprocess
def test_bench_trainer_calc_shape_reports_share_prefix(quick_all):
    res = quick_all
    assert "share_prefix_speedup_g4" in res
    calc = res["shapes"]["calc_g4"]
    assert set(calc["step_s"]) == set(calc["peak_mb"]) == {"arl", "arl_share_prefix"}
    assert calc["computed_tokens"]["arl_share_prefix"] < calc["computed_tokens"]["arl"] == calc["tokens"]
    assert calc["loss_rel_diff"] <= 1e-4 and calc["head_grad_in_forward"]["arl_share_prefix"] == 1.0


@pytest.mark.slow  # trains in a benchmark subprocess
def test_bench_trainer_main_share_shape_reports_share_prefix(quick_all):
    res = quick_all
    assert "share_prefix_speedup_main" in res
    main = res["shapes"]["main_share"]
    assert set(main["step_s"]) == set(main["peak_mb"]) == {"arl", "arl_share_prefix"}
    assert main["computed_tokens"]["arl_share_prefix"] <= main["computed_tokens"]["arl"] == main["tokens"]
    assert main["loss_rel_diff"] <= 1e-4


def test_peak_bytes_leaves_out_the_returned_tensors():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from bench_logprob import peak_bytes

    def call():
        tmp = torch.ones(1 << 20)  # 4 MiB, freed before the end
        out = torch.ones(1 << 18)  # 1 MiB, returned
        del tmp
        return (out,)

    total, beyond, out = peak_bytes(call, "cpu")
    assert total == 5 << 20 and beyond == 4 << 20 and out[0].numel() == 1 << 18
