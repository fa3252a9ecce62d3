"""The group advantage estimators (arl/algo/advantages.py): the group normalization the policy-loss op
did itself before it took advantages as input, checked here instead (hand values, zero-variance
groups, the scalar spec of tests/scalar_loss.py, near-constant groups where eps matters)."""
import math

import numpy as np
import pytest
import torch

from arl.algo.advantages import group_advantages
from scalar_loss import scalar_group_advantages


def test_hand_values_of_each_estimator():
    r, g = [1.0, 0.0], [0, 0]
    a = 1 / math.sqrt(2)  # +-0.5 / std, std = sqrt(0.5) (Bessel)
    for est, eps, want in (("grpo", 0.0, [a, -a]), ("dr_grpo", 1e-6, [0.5, -0.5]), ("none", 1e-6, [1.0, 0.0]),
                           ("rloo", 1e-6, [1.0, -1.0])):
        adv, n_zero, n_groups = group_advantages(r, g, est, eps)
        assert adv.dtype == np.float64 and (n_zero, n_groups) == (0, 1)
        np.testing.assert_allclose(adv, want, rtol=0, atol=1e-15, err_msg=est)


@pytest.mark.parametrize("est", ["grpo", "dr_grpo"])
def test_zero_variance_group_gets_exactly_zero_advantage(est):
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.7, 0.2])
    adv, n_zero, n_groups = group_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1]), est, 1e-6)
    assert bool((adv[:3] == 0).all()) and bool((adv[3:] != 0).all())
    assert n_zero / n_groups == pytest.approx(0.5)
    one, n_zero, n_groups = group_advantages([0.4], [7], est, 1e-6)  # a group of one: no comparison
    assert one[0] == 0.0 and (n_zero, n_groups) == (1, 1)


@pytest.mark.parametrize("est", ["grpo", "dr_grpo", "none"])
@pytest.mark.parametrize("kind", ["binary", "normal"])
def test_matches_the_scalar_spec_with_any_group_ids(est, kind):
    rng = np.random.default_rng(0)
    N = 40
    rewards = (rng.random(N) > 0.5).astype(np.float64) if kind == "binary" else rng.standard_normal(N)
    gids = (np.arange(N) // 4)[rng.permutation(N)] * 7 - 3  # non-contiguous, negative ids
    adv, _, _ = group_advantages(torch.from_numpy(rewards), torch.from_numpy(gids), est, 1e-6)
    want, _ = scalar_group_advantages(rewards.tolist(), gids.tolist(), est, 1e-6)
    np.testing.assert_allclose(adv, want, rtol=1e-12, atol=1e-15)


def test_near_constant_groups_where_eps_matters():
    """Reward groups whose std is of the size of eps (1e-6), where eps is ~60% of the denominator,
    next to ordinary, zero-variance and one-member groups: float64 against the scalar spec, and eps
    visibly changes the advantages (a test of the test)."""
    groups = [[0.0, 0.0, 0.0, 1e-6], [1e-6, 0.0], [2.0, 2.0 + 2e-6, 2.0], [0.25], [0.5, 0.5], [0.0, 1.0, 0.0, 1.0]]
    rewards = [r for g in groups for r in g]
    gids = [i for i, g in enumerate(groups) for _ in g]
    for est in ("grpo", "dr_grpo"):
        adv, n_zero, n_groups = group_advantages(rewards, gids, est, 1e-6)
        want, _ = scalar_group_advantages(rewards, gids, est, 1e-6)
        np.testing.assert_allclose(adv, want, rtol=1e-12, atol=1e-18, err_msg=est)
        assert (n_zero, n_groups) == (2, 6)
    no_eps = group_advantages(rewards, gids, "grpo", 0.0)[0]
    with_eps = group_advantages(rewards, gids, "grpo", 1e-6)[0]
    assert abs(no_eps[3] - with_eps[3]) > 1e-2 * abs(with_eps[3])
