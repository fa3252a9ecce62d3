"""Ulysses sequence parallelism (arl/model/ulysses.py): the sharded packed forward on 2 gloo ranks
equals the unsharded one, values and parameter gradients, with sequences split across the shard
boundary and grouped-query heads that do and do not split over the ranks."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from arl.model.ulysses import plan_shard

# the 2-rank cases share one spawned group (the module fixture): keep them on one pytest worker
pytestmark = pytest.mark.xdist_group("ulysses")



def tiny_qwen(num_key_value_heads: int = 2):
    """tests/two_rank.py's tiny Qwen2 (4 query heads) with ``num_key_value_heads`` kv heads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=num_key_value_heads, intermediate_size=64, max_position_embeddings=256)
    return Qwen2ForCausalLM(cfg).float()


def test_plan_shard_pads_to_equal_shards():
    cu = torch.tensor([0, 5, 12, 13])
    a, b = plan_shard(cu, 2, 0), plan_shard(cu, 2, 1)
    assert (a.padded, a.local, a.start, a.real) == (14, 7, 0, 7)
    assert (b.start, b.stop, b.real) == (7, 14, 6)
    assert b.cu_seqlens.tolist() == [0, 5, 12, 13, 14]  # the pad token: a sequence of its own
    assert plan_shard(torch.tensor([0, 6, 12]), 3, 2).cu_seqlens.tolist() == [0, 6, 12]
    with pytest.raises(ValueError, match="rank 2 of 2"):
        plan_shard(cu, 2, 2)


def test_inner_attention_is_flash_where_it_runs(monkeypatch):
    """Between the all-to-alls: arl's varlen SDPA on CPU; flash-attn's varlen kernel where
    ``attn: auto`` would pick it, given the padded batch's int32 cu_seqlens and its longest
    sequence.  (flash-attn itself runs only on a GPU: the call is checked here with a stand-in
    that computes the same attention.)"""
    import transformers.integrations.flash_attention as fa

    from arl.model import ulysses
    from arl.model.packed import _varlen_sdpa_attention

    assert ulysses.inner_attention(torch.device("cpu")) is ulysses._sdpa_inner
    monkeypatch.setattr(ulysses, "_flash_available", lambda d: True)
    assert ulysses.inner_attention(torch.device("cpu")) is ulysses._flash_inner
    seen = {}

    def stand_in(module, q, k, v, mask, cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None,
                 max_length_k=None, **kw):
        seen.update(dtype=cu_seq_lens_q.dtype, same=cu_seq_lens_k is cu_seq_lens_q, longest=(max_length_q, max_length_k))
        return _varlen_sdpa_attention(module, q, k, v, mask, cu_seq_lens_q=cu_seq_lens_q, **kw)

    monkeypatch.setattr(fa, "flash_attention_forward", stand_in)
    module = torch.nn.Module()
    q, k, v = (torch.randn(1, 2, 9, 4) for _ in range(3))
    cu = torch.tensor([0, 2, 7, 9])
    want, _ = ulysses._sdpa_inner(module, q, k, v, None, cu, dropout=0.0, scaling=None)
    got, _ = ulysses._flash_inner(module, q, k, v, None, cu, dropout=0.0, scaling=None)
    assert seen == {"dtype": torch.int32, "same": True, "longest": (5, 5)}
    torch.testing.assert_close(got, want)


def test_heads_must_split():
    from arl.model.ulysses import check_heads

    with pytest.raises(ValueError, match=r"sequence_parallel: 3 must divide the model's attention heads \(4\)"):
        check_heads(tiny_qwen().config, 3)


def _batch():
    g = torch.Generator().manual_seed(1)
    lens = [9, 23, 4, 17]  # 53 tokens: the shards (27 each) split the second sequence
    ids = torch.randint(0, 64, (sum(lens),), generator=g)
    cu = torch.tensor([0] + lens).cumsum(0)
    return ids, cu


def _reference(kv_heads, ckpt=False):
    from arl.model.packed import packed_hidden_states

    model = tiny_qwen(num_key_value_heads=kv_heads)
    ids, cu = _batch()
    h = packed_hidden_states(model, ids, cu, attn="varlen_sdpa")
    w = torch.randn(h.shape, generator=torch.Generator().manual_seed(2))
    (h * w).sum().backward()
    return h.detach(), w, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


FORWARD_CASES = [(2, False), (1, False), (2, True)]  # (kv heads, gradient checkpointing); 1 kv head: expanded first


