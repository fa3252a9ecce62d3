"""The trainer step with ``trainer.share_prefix`` equals the unshared step (issue 38, acceptance 3):
loss, metrics and every parameter's gradient, for turn credit (policy_gradient with per-chunk
segments and the grad-in-forward head), IPA (imitation + chunk-level RL, the groups sharing the
expert prefix including trained tokens) and the critic (value head on the trunk; ``critic.model:
separate`` in the slow tier).

Fast: the step's arithmetic (objective.begin_step -> forward -> objective.loss -> backward ->
end_step, as ``PolicyTrainer.rl_step`` runs it) on the tiny Qwen2 in float64, rtol 1e-6.
Slow: ``PolicyTrainer.rl_step`` itself on 2 gloo ranks, ZeRO 0, 2 and 3, fp32 (loss and metrics
rtol 1e-5; gradients rtol 1e-4 with atol 1e-5 of the tensor's largest entry, as
tests/test_shared_prefix_forward.py: the shared prefix sums its suffixes' gradients before a layer,
the unshared step after it)."""
import os
from collections import defaultdict

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from arl.config import AlgoConfig, CriticConfig, OptimConfig, StabilizerConfig
from arl.data import Trajectory, TrajectoryStatus
from arl.data.packer import PackerConfig, pack_step
from arl.model.shared_prefix import micro_batch_logprobs
from arl.ops.policy_loss import LossConfig
from arl.stabilizers import Stabilizers
from arl.algo.objectives import Forward, make_objective

from test_shared_prefix_forward import F32, F64, assert_grad_close, float64_norms  # noqa: F401 (fixture)
from two_rank import tiny_qwen

LOSS = LossConfig(ratio_level="chunk", gamma=0.95, clip_high=0.28, loss_agg="token-mean")
CRITIC = CriticConfig(gamma=0.97, lam=0.9, lr_mult=3.0, value_coef=0.5, clip=0.2)
SYS, PROMPT, BUDGET = 24, 18, 160
KINDS = {  # name -> (objective, stabilizers, algo, critic config)
    "turn_credit": ("policy_gradient", dict(turn_credit=dict(enabled=True)), None, None),
    "ipa": ("ipa", dict(ipa=dict(enabled=True)), None, None),
    "critic": ("critic", dict(turn_credit=dict(enabled=True)), AlgoConfig(advantage="gae"), CRITIC),
    "critic_separate": ("critic", dict(turn_credit=dict(enabled=True)), AlgoConfig(advantage="gae"),
                        CRITIC.model_copy(update={"model": "separate"})),
}


