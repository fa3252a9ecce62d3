"""Planted-bug tests (issue #54) for the config checks, ``share_prefix``'s resolution and report, and
the shared-prefix layout's compute estimate.  Expectations written out by hand."""
import numpy as np
import pytest

from arl.config import ConfigError, load_config
from arl.data.packer import PackerConfig, pack_step
from arl.data.prefix_tree import build_layout, layout_compute
from arl.data.share_report import share_report
from arl.layout import _share_prefix_line

from test_share_report import _traj

GPU = "configs/qwen2.5-7b_8gpu.yaml"


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_gae_refuses_a_loss_agg_other_than_token_mean(agg):
    """Plant: gae accepting a ``loss_agg`` other than token-mean (the critic's per-chunk segments
    change a sequence-level mean).  Turn credit is off so that its own check cannot answer instead."""
    with pytest.raises(ConfigError, match=rf"algo.advantage: gae needs .* loss.loss_agg token-mean \(got chunk, chunk, "
                                          rf"{agg}\)") as e:
        load_config(None, ["algo.advantage=gae", f"loss.loss_agg={agg}", "stabilizers.turn_credit.enabled=false"])
    assert "\n" not in str(e.value)
    load_config(None, ["algo.advantage=gae", "loss.loss_agg=token-mean", "stabilizers.turn_credit.enabled=false"])


@pytest.mark.parametrize("attn", ["auto", "varlen_sdpa"])
def test_share_prefix_auto_stays_off_on_gpu_whatever_the_attention(attn):
    """Plant: ``share_prefix: auto`` turning on for GPU layouts (the GPU test config's
    flash_attention_2 has no shared-prefix path, so only an attention that has one tells)."""
    cfg = load_config(GPU, [f"model.attn_implementation={attn}"])
    assert cfg.shares_prefix() is False
    assert _share_prefix_line(cfg) == "off (auto: GPU: not measured there yet)"
    assert load_config(GPU, [f"model.attn_implementation={attn}", "trainer.share_prefix=true"]).shares_prefix() is True


def test_a_split_group_with_different_prompts_is_reported_by_its_prompts():
    """Plant: the share report's fallback reason wrong (a group split over micro-batches whose
    members share no prefix anyway was blamed on the split).  Each member starts with its own token,
    so they share 0 leading tokens; one sequence fills a micro-batch (budget 60, 50 tokens each)."""
    rng = np.random.default_rng(3)
    trajs = [_traj(np.concatenate([[k], rng.integers(0, 64, 49)]), 0) for k in range(3)]
    packed = pack_step(trajs, PackerConfig(token_budget=60, share_prefix=True))
    assert packed.split_groups == [0]
    assert share_report(packed, 16)["reasons"] == ["group 0: its 3 sequences share 0 leading tokens (< min_shared 16)"]


def test_layout_compute_counts_the_prefix_in_every_childs_attention():
    """Plant: the shared-prefix layout's compute estimate counting the attention to the prefix once
    (l * P instead of 2 l P).  Two sequences of 30 tokens sharing their first 20: the prefix costs
    20 + c 20^2, each child 10 + c (10^2 + 2 * 10 * 20) -- the 30-token sequences' 2 (30 + c 900)
    less the 20 + c 400 computed once: 40 + 1400 c = 54 at c = 0.01."""
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 64, 20)
    seqs = [np.concatenate([prefix, rng.integers(100, 164, 10)]), np.concatenate([prefix, rng.integers(200, 264, 10)])]
    layout = build_layout(seqs, 16)
    assert layout.seg_bounds.tolist() == [0, 20, 30, 40]
    assert layout_compute(layout, 0.01) == pytest.approx(54.0, rel=1e-12)
    assert layout_compute(layout, 0.0) == pytest.approx(40.0, rel=1e-12)
    # the packer balances ranks on the same figure
    packed = pack_step([_traj(s, 0) for s in seqs], PackerConfig(token_budget=100, share_prefix=True, attn_coef=0.01))
    assert packed.rank_compute == [pytest.approx(54.0, rel=1e-12)]
