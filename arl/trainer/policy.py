"""The trainer step: a DeepSpeed engine over a Hugging Face causal LM, fed packed micro-batches.

One optimizer step = every micro-batch of this rank (the packer gives each rank the same count),
each forward → fused logprobs → ``policy_loss`` with the step's GLOBAL normalizer, then one
``engine.step()``.  DeepSpeed's gradient accumulation is unmanaged (``step()`` is the boundary), so
steps may hold any number of micro-batches; it averages gradients over ranks, so each
micro-batch loss is multiplied by the world size to give the whole-step sum / normalizer.
"""
from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Optional, Sequence

import torch
from transformers.utils import logging as hf_logging

from ..config import CriticConfig, OptimConfig
from ..data.packer import MicroBatch
from ..ops.policy_loss import LossConfig, policy_loss
from ..ops.policy_loss.local_grad import local_logp_grad
from ..metrics import per_turn_sums, success_logprob_sums, turn_means
from ..model.packed import packed_logprobs
from ..model.tied import is_tied, untied_state
from ..stabilizers.ipa import ipa_mixed_loss
from . import faults
from .critic import VALUE_HEAD, Critic, attach_value_head, param_groups, without_value_head
from .dist import all_max_int, all_sum, any_rank, rank, world_size


def lr_lambda(optim: OptimConfig, total_steps: int):
    """Linear warm-up, then constant, linear decay or cosine decay to 0 at ``total_steps``."""
    warm = optim.warmup_steps
    total = max(total_steps, warm + 1)

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        frac = min(1.0, (step - warm) / max(1, total - warm))
        if optim.schedule == "linear":
            return 1.0 - frac
        if optim.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * frac))
        return 1.0

    return f


# config keys whose positive value makes a model's train-mode forward random (HF names: dropout,
# attention_dropout, resid_pdrop, ...; MoE routers' jitter noise)
_STOCHASTIC_KEYS = ("dropout", "pdrop", "jitter")


def train_mode_randomness(model: torch.nn.Module) -> list:
    """What makes the train-mode forward of ``model`` differ from its eval-mode one: dropout modules
    with p > 0 and positive dropout / jitter entries of its config.  Empty: the gradient pass
    computes the same logprobs as a no-grad eval pass over the same weights."""
    found = [f"{n or type(model).__name__}: {type(m).__name__}(p={m.p})" for n, m in model.named_modules()
             if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
    cfg = getattr(model, "config", None)
    items = cfg.to_dict().items() if hasattr(cfg, "to_dict") else ()
    found += [f"config.{k}={v}" for k, v in items
              if any(s in k for s in _STOCHASTIC_KEYS) and isinstance(v, (int, float)) and not isinstance(v, bool)
              and v > 0]
    return found


def deepspeed_config(zero_stage: int, grad_clip: float, dtype: torch.dtype) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,  # step() is the boundary: any number of micro-batches
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage, "overlap_comm": False, "contiguous_gradients": True},
        "zero_allow_untested_optimizer": True,  # torch AdamW: no run-time C++ build of DeepSpeed's Adam
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": False},
        "steps_per_print": 2 ** 62,
        "wall_clock_breakdown": False,
    }


