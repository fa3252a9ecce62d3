"""Probe: where a trainer rank's peak memory goes, full fine-tuning vs LoRA, through arl's own
``PolicyTrainer`` at bench/bench_lora.py's shapes (SmolLM2-135M-Instruct, fp32, ZeRO-0, one gloo
rank, 2048-token micro-batches, two RL steps so Adam's state exists for the second) and its merged
weight sync (``full_state_dict``, what ``WeightSender`` sends).  One process per arm (docs/lora.md):

    python bench/probe_trainer_memory.py full
    python bench/probe_trainer_memory.py lora
    python bench/probe_trainer_memory.py lora --malloc default   # glibc's own mmap threshold
    python bench/probe_trainer_memory.py lora --checkpointing    # model.gradient_checkpointing

Per phase: the resident set now and its peak so far (``/proc/self/status``), what glibc's malloc
holds in use and holds free (``mallinfo2``), and the tensors alive by kind (parameters, gradients,
Adam state, other: summed over unique storages found by the garbage collector, so a second copy of
the weights shows); per step its wall, CPU time and minor page faults.  The last stdout line is a
JSON object with the peak resident set over the start's, and whether any base weight has a gradient
or is in the optimizer.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

if "--thp" in sys.argv:  # read once, at torch's first allocation: before the import
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MODEL = "models/smollm2-135m-instruct"
GIB = 2 ** 30


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _status(key: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024 / GIB
    return float("nan")


def malloc_gib() -> tuple:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    m = libc.mallinfo2()
    return (m.uordblks + m.hblkhd) / GIB, m.fordblks / GIB  # in use (heap + mmapped), free but held


def tensors_gib(tr) -> dict:
    """Live tensor bytes by kind, each storage counted once."""
    seen, out = set(), {"params": 0, "grads": 0, "optim": 0, "other": 0}

    def add(t, kind):
        s = t.untyped_storage()
        if s.data_ptr() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            out[kind] += s.nbytes()

    if tr is not None:
        for p in tr.module.parameters():
            add(p, "params")
        for p in tr.module.parameters():
            if p.grad is not None:
                add(p.grad, "grads")
        for st in tr._torch_opt.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    add(v, "optim")
    for o in gc.get_objects():
        try:
            if torch.is_tensor(o) and o.device.type == "cpu":
                add(o, "other")
        except Exception:
            pass
    return {k: v / GIB for k, v in out.items()}


def micro_batches(tokens_per_mb: int, n_mbs: int, vocab: int):
    from arl.config import StabilizerConfig
    from arl.data import Trajectory
    from arl.data.packer import PackerConfig, pack_step
    from arl.ops.policy_loss import LossConfig
    from arl.stabilizers import Stabilizers
    from two_rank import random_chunk_ids

    rng = np.random.default_rng(0)
    L = tokens_per_mb // 4
    trajs = [Trajectory(tokens=rng.integers(0, vocab, L), chunk_ids=random_chunk_ids(rng, L),
                        rollout_logp=np.full(L, -4.2, np.float32), reward=float(i % 2), group_id=i // 4)
             for i in range(4 * n_mbs)]
    loss = LossConfig(ratio_level="token", surrogate="ppo_clip", clip_low=0.2, clip_high=0.28)
    stab = Stabilizers(StabilizerConfig(), loss)
    prep = stab.prepare(trajs, loss)
    packed = pack_step(prep.trajectories, PackerConfig(token_budget=tokens_per_mb, num_ranks=1), loss,
                       advantages=prep.advantages)
    stab.apply(packed, prep, loss)
    return packed.ranks[0], loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arm", choices=["full", "lora"])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (bench: 2048)")
    ap.add_argument("--mbs", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--malloc", choices=["arl", "default"], default="arl",
                    help="arl: the trainer rank's allocator setting (arl.trainer.memory); default: glibc's")
    ap.add_argument("--thp", action="store_true", help="THP_MEM_ALLOC_ENABLE=1: torch's large blocks on huge pages")
    ap.add_argument("--checkpointing", action="store_true", help="model.gradient_checkpointing")
    args = ap.parse_args()

    if args.malloc == "arl":
        from arl.trainer.memory import release_freed_memory

        release_freed_memory()
    torch.set_num_threads(args.threads)
    from arl.config import LoRAConfig, OptimConfig
    from arl.model.lora import apply_lora
    from arl.procs import free_port
    from arl.trainer.dist import init_distributed, set_rank_env
    from arl.trainer.policy import PolicyTrainer
    from transformers import AutoModelForCausalLM

    set_rank_env(0, 1, free_port())
    init_distributed("cpu")
    phases, tr = [], None

    def mark(name):
        gc.collect()
        used, held = malloc_gib()
        row = {"phase": name, "rss": _status("VmRSS"), "rss_peak": _status("VmHWM"), "malloc_used": used,
               "malloc_free_held": held, **tensors_gib(tr)}
        phases.append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    mark("start")
    m = AutoModelForCausalLM.from_pretrained(ROOT / MODEL, dtype=torch.float32)
    if args.checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.arm == "lora":
        m = apply_lora(m, LoRAConfig(r=16, alpha=32))
    mark("model")
    tr = PolicyTrainer(m, optim=OptimConfig(lr=1e-5), zero_stage=0, total_steps=10)
    del m
    mark("trainer")
    mbs, loss = micro_batches(args.tokens, args.mbs, tr.module.config.vocab_size)
    base_params = [n for n, p in tr.module.named_parameters() if ".lora_" not in n and args.arm == "lora"]
    step_s, cpu_s, faults = [], [], []
    for step in range(args.steps):
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        tr.rl_step(mbs, None, loss)
        step_s.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu_s.append({"user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime})
        faults.append(r1.ru_minflt - r0.ru_minflt)
        mark(f"step{step + 1}")
    state = tr.full_state_dict(copy=False)  # as the weight sync asks for it
    mark("sync_state")
    del state
    mark("after_sync")
    named = dict(tr.module.named_parameters())
    in_opt = {id(p) for g in tr._torch_opt.param_groups for p in g["params"]}
    checks = {"trainable": sum(p.numel() for p in tr.module.parameters() if p.requires_grad),
              "base_with_grad": sum(1 for n in base_params if named[n].grad is not None),
              "base_in_optimizer": sum(1 for n in base_params if id(named[n]) in in_opt)}
    peak = max(r["rss_peak"] for r in phases) - phases[0]["rss"]
    res = {"probe": "trainer_memory", "arm": args.arm, "malloc": args.malloc, "thp": args.thp,
           "checkpointing": args.checkpointing, "tokens_per_mb": args.tokens, "mbs": args.mbs, "steps": args.steps,
           "step_s": step_s, "cpu_s": cpu_s, "minor_faults": faults, "load": os.getloadavg()[0],
           "peak_rss_over_start_gib": peak, **checks, "phases": phases}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
