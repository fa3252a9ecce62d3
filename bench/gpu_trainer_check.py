"""Trainer steps from recorded trajectories (the GPU check's trainer stages; see bench/gpu_prepare.py).

``steps``: the main job's trainer step, as trainer rank 0 of a one-rank run takes it (stabilizers'
advantages, packer, ``PolicyTrainer``: DeepSpeed ZeRO-2, the fused logprob head over the packed
forward with arl's varlen SDPA, the policy loss), for ``--steps`` steps on the recorded batches,
from the recorded policy.  It saves every step's metrics, the fp32 master weights before and after
and the policy's logprobs of the trained tokens before and after.  With ``--reference`` it checks
the update against a reference run of the same steps (``compare``: the tolerances and why).

    # the reference: fp32 on CPU (gloo; on a GPU node CUDA is hidden from it)
    python bench/gpu_trainer_check.py steps --data gpu_check_in --device cpu --dtype float32 --out ref.pt
    # the GPU run: NCCL, bf16, the CUDA loss, checked against the reference
    python bench/gpu_trainer_check.py steps --data gpu_check_in --device cuda --dtype bfloat16 \\
        --loss-backend cuda --reference ref.pt --out gpu.pt

``perf``: trainer tokens/s and MFU of the same step on a model of realistic size (``--arch``,
random weights: only the shapes matter) fed the recorded trajectories, repeated to fill
``--tokens`` per step.

Both print one JSON object as their last stdout line; ``steps --reference`` exits 1 when the
update is outside the tolerance.  One process is one trainer rank (world size 1); nothing here
imports vLLM.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Tolerances of a bf16 GPU run against the fp32 CPU reference (``compare``).  bf16 keeps 8
# significant bits (relative rounding 2**-9 ~ 0.2% per op); DeepSpeed keeps fp32 master weights and
# Adam state, so the error enters through the bf16 forward and backward (logprobs, gradients summed
# over the micro-batches in bf16), compounded over the layers.  Adam divides by the gradient's own
# size, so an element whose gradient is near zero gets a large relative error in its update, while
# the update as a whole stays close.  Measured here, bf16 against fp32 on CPU (DeepSpeed ZeRO-2, the
# main job's recording from ``--prepare``: 128 trajectories, 3 steps of 2 updates), in the order of
# the keys below: 0.062, cos 0.998, 0.0018 nats, 0.067, 0.0006, 0.037.  Each bound is 3-10x that
# and still well below what a wrong step gives: leaving out the first micro-batch of each step
# measured 0.39, cos 0.92, loss 20% and grad norm 30% off; a wrong learning rate or sign shows in
# the update (tests/test_gpu_check.py).
TOL_BF16 = {
    "update_rel_err": 0.25,  # ||dW - dW_ref|| / ||dW_ref||, fp32 master weights, all parameters
    "update_cos_min": 0.97,  # cosine of dW and dW_ref
    "logp_mae": 0.01,  # mean |logp - logp_ref| of the trained tokens before the first update (nats)
    "dlogp_rel_err": 0.25,  # the policy's move on the trained tokens: ||dlogp - dlogp_ref|| / ||dlogp_ref||
    "loss_rel_err": 0.02,  # per step, |loss - loss_ref| / max(|loss_ref|, 1e-3)
    "grad_norm_rel_err": 0.15,  # per step
}
# fp32 against fp32 (the CPU test: the same code twice) is exact up to reduction order
TOL_FP32 = {"update_rel_err": 1e-4, "update_cos_min": 1 - 1e-6, "logp_mae": 1e-5, "dlogp_rel_err": 1e-4,
            "loss_rel_err": 1e-5, "grad_norm_rel_err": 1e-5}
TOLERANCES = {"bfloat16": TOL_BF16, "float32": TOL_FP32}

# dense bf16 tensor-core peak (no sparsity), FLOP/s, by device name: the MFU denominator
PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12}

# model shapes for ``perf`` (Qwen2 family; tied: input and output embeddings shared)
ARCHES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "test-tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=2048, tie_word_embeddings=False),
}


# ---------------------------------------------------------------- the rank
def start_rank(device: str) -> None:
    """This process as rank 0 of a one-rank trainer group: DeepSpeed's accelerator pinned before
    DeepSpeed is imported (the CPU reference on a GPU node must not pick CUDA), the CUDA device set
    before the NCCL group starts."""
    os.environ.setdefault("DS_BUILD_OPS", "0")
    os.environ["DS_ACCELERATOR"] = "cuda" if device == "cuda" else "cpu"
    import torch

    from arl.procs import free_port
    from arl.trainer.dist import init_distributed, set_rank_env

    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("gpu_trainer_check: --device cuda but torch sees no CUDA device")
        torch.cuda.set_device(0)
    set_rank_env(0, 1, free_port())
    init_distributed(device)


def load_prepared(data: Path):
    from arl.config import TrainConfig
    from arl.data.trajectory import load_trajectories

    meta_path = data / "meta.json"
    if not meta_path.exists():
        raise SystemExit(f"gpu_trainer_check: {meta_path} missing; run `bash bench/gpu_check.sh --prepare` first")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != "arl.gpu_check.v1":
        raise SystemExit(f"gpu_trainer_check: {meta_path}: unknown format {meta.get('format')!r}")
    cfg = TrainConfig.model_validate(meta["config"])
    batches = [load_trajectories(str(data / f)) for f in meta["batches"]]
    return cfg, batches


def data_id(data: Path) -> str:
    """Identity of a prepared folder's recording and policy: a run checks only against a
    reference of the same data."""
    import hashlib

    meta = json.loads((data / "meta.json").read_text())
    files = [data / f for f in meta["batches"]] + sorted((data / "model").glob("*.safetensors"))
    h = hashlib.sha256()
    for path in files:
        h.update(str(path.relative_to(data)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def step_batch(cfg, stab, trajs, step: int, micro_batch_tokens: int | None = None):
    """Trainer rank 0's part of a step (arl/trainer/rank.py ``next_batch``): the step's loss config
    and advantages from the stabilizers, then the packer; returns (micro-batches, loss config)."""
    from arl.data.batch import RolloutBatch
    from arl.data.packer import PackerConfig, pack_step
    from arl.metrics import trajectory_metrics

    batch = RolloutBatch(step, list(trajs), {})
    success = trajectory_metrics(batch.trajectories).get("success/train")
    loss_cfg = stab.loss_config(step, success)
    prep = stab.prepare(batch.trainable(), loss_cfg)
    packer = PackerConfig(token_budget=micro_batch_tokens or cfg.trainer.micro_batch_tokens, num_ranks=1,
                          seed=cfg.seed + step)
    packed = pack_step(prep.trajectories, packer, loss_cfg, advantages=prep.advantages)
    stab.apply(packed, prep, loss_cfg)
    return packed.ranks[0], loss_cfg


def master_weights(tr) -> dict:
    """The optimizer's fp32 master copy of every trained parameter, on CPU (bf16 runs keep the
    module in bf16; the update is read where the optimizer makes it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for n, p in tr.module.named_parameters():
        if p.requires_grad:
            w = safe_get_full_fp32_param(p)
            out[n] = (w if w is not None else p).detach().float().cpu().clone()
    return out


