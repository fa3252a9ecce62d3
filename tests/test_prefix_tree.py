"""Shared-prefix layout (arl/data/prefix_tree.py) and the packer's ``share_prefix``: each shared
prefix laid out once, every packed token mapped to its computed position, the head rows predicting
exactly the packed next tokens (the first token of a suffix from the last token of its prefix),
the micro-batch's loss tensors unchanged, and budget / balancing counting the computed tokens."""
import numpy as np
import pytest

from arl.data import Trajectory
from arl.data.packer import PackerConfig, estimated_compute, pack_step
from arl.data.prefix_tree import build_layout, computed_tokens, layout_compute

SYS, PROMPT = 20, 18  # batch-wide block, each group's own prompt


def tree_batch(seed=0, groups=2, group=3, vocab=64):
    """Sequences [system ; group prompt ; own turns] of ``groups`` groups, one sequence sharing
    nothing, one duplicate and one that is a prefix of another."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, SYS)
    seqs, gids = [], []
    for g in range(groups):
        prompt = rng.integers(0, vocab, PROMPT)
        for _ in range(group):
            seqs.append(np.concatenate([system, prompt, rng.integers(0, vocab, int(rng.integers(3, 12)))]))
            gids.append(g)
    seqs.append((system[0] + 1 + rng.integers(0, vocab - 1, 25)) % vocab)  # first token differs: shares nothing
    seqs.append(seqs[0].copy())
    seqs.append(seqs[1][: SYS + PROMPT + 2].copy())
    return seqs, gids + [groups, 0, 0]


def _check_maps(layout, seqs, trained=None):
    packed = np.concatenate(seqs)
    src = layout.src.numpy()
    assert src.shape == packed.shape
    np.testing.assert_array_equal(layout.token_ids.numpy()[src], packed)
    pos = np.concatenate([np.arange(len(s)) for s in seqs])
    np.testing.assert_array_equal(layout.position_ids.numpy()[src], pos)  # positions continue the prefix chain
    row = layout.head_row.numpy()
    last = np.cumsum([len(s) for s in seqs]) - 1
    assert (row[last] == -1).all()
    t = np.flatnonzero(row >= 0)
    assert t.size == packed.size - len(seqs)
    np.testing.assert_array_equal(layout.head_src.numpy()[row[t]], src[t])
    np.testing.assert_array_equal(layout.head_tgt.numpy()[row[t]], packed[t + 1])
    first = layout.head_first.numpy()
    np.testing.assert_array_equal(row[first], np.arange(first.size))
    pairs = len({(int(a), int(b)) for a, b in zip(src[t], packed[t + 1])})
    if trained is None:  # every (computed position, next token) pair is one row
        assert pairs == layout.head_src.numel()
    else:  # and a trained token's row is its own
        own = np.concatenate(trained)[t + 1]
        rows, counts = np.unique(row[t], return_counts=True)
        assert (counts[np.searchsorted(rows, row[t][own])] == 1).all()
        assert layout.head_src.numel() <= pairs + own.sum()


def test_two_level_tree_with_fallback_duplicate_and_contained_sequence():
    seqs, _ = tree_batch()
    layout = build_layout(seqs)
    _check_maps(layout, seqs)
    parent = layout.seg_parent.tolist()
    bounds = layout.seg_bounds.numpy()
    lens = bounds[1:] - bounds[:-1]
    assert parent[0] == -1 and lens[0] == SYS  # the batch-wide block, once
    groups = [s for s, p in enumerate(parent) if p == 0]
    assert sorted(lens[groups]) == [PROMPT, PROMPT]  # each group's prompt, once, under it
    assert all(p < s for s, p in enumerate(parent))  # a parent precedes its children
    assert parent.count(-1) == 2  # the system block and the sequence sharing nothing
    # own turns are shorter than min_shared: the duplicate's and the contained sequence's are repeated
    own = [len(s) - SYS - PROMPT for s in seqs[:6]]
    assert layout.num_tokens == SYS + 2 * PROMPT + sum(own) + 25 + own[0] + 2


def test_first_suffix_token_is_predicted_by_the_last_prefix_token():
    seqs, _ = tree_batch()
    layout = build_layout(seqs)
    starts = np.concatenate([[0], np.cumsum([len(s) for s in seqs])[:-1]])
    src, row = layout.src.numpy(), layout.head_row.numpy()
    for k in range(6):  # the group members: prefix of SYS + PROMPT tokens
        t = starts[k] + SYS + PROMPT - 1  # last token of the shared prefix in sequence k
        r = row[t]
        assert layout.head_tgt[r] == seqs[k][SYS + PROMPT]
        assert layout.head_src[r] == src[t] == src[starts[3 * (k // 3)] + SYS + PROMPT - 1]  # once per group
        assert layout.position_ids[src[t + 1]] == SYS + PROMPT


def test_trained_tokens_get_their_own_head_rows():
    """The duplicate and the contained sequence predict their first turn's tokens from the same
    computed positions as sequences 0 and 1: with those tokens trained, each keeps its own row."""
    seqs, _ = tree_batch()
    trained = [np.arange(len(s)) >= SYS + PROMPT for s in seqs]
    shared, own = build_layout(seqs), build_layout(seqs, trained=trained)
    _check_maps(own, seqs, trained)
    assert own.head_src.numel() > shared.head_src.numel()
    np.testing.assert_array_equal(own.src.numpy(), shared.src.numpy())
    assert (np.diff(own.head_first.numpy()) > 0).all()  # rows in packed order of first use


def test_no_shared_prefix_means_no_layout_and_min_shared_is_respected():
    rng = np.random.default_rng(1)
    seqs = [np.concatenate([[i], rng.integers(0, 64, 30)]) for i in range(4)]
    assert build_layout(seqs) is None
    assert computed_tokens(seqs) == sum(map(len, seqs))
    common = rng.integers(0, 64, 10)
    seqs = [np.concatenate([common, [i], rng.integers(0, 64, 5)]) for i in range(3)]
    assert build_layout(seqs, min_shared=11) is None  # 10 shared tokens: not worth a segment
    layout = build_layout(seqs, min_shared=10)
    assert layout.num_tokens == 10 + 3 * 6
    _check_maps(layout, seqs)
    with pytest.raises(ValueError, match="min_shared=0: must be >= 1"):
        build_layout(seqs, min_shared=0)


def test_random_trees_map_exactly():
    rng = np.random.default_rng(2)
    for _ in range(30):
        base = rng.integers(0, 4, 40)  # a small vocabulary: many accidental common prefixes
        seqs = [np.concatenate([base[: int(rng.integers(1, 40))], rng.integers(0, 4, int(rng.integers(0, 20)))])
                for _ in range(int(rng.integers(2, 9)))]
        layout = build_layout(seqs, min_shared=int(rng.integers(1, 6)))
        if layout is not None:
            _check_maps(layout, seqs)
            assert layout.num_tokens <= sum(map(len, seqs))


def test_layout_compute_is_the_unshared_estimate_minus_what_is_shared():
    seqs, _ = tree_batch()
    layout = build_layout(seqs, min_shared=1000)
    assert layout is None
    layout = build_layout(seqs)
    coef = 1e-3
    full = float(estimated_compute([len(s) for s in seqs], coef).sum())
    assert layout_compute(layout, coef) < full
    single = build_layout([seqs[0], seqs[0]])  # two identical sequences: one computed
    assert layout_compute(single, coef) == pytest.approx(float(estimated_compute([len(seqs[0])], coef).sum()))


def _trajs(seqs, gids):
    rng = np.random.default_rng(3)
    out = []
    for s, g in zip(seqs, gids):
        cid = np.full(len(s), -1, np.int32)
        cid[SYS + PROMPT:] = 0
        out.append(Trajectory(tokens=s, chunk_ids=cid, rollout_logp=rng.normal(-2, 0.5, len(s)).astype(np.float32),
                              reward=float(rng.integers(0, 2)), group_id=g))
    return out


def test_packer_keeps_the_loss_tensors_and_counts_computed_tokens():
    seqs, gids = tree_batch()
    trajs = _trajs(seqs, gids)
    adv = np.linspace(-1, 1, len(trajs))
    off = pack_step(trajs, PackerConfig(token_budget=4096), advantages=adv)
    on = pack_step(trajs, PackerConfig(token_budget=4096, share_prefix=True), advantages=adv)
    (a,), (b,) = off.ranks[0], on.ranks[0]
    for name in ("token_ids", "position_ids", "cu_seqlens", "chunk_ids", "rollout_logp", "rewards", "group_ids",
                 "advantages", "traj_indices"):
        np.testing.assert_array_equal(getattr(a, name).numpy(), getattr(b, name).numpy(), err_msg=name)
    assert a.normalizer == b.normalizer and a.tree is None
    assert b.tree is not None and b.computed_tokens == b.tree.num_tokens < b.num_tokens
    assert on.rank_computed_tokens == [b.computed_tokens] and off.rank_computed_tokens == [a.num_tokens]
    assert b.est_compute < a.est_compute
    sel = [seqs[i] for i in b.traj_indices.tolist()]
    _check_maps(b.tree, sel, [b.chunk_ids.numpy()[x:y] >= 0 for x, y in zip(b.cu_seqlens[:-1], b.cu_seqlens[1:])])


def test_budget_counts_computed_tokens():
    """A group of 4 x 60 tokens sharing a 50-token prompt: 240 tokens, 90 computed.  With a budget
    of 128 it stays in one micro-batch only when sharing."""
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 64, 50)
    seqs = [np.concatenate([prompt, [i], rng.integers(0, 64, 9)]) for i in range(4)]
    trajs = _trajs(seqs, [0] * 4)
    off = pack_step(trajs, PackerConfig(token_budget=128))
    on = pack_step(trajs, PackerConfig(token_budget=128, share_prefix=True))
    assert off.split_groups == [0] and on.split_groups == []
    (mb,) = on.ranks[0]
    assert mb.num_tokens == 240 and mb.computed_tokens == 90
