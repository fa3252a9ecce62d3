"""A DeepSpeed engine over a module and its AdamW: the policy's (arl/trainer/policy.py) and the separate
critic's (arl/algo/critic_model.py), built the same way so both partition, clip and checkpoint alike."""
from __future__ import annotations

import math

import torch

from ..config import OptimConfig


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



# DeepSpeed's default reduce bucket (elements): ZeRO allocates one bucket this size up front
DS_REDUCE_BUCKET = 500_000_000


def deepspeed_config(zero_stage: int, grad_clip: float, dtype: torch.dtype, offload=None,
                     trainable_params: int | None = None) -> dict:
    zero = {"stage": zero_stage, "overlap_comm": False, "contiguous_gradients": True}
    if trainable_params is not None:
        # ZeRO allocates its reduce bucket whole before the first backward and flushes it when the next
        # gradient would overflow it: a bucket larger than every trainable parameter together never
        # fills past that, so capping it there reduces in the same order and frees the rest (1.9 GiB of
        # fp32 for a model under 500M parameters, LoRA's adapters above all)
        zero["reduce_bucket_size"] = max(1, min(DS_REDUCE_BUCKET, int(trainable_params)))
    if offload is not None and offload.optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if offload is not None and offload.params == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,  # step() is the boundary: any number of micro-batches
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch AdamW: no run-time C++ build of DeepSpeed's Adam
        # offloaded on a CPU machine the state is in host memory anyway: torch's AdamW steps it there
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": False},
        "steps_per_print": 2 ** 62,
        "wall_clock_breakdown": False,
    }


def make_optimizer(params, optim: OptimConfig, offload_optimizer: bool, on_gpu: bool):
    """AdamW over ``params``; with the optimizer offloaded from a GPU, DeepSpeed's CPU Adam (its C++ op,
    JIT-built on first use: the one-line error names what is missing)."""
    kw = dict(lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)
    if not (offload_optimizer and on_gpu):
        return torch.optim.AdamW(params, **kw)
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **kw)
    except Exception as e:  # a missing compiler / ninja / headers surface here, not mid-run
        raise RuntimeError(f"trainer.offload.optimizer: cpu needs DeepSpeed's CPU Adam op, which failed to build or "
                           f"load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def make_engine(model: torch.nn.Module, params, optim: OptimConfig, *, zero_stage: int, total_steps: int,
                dtype: torch.dtype, offload=None, on_gpu: bool = False) -> tuple:
    """``(engine, torch optimizer, lr scheduler)``: DeepSpeed over ``model`` with AdamW over ``params``
    (parameters or param groups) and ``lr_lambda``'s schedule.  The torch optimizer is the one whose
    param groups carry the lr DeepSpeed steps with."""
    import deepspeed

    opt = make_optimizer(params, optim, offload_optimizer=offload is not None and offload.optimizer == "cpu",
                         on_gpu=on_gpu)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(optim, total_steps))
    trainable = sum(getattr(p, "ds_numel", p.numel()) for g in opt.param_groups for p in g["params"])  # ZeRO-3 Init: ds_numel
    engine, _, _, sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                               config=deepspeed_config(zero_stage, optim.grad_clip, dtype, offload,
                                                                       trainable_params=trainable))
    return engine, opt, sched