def trained_logprobs(tr, mbs):
    """The policy's logprobs of every trained token (loss-mask order of the micro-batches)."""
    import torch

    parts = [lp[mb.loss_mask.to(lp.device)].cpu() for mb, lp in zip(mbs, tr.old_logprobs(mbs)) if lp is not None]
    return torch.cat(parts) if parts else torch.zeros(0)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def updates(cfg, args) -> int:
    return args.updates if args.updates is not None else cfg.trainer.updates_per_batch


def make_trainer(cfg, model, args, dtype):
    from arl.config import LoRAConfig
    from arl.model.lora import apply_lora
    from arl.trainer import PolicyTrainer

    if args.lora:  # adapters on every linear layer but lm_head: only they train
        model = apply_lora(model, LoRAConfig(r=args.lora, alpha=2.0 * args.lora))
    return PolicyTrainer(model, optim=cfg.trainer.optim, zero_stage=args.zero_stage, total_steps=cfg.trainer.steps,
                         dtype=dtype, loss_backend=args.loss_backend, temperature=cfg.rollout.temperature,
                         ref_model=None, attn=args.attn, objective=cfg.algo.objective_name(cfg.stabilizers.ipa.enabled),
                         critic=cfg.critic)


def run_steps(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arl.stabilizers import Stabilizers
    from arl.trainer.rank import update_on_batch

    start_rank(args.device)
    cfg, batches = load_prepared(args.data)
    if cfg.loss.kl_beta > 0:
        raise SystemExit("gpu_trainer_check: the recorded config has loss.kl_beta > 0; the check runs without a "
                         "reference model")
    torch.manual_seed(cfg.seed)
    dtype = getattr(torch, args.dtype)
    model_dir = str(args.data / "model")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    tr = make_trainer(cfg, model, args, dtype)
    stab = Stabilizers(cfg.stabilizers, cfg.loss, decode=tok.decode, algo=cfg.algo)
    w0 = master_weights(tr)
    steps, first = [], None
    for step in range(args.steps):
        mbs, loss_cfg = step_batch(cfg, stab, batches[step % len(batches)], step)
        sync(args.device)
        t0 = time.perf_counter()
        m = update_on_batch(tr, mbs, loss_cfg, updates(cfg, args))  # the trainer's own step
        sync(args.device)
        dt = time.perf_counter() - t0
        old = tr.last_old_logps
        tokens = sum(mb.num_tokens for mb in mbs)
        steps.append({"step": step, "time_s": dt, "tokens": int(tokens), "tokens_per_s": tokens / dt,
                      **{k: float(v) for k, v in m.items()}})
        if first is None:
            first = (mbs, torch.cat([o[mb.loss_mask.to(o.device)].cpu() for mb, o in zip(mbs, old) if o is not None]))
    mbs0, logp0 = first
    logp1 = trained_logprobs(tr, mbs0)  # the same tokens under the updated policy
    res = {"device": args.device, "dtype": args.dtype, "loss_backend": args.loss_backend, "attn": args.attn,
           "zero_stage": args.zero_stage, "updates": updates(cfg, args), "data_id": data_id(args.data), "steps": steps, "w0": w0, "w1": master_weights(tr),
           "logp0": logp0, "logp1": logp1, "env": env_info(args.device)}
    return res


def rel(a: float, b: float, floor: float = 1e-3) -> float:
    return abs(a - b) / max(abs(b), floor)


def compare(res: dict, ref: dict, tol: dict) -> dict:
    """The run's update against the reference's: every figure and whether it is inside ``tol``.
    A reference without learning signal (every step skipped) fails: it would check nothing."""
    import torch

    for k in ("data_id", "updates", "zero_stage"):
        if res.get(k) != ref.get(k):
            raise ValueError(f"compare: the reference ran with {k}={ref.get(k)!r}, this run with {res.get(k)!r}")
    if len(res["steps"]) != len(ref["steps"]):
        raise ValueError(f"compare: the reference ran {len(ref['steps'])} steps, this run {len(res['steps'])}")
    names = sorted(ref["w0"])
    if sorted(res["w0"]) != names:
        raise ValueError("compare: the two runs trained different parameter sets")
    d = torch.cat([(res["w1"][n] - res["w0"][n]).flatten().double() for n in names])
    d_ref = torch.cat([(ref["w1"][n] - ref["w0"][n]).flatten().double() for n in names])
    nref = float(d_ref.norm())
    fig = {"update_norm_ref": nref,
           "update_rel_err": float((d - d_ref).norm()) / max(nref, 1e-30),
           "update_cos": float(torch.nn.functional.cosine_similarity(d, d_ref, dim=0)),
           "logp_mae": float((res["logp0"] - ref["logp0"]).abs().mean()),
           "tokens": int(ref["logp0"].numel())}
    dl, dl_ref = (res["logp1"] - res["logp0"]).double(), (ref["logp1"] - ref["logp0"]).double()
    fig["dlogp_rel_err"] = float((dl - dl_ref).norm()) / max(float(dl_ref.norm()), 1e-30)
    fig["dlogp_norm_ref"] = float(dl_ref.norm())
    fig["loss_rel_err"] = max(rel(a["loss"], b["loss"]) for a, b in zip(res["steps"], ref["steps"]))
    fig["grad_norm_rel_err"] = max(rel(a["grad_norm"], b["grad_norm"]) for a, b in zip(res["steps"], ref["steps"]))
    fails = [k for k in ("update_rel_err", "logp_mae", "dlogp_rel_err", "loss_rel_err", "grad_norm_rel_err")
             if not fig[k] <= tol[k]]
    if not fig["update_cos"] >= tol["update_cos_min"]:
        fails.append("update_cos")
    signal = [s for s in ref["steps"] if s.get("skipped_no_signal", 0.0) == 0.0]
    if not signal or nref == 0.0:
        fails.append("no_signal")
    return {"figures": fig, "tolerance": tol, "fails": fails, "ok": not fails}


def env_info(device: str) -> dict:
    import torch

    out = {"torch": torch.__version__}
    try:
        import deepspeed
        import transformers

        out.update(deepspeed=deepspeed.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    if device == "cuda":
        out.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return out


def cmd_steps(args) -> int:
    import torch

    ref = None
    if args.reference:  # a reference of other data or other steps is refused before the run
        if not args.reference.exists():
            raise SystemExit(f"gpu_trainer_check: --reference {args.reference}: no such file")
        ref = torch.load(args.reference, weights_only=False)
        want = {"data_id": data_id(args.data), "zero_stage": args.zero_stage, "steps": args.steps}
        got = {"data_id": ref.get("data_id"), "zero_stage": ref.get("zero_stage"), "steps": len(ref.get("steps", ()))}
        if args.updates is not None:
            want["updates"], got["updates"] = args.updates, ref.get("updates")
        bad = [f"{k}={got[k]!r} (this run: {want[k]!r})" for k in want if got[k] != want[k]]
        if bad:
            raise SystemExit(f"gpu_trainer_check: --reference {args.reference} ran with {', '.join(bad)}")
    res = run_steps(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(res, args.out)
    summary = {"check": "trainer_steps", "device": args.device, "dtype": args.dtype, "loss_backend": args.loss_backend,
               "attn": args.attn, "zero_stage": args.zero_stage, "updates": res["updates"], "data_id": res["data_id"],
               "env": res["env"],
               "steps": [{k: s[k] for k in ("step", "loss", "grad_norm", "tokens", "tokens_per_s",
                                            "skipped_no_signal", "logp_abs_diff_vs_rollout") if k in s}
                         for s in res["steps"]]}
    rc = 0
    if ref is not None:
        out = compare(res, ref, TOLERANCES[args.dtype])
        summary.update(compare_to=str(args.reference), **out)
        rc = 0 if out["ok"] else 1
    emit(summary, args.json)
    return rc


def emit(obj: dict, path) -> None:
    """The result as the last stdout line, and in ``path`` when given."""
    line = json.dumps(obj)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(line + "\n")
    print(line)


# ---------------------------------------------------------------- perf
def model_flops(arch: dict, seq_lens, forward_passes: int = 1, backward_passes: int = 1) -> float:
    """Model FLOPs (not hardware: the fused head's recomputation is not counted) of forward and
    backward passes over packed sequences: 2 per weight per token for each matmul in forward, twice
    that in backward, plus causal attention (QK^T and PV: 2 * L^2 * d per layer forward)."""
    h, L = arch["hidden_size"], arch["num_hidden_layers"]
    kv = h // arch["num_attention_heads"] * arch["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * arch["intermediate_size"]  # q,o + k,v + gate,up,down
    dense = L * per_layer + arch["vocab_size"] * h  # + lm_head
    tokens = sum(seq_lens)
    attn = 2 * L * h * sum(n * n for n in seq_lens)  # causal: half of 2 * 2 * L^2 * d
    per_pass = 2 * dense * tokens + attn
    return per_pass * (forward_passes + 2 * backward_passes)


def tiled(trajs, tokens: int):
    """Whole groups of the recorded trajectories, repeated until ``tokens`` tokens; each copy of a
    group is a group of its own."""
    from arl.data.trajectory import Trajectory

    groups = {}
    for t in trajs:
        groups.setdefault(int(t.group_id), []).append(t)
    out, total, gid = [], 0, 0
    while total < tokens:
        for members in groups.values():
            out += [Trajectory(tokens=t.tokens, chunk_ids=t.chunk_ids, rollout_logp=t.rollout_logp, reward=t.reward,
                               group_id=gid, policy_version=t.policy_version, turns=list(t.turns), status=t.status,
                               metadata=dict(t.metadata)) for t in members]
            total += sum(len(t) for t in members)
            gid += 1
            if total >= tokens:
                break
    return out


def cmd_perf(args) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from arl.stabilizers import Stabilizers
    from arl.trainer.rank import update_on_batch

    start_rank(args.device)
    cfg, batches = load_prepared(args.data)
    arch = ARCHES[args.arch]
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    mcfg = Qwen2Config(**arch, max_position_embeddings=32768, use_sliding_window=False)
    with torch.device(args.device):  # random weights made where they are trained (a 0.5B init on CPU is slow)
        model = Qwen2ForCausalLM(mcfg).to(dtype)
    tr = make_trainer(cfg, model, args, dtype)
    stab = Stabilizers(cfg.stabilizers, cfg.loss, algo=cfg.algo)
    trajs = tiled([t for b in batches for t in b], args.tokens)
    mbs, loss_cfg = step_batch(cfg, stab, trajs, 0, micro_batch_tokens=args.micro_batch_tokens)
    # the recorded engine logprobs are another model's: this model's own stand in (on-policy, as in
    # a run), or the rollout-mismatch mask of the main job's loss would drop every chunk
    for mb, lp in zip(mbs, tr.old_logprobs(mbs)):
        if lp is not None:
            mb.rollout_logp = torch.where(mb.loss_mask, lp.cpu(), torch.zeros_like(lp.cpu()))
    lens = [int(n) for mb in mbs for n in (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()]
    tokens = sum(lens)
    n_up = updates(cfg, args)  # the old-logprob forward (when the step needs it), then each update's fwd+bwd
    n_old = 1 if tr.old_pass_needed(n_up) else 0
    flops = model_flops(arch, lens, forward_passes=n_old + n_up, backward_passes=n_up)
    times = []
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        sync(args.device)
        t0 = time.perf_counter()
        m = update_on_batch(tr, mbs, loss_cfg, n_up)
        sync(args.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]  # the median step
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    if peak is None and args.device == "cuda":
        name = torch.cuda.get_device_name(0)
        peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    n_params = sum(p.numel() for p in tr.module.parameters())
    out = {"check": "trainer_perf", "arch": args.arch, "params": n_params, "device": args.device, "dtype": args.dtype,
           "loss_backend": args.loss_backend, "attn": args.attn, "zero_stage": args.zero_stage, "env": env_info(args.device),
           "tokens_per_step": tokens, "sequences": len(lens), "micro_batches": len(mbs),
           "updates_per_batch": n_up, "step_s_median": step_s,
           "step_s_all": [round(t, 4) for t in times], "trainer_tokens_per_s": tokens / step_s,
           "model_tflops_per_step": flops / 1e12, "achieved_tflops": flops / step_s / 1e12,
           "peak_tflops": peak / 1e12 if peak else None, "mfu": flops / step_s / peak if peak else None,
           "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "skipped_no_signal": m["skipped_no_signal"]}
    if args.device == "cuda":
        out["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    finite = all(math.isfinite(out[k]) for k in ("loss", "grad_norm"))
    if not finite:
        print("gpu_trainer_check: non-finite loss or grad norm", file=sys.stderr)
    emit(out, args.json)
    return 0 if finite else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("steps", "perf"):
        p = sub.add_parser(name)
        p.add_argument("--data", type=Path, default=ROOT / "gpu_check_in", help="the prepared folder")
        p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
        p.add_argument("--dtype", choices=sorted(TOLERANCES), default="bfloat16")
        p.add_argument("--loss-backend", default="auto", help="policy-loss backend (cuda on a GPU; reference: the spec)")
        p.add_argument("--attn", default="varlen_sdpa", help="packed attention path (arl/model/packed.py)")
        p.add_argument("--zero-stage", type=int, default=2)
        p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
        p.add_argument("--steps", type=int, default=3 if name == "steps" else 5)
        p.add_argument("--updates", type=int, default=None,
                       help="optimizer updates per step on the step's old logprobs (default: trainer.updates_per_batch; "
                            "from the second on the ratio leaves 1 and clipping acts)")
        p.add_argument("--json", type=Path, default=None, help="also write the result JSON here")
    s = sub.choices["steps"]
    s.add_argument("--out", type=Path, default=None, help="save the run (torch.save) for a later --reference")
    s.add_argument("--reference", type=Path, default=None, help="a saved reference run to check against")
    p = sub.choices["perf"]
    p.add_argument("--arch", choices=sorted(ARCHES), default="qwen2.5-0.5b")
    p.add_argument("--tokens", type=int, default=65536, help="tokens per step (the recording, repeated)")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=None, help="MFU denominator (default: by GPU name)")
    args = ap.parse_args(argv)
    return {"steps": cmd_steps, "perf": cmd_perf}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