def tree_trajectories(seed=0, groups=3, group=4, ipa=False):
    """Calculator-shaped trajectories on the tiny vocabulary: [system ; group prompt ; model turn
    (chunk 0) ; observation ; model turn (chunk 1)], the system block shared by the batch, the
    prompt by the group; with ``ipa`` the first model turn and its observation are the group's
    expert prefix (the same tokens in every member: trained tokens inside a shared prefix).  One
    member is MASKED (a group of its own, nothing trained) and one sequence shares nothing."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 64, SYS)
    out = []

    def turn(n):
        return rng.integers(0, 64, n)

    for g in range(groups):
        prompt = turn(PROMPT)
        expert = (turn(int(rng.integers(4, 9))), turn(int(rng.integers(2, 5))))
        for k in range(group):
            t0, obs = expert if ipa else (turn(int(rng.integers(4, 9))), turn(int(rng.integers(2, 5))))
            t1 = turn(int(rng.integers(4, 12)))
            tokens = np.concatenate([system, prompt, t0, obs, t1])
            chunk = np.concatenate([np.full(SYS + PROMPT, -1), np.zeros(len(t0)), np.full(len(obs), -1),
                                    np.ones(len(t1))]).astype(np.int32)
            meta = {"turn_info": [{"new_state": bool(rng.random() > 0.5)} for _ in range(2)]}
            if ipa:
                meta.update({"ipa_prefix_chunks": 1, "ipa_imitate": k == 0})
            out.append(Trajectory(tokens=tokens, chunk_ids=chunk,
                                  rollout_logp=(-4.2 + 0.5 * rng.normal(size=len(tokens))).astype(np.float32),
                                  reward=float(rng.random() > 0.5), group_id=g,
                                  status=TrajectoryStatus.MASKED if (g, k) == (1, 2) else TrajectoryStatus.OK,
                                  metadata=meta))
    L = 30  # shares nothing: its first token differs from the system block's
    tokens = (system[0] + 1 + rng.integers(0, 63, L)) % 64
    chunk = np.concatenate([np.full(10, -1), np.zeros(8), np.full(4, -1), np.ones(8)]).astype(np.int32)
    meta = {"turn_info": [{"new_state": True}] * 2}
    if ipa:
        meta.update({"ipa_prefix_chunks": 1, "ipa_imitate": False})
    out.append(Trajectory(tokens=tokens, chunk_ids=chunk, rollout_logp=np.full(L, -4.2, np.float32), reward=1.0,
                          group_id=groups, metadata=meta))
    return out


def step_batches(kind: str, share: bool, world: int = 1, seed: int = 0):
    """(the packed ranks, the loss config) of one step of ``kind`` as rank 0 makes it."""
    _, stab_cfg, algo, _ = KINDS[kind]
    stab = Stabilizers(StabilizerConfig(**stab_cfg), LOSS, algo=algo)
    loss_cfg = stab.loss_config(0)
    prep = stab.prepare(tree_trajectories(seed, ipa=kind == "ipa"), loss_cfg)
    packed = pack_step(prep.trajectories, PackerConfig(token_budget=BUDGET, num_ranks=world, share_prefix=share),
                       loss_cfg, advantages=prep.advantages)
    stab.apply(packed, prep, loss_cfg)
    return packed, loss_cfg


def _step(model, objective, mbs, loss_cfg):
    """``PolicyTrainer.rl_step``'s arithmetic on one process without DeepSpeed (any dtype): loss,
    metrics (averaged over the micro-batches as ``_finish_step`` does) and parameter gradients."""
    model.zero_grad()
    metrics, applied = defaultdict(list), []
    begin = objective.begin_step(mbs, None, "cpu")
    for mb in mbs:
        if mb.is_empty:
            continue
        plan = objective.head_grad(mb, loss_cfg, None, 1.0, "cpu")
        logp, ent, *hidden = micro_batch_logprobs(model, mb, "cpu", with_entropy=True,
                                                  return_hidden=objective.needs_hidden, head_grad=plan)
        applied.append(plan is not None and plan.applied)
        fwd = Forward(logp, ent, logp.detach(), None, hidden[0] if hidden else None, None)
        out = objective.loss(mb, fwd, loss_cfg, "cpu")
        out.total.backward()
        metrics["loss"].append(float(out.loss.detach()) * len(mbs))
        for k, v in out.metrics.items():
            metrics[k].append(float(v))
    res = {k: sum(v) / len(v) for k, v in metrics.items()}
    res.update({**begin, **objective.end_step("cpu")})
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return res, grads, applied


def assert_metrics_equal(on: dict, off: dict, rel: float):
    assert set(on) == set(off)
    for k, v in off.items():
        if np.isnan(v):
            assert np.isnan(on[k]), k
        else:
            assert on[k] == pytest.approx(v, rel=rel, abs=1e-12), k


def _run(kind, mbs, loss_cfg):
    name, _, _, critic = KINDS[kind]
    model = tiny_qwen().double()
    objective = make_objective(name, "reference", critic)
    objective.prepare_model(model, 1e-2)
    if critic is not None:  # a zero head gives V = 0 everywhere: move it so the values enter the loss
        with torch.no_grad():
            for p in model.arl_value_head.parameters():
                p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype))
    return _step(model, objective, mbs, loss_cfg)


def unshared(mbs):
    """The same micro-batches without their shared-prefix layouts (the ordinary forward)."""
    from dataclasses import replace

    return [replace(mb, tree=None) for mb in mbs]


@pytest.mark.parametrize("kind", ["turn_credit", "ipa", "critic"])
def test_step_with_share_prefix_equals_the_unshared_step_float64(kind, float64_norms):
    shared, loss_cfg = step_batches(kind, True)
    plain, _ = step_batches(kind, False)
    mbs = shared.ranks[0]
    assert sum(mb.tree is not None for mb in mbs) >= 2 and len(mbs) >= 2, [mb.tree is not None for mb in mbs]
    assert not any(mb.tree is not None for mb in plain.ranks[0])
    assert shared.normalizer == plain.normalizer
    assert sum(shared.rank_computed_tokens) < sum(plain.rank_computed_tokens) == plain.num_tokens
    m_on, g_on, a_on = _run(kind, mbs, loss_cfg)
    m_off, g_off, a_off = _run(kind, unshared(mbs), loss_cfg)  # the same micro-batches, ordinary forward
    m_pl, g_pl, _ = _run(kind, plain.ranks[0], loss_cfg)  # ordinary packing (other micro-batches)
    if kind == "turn_credit":  # the grad-in-forward head runs in both steps
        assert all(a_off) and all(a_on), (a_off, a_on)
    assert_metrics_equal(m_on, m_off, 1e-6)
    # packed without sharing, the micro-batches hold other sequences: the step's loss and its
    # step-wide figures (the critic's value/*) are the same; the per-micro-batch means are not
    # (they follow the packing, as with any other micro_batch_tokens)
    step_wide = [k for k in m_pl if k == "loss" or k.startswith("value/")]
    assert_metrics_equal({k: m_on[k] for k in step_wide}, {k: m_pl[k] for k in step_wide}, 1e-6)
    assert set(g_on) == set(g_off) == set(g_pl) and g_off
    for n, g in g_off.items():
        assert float(g.abs().max()) > 0, n
        assert_grad_close(g_on[n], g, F64, n)
        assert_grad_close(g_on[n], g_pl[n], F64, n)



def test_micro_batch_hidden_states_over_the_layout(float64_norms):
    """The separate critic's trunk reads the micro-batch's hidden states over its layout: the packed
    forward's, float64 rtol 1e-6."""
    from arl.model.packed import packed_hidden_states
    from arl.model.shared_prefix import micro_batch_hidden_states

    model = tiny_qwen().double()
    model.set_output_embeddings(torch.nn.Identity())  # as critic_model.py: no lm_head
    mbs = [mb for mb in step_batches("critic", True)[0].ranks[0] if mb.tree is not None]
    assert mbs
    for mb in mbs:
        got = micro_batch_hidden_states(model, mb, "cpu")
        want = packed_hidden_states(model, mb.token_ids, mb.cu_seqlens)
        torch.testing.assert_close(got, want, **F64)

