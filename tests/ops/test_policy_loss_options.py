"""The one option table (arl/ops/policy_loss/options.py) against the enums of the C++/CUDA core
(csrc/policy_loss/core.h), parsed from the header: every code and the iopts/fopts/stats order."""
from __future__ import annotations

import pathlib
import re

from arl.ops.policy_loss import METRIC_KEYS
from arl.ops.policy_loss import options as O
from arl.ops.policy_loss.group_adv import GROUP_STATS, IN_PASS

HEADER = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "policy_loss" / "core.h"
# C++ enumerator (without its k / kI / kF / kS prefix) -> Python name, where they are not the same word
ALIASES = {"NoLevel": "none", "KLOff": "off", "K1": "k1", "K2": "k2", "K3": "k3",
           "MismatchFrac": "mismatch_masked_frac"}


def _enums() -> dict[str, dict[str, int]]:
    src = re.sub(r"//[^\n]*", "", HEADER.read_text())
    out = {}
    for name, body in re.findall(r"enum\s+(\w+)\s*:\s*int\s*\{([^}]*)\}", src):
        vals, nxt = {}, 0
        for item in filter(None, (x.strip() for x in body.split(","))):
            key, _, val = (p.strip() for p in item.partition("="))
            nxt = int(val) if val else nxt
            vals[key] = nxt
            nxt += 1
        out[name] = vals
    return out


def _norm(s: str) -> str:
    return re.sub(r"[_\-]", "", s).lower()


def _as_python(enum: dict[str, int], prefix: str) -> dict[str, int]:
    out = {}
    for key, val in enum.items():
        bare = key[len(prefix):] if key.startswith(prefix) else key
        out[_norm(ALIASES.get(bare, bare))] = val
    return out


def test_option_codes_equal_the_cpp_enums():
    e = _enums()
    tables = {"Level": O.LEVEL, "Surrogate": O.SURROGATE, "MismatchMode": O.MISMATCH_MODE,
              "LossAgg": O.LOSS_AGG, "KL": O.KL}
    for enum, table in tables.items():
        assert _as_python(e[enum], "k") == {_norm(k): v for k, v in table.items()}, enum


def test_option_and_stat_order_equal_the_cpp_enums():
    e = _enums()
    for enum, prefix, names, count in (("IOpt", "kI", O.IOPTS, "kINumIOpts"), ("FOpt", "kF", O.FOPTS, "kFNumFOpts"),
                                       ("Stat", "kS", METRIC_KEYS + ("InvD",), "kNumStats")):
        vals = dict(e[enum])
        n = vals.pop(count)
        assert n == len(names), enum
        assert _as_python(vals, prefix) == {_norm(k): i for i, k in enumerate(names)}, enum


def test_kernel_options_follow_the_table():
    cfg = O.LossConfig(ratio_level="chunk", mismatch_level="none", kl_beta=0.1, kl_estimator="k2", positive_only=True)
    io, fo = O.kernel_options(cfg, 5.0)
    i = dict(zip(O.IOPTS, io))
    assert (i["ratio_level"], i["mismatch_level"], i["kl"], i["positive_only"]) == (2, 3, 2, 1)
    assert i["has_normalizer"] == 1 and dict(zip(O.FOPTS, fo))["normalizer"] == 5.0
    assert i["adv_estimator"] == O.ADV_GIVEN  # advantages given unless the in-pass inputs are
    # the estimator and its eps come with the in-pass inputs (algo.advantage, algo.adv_eps), not the loss config
    assert "AdvNorm" not in _enums() and "adv_eps" not in O.LossConfig.model_fields


def test_in_pass_codes_equal_the_cpp_enums():
    """The in-pass estimator codes and the columns of the step's group table (group_adv.py)."""
    e = _enums()
    assert _as_python(e["AdvEstimator"], "k") == {"advgiven": O.ADV_GIVEN, **{_norm(k): v for k, v in IN_PASS.items()}}
    cols = dict(e["GroupStat"])
    assert cols.pop("kNumGroupStats") == len(GROUP_STATS)
    assert _as_python(cols, "kG") == {_norm(k): i for i, k in enumerate(GROUP_STATS)}
