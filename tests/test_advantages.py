"""The advantage estimators (arl/algo/advantages.py) against plain-Python references, the registry's
one-function extension, and the ``algo`` config section that chooses them."""
import math
import random

import numpy as np
import pytest

from arl.algo.advantages import ESTIMATORS, group_advantages, register_estimator
from arl.config import AlgoConfig, ConfigError, load_config
from estimator_ref import groups_of, ref


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "none"])
@pytest.mark.parametrize("seed", range(5))
def test_estimators_match_plain_python(name, seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    groups = [rng.randint(0, 6) * 7 - 3 for _ in range(n)]  # any integers name a group
    rewards = [rng.choice([0.0, 1.0, 0.5, rng.uniform(-2, 2)]) for _ in range(n)]
    adv, zero_var, G = group_advantages(rewards, groups, name, 1e-6)
    assert adv.dtype == np.float64
    assert adv.tolist() == pytest.approx(ref(name, rewards, groups, 1e-6), rel=1e-12, abs=1e-12)
    members = groups_of(groups)
    assert G == len(members)
    assert zero_var == sum(max(rewards[i] for i in m) == min(rewards[i] for i in m) for m in members.values())


def test_grpo_eps_is_in_the_denominator():
    # std of (0, 1) with Bessel's correction is sqrt(0.5); eps large enough that dropping it shows
    adv, _, _ = group_advantages([0.0, 1.0], [0, 0], "grpo", 0.5)
    want = 0.5 / (math.sqrt(0.5) + 0.5)
    assert adv.tolist() == pytest.approx([-want, want], rel=1e-15)


def test_rloo_hand_numbers():
    adv, _, _ = group_advantages([1.0, 0.0, 0.0, 1.0, 1.0], [0, 0, 0, 1, 1], "rloo", 1e-6)
    assert adv.tolist() == pytest.approx([1.0, -0.5, -0.5, 0.0, 0.0])


def test_bad_rewards_fail_in_one_line():
    with pytest.raises(ValueError, match="rewards: non-finite value nan at index 1"):
        group_advantages([0.0, float("nan")], [0, 0], "grpo", 1e-6)
    with pytest.raises(ValueError, match="algo.advantage: unknown estimator 'ppo'"):
        group_advantages([0.0], [0], "ppo", 1e-6)
    with pytest.raises(ValueError, match="is a critic estimator"):
        group_advantages([0.0], [0], "gae", 1e-6)


def test_an_estimator_is_one_function_and_one_line():
    @register_estimator("test_max_baseline")
    def max_baseline(r, g, eps):
        """R - the group's best reward."""
        best = np.full(int(g.max()) + 1, -np.inf)
        np.maximum.at(best, g, r)
        return r - best[g]

    try:
        cfg = load_config("configs/tiny_cpu.yaml", ["algo.advantage=test_max_baseline"])
        assert cfg.algo.advantage == "test_max_baseline"
        adv, _, _ = group_advantages([1.0, 0.0, 0.5], [4, 4, 4], cfg.algo.advantage, cfg.algo.adv_eps)
        assert adv.tolist() == [0.0, -1.0, -0.5]
    finally:
        del ESTIMATORS["test_max_baseline"]


def test_algo_section():
    cfg = load_config("configs/tiny_cpu.yaml")
    assert cfg.algo == AlgoConfig() and cfg.algo.objective_name(False) == "policy_gradient"
    assert cfg.algo.objective_name(True) == "ipa"
    for ov, msg in {"algo.advantage=ppo": "algo.advantage: .*unknown estimator 'ppo'",
                    "algo.adv_eps=0": "algo.adv_eps",
                    "algo.objective=ipa": "algo.objective: 'ipa' needs stabilizers.ipa.enabled true"}.items():
        with pytest.raises(ConfigError, match=msg) as e:
            load_config("configs/tiny_cpu.yaml", [ov])
        assert "\n" not in str(e.value)


def test_old_keys_name_their_replacement():
    for ov, new in (("loss.adv_norm=group_std", "algo.advantage"), ("loss.adv_eps=1e-6", "algo.adv_eps"),
                    ("critic.enabled=true", "algo.advantage: gae")):
        with pytest.raises(ConfigError, match=f"moved to {new}"):
            load_config("configs/tiny_cpu.yaml", [ov])