# ------------------------------------------------------------------ slow: the real step, 2 ranks
STAGES = (0, 2, 3)
VARIANTS = ("on", "off", "plain")  # shared layouts; the same micro-batches without; ordinary packing


def _rank_batches(kind, world, rank):
    shared, loss_cfg = step_batches(kind, True, world)
    plain, _ = step_batches(kind, False, world)
    return {"on": shared.ranks[rank], "off": unshared(shared.ranks[rank]), "plain": plain.ranks[rank]}, loss_cfg


def _grad_log(modules: dict) -> dict:
    """Each parameter's rank-local gradient (before DeepSpeed reduces it), summed over backwards."""
    sums = {}
    for prefix, module in modules.items():
        for n, p in module.named_parameters():
            if p.requires_grad:
                p.register_hook(lambda g, n=f"{prefix}{n}": sums.__setitem__(n, sums.get(n, 0) + g.detach().clone()))
    return sums


def _two_rank_worker(rank, world, port, result_dir):
    import faulthandler

    faulthandler.enable(all_threads=True)
    from arl.trainer import PolicyTrainer
    from arl.trainer.dist import init_distributed, set_rank_env
    from arl.trainer.rank import update_on_batch

    set_rank_env(rank, world, port)
    init_distributed("cpu")
    res = {}
    for stage in STAGES:
        for kind, (name, _, _, critic) in KINDS.items():
            if kind == "critic_separate" and stage == 2:
                continue  # ZeRO 0 and 3 bracket it (its engine is the policy's kind)
            batches, loss_cfg = _rank_batches(kind, world, rank)
            for variant in VARIANTS:
                tr = PolicyTrainer(tiny_qwen(), optim=OptimConfig(lr=1e-2, grad_clip=1e6), zero_stage=stage,
                                   total_steps=10, objective=name, critic=critic)
                sep = getattr(tr.objective, "separate", None)
                grads = _grad_log({"": tr.module, **({"critic.": sep.engine.module} if sep is not None else {})})
                m = update_on_batch(tr, batches[variant], loss_cfg, updates=1)
                res[(stage, kind, variant)] = {"m": m, "g": grads, "trees": [mb.tree is not None
                                                                             for mb in batches[variant]]}
    torch.save(res, os.path.join(result_dir, f"rank{rank}.pt"))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    from arl.procs import exit_process

    exit_process(0)


@pytest.mark.slow
def test_rl_step_share_prefix_two_ranks_zero_0_2_3(tmp_path):
    from arl.procs import free_port

    mp.spawn(_two_rank_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    keys = sorted({(s, k) for s, k, _ in ranks[0]})
    assert len(keys) == len(STAGES) * len(KINDS) - 1
    for stage, kind in keys:
        tag = f"ZeRO-{stage} {kind}"
        per = [{v: r[(stage, kind, v)] for v in VARIANTS} for r in ranks]
        assert any(t for p in per for t in p["on"]["trees"]), tag
        for p in per:  # each rank: its own micro-batches with and without their layouts
            on, off = p["on"], p["off"]
            assert_metrics_equal(on["m"], off["m"], 1e-5)
            if kind == "turn_credit":
                assert on["m"]["head_grad_in_forward"] == off["m"]["head_grad_in_forward"] == 1.0, tag
            assert set(on["g"]) == set(off["g"]) and off["g"], tag
            for n, g in off["g"].items():
                assert_grad_close(on["g"][n], g, F32, f"{tag} {n}")
        # ordinary packing puts other sequences on each rank: the step's global figures agree
        on, plain = (per[0][v]["m"] for v in ("on", "plain"))
        step_wide = [k for k in plain if k == "grad_norm" or k.startswith("value/")]
        assert_metrics_equal({k: on[k] for k in step_wide}, {k: plain[k] for k in step_wide}, 1e-5)
        loss = [sum(p[v]["m"]["loss"] for p in per) for v in ("on", "plain")]
        assert loss[0] == pytest.approx(loss[1], rel=1e-5), tag
        for n in per[0]["plain"]["g"]:
            g_on, g_plain = (sum(p[v]["g"][n] for p in per) for v in ("on", "plain"))
            assert_grad_close(g_on, g_plain, F32, f"{tag} summed over ranks {n}")
