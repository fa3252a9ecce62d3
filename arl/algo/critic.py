"""The turn-level critic: a linear value head on the policy's final hidden state, trained with the
policy in the same backward (the ``critic`` objective, arl/algo/objectives.py; GAE over chunks:
arl/algo/advantages.py, its inputs arl/algo/gae.py).

Why a head on the shared trunk and not a separate critic model: the values are read from the hidden
states the policy's forward computes anyway, so the critic costs one [H] -> 1 projection per chunk
and H + 1 parameters (with their Adam state); no second model's weights, optimizer state, forward or
ZeRO partitioning.  The price is that the value loss's gradient also reaches the trunk, so its
weight (``critic.value_coef``) and the head's own learning rate (``critic.lr_mult``, a separate
param group) are the knobs that keep the critic from pulling the policy around.  ``critic.model:
separate`` puts the same head on a second trunk with its own optimizer instead
(arl/algo/critic_model.py); this class computes its values and loss all the same.

The head is a submodule of the Hugging Face model (``VALUE_HEAD``), so DeepSpeed wraps, partitions
(ZeRO-3), checkpoints and restores it with the policy and its optimizer state; it is taken out of
every whole-model state dict (``without_value_head``), so neither the weight sync to vLLM nor the HF
export ever sees it.  It starts at 0 (V = 0: identical on every rank, no seed to agree on).

Where a value is read: at the token just before a chunk's first token; its hidden state has read the
prompt, the earlier turns and their observations, i.e. exactly the context the chunk acts in.

Value loss (PPO's clipped form), per chunk with GAE target G = A + V_old:

    l = 0.5 * max((V - G)^2, (V_old + clip(V - V_old, -c, c) - G)^2)

summed over the step's chunks and divided by their number (all ranks, ``critic_points``'
normalizer).  With one update per batch V_old is the gradient pass's own value, detached (as the old
logprobs are), so the clip cannot bite on that update; with more updates the old pass gives V_old.

``whiten``: the chunks' GAE advantages are shifted and scaled to mean 0 and variance 1 over the whole
step (every rank's chunks, each chunk once), A' = (A - mean) / max(sqrt(var + 1e-8), whiten_min_std),
before the loss takes them; the value target stays G = A + V_old.  The step's mean and variance need every chunk's
old value before the first micro-batch's loss, so whitening always runs the old pass.  Why: with
raw advantages a head that lags the returns makes nearly every chunk's advantage positive, and one
that overshoots makes nearly every one negative; whitened, the step always pushes both ways.  The
floor (``whiten_min_std``, reward units) is for steps whose episodes all agree: their advantages are
the critic's bootstrap noise alone (std 0.005 on the long-horizon task's all-fail steps), which a
plain whitening scales up to unit advantages that push the policy at random.

Whether the critic learns (``step_metrics``): ``value/explained_var`` (1 - Var(G - V) / Var(G)),
calibration by turn index (``value/calib/turn{k}_pred`` vs ``_return``: the mean value and mean
return of the step's chunks at turn k; a head that only learned the average return is flat over k
while returns are not), and ``value/adv_outcome_corr``, Pearson's r between a chunk's GAE advantage
and its episode's return (near 0: the advantages do not tell winning episodes from losing ones).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..model.ulysses import ShardRows
from .advantages import gae

VALUE_HEAD = "arl_value_head"  # the head's submodule name on the policy (and its state-dict prefix)


def attach_value_head(model: torch.nn.Module) -> torch.nn.Linear:
    """Add the zero-initialized value head [H] -> 1 to ``model`` (before DeepSpeed wraps it)."""
    if hasattr(model, VALUE_HEAD):
        raise ValueError(f"model: already has a {VALUE_HEAD!r} submodule")
    hidden = getattr(model.config, "hidden_size", None)
    if not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"model.config.hidden_size: {hidden!r}; the value head needs the hidden width")
    p = next(model.parameters())
    head = torch.nn.Linear(hidden, 1, device=p.device, dtype=p.dtype)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    model.add_module(VALUE_HEAD, head)
    return head


def without_value_head(state: dict) -> dict:
    """A whole-model state dict without the head's entries: what weight sync and HF export take."""
    prefix = VALUE_HEAD + "."
    return {k: v for k, v in state.items() if not k.startswith(prefix)}


def param_groups(model: torch.nn.Module, lr: float, lr_mult: float) -> list:
    """The optimizer's two param groups: the policy at ``lr``, the value head at ``lr * lr_mult``."""
    head = {id(p) for p in getattr(model, VALUE_HEAD).parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trainable if id(p) not in head]},
            {"params": [p for p in trainable if id(p) in head], "lr": lr * lr_mult}]


