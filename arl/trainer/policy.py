"""The trainer step: a DeepSpeed engine over a Hugging Face causal LM, fed packed micro-batches.

One optimizer step = every micro-batch of this rank (the packer gives each rank the same count),
each forward → fused logprobs → ``policy_loss`` with the step's GLOBAL normalizer, then one
``engine.step()``.  DeepSpeed's gradient accumulation is unmanaged (``step()`` is the boundary), so
steps may hold any number of micro-batches; it averages gradients over ranks, so each
micro-batch loss is multiplied by the world size to give the whole-step sum / normalizer.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Optional, Sequence

import torch
from transformers.utils import logging as hf_logging

from ..algo.critic import VALUE_HEAD, without_value_head
from ..algo.critic_role import check_old_values, head_mismatch
from ..algo.objectives import Forward, LossOut, make_objective
from ..config import CriticConfig, OffloadConfig, OptimConfig
from ..data.packer import MicroBatch
from ..ops.policy_loss import LossConfig
from ..metrics import per_turn_sums, success_logprob_sums, turn_means
from ..model.lora import ADAPTER, base_state_dict, hf_model, is_lora, merged_state_dict
from ..model.packed import packed_logprobs
from ..model.shared_prefix import micro_batch_logprobs
from ..model.tied import is_tied, untied_state
from . import faults
from .dist import all_max_int, all_sum, any_rank, rank, world_size
from .engine import deepspeed_config, lr_lambda, make_engine, make_optimizer  # noqa: F401 (re-exported)
from .park import Parking
from .seqpar import SequenceParallel


# config keys whose positive value makes a model's train-mode forward random (HF names: dropout,
# attention_dropout, resid_pdrop, ...; MoE routers' jitter noise)
_STOCHASTIC_KEYS = ("dropout", "pdrop", "jitter")
# token counts of a step: summed over its micro-batches (and ranks: ``all_mean(sums=...)``), where
# every other loss metric is their mean (a count's mean would halve when twice the sequences fit in
# one micro-batch, as under trainer.share_prefix)
COUNT_METRICS = ("tokens_kept", "ipa/il_tokens", "ipa/rl_tokens")


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


class PolicyTrainer:
    def __init__(self, model: torch.nn.Module, *, optim: OptimConfig, zero_stage: int = 2, total_steps: int = 1,
                 dtype: torch.dtype = torch.float32, loss_backend: str = "auto", temperature: float = 1.0,
                 ref_model: Optional[torch.nn.Module] = None, attn: str = "auto", objective: str = "policy_gradient",
                 critic: Optional[CriticConfig] = None, head_grad_in_forward: bool = True,
                 offload: Optional[OffloadConfig] = None, park_while_generating: bool = False,
                 sequence_parallel: int = 1):
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
        # what a micro-batch's forward becomes before backward (arl/algo/objectives.py); it may add
        # heads to the model (the critic's value head, in its own param group)
        self.objective = make_objective(objective, loss_backend, critic)
        params = self.objective.prepare_model(model, optim.lr)
        # self._torch_opt: the param groups DeepSpeed's optimizer steps with (lr read per step)
        build = lambda m, p: make_engine(m, p, optim, zero_stage=zero_stage, total_steps=total_steps,  # noqa: E731
                                         dtype=dtype, offload=offload, on_gpu=self.device.type == "cuda")
        self.engine, self._torch_opt, self.scheduler = build(model, params)
        self.optimizer = self.engine.optimizer
        if self.objective.critic is not None:  # a separate critic's own engine; the critic's collectives
            self.objective.critic.build(build, self.device, attn, all_sum)
        self.world = world_size()
        self.sp = SequenceParallel(sequence_parallel, getattr(model, "config", None))  # arl/trainer/seqpar.py
        self.train_randomness = train_mode_randomness(model)  # non-empty: the old-logprob pass is kept
        self.last_old_logps: list = []  # the old logprobs the last rl_step trained against
        if zero_stage == 0 and dtype == torch.float32:
            self._record_grad_norm_on_clip()
        # trainer.offload.while_generating: state in host memory during the engine's turn (arl/trainer/park.py)
        self.parking = Parking(self) if park_while_generating else None

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
        """Logprobs of the frozen reference policy (for the KL term): the reference model, or under LoRA
        without one the policy with its adapters disabled; a collective under ZeRO-3."""
        if self.ref_model is not None:
            return self.old_logprobs(mbs, model=self.ref_model)
        if not is_lora(self.engine.module):
            raise ValueError("ref_logprobs: the trainer has no reference model (trainer.reference_model: true)")
        with self.engine.module.disable_adapter():  # LoRA: the base without adapters is the reference
            return self.old_logprobs(mbs)

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

    def park(self) -> None:
        """The engine's turn begins: with parking on, the state goes to host memory."""
        if self.parking is not None:
            self.parking.park()

    def unpark(self) -> None:
        """The trainer's turn (the engine is asleep): the state back on the device before the update."""
        if self.parking is not None:
            self.parking.unpark()

    def awake(self):
        """A block that runs the model: the state on the device for it (parked again after)."""
        return self.parking.awake() if self.parking is not None else _null()

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
        if self.sp.on:  # the config refuses what SP does not cover (shared prefixes, the separate critic)
            return self.sp.logprobs(hf_model(model), mb, self.device, self.temperature, with_entropy, return_hidden)
        return micro_batch_logprobs(hf_model(model), mb, self.device, temperature=self.temperature,  # share_prefix
                                    with_entropy=with_entropy, attn=self.attn, return_hidden=return_hidden,
                                    head_grad=head_grad)

    def old_pass_needed(self, updates_per_batch: int) -> bool:
        """Whether ``old_logprobs`` must run before the updates of a batch.  With one update per batch
        the weights do not change between that pass and the gradient pass (gradients accumulate over
        the micro-batches of one optimizer step), so the old logprobs are the gradient pass's logp,
        detached -- ``rl_step(mbs, None, ...)`` takes them from there.  That holds only when the
        train-mode forward is the eval-mode one (no dropout); otherwise the pass is kept.  An objective
        may keep it too (the critic's ``whiten``: the step's statistics need every old value first)."""
        return updates_per_batch > 1 or bool(self.train_randomness) or self.objective.needs_old_pass

    @torch.no_grad()
    def old_logprobs(self, mbs: Sequence[MicroBatch], model=None, values: Optional[list] = None) -> list:
        """Logprobs of the current weights (the PPO 'old' policy), or of ``model`` (reference).  With
        ``values`` a list, the same pass appends each micro-batch's old values (the objective's extras:
        the critic's values; None for objectives without them)."""
        m = model if model is not None else self.engine.module
        with_values = values is not None and self.objective.needs_hidden and m is self.engine.module
        was = m.training
        m.eval()
        out = []
        for mb in mbs:
            if mb.is_empty:
                if self.zero3:  # ZeRO-3 gathers parameters in forward: every rank joins
                    _, hidden = self._dummy_forward(m, return_hidden=True)
                    if with_values:
                        self.objective.critic.zero_touch(m, hidden)
                out.append(None)
                if with_values:
                    values.append(None)
            elif with_values:
                logp, _, hidden = self.logprobs(mb, model=m, return_hidden=True)
                out.append(logp.float())
                values.append(self.objective.critic.old_values(m, hidden, mb))
            else:
                out.append(self.logprobs(mb, model=m)[0].float())
        m.train(was)
        return out

    def _dummy_forward(self, model, return_hidden: bool = False):
        self._begin_forward(model)
        ids = torch.zeros(2, dtype=torch.long, device=self.device)
        cu = torch.tensor([0, 2], dtype=torch.int32, device=self.device)
        out = packed_logprobs(hf_model(model), ids, cu, temperature=self.temperature, attn=self.attn,
                              return_hidden=return_hidden)
        return (out[0], out[-1]) if return_hidden else out[0]

    def _dummy_backward(self) -> None:
        # an empty micro-batch still runs forward/backward so every rank joins the same gradient
        # collectives (ZeRO reduces in backward hooks; under ZeRO-3 also gathers in the backward of
        # what a real micro-batch's graph holds, in its order: the objective's extra term reads
        # the dummy's own hidden states, as a real loss does); its loss is exactly 0
        lp, hidden = self._dummy_forward(self.engine.module, return_hidden=True)
        loss = lp.sum() * 0.0
        critic = self.objective.critic
        extra = critic.zero_touch(self.engine.module, hidden) if critic is not None else None
        if extra is not None:  # the critic's own parameters (value head) join the same collectives
            loss = loss + extra
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
        # counts are summed over the ranks when logged: a sequence-parallel group's ranks share each count
        out = {k: float(sum(v) / self.sp.size if k in COUNT_METRICS else sum(v) / len(v)) for k, v in metrics.items() if v}
        out["grad_norm"] = float(gn) if gn is not None else float("nan")
        out["lr"] = float(self.scheduler.get_last_lr()[0])
        return out

    # ------------------------------------------------------------ steps
    def rl_step(self, mbs: Sequence[MicroBatch], old_logps: Optional[Sequence[Optional[torch.Tensor]]],
                loss_cfg: LossConfig,
                ref_logps: Optional[Sequence[Optional[torch.Tensor]]] = None, success_threshold: float = 1.0,
                old_values: Optional[Sequence[Optional[torch.Tensor]]] = None) -> dict:
        """One optimizer step of the objective over this rank's micro-batches: forward ->
        ``objective.loss`` -> backward each, then one ``engine.step()``.  ``old_logps``: the 'old'
        policy's logprobs per micro-batch, or None when the weights being updated ARE the old policy
        (``old_pass_needed`` false): then each gradient pass's logp, detached, is its old logprob.
        ``old_values``: the old pass's extras (critic values), with ``old_logps`` or not at all.
        ``last_old_logps`` holds the old logprobs used.  Besides the loss metrics: ``entropy/turn_k``
        and ``logp/success_mean`` (reward >= ``success_threshold``) over every rank; a collective."""
        self.engine.train()
        if old_logps is None and self.train_randomness:
            raise ValueError(f"rl_step: old_logps=None needs a deterministic train-mode forward; the model has "
                             f"{', '.join(self.train_randomness[:3])} (run old_logprobs first)")
        check_old_values(self.objective, old_logps, old_values)
        metrics, parts = defaultdict(list), defaultdict(list)
        self.last_old_logps = []
        critic = self.objective.critic
        if critic is not None and critic.frozen():  # the critic's warm-up: it alone learns (arl/algo/critic_role.py)
            return critic.frozen_step(mbs, old_values, self.device)
        begin = self.objective.begin_step(mbs, old_values, self.device)
        for i, mb in enumerate(mbs):
            if mb.is_empty:
                self._dummy_backward()
                self.last_old_logps.append(None)
                continue
            fwd, applied = self._forward(mb, i, old_logps, ref_logps, old_values, loss_cfg)
            out = self.objective.loss(mb, fwd, loss_cfg, self.device)
            self.engine.backward(out.total * self.world, scale_wrt_gas=False)
            faults.reached("backward")  # test-only kill point (arl/trainer/faults.py)
            metrics["head_grad_in_forward"].append(float(applied))
            self._record(metrics, parts, mb, fwd, out, len(mbs), success_threshold)
        turn = self._turn_metrics(parts)
        end = self.objective.end_step(self.device)  # a collective (the critic's value metrics)
        signal = any_rank(self.objective.has_signal(metrics, loss_cfg, end), self.device)
        out = self._finish_step(metrics, apply_update=signal)
        out.update({**end, **begin, "skipped_no_signal": float(not signal), **turn})
        return out

    def _forward(self, mb: MicroBatch, i: int, old_logps, ref_logps, old_values, loss_cfg) -> tuple:
        """``(Forward, whether the head's gradient was produced in forward)`` of micro-batch ``i``."""
        ref = ref_logps[i].to(self.device) if ref_logps is not None and ref_logps[i] is not None else None
        plan = None
        if old_logps is None and self.head_grad_in_forward and not self.sp.on:  # the loss's gradient is local
            plan = self.objective.head_grad(mb, loss_cfg, ref, float(self.world), self.device)
        logp, ent, *hidden = self.logprobs(mb, with_entropy=True, return_hidden=self.objective.needs_hidden,
                                           head_grad=plan)
        old = logp.detach() if old_logps is None else old_logps[i]
        self.last_old_logps.append(old)
        old_v = old_values[i] if old_values is not None else None
        fwd = Forward(logp, ent, old.to(self.device), ref, hidden[0] if hidden else None, old_v)
        return fwd, plan is not None and plan.applied

    def _record(self, metrics, parts, mb: MicroBatch, fwd: Forward, out: LossOut, n_mbs: int, threshold) -> None:
        # the step's loss is the sum of every micro-batch's over every rank: averaged over this rank's
        # micro-batches here and over the replicas when logged, hence the two factors
        metrics["loss"].append(float(out.loss.detach()) * n_mbs * self.sp.dp)
        for k, v in out.metrics.items():
            metrics[k].append(float(v))
        if fwd.entropy is not None:
            for k, v in (("ent", fwd.entropy), ("logp", fwd.logp), ("cid", mb.chunk_ids), ("cu", mb.cu_seqlens),
                         ("ok", mb.rewards >= threshold)):
                parts[k].append(v.detach())

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
        # save_latest=False: arl moves DeepSpeed's 'latest' itself, once the checkpoint is complete (checkpoints.py)
        self.engine.save_checkpoint(directory, tag=tag, client_state=client_state, save_latest=False)
        if self.objective.critic is not None:  # a separate critic's engine, beside the policy's
            self.objective.critic.save(directory, tag)

    def load_checkpoint(self, directory: str, tag: Optional[str] = None) -> dict:
        try:
            path, client_state = self.engine.load_checkpoint(directory, tag=tag)
        except RuntimeError as e:  # DeepSpeed's strict load: a value head on one side only
            if VALUE_HEAD not in str(e):
                raise
            raise ValueError(head_mismatch(self.objective.critic, directory)) from None
        if path is None:
            raise ValueError(f"--resume: no DeepSpeed checkpoint found in {directory}")
        if self.objective.critic is not None:
            self.objective.critic.load(directory, tag)
        return client_state or {}

    def full_state_dict(self, rank0_only: bool = True, to_cpu: bool = True, copy: bool = True,
                        adapters: bool = True) -> Optional[dict]:
        """The whole policy's HF-named state dict (never the critic's value head), copied to CPU (or
        detached views on the device when not ``to_cpu``; under ZeRO-3 always copies), ``None`` on
        ranks > 0 when ``rank0_only``.  ``copy=False``: tensors already on CPU are not copied again
        (views of the live weights; under LoRA the merged ones are new anyway), for a caller done with
        them before the next update (the weight sync: a copy would be a model's size of peak memory).
        Under ZeRO-3 the parameters are partitioned over the ranks and gathered here: a collective,
        every rank calls it.  ``adapters=False`` (LoRA): the base weights, adapters off."""
        import deepspeed

        keep = not rank0_only or rank() == 0
        module = self.engine.module
        ctx = (deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None) if self.zero3
               else _null())
        with ctx:
            if not keep:
                return None
            # the policy only: the critic's value head (arl/algo/critic.py) is neither synced nor exported
            # under LoRA: the merged weights, under the base model's names (arl/model/lora.py)
            if not is_lora(module):
                state = module.state_dict()
            else:
                state = merged_state_dict(module) if adapters else base_state_dict(module)
            state = without_value_head(state)
            if self.zero3 or (to_cpu and copy):  # gathered ZeRO-3 tensors are released when the context exits
                return {k: v.detach().to("cpu" if to_cpu else v.device, copy=True).contiguous()
                        for k, v in state.items()}
            return {k: v.detach().to("cpu").contiguous() if to_cpu else v.detach() for k, v in state.items()}

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
                hf_model(self.engine.module).save_pretrained(directory, state_dict=state, safe_serialization=True)
            finally:
                if bar:
                    hf_logging.enable_progress_bar()
            if tokenizer is not None:
                tokenizer.save_pretrained(directory)
        if is_lora(self.engine.module):  # and the adapter alone (peft's format), beside the merged model
            self._export_adapter(os.path.join(directory, "adapter"))

    def adapter_state(self) -> Optional[tuple]:
        """LoRA: (the adapter's tensors in peft's saved format, on CPU; its peft config) on rank 0,
        None on the others; collective under ZeRO-3 (the adapters are gathered)."""
        import deepspeed
        from peft.utils import get_peft_model_state_dict

        module = self.engine.module
        params = [p for n, p in module.named_parameters() if ".lora_" in n]
        with (deepspeed.zero.GatheredParameters(params, modifier_rank=None) if self.zero3 else _null()):
            if rank() != 0:
                return None
            state = get_peft_model_state_dict(module, adapter_name=ADAPTER)
            return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}, \
                module.peft_config[ADAPTER]

    def _export_adapter(self, directory: str) -> None:
        import deepspeed

        module = self.engine.module
        params = [p for n, p in module.named_parameters() if ".lora_" in n]
        with (deepspeed.zero.GatheredParameters(params, modifier_rank=None) if self.zero3 else _null()):
            if rank() == 0:
                module.save_pretrained(directory, safe_serialization=True)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