def _forward_case(rank, world, kv_heads, ckpt):
    """This rank's hidden states, and (rank 0) the parameter gradients summed over the ranks."""
    import torch.distributed as dist

    from arl.model.ulysses import sp_hidden_states

    model = tiny_qwen(num_key_value_heads=kv_heads)
    if ckpt:  # the layers' forward runs again in backward, all-to-alls included
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    ids, cu = _batch()
    shard = plan_shard(cu, world, rank)
    h = sp_hidden_states(model, ids, cu, shard)
    _, w, _ = _reference(kv_heads)
    (h[:shard.real] * w[shard.start:shard.start + shard.real]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():  # each rank holds its tokens' share of the gradient
        dist.all_reduce(g)
    # numpy: pickled by value (a tensor would travel as a shared-memory handle that dies with this process)
    return h[:shard.real].detach().numpy(), {n: g.numpy() for n, g in grads.items()} if rank == 0 else None


def _worker(rank, world, port, q):
    """Every case of this module on one SP group: the forward cases (2 ranks), then the loss levels."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        out = {"forward": {c: _forward_case(rank, world, *c) for c in FORWARD_CASES}} if world == 2 else {}
        out["loss"] = _loss_levels(rank, world)
        q.put((rank, out, None))
    except BaseException as e:  # the parent reads the cause instead of waiting out its timeout
        q.put((rank, None, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


def _run_ranks(world: int) -> dict:
    """``world`` spawned ranks of ``_worker``: {rank: its results}; their errors when one failed."""
    from arl.procs import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = {r: (out, err) for r, out, err in (q.get(timeout=240) for _ in procs)}
    assert all(out is not None for out, _ in got.values()), [err for _, err in got.values()]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return {r: out for r, (out, _) in got.items()}


@pytest.fixture(scope="module")
def two_ranks():
    return _run_ranks(2)


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads,ckpt", FORWARD_CASES)
def test_two_rank_forward_and_gradients_equal_one_rank(kv_heads, ckpt, two_ranks):
    got = {r: two_ranks[r]["forward"][(kv_heads, ckpt)] for r in (0, 1)}
    ref_h, _, ref_g = _reference(kv_heads)
    torch.testing.assert_close(torch.cat([torch.from_numpy(got[0][0]), torch.from_numpy(got[1][0])]), ref_h, rtol=1e-5, atol=1e-5)
    assert sorted(got[0][1]) == sorted(ref_g)
    for n, g in got[0][1].items():  # the suite's fp32 gradient tolerance: atol relative to the largest entry
        torch.testing.assert_close(torch.from_numpy(g), ref_g[n], rtol=1e-4, atol=1e-5 * float(ref_g[n].abs().max()),
                                   msg=lambda m: f"{n}: {m}")


# ------------------------------------------------------------------ the loss over a split batch
LEVELS = [("token", "ppo_clip"), ("sequence", "ppo_clip"), ("chunk", "ppo_clip")]


def _loss_inputs(T, cu):
    """Chunk ids (model turns of 1-7 tokens between observations), per-sequence advantages, and old
    logprobs a little off the current ones, all fixed by seeds."""
    import numpy as np

    from two_rank import random_chunk_ids

    rng = np.random.default_rng(3)
    bounds = cu.tolist()
    parts, base = [], 0
    for a, b in zip(bounds[:-1], bounds[1:]):  # chunk ids rise through the packed batch
        c = random_chunk_ids(rng, b - a)
        parts.append(np.where(c >= 0, c + base, -1))
        base += int(c.max()) + 1
    chunks = torch.from_numpy(np.concatenate(parts))
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])
    noise = torch.randn(T, generator=torch.Generator().manual_seed(4)) * 0.05
    return chunks, adv, noise


def _loss(logp, cu, level, surrogate):
    from arl.ops.policy_loss import LossConfig, policy_loss

    chunks, adv, noise = _loss_inputs(logp.shape[0], cu)
    old = (logp.detach() + noise).masked_fill(chunks < 0, 0.0)
    cfg = LossConfig(ratio_level=level, surrogate=surrogate, clip_high=0.28)
    return policy_loss(logp, old, advantages=adv, cu_seqlens=cu.int(), chunk_ids=chunks.int(), config=cfg).loss


def _loss_reference(level, surrogate):
    from arl.model.packed import packed_logprobs

    model = tiny_qwen(2)
    ids, cu = _batch()
    logp, _ = packed_logprobs(model, ids, cu, attn="varlen_sdpa")
    loss = _loss(logp, cu, level, surrogate)
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _loss_levels(rank, world):
    """(rank 0) every level's loss and parameter gradients summed over the ranks."""
    import torch.distributed as dist

    from arl.model.ulysses import sp_logprobs

    out = {}
    for level, surrogate in LEVELS:
        model = tiny_qwen(2)
        ids, cu = _batch()
        logp, _ = sp_logprobs(model, ids, cu, plan_shard(cu, world, rank))
        loss = _loss(logp, cu, level, surrogate)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        for g in grads.values():
            dist.all_reduce(g)
        out[level] = (float(loss), {n: g.numpy() for n, g in grads.items()})
    return out if rank == 0 else {}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_loss_over_a_split_batch_equals_one_rank(world, request):
    """A chunk and a sequence straddle a shard boundary (the second sequence spans tokens 9-31; SP=2:
    shards 0-26 and 27-53; SP=4, 4 processes, 2 kv heads over 4 ranks: 0-13, 14-27, 28-41, 42-55 of
    the batch padded to 56): token, sequence (GSPO) and chunk (IPA) ratio levels."""
    loss_out = (request.getfixturevalue("two_ranks") if world == 2 else _run_ranks(world))[0]["loss"]
    chunks, _, _ = _loss_inputs(*_batch()[0].shape, _batch()[1])
    local = plan_shard(_batch()[1], world, 0).local
    cuts = [local * k for k in range(1, world)]  # the first token of each shard after the first
    assert any(chunks[c - 1] >= 0 and chunks[c - 1] == chunks[c] for c in cuts), "no chunk straddles a shard boundary"
    for level, surrogate in LEVELS:
        loss, grads = loss_out[level]
        ref_loss, ref_g = _loss_reference(level, surrogate)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7), level
        assert sorted(grads) == sorted(ref_g)
        for n, g in grads.items():
            torch.testing.assert_close(torch.from_numpy(g), ref_g[n], rtol=1e-4,
                                       atol=1e-5 * float(ref_g[n].abs().max()), msg=lambda m: f"{level} {n}: {m}")