# the per-step sums behind the value metrics, in this order (all-reduced once per step); "a", "o":
# the chunk's GAE advantage (whitened when on) and its episode's return, for their correlation
_SUMS = ("n", "v", "ret", "ret2", "res", "res2", "loss", "clipped", "a", "a2", "o", "o2", "ao")
WHITEN_EPS = 1e-8
CALIB_TURNS = 8  # calibration by turn index: turns 0..6 each, the last bucket holds turn 7 and later


def one_rank_sum(t: torch.Tensor, device) -> torch.Tensor:
    """The sum over ranks of one process: ``t`` itself.  The trainer hands the critic its own ``all_sum``
    (arl/trainer/dist.py, where every collective of the trainer goes) when it builds the critic."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("critic: a run on several ranks sums the step's statistics with the trainer's all_sum "
                         "(objective.critic.build(..., all_sum=...)), none was given")
    return t.clone()


class Critic:
    """The value head's part of one trainer step (``PolicyTrainer`` calls it per micro-batch)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.all_sum = one_rank_sum  # the trainer's collective, once built (critic_role.py)
        self._restart()
        self.white = None  # (mean, 1/std) of the step's raw GAE advantages, when whitening

    def _restart(self) -> None:
        self.sums = torch.zeros(len(_SUMS), dtype=torch.float64)
        self.calib = torch.zeros(3, CALIB_TURNS, dtype=torch.float64)  # per turn bucket: count, sum V, sum G

    def begin_step(self, mbs, old_values, device) -> dict:
        """Before a step's first loss: with ``whiten``, the mean and variance of the step's raw GAE
        advantages from the old pass's values (every rank; a collective, so every rank calls it).
        Returns the raw advantages' ``value/adv_raw_mean`` and ``value/adv_raw_std``."""
        self.white = None
        if not self.cfg.whiten:
            return {}
        if old_values is None:
            raise ValueError("critic.whiten: needs the step's old values before its first loss "
                             "(old_logprobs(mbs, values=[]) and rl_step(..., old_values=...))")
        s = torch.zeros(3, dtype=torch.float64)
        for mb, ov in zip(mbs, old_values):
            if ov is None or mb.critic is None or ov.numel() == 0:
                continue
            a, _ = gae(ov, mb.critic["rewards"], mb.critic["seq"], self.cfg.gamma, self.cfg.lam)
            s += torch.stack([torch.tensor(float(a.numel()), dtype=torch.float64), a.sum(), (a * a).sum()])
        n, tot, sq = self.all_sum(s, device).tolist()
        if n == 0:
            return {}
        mean = tot / n
        var = max(sq / n - mean * mean, 0.0)
        self.white = (mean, max(var + WHITEN_EPS, self.cfg.whiten_min_std ** 2) ** -0.5)
        return {"value/adv_raw_mean": mean, "value/adv_raw_std": var ** 0.5}

    def values(self, model, hidden: torch.Tensor, mb) -> torch.Tensor:
        """[P] values (float32, float64 for a float64 model) at the micro-batch's value points, with
        the graph; NaN/inf raise."""
        if mb.critic is None:
            raise ValueError("critic: the micro-batch has no value points (arl/algo/step.py attach_roles sets them under algo.advantage: gae)")
        head = getattr(model, VALUE_HEAD)
        if isinstance(hidden, ShardRows):  # sequence parallel: each rank its rows, summed over the group
            v = hidden.select(mb.critic["pos"], lambda h: head(h).squeeze(-1))
        else:
            pos = mb.critic["pos"].to(hidden.device)
            P = pos.numel()
            # the head runs once per micro-batch on every rank, also without a value point (then on one
            # token, sliced away): ZeRO-3 gathers its weight in forward and reduces its gradient in backward
            idx = pos if P else torch.zeros(1, dtype=torch.int64, device=hidden.device)
            v = head(hidden.index_select(0, idx)).squeeze(-1)[:P]
        v = v.to(torch.promote_types(v.dtype, torch.float32))
        if not bool(torch.isfinite(v).all()):
            bad = int((~torch.isfinite(v)).nonzero()[0])
            raise FloatingPointError(f"critic: value head output {float(v[bad])} at value point {bad} of micro-batch "
                                     f"{mb.index} (rank {mb.rank}); the critic diverged (lower critic.lr_mult or "
                                     "critic.value_coef)")
        return v

    @staticmethod
    def touch(model, hidden: torch.Tensor) -> torch.Tensor:
        """An exact 0 that depends on the head and, through ``hidden``, on the trunk as a real value
        loss does, so every rank's backward reaches the same parameters in the same order (ZeRO
        reduces gradients in backward hooks, ZeRO-3 also gathers there: a rank whose graph differed
        would hang or desync the others)."""
        return getattr(model, VALUE_HEAD)(hidden[:1]).sum() * 0.0

    def micro_batch(self, v: torch.Tensor, old_v: torch.Tensor, mb, seg_adv: torch.Tensor):
        """``(segment advantages, value loss)``: the loss segments' advantages with each chunk's GAE
        advantage (from ``old_v``) added, and this micro-batch's share of the step's value loss."""
        c = mb.critic
        if v.numel() == 0:
            return seg_adv, v.sum()  # an exact 0 that still reaches the head in backward
        adv, ret = gae(old_v, c["rewards"], c["seq"], self.cfg.gamma, self.cfg.lam)
        if self.cfg.whiten:
            if self.white is None:
                raise ValueError("critic.whiten: micro_batch before begin_step (the step's advantage statistics)")
            adv = (adv - self.white[0]) * self.white[1]
        seg_adv = seg_adv.to(torch.float64).clone()
        seg_adv.index_add_(0, c["seg"], adv)
        ret = ret.to(v.device, v.dtype)
        old_v = old_v.to(v.device, v.dtype)
        sq = (v - ret) ** 2
        clipped = torch.zeros_like(sq, dtype=torch.bool)
        if self.cfg.clip is not None:
            vc = old_v + (v - old_v).clamp(-self.cfg.clip, self.cfg.clip)
            sqc = (vc - ret) ** 2
            clipped = sqc > sq
            sq = torch.maximum(sq, sqc)
        per = 0.5 * sq
        loss = per.sum() / c["normalizer"]
        self._record(v.detach().double().cpu(), ret.double().cpu(), per.detach().double().cpu(), clipped.cpu(),
                     adv.double().cpu(), c)
        return seg_adv, loss

    def _record(self, vd, r, per, clipped, adv, c) -> None:
        """Add one micro-batch's points to the step's sums (value fit, calibration, correlation)."""
        res = r - vd
        o = c["episode_return"].double()
        self.sums += torch.stack([torch.tensor(float(vd.numel()), dtype=torch.float64), vd.sum(), r.sum(),
                                  (r * r).sum(), res.sum(), (res * res).sum(), per.sum(), clipped.double().sum(),
                                  adv.sum(), (adv * adv).sum(), o.sum(), (o * o).sum(), (adv * o).sum()])
        b = c["turn"].clamp(max=CALIB_TURNS - 1)
        for row, x in enumerate((torch.ones_like(vd), vd, r)):
            self.calib[row].index_add_(0, b, x)

    def discard(self) -> None:
        """Drop the sums recorded since the last ``step_metrics`` (the separate critic's later epochs)."""
        self._restart()

    def step_metrics(self, device) -> dict:
        """``value/*`` over the whole step (every rank; a collective), then the sums restart."""
        both = self.all_sum(torch.cat([self.sums, self.calib.flatten()]), device)
        s = dict(zip(_SUMS, both[:len(_SUMS)].tolist()))
        calib = both[len(_SUMS):].view(3, CALIB_TURNS).tolist()
        self._restart()
        n = s["n"]
        if n == 0:
            return {}
        out = {"value/loss": s["loss"] / n, "value/mean": s["v"] / n, "value/clip_frac": s["clipped"] / n,
               "value/return_mean": s["ret"] / n}
        var_ret = s["ret2"] / n - (s["ret"] / n) ** 2
        var_res = s["res2"] / n - (s["res"] / n) ** 2
        var_a = s["a2"] / n - (s["a"] / n) ** 2
        var_o = s["o2"] / n - (s["o"] / n) ** 2
        # returns that all agree explain nothing: no figure rather than a NaN; nor when every episode's
        # outcome agrees: the targets then vary only by the critic's own bootstrap (noise against noise:
        # -17 measured on an all-fail step of the long-horizon task)
        if var_ret > 1e-12 and var_o > 1e-12:
            out["value/explained_var"] = 1.0 - var_res / var_ret
        if var_a > 1e-12 and var_o > 1e-12:  # Pearson's r; undefined when either side is constant
            out["value/adv_outcome_corr"] = (s["ao"] / n - s["a"] / n * s["o"] / n) / (var_a * var_o) ** 0.5
        for k, (cnt, sv, sg) in enumerate(zip(*calib)):
            if cnt > 0:  # mean predicted value and mean return of the chunks at turn k
                out[f"value/calib/turn{k}_pred"] = sv / cnt
                out[f"value/calib/turn{k}_return"] = sg / cnt
        return out