class PolicyTrainer:
    def __init__(self, model: torch.nn.Module, *, optim: OptimConfig, zero_stage: int = 2, total_steps: int = 1,
                 dtype: torch.dtype = torch.float32, loss_backend: str = "auto", temperature: float = 1.0,
                 ref_model: Optional[torch.nn.Module] = None, attn: str = "auto",
                 critic: Optional[CriticConfig] = None, head_grad_in_forward: bool = True):
        import deepspeed

        from deepspeed.accelerator import get_accelerator

        # where DeepSpeed puts the module (cuda:LOCAL_RANK on GPU nodes; the model arrives on CPU)
        self.device = torch.device(get_accelerator().current_device_name())
        self.dtype = dtype
        self.loss_backend = loss_backend
        self.temperature = temperature
        self.attn = attn
        # with the old-logp pass skipped, the logprob head produces its gradients in its forward
        # (no logits recomputation in backward) where the loss's gradient is local (local_grad.py)
        self.head_grad_in_forward = head_grad_in_forward
        self.zero3 = zero_stage == 3
        self.ref_model = self._frozen(ref_model, dtype) if ref_model is not None else None
        # the critic (arl/trainer/critic.py): a value head on this model, in its own param group
        self.critic = Critic(critic) if critic is not None and critic.enabled else None
        if self.critic is not None:
            attach_value_head(model)
            params = param_groups(model, optim.lr, critic.lr_mult)
        else:
            params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)
        self._torch_opt = opt  # the param groups DeepSpeed's optimizer steps with (lr read per step)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(optim, total_steps))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=sched, config=deepspeed_config(zero_stage, optim.grad_clip, dtype))
        self.world = world_size()
        self.train_randomness = train_mode_randomness(model)  # non-empty: the old-logprob pass is kept
        self.last_old_logps: list = []  # the old logprobs the last rl_step trained against
        if zero_stage == 0 and dtype == torch.float32:
            self._record_grad_norm_on_clip()

    def _frozen(self, model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
        """The frozen reference policy: a plain copy, or under ZeRO-3 partitioned like the policy by
        an optimizer-less DeepSpeed engine (its forward gathers, so every rank runs each forward)."""
        model = model.to(self.device).eval().requires_grad_(False)
        if not self.zero3:
            return model
        import deepspeed

        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
               "bf16": {"enabled": dtype == torch.bfloat16}, "steps_per_print": 2 ** 62}
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        return engine.module.eval()

    def ref_logprobs(self, mbs: Sequence[MicroBatch]) -> list:
        """Logprobs of the frozen reference policy (for the KL term); a collective under ZeRO-3."""
        if self.ref_model is None:
            raise ValueError("ref_logprobs: the trainer has no reference model (trainer.reference_model: true)")
        return self.old_logprobs(mbs, model=self.ref_model)

    def _record_grad_norm_on_clip(self) -> None:
        """Without ZeRO, DeepSpeed clips fp32 gradients but drops the norm; keep it for metrics."""
        from deepspeed.runtime.utils import clip_grad_norm_

        eng = self.engine

        def clip_and_record():
            eng._global_grad_norm = float(clip_grad_norm_(parameters=eng.module.parameters(),
                                                          max_norm=eng.gradient_clipping(), mpu=eng.mpu))

        eng.clip_fp32_gradients = clip_and_record

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    # ------------------------------------------------------------ forward helpers
    def _begin_forward(self, model) -> None:
        """What ``engine.forward`` does before a forward, for our direct calls of the module: the ZeRO
        optimizer advances its micro-step.  ZeRO-3 copies the first micro-batch's gradient partition
        and adds the later ones only once the micro-step is > 0; without this every backward
        overwrote the last and the step used the last micro-batch's gradient alone."""
        opt = getattr(self.engine, "optimizer", None)
        if model is self.engine.module and hasattr(opt, "clear_backward_seen_flag"):
            opt.clear_backward_seen_flag()

    def logprobs(self, mb: MicroBatch, with_entropy: bool = False, model=None, return_hidden: bool = False,
                 head_grad=None):
        model = model if model is not None else self.engine.module
        self._begin_forward(model)
        return packed_logprobs(model, mb.token_ids.to(self.device), mb.cu_seqlens.to(self.device),
                               temperature=self.temperature, with_entropy=with_entropy, attn=self.attn,
                               return_hidden=return_hidden, head_grad=head_grad)

    def _loss_kwargs(self, mb: MicroBatch) -> tuple:
        """(advantages, policy_loss keyword arguments) of a non-IPA micro-batch, on the device."""
        adv = mb.advantages.to(self.device, torch.float32) if mb.advantages is not None else None
        kw = mb.loss_kwargs()
        kw.pop("advantages")  # passed on their own (adv above), on the device
        if mb.segments is not None:  # turn credit: each chunk a segment with its own advantage
            kw.update(mb.segments)
            adv = kw.pop("advantages").to(self.device, torch.float32)
        return adv, {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}

    def _head_grad(self, mb: MicroBatch, loss_cfg: LossConfig, ref) -> Optional[object]:
        """The loss's d loss / d logp plan for the head (old = this pass's logp, detached), or None:
        switched off, or IPA's mixed loss (no plan for it)."""
        if not self.head_grad_in_forward or mb.ipa is not None:
            return None
        adv, kw = self._loss_kwargs(mb)
        return local_logp_grad(config=loss_cfg, ref_logp=ref, with_entropy=True, advantages=adv,
                               scale=float(self.world), **kw)

    def old_pass_needed(self, updates_per_batch: int) -> bool:
        """Whether ``old_logprobs`` must run before the updates of a batch.  With one update per batch
        the weights do not change between that pass and the gradient pass (gradients accumulate over
        the micro-batches of one optimizer step), so the old logprobs are the gradient pass's logp,
        detached -- ``rl_step(mbs, None, ...)`` takes them from there.  That holds only when the
        train-mode forward is the eval-mode one (no dropout); otherwise the pass is kept.  The critic's
        ``whiten`` keeps it too: the step's advantage statistics need every old value first."""
        whiten = self.critic is not None and self.critic.cfg.whiten
        return updates_per_batch > 1 or bool(self.train_randomness) or whiten

    @torch.no_grad()
    def old_logprobs(self, mbs: Sequence[MicroBatch], model=None, values: Optional[list] = None) -> list:
        """Logprobs of the current weights (the PPO 'old' policy), or of ``model`` (reference).  With
        the critic on and ``values`` a list, the same pass appends each micro-batch's old values."""
        m = model if model is not None else self.engine.module
        with_values = values is not None and self.critic is not None and m is self.engine.module
        was = m.training
        m.eval()
        out = []
        for mb in mbs:
            if mb.is_empty:
                if self.zero3:
                    self._dummy_forward(m)  # ZeRO-3 gathers parameters in forward: every rank joins
                    if with_values:
                        self.critic.touch(m, torch.zeros(1, self.critic_width, device=self.device, dtype=self.dtype))
                out.append(None)
                if with_values:
                    values.append(None)
            elif with_values:
                logp, _, hidden = self.logprobs(mb, model=m, return_hidden=True)
                out.append(logp.float())
                values.append(self.critic.values(m, hidden, mb).detach())
            else:
                out.append(self.logprobs(mb, model=m)[0].float())
        m.train(was)
        return out

    @property
    def critic_width(self) -> int:
        return int(self.engine.module.config.hidden_size)

    def _dummy_forward(self, model):
        self._begin_forward(model)
        ids = torch.zeros(2, dtype=torch.long, device=self.device)
        cu = torch.tensor([0, 2], dtype=torch.int32, device=self.device)
        return packed_logprobs(model, ids, cu, temperature=self.temperature, attn=self.attn)[0]

    def _dummy_backward(self) -> None:
        # an empty micro-batch still runs forward/backward so every rank joins the same gradient
        # collectives (ZeRO reduces in backward hooks); its loss is exactly 0
        lp = self._dummy_forward(self.engine.module)
        loss = lp.sum() * 0.0
        if self.critic is not None:  # the value head's parameters join the same collectives
            h = torch.zeros(1, self.critic_width, device=self.device, dtype=self.dtype)
            loss = loss + self.critic.touch(self.engine.module, h)
        self.engine.backward(loss, scale_wrt_gas=False)

    def _finish_step(self, metrics: dict, apply_update: bool = True) -> dict:
        if apply_update:
            self.engine.step()
        else:
            # The gradient is exactly zero, but Adam would still move every weight on its momentum
            # (measured: a collapsing toy run kept degrading for 15 signal-free steps).  lr 0 for
            # this step: the weights stay, the moments decay, and the LR scheduler DeepSpeed steps
            # right after the optimizer sets the next step's lr again (tests/test_trainer_ds.py).
            for g in self._torch_opt.param_groups:
                g["lr"] = 0.0
            self.engine.step()
        gn = self.engine.get_global_grad_norm()
        out = {k: float(sum(v) / len(v)) for k, v in metrics.items() if v}
        out["grad_norm"] = float(gn) if gn is not None else float("nan")
        out["lr"] = float(self.scheduler.get_last_lr()[0])
        return out

    # ------------------------------------------------------------ steps
    def rl_step(self, mbs: Sequence[MicroBatch], old_logps: Optional[Sequence[Optional[torch.Tensor]]],
                loss_cfg: LossConfig,
                ref_logps: Optional[Sequence[Optional[torch.Tensor]]] = None, success_threshold: float = 1.0,
                old_values: Optional[Sequence[Optional[torch.Tensor]]] = None) -> dict:
        """One optimizer step of the policy loss over this rank's micro-batches.  ``old_logps``: the
        'old' policy's logprobs per micro-batch, or None when the weights being updated ARE the old
        policy (one update per batch, no dropout: ``old_pass_needed``): then each micro-batch's
        gradient-pass logp, detached, is its old logprob (ratio exactly 1, as in value it is).
        ``last_old_logps`` holds what was used, for metrics against the rollout.  Besides the loss
        metrics: ``entropy/turn_k`` (mean entropy of the k-th model turn's tokens) and
        ``logp/success_mean`` (mean logprob of successful trajectories' trained tokens, reward >=
        ``success_threshold``), both over every rank; a collective, so every rank calls it.

        With the critic on, each micro-batch's forward also gives the values at its chunk starts:
        GAE over them (``old_values``, the old pass's, or this pass's own, detached, exactly when
        ``old_logps`` is None) gives the chunks' advantages before the loss, and the clipped value
        loss joins the policy loss in the one backward (``value/*`` metrics; ``loss`` stays the
        policy loss)."""
        self.engine.train()
        if self.critic is not None and (old_values is None) != (old_logps is None):
            raise ValueError("rl_step: with the critic, old_values come with old_logps (both from old_logprobs(mbs, "
                             "values=[])) or neither (both from the gradient pass)")
        metrics = defaultdict(list)
        parts = defaultdict(list)  # per micro-batch: entropy, logp, chunk_ids, cu_seqlens, success
        if old_logps is None and self.train_randomness:
            raise ValueError(f"rl_step: old_logps=None needs a deterministic train-mode forward; the model has "
                             f"{', '.join(self.train_randomness[:3])} (run old_logprobs first)")
        self.last_old_logps = used_old = []
        white = self.critic.begin_step(mbs, old_values, self.device) if self.critic is not None else {}
        for i, mb in enumerate(mbs):
            if mb.is_empty:
                self._dummy_backward()
                used_old.append(None)
                continue
            ref = ref_logps[i].to(self.device) if ref_logps is not None and ref_logps[i] is not None else None
            # the grad-in-forward head needs the loss's advantages before the forward; the critic's come
            # out of this forward's values, so with the critic the head takes the ordinary path
            plan = self._head_grad(mb, loss_cfg, ref) if old_logps is None and self.critic is None else None
            if self.critic is not None:
                logp, ent, hidden = self.logprobs(mb, with_entropy=True, return_hidden=True)
                val = self.critic.values(self.engine.module, hidden, mb)
                old_val = val.detach() if old_values is None else old_values[i].to(self.device)
            else:
                logp, ent = self.logprobs(mb, with_entropy=True, head_grad=plan)
            metrics["head_grad_in_forward"].append(float(plan is not None and plan.applied))
            old = logp.detach() if old_logps is None else old_logps[i]
            used_old.append(old)
            # the step's advantages (arl/stabilizers/advantages.py) when the packer was given them:
            # exact for split groups, and how shaping / reweighting / masking reach the loss; None:
            # the loss normalizes the micro-batch's rewards itself
            adv = mb.advantages.to(self.device, torch.float32) if mb.advantages is not None else None
            if mb.ipa is not None:  # IPA resampling: imitation on the expert prefix + RL on the resampled chunks
                if self.critic is not None:
                    raise ValueError("rl_step: the critic cannot train IPA micro-batches (critic.enabled excludes "
                                     "stabilizers.ipa.enabled)")
                r = mb.ipa
                loss, lm = ipa_mixed_loss(
                    logp, old.to(self.device), mb=mb, il_mask=r["il_mask"], rl_chunk_ids=r["rl_chunk_ids"],
                    loss_cfg=loss_cfg, il_normalizer=r["il_normalizer"], rl_normalizer=r["rl_normalizer"],
                    lambda_il=r["lambda_il"], lambda_rl=r["lambda_rl"], advantages=adv, entropy=ent, ref_logp=ref,
                    backend=self.loss_backend)
            else:
                if self.critic is not None:  # each chunk a segment; its advantage + GAE over this pass's values
                    if mb.segments is None:
                        raise ValueError("rl_step: the critic needs per-chunk loss segments "
                                         "(Stabilizers(critic=...).apply)")
                    kw = {**mb.loss_kwargs(), **mb.segments}
                    adv, vloss = self.critic.micro_batch(val, old_val, mb, kw.pop("advantages"))
                    adv = adv.to(self.device, torch.float32)
                    kw = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
                else:
                    adv, kw = self._loss_kwargs(mb)
                out = policy_loss(logp, old.to(self.device), config=loss_cfg, entropy=ent, ref_logp=ref,
                                  advantages=adv, backend=self.loss_backend, **kw)
                loss, lm = out.loss, out.metrics
            total = loss
            if self.critic is not None:
                total = loss + self.critic.cfg.value_coef * vloss
            self.engine.backward(total * self.world, scale_wrt_gas=False)
            faults.reached("backward")  # test-only kill point (arl/trainer/faults.py)
            # the step's loss is the sum of every micro-batch's over every rank: averaged over this
            # rank's micro-batches here and over the ranks when logged, hence the two factors
            metrics["loss"].append(float(loss.detach()) * len(mbs) * self.world)
            for k, v in lm.items():
                metrics[k].append(float(v))
            if ent is not None:
                for k, v in (("ent", ent), ("logp", logp), ("cid", mb.chunk_ids), ("cu", mb.cu_seqlens),
                             ("ok", mb.rewards >= success_threshold)):
                    parts[k].append(v.detach())
        turn = self._turn_metrics(parts)
        # no advantage on any rank and no KL / entropy term: nothing to learn from this batch
        signal = (any(v > 0 for v in metrics.get("adv_nonzero_frac", ())) or any(v > 0 for v in metrics.get("ipa/il_tokens", ()))
                  or loss_cfg.kl_beta > 0 or loss_cfg.entropy_coef > 0)
        value = self.critic.step_metrics(self.device) if self.critic is not None else {}
        signal = any_rank(signal or bool(value), self.device)  # value metrics: the value loss has points to fit
        out = self._finish_step(metrics, apply_update=signal)
        out.update(value)
        out.update(white)
        out["skipped_no_signal"] = float(not signal)
        out.update(turn)
        return out

    def _turn_metrics(self, parts: dict) -> dict:
        """Per-turn entropy and the successful trajectories' mean logprob over all ranks: sums and
        counts are all-reduced (turn counts padded to the largest), then divided."""
        if parts["ent"]:
            sums, counts = per_turn_sums(parts["ent"], parts["cid"], parts["cu"])
            ls, lc = success_logprob_sums(parts["logp"], parts["cid"], parts["cu"], parts["ok"])
        else:  # no micro-batch on this rank
            sums, counts, ls, lc = torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64), 0.0, 0
        if world_size() > 1:
            K = all_max_int(sums.numel(), self.device)
            pad = lambda x: torch.cat([x, x.new_zeros(K - x.numel())])  # noqa: E731
            buf = all_sum(torch.cat([pad(sums), pad(counts), torch.tensor([ls, float(lc)], dtype=torch.float64)]),
                          self.device)
            sums, counts, ls, lc = buf[:K], buf[K:2 * K], float(buf[2 * K]), float(buf[2 * K + 1])
        out = turn_means(sums, counts)
        if lc > 0:
            out["logp/success_mean"] = ls / lc
        return out

    def sft_step(self, mbs: Sequence[MicroBatch], normalizer: float) -> dict:
        """One optimizer step of NLL on the trained (chunk) tokens; ``normalizer`` = the step's
        trained-token count over all ranks."""
        self.engine.train()
        metrics = defaultdict(list)
        for mb in mbs:
            if mb.is_empty:
                self._dummy_backward()
                continue
            logp, _ = self.logprobs(mb)
            mask = mb.loss_mask.to(self.device)
            nll = -(logp * mask).sum() / normalizer
            self.engine.backward(nll * self.world, scale_wrt_gas=False)
            metrics["sft_nll_per_token"].append(float(-(logp.detach() * mask).sum() / mask.sum().clamp_min(1)))
        return self._finish_step(metrics)

    # ------------------------------------------------------------ state
    def save_checkpoint(self, directory: str, tag: str, client_state: dict) -> None:
        self.engine.save_checkpoint(directory, tag=tag, client_state=client_state)

    def load_checkpoint(self, directory: str, tag: Optional[str] = None) -> dict:
        try:
            path, client_state = self.engine.load_checkpoint(directory, tag=tag)
        except RuntimeError as e:  # DeepSpeed's strict load: a value head on one side only
            if VALUE_HEAD not in str(e):
                raise
            now = "on" if self.critic is not None else "off"
            then = "off" if self.critic is not None else "on"
            raise ValueError(f"--resume: the checkpoint in {directory} was saved with critic.enabled {then}, this run "
                             f"has it {now}: resume with the setting it was saved with") from None
        if path is None:
            raise ValueError(f"--resume: no DeepSpeed checkpoint found in {directory}")
        return client_state or {}

    def full_state_dict(self, rank0_only: bool = True, to_cpu: bool = True) -> Optional[dict]:
        """The whole policy's HF-named state dict (never the critic's value head), copied to CPU (or
        detached views on the device when not ``to_cpu``; under ZeRO-3 always copies), ``None`` on
        ranks > 0 when ``rank0_only``.
        Under ZeRO-3 the parameters are partitioned over the ranks and gathered here: a collective,
        every rank calls it."""
        import deepspeed

        keep = not rank0_only or rank() == 0
        module = self.engine.module
        ctx = (deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None) if self.zero3
               else _null())
        with ctx:
            if not keep:
                return None
            # the policy only: the critic's value head (arl/trainer/critic.py) is neither synced nor exported
            state = without_value_head(module.state_dict())
            if to_cpu or self.zero3:  # gathered ZeRO-3 tensors are released when the context exits
                return {k: v.detach().to("cpu" if to_cpu else v.device, copy=True).contiguous()
                        for k, v in state.items()}
            return {k: v.detach() for k, v in state.items()}

    def export_hf(self, directory: str, tokenizer=None) -> None:
        """HF-format safetensors (loadable by transformers and vLLM); collective under ZeRO-3.  A tied
        model is written as the original is: one tensor, tied again on load (arl/model/tied.py)."""
        state = self.full_state_dict()
        if state is not None:
            # the gathered copies no longer share memory, so save_pretrained would write both names
            state = untied_state(state, is_tied(self.engine.module))
            os.makedirs(directory, exist_ok=True)
            # no "Writing model shards" bar for every checkpoint through the run's progress bar
            bar = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()
            try:
                self.engine.module.save_pretrained(directory, state_dict=state, safe_serialization=True)
            finally:
                if bar:
                    hf_logging.enable_progress_bar()
            if tokenizer is not None:
                tokenizer.save_pretrained(directory)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
