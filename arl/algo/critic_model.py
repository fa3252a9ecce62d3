"""The separate critic (``critic.model: separate``): a second trunk with its own value head, DeepSpeed
engine and AdamW, trained on the policy's packed micro-batches with its own backward.

Why a second model: the shared head (arl/algo/critic.py) reads the policy's hidden states, so the
value loss's gradient moves the policy's trunk and the policy loss's gradient moves the critic's
features; on a small trunk the two fight (explained variance stayed under 0.1, issue #39).  A
separate trunk costs a second copy of the weights, gradients and optimizer state (the dry-run plan
counts them) and a second forward and backward per micro-batch, and buys a critic whose features
serve the value alone, with its own learning rate (``trainer.optim.lr * critic.lr_mult``) and a
warm-up on the frozen start policy (``critic.warmup_steps``) before the policy moves.

The copy is taken from the policy the trainer is given, i.e. the start weights (after the SFT warm
start when there is one), before DeepSpeed wraps either; its output embedding (lm_head) is dropped:
the values are read from the final hidden states (``packed_hidden_states``), so a vocabulary-sized
matrix would only cost memory.  The value head starts at 0, as the shared one does.

The critic is never in the weight sync or the HF export (it is not the policy's module); it is
checkpointed beside the policy, in ``<checkpoint>/<tag>/critic`` (DeepSpeed's format: weights, Adam
state, lr schedule, and the steps it has taken, which the warm-up counts).
"""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from ..model.packed import packed_hidden_states
from ..model.shared_prefix import micro_batch_hidden_states
from .critic import VALUE_HEAD, Critic, attach_value_head

CRITIC_DIR = "critic"  # under a checkpoint's tag directory


class CriticModel:
    """The separate critic's model, engine and step; ``SeparateCriticObjective`` and its role drive it."""

    def __init__(self, critic: Critic, policy: torch.nn.Module, lr: float):
        self.critic = critic
        if hasattr(policy, "disable_adapter"):  # config.py refuses it first; a trainer built by hand gets this
            raise ValueError("critic.model: separate does not take a LoRA policy yet (model.lora)")
        module = copy.deepcopy(policy)
        module.set_output_embeddings(torch.nn.Identity())  # no lm_head: values come from the hidden states
        attach_value_head(module)
        self.module, self.lr = module, lr
        self.engine = self.opt = self.sched = None
        self.device, self.attn = None, "auto"
        self.steps = 0  # optimizer steps taken (checkpointed): the warm-up counts them

    def build(self, build_engine, device, attn: str) -> None:
        params = [{"params": [p for p in self.module.parameters() if p.requires_grad],
                   "lr": self.lr * self.critic.cfg.lr_mult}]
        self.engine, self.opt, self.sched = build_engine(self.module, params)
        self.device, self.attn = device, attn

    # ------------------------------------------------------------ forward / backward
    def _begin_forward(self) -> None:
        opt = self.engine.optimizer  # ZeRO's micro-step, as PolicyTrainer._begin_forward explains
        if hasattr(opt, "clear_backward_seen_flag"):
            opt.clear_backward_seen_flag()

    def _forward(self, token_ids, cu_seqlens) -> torch.Tensor:
        self._begin_forward()
        return packed_hidden_states(self.engine.module, token_ids.to(self.device), cu_seqlens.to(self.device),
                                    attn=self.attn)

    def values(self, mb) -> torch.Tensor:
        """The micro-batch's values from the critic's trunk (with the graph when grad is on); over the
        micro-batch's shared-prefix layout when it has one (trainer.share_prefix), as the policy's."""
        self.engine.module.train(torch.is_grad_enabled())
        self._begin_forward()
        hidden = micro_batch_hidden_states(self.engine.module, mb, self.device, attn=self.attn)
        return self.critic.values(self.engine.module, hidden, mb)

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed averages gradients over ranks; the loss is already the step's share (global normalizer)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.engine.backward(loss * world, scale_wrt_gas=False)

    def empty(self) -> None:
        """An empty micro-batch: a 2-token forward (and, with grad on, a backward of an exact 0), so
        every rank joins ZeRO's gathers and gradient reductions."""
        ids = torch.zeros(2, dtype=torch.long)
        h = self._forward(ids, torch.tensor([0, 2], dtype=torch.int32))
        # the head reads the trunk's output as in a real micro-batch: ZeRO-3 gathers each submodule in
        # backward in graph order, so the graph must have the same shape on every rank
        zero = getattr(self.engine.module, VALUE_HEAD)(h[:1]).sum() * 0.0
        if torch.is_grad_enabled():
            self.backward(zero)

    def step(self, apply: bool, count: bool = True) -> dict:
        """The critic's optimizer step; without a value point on any rank (``apply`` false) at lr 0, so
        Adam's momentum does not move it (the policy's rule, PolicyTrainer._finish_step).  ``count``:
        the step is a trainer step's first (the warm-up counts trainer steps, not ``critic.epochs``'
        extra passes; the critic's lr schedule advances on every optimizer step)."""
        if not apply:
            for g in self.opt.param_groups:
                g["lr"] = 0.0
        self.engine.step()
        self.steps += int(count)
        out = {"critic/lr": float(self.sched.get_last_lr()[0])}
        gn = self.engine.get_global_grad_norm()  # None where DeepSpeed keeps no norm (ZeRO 0)
        if gn is not None:
            out["critic/grad_norm"] = float(gn)
        return out

    # ------------------------------------------------------------ state
    def save(self, directory: str, tag: str) -> None:
        self.engine.save_checkpoint(os.path.join(directory, tag), tag=CRITIC_DIR,
                                    client_state={"critic_steps": self.steps}, save_latest=False)

    def load(self, directory: str, tag) -> None:
        if tag is None:  # the policy's DeepSpeed checkpoint took its own 'latest' pointer
            with open(os.path.join(directory, "latest")) as f:
                tag = f.read().strip()
        where = os.path.join(directory, tag)
        if not os.path.isdir(os.path.join(where, CRITIC_DIR)):
            raise ValueError(f"--resume: the checkpoint {where} has no separate critic (saved with critic.model: "
                             "shared or the critic off): resume with the setting it was saved with")
        path, state = self.engine.load_checkpoint(where, tag=CRITIC_DIR)
        if path is None:
            raise ValueError(f"--resume: the critic's checkpoint in {where}/{CRITIC_DIR} could not be loaded")
        self.steps = int(state["critic_steps"])
