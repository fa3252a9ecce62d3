"""Trainer step throughput: arl's ``rl_step`` next to the model's raw packed fwd+bwd and a naive
Hugging Face-style step, on the same batch, in one run.

Shapes (``--shapes``):

* ``main``: the main job's model (configs/tiny_cpu.yaml: ``model.name_or_path: tiny``, built
  locally) and one trainer rank's share of one step of the main job's shape: ``tasks_per_step x
  group_size`` toy-task trajectories rendered by the task's expert (as the SFT demonstrations are),
  random 0/1 rewards, prepared, packed (``micro_batch_tokens``, ``world_size`` ranks) and given
  turn-credit segments by the main job's stabilizers, rollout logprobs = the model's own (an
  engine at staleness 0).
* ``large``: Qwen2.5-0.5B's shape (24 layers, hidden 896, vocab 151936, tied head) with random
  weights, short sequences (``--large-seqs`` of ``--large-len`` tokens), the main job's loss, one
  rank, arl at ZeRO stage ``--large-zero-stage`` (default 0: one rank has nothing to partition)
  (``--quick``: 1 layer, hidden 64, vocab 8192).

* ``calc``: SmolLM2-135M-Instruct's shape (configs/smollm2_tools_cpu.yaml, random weights) on a
  calculator-shaped batch (issue 38: ~450-token trajectories, ~370 of them the shared prompt: one
  system + tools block for the batch, a task prompt per group), ``--calc-tasks`` groups of each
  ``--calc-groups`` size: only ``arl`` (today's step) and ``arl_share_prefix`` (the same batch packed
  with ``share_prefix``: each shared prefix computed once), side by side (docs/share_prefix.md).
* ``main_share``: the main shape's batch the same way: rank 0's trajectories of the step (whole
  groups, as the ordinary packing gives them) packed for one rank without and with ``share_prefix``.

Variants, each over the same micro-batches (tokens/s counts the batch's real tokens):

* ``raw``: the model alone: packed forward (varlen attention) -> lm_head logits -> cross entropy
  (the model's own head and loss, as HF computes them) -> backward.  No old pass, no optimizer.
* ``arl``: ``PolicyTrainer.rl_step(mbs, None, ...)`` with ``head_grad_in_forward=True`` -- packed
  forward, the logprob head that computes its gradients in its forward (old = this pass's logp, so the
  loss's gradient is known there: arl/ops/logprob/grad_in_forward.py), ``policy_loss``, DeepSpeed
  backward and optimizer step.
* ``arl_with_old_pass``: ``old_logprobs`` (a no-grad forward over every micro-batch) + ``rl_step``:
  the step as it ran before the skip, and as it still runs with several updates or dropout.
* ``arl_recompute_head``: ``arl`` with ``head_grad_in_forward=False`` (the trainer's other head): the
  bounded-memory fused head whose backward recomputes the logits (4 lm_head matmuls instead of 3).
* ``arl_naive_head``: ``arl`` with the logprob head's ``naive`` backend ([T, V] logits).
* ``naive``: a naive HF-style step: each micro-batch's sequences padded to its longest, a no-grad
  padded forward for the old logprobs, the padded forward with full logits -> log_softmax ->
  gather (+ entropy), the reference torch ``policy_loss`` (the spec), backward, torch AdamW.  Its
  first step's loss must equal arl's first step's (same initial weights), or the bench fails.

Variants run one after another, each on its own model and optimizer built from the same seed (or
checkpoint), freed before the next (at the large shape two at once do not fit 24 GiB): before each
build a one-line memory estimate is printed and the run stops with a one-line error if it exceeds
the available memory (psutil); each variant's RSS peak is reported.  Per variant: a warm-up step
(``--warm all``; ``first``: only the first variant, the profiled step warms up the others), one step
under the allocation profiler (peak memory of one step beyond what exists before it,
bench_logprob.peak_bytes; arl's figures at ZeRO-2 include the reduce bucket it allocates in every
backward, ``reduce_bucket_size`` = 5e8 elements by default, 1.9 GiB in fp32, whose untouched pages
a CPU never makes resident), then ``--reps`` timed steps (median).  Sequential, not interleaved:
load drift on a shared machine hits the variants unequally -- record the load.  Also the breakdown
of an ``arl`` step with the old pass (forward, head+loss, backward, optimizer, old-logp pass,
other; timers around the real functions).  JSON: ``efficiency_vs_raw`` (arl / raw tokens/s),
``speedup_vs_naive`` (arl / naive), ``old_logp_pass_saved`` (the fraction of the with-pass step the
skip saves), ``fused_head_step_time_ratio`` (arl / arl_naive_head step time),
``grad_in_forward_step_time_ratio`` (arl / arl_recompute_head), ``recompute_head_step_time_ratio``
(arl_recompute_head / arl_naive_head), for the main shape at the top level (``*_large``: the large
shape's) and per shape under ``shapes``.  Timings on a shared machine are noise, not results.

    python bench/bench_trainer.py                 # main + large shape, 5 reps
    python bench/bench_trainer.py --quick         # 2 tasks, shrunk large shape, 1 rep, one warm-up per model
    python bench/bench_trainer.py --threads 1     # one trainer rank's thread count in the main job
    python bench/bench_trainer.py --shapes calc   # today's step vs share_prefix, G = 4 and 8
    python bench/bench_trainer.py --shapes main_share --quick   # the main job's shape, share_prefix off / on
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_logprob import peak_bytes  # noqa: E402

from arl.config import OptimConfig, load_config  # noqa: E402
from arl.data import Trajectory  # noqa: E402
from arl.data.packer import PackerConfig, pack_step  # noqa: E402
from arl.model.packed import packed_hidden_states, packed_logprobs  # noqa: E402
from arl.ops.policy_loss import LossConfig, policy_loss  # noqa: E402
from arl.stabilizers import Stabilizers  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "tiny_cpu.yaml")
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=32768, rope_theta=1_000_000.0)
QUICK_LARGE = dict(QWEN25_05B, vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1)
TARGETS = {"share_prefix_speedup_g8": 2.0, "share_prefix_speedup_g4": 1.5, "efficiency_vs_raw": 0.85, "efficiency_vs_raw_large": 0.9, "speedup_vs_naive": 1.5,
           "fused_head_step_time_ratio": 1.0, "fused_head_step_time_ratio_large": 1.0}


@dataclass
class Shape:
    name: str
    make_model: Callable[[], torch.nn.Module]  # the same initial weights at every call
    mbs: list  # this rank's micro-batches
    loss_cfg: LossConfig
    optim: OptimConfig
    zero_stage: int
    temperature: float
    describe: dict
    params: int = 0  # parameter count, for the memory estimate
    arch: object = None  # the model's HF config
    mbs_shared: Optional[list] = None  # the same batch packed with share_prefix (calc shape)


# ---------------------------------------------------------------- the batches
def _prepared(trajs, stab: Stabilizers, budget: int, ranks: int, seed: int, share_prefix: bool = False):
    """Rank 0's micro-batches and the loss config, as trainer rank 0 makes them (rank.next_batch)."""
    loss_cfg = stab.loss_config(0, None)
    prep = stab.prepare(trajs, loss_cfg)
    packed = pack_step(prep.trajectories, PackerConfig(token_budget=budget, num_ranks=ranks, seed=seed,
                                                       share_prefix=share_prefix), loss_cfg, advantages=prep.advantages)
    stab.apply(packed, prep, loss_cfg)
    return packed.ranks[0], loss_cfg


def _engine_logprobs(model, mbs) -> tuple:
    """rollout_logp = the model's own logprobs (an engine at staleness 0): the mismatch weight
    then sees the distances a real step sees, not noise.  Returns (parameter count, HF config)."""
    with torch.no_grad():
        for mb in mbs:
            if not mb.is_empty:
                mb.rollout_logp = packed_logprobs(model, mb.token_ids, mb.cu_seqlens)[0].cpu()
    return sum(p.numel() for p in model.parameters()), model.config


def _logprobs_back(mbs, trajs) -> None:
    """The engine's logprobs (``_engine_logprobs``) back onto the trajectories, to pack them again."""
    for mb in mbs:
        for i, x, y in zip(mb.traj_indices.tolist(), mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist()):
            trajs[i].rollout_logp = mb.rollout_logp[x:y].numpy().copy()


def main_shape(quick: bool, seed: int = 0, share: bool = False) -> Shape:
    from transformers import AutoTokenizer

    from arl.prepare import model_dir_for
    from arl.rollout.episode import ChatFormat
    from arl.rollout.expert import expert_demos
    from arl.trainer.models import load_policy

    cfg = load_config(CONFIG)
    model_dir = model_dir_for(cfg)
    tok = AutoTokenizer.from_pretrained(model_dir)
    G, tasks = cfg.rollout.group_size, (2 if quick else cfg.rollout.tasks_per_step)
    demos = expert_demos(cfg, ChatFormat(tok), G * tasks)
    if len(demos) < G * tasks:
        raise RuntimeError(f"main shape: the expert solved {len(demos)} of {G * tasks} tasks")
    rng = np.random.default_rng(seed)
    trajs = [dataclasses.replace(t, group_id=i // G, reward=float(rng.random() < 0.5)) for i, t in enumerate(demos)]
    stab = Stabilizers(cfg.stabilizers, cfg.loss, decode=tok.decode, algo=cfg.algo)
    mbs, loss_cfg = _prepared(trajs, stab, cfg.trainer.micro_batch_tokens, cfg.trainer.world_size, cfg.seed)
    make = lambda: load_policy(cfg, model_dir)  # noqa: E731
    params, arch = _engine_logprobs(make(), mbs)
    shared = None
    if share:  # rank 0's trajectories (whole groups), packed for it without and with share_prefix
        _logprobs_back(mbs, trajs)
        trajs = [trajs[i] for i in sorted(i for mb in mbs for i in mb.traj_indices.tolist())]
        mbs, loss_cfg = _prepared(trajs, stab, cfg.trainer.micro_batch_tokens, 1, cfg.seed)
        shared, _ = _prepared(trajs, stab, cfg.trainer.micro_batch_tokens, 1, cfg.seed, share_prefix=True)
    lens = [len(t) for t in trajs]
    return Shape("main_share" if share else "main", make, mbs, loss_cfg, cfg.trainer.optim, cfg.trainer.zero_stage,
                 cfg.rollout.temperature,
                 {"model": "tiny (configs/tiny_cpu.yaml)", "trajectories": len(trajs), "rank_share_of": cfg.trainer.world_size,
                  "traj_len_mean": float(np.mean(lens)), "traj_len_max": int(max(lens)),
                  "micro_batch_tokens": cfg.trainer.micro_batch_tokens}, params, arch, mbs_shared=shared)


def _synthetic(n: int, lo: int, hi: int, vocab: int, group: int, seed: int) -> list:
    """``n`` multi-turn-shaped trajectories: a prompt, then trained assistant chunks between
    untrained observations; random tokens, random 0/1 rewards, groups of ``group``."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(lo, hi + 1))
        chunk = np.full(L, -1, dtype=np.int32)
        pos, k = max(1, L // 4), 0
        while pos < L - 1:
            span = int(rng.integers(8, 24))
            chunk[pos:pos + span] = k
            k += 1
            pos += span + int(rng.integers(4, 16))
        out.append(Trajectory(tokens=rng.integers(0, vocab, L), chunk_ids=chunk, rollout_logp=np.zeros(L, np.float32),
                              reward=float(rng.random() < 0.5), group_id=i // group))
    return out


def large_shape(quick: bool, seqs: int, lens: tuple, budget: int, layers, zero_stage: int, seed: int = 0) -> Shape:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = load_config(CONFIG)
    arch = dict(QUICK_LARGE if quick else QWEN25_05B)
    if layers is not None:
        arch["num_hidden_layers"] = layers
    if quick:
        seqs, lens, budget = 8, (32, 64), 256

    def make():
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(Qwen2Config(**arch)).float()

    trajs = _synthetic(seqs, lens[0], lens[1], arch["vocab_size"], cfg.rollout.group_size, seed)
    stab = Stabilizers(cfg.stabilizers, cfg.loss, algo=cfg.algo)
    mbs, loss_cfg = _prepared(trajs, stab, budget, 1, seed)
    params, conf = _engine_logprobs(make(), mbs)
    _release()
    return Shape("large", make, mbs, loss_cfg, cfg.trainer.optim, zero_stage, cfg.rollout.temperature,
                 {"model": "Qwen2.5-0.5B shape, random weights" if not quick else "Qwen2.5-0.5B vocab, shrunk",
                  "zero_stage": zero_stage,
                  **{k: arch[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size")},
                  "trajectories": seqs, "traj_len": list(lens), "micro_batch_tokens": budget}, params, conf)


SMOLLM2_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "smollm2_tools_cpu.yaml")
CALC = dict(system=300, prompt=70, turn1=(15, 35), obs=(10, 20), turn2=(30, 50))  # ~450 tokens, ~370 prompt


def _calc_trajectories(tasks: int, group: int, vocab: int, seed: int) -> list:
    """The calculator batch's token structure (issue 38's measurement: ~450 tokens, ~370 of them the
    prompt, mostly the tool schemas): one system + tools block for the whole batch, a task prompt per
    group, then per sample a model turn, a tool observation and a second model turn; random tokens."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, CALC["system"])
    out = []
    for g in range(tasks):
        prompt = np.concatenate([system, rng.integers(0, vocab, CALC["prompt"])])
        for _ in range(group):
            spans = [int(rng.integers(*CALC[k])) for k in ("turn1", "obs", "turn2")]
            L = len(prompt) + sum(spans)
            chunk = np.full(L, -1, dtype=np.int32)
            a = len(prompt)
            chunk[a:a + spans[0]] = 0
            chunk[a + spans[0] + spans[1]:] = 1
            tokens = np.concatenate([prompt, rng.integers(0, vocab, sum(spans))])
            out.append(Trajectory(tokens=tokens, chunk_ids=chunk, rollout_logp=np.zeros(L, np.float32),
                                  reward=float(rng.random() < 0.5), group_id=g))
    return out


def calc_shape(quick: bool, group: int, tasks: int, layers, seed: int = 0) -> Shape:
    """SmolLM2-135M-Instruct's shape (configs/smollm2_tools_cpu.yaml's model.arch, random weights:
    step time does not depend on them) on a calculator-shaped batch of ``tasks`` groups of ``group``,
    packed as that config packs (micro_batch_tokens, one rank), with and without share_prefix."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = load_config(SMOLLM2_CONFIG)
    a = cfg.model.arch
    arch = dict(vocab_size=a.vocab_size, hidden_size=a.hidden, intermediate_size=a.intermediate,
                num_hidden_layers=layers or (4 if quick else a.layers), num_attention_heads=a.heads,
                num_key_value_heads=a.kv_heads, tie_word_embeddings=a.tie_word_embeddings,
                max_position_embeddings=2048)

    def make():
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(**arch)).float()

    trajs = _calc_trajectories(tasks, group, a.vocab_size, seed)
    stab = Stabilizers(cfg.stabilizers, cfg.loss, algo=cfg.algo)
    budget = cfg.trainer.micro_batch_tokens
    mbs, loss_cfg = _prepared(trajs, stab, budget, 1, seed)
    params, conf = _engine_logprobs(make(), mbs)
    _logprobs_back(mbs, trajs)  # for the shared packing
    mbs, loss_cfg = _prepared(trajs, stab, budget, 1, seed)
    shared, _ = _prepared(trajs, stab, budget, 1, seed, share_prefix=True)
    _release()
    lens = [len(t) for t in trajs]
    return Shape(f"calc_g{group}", make, mbs, loss_cfg, cfg.trainer.optim, cfg.trainer.zero_stage,
                 cfg.rollout.temperature,
                 {"model": "SmolLM2-135M shape, random weights", "group_size": group, "tasks": tasks,
                  **{k: arch[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size")},
                  "trajectories": len(trajs), "traj_len_mean": float(np.mean(lens)),
                  "shared_prompt": CALC["system"] + CALC["prompt"], "batch_wide_block": CALC["system"],
                  "micro_batch_tokens": budget}, params, conf, mbs_shared=shared)


# ---------------------------------------------------------------- the variants
def _next_token_targets(ids: torch.Tensor, cu: torch.Tensor):
    """Positions that have a next token in their sequence, and those next tokens."""
    has_next = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    has_next[cu[1:].long() - 1] = False
    src = has_next.nonzero().squeeze(1)
    return src, ids[src + 1]


def raw_step(model, mbs, device) -> None:
    """The model's own packed fwd+bwd: hidden states, lm_head logits, cross entropy, backward."""
    model.train()
    for mb in mbs:
        if mb.is_empty:
            continue
        ids, cu = mb.token_ids.to(device), mb.cu_seqlens.to(device)
        src, tgt = _next_token_targets(ids, cu)
        logits = model.get_output_embeddings()(packed_hidden_states(model, ids, cu).index_select(0, src))
        torch.nn.functional.cross_entropy(logits.float(), tgt).backward()
    model.zero_grad(set_to_none=True)


def _padded_logprobs(model, mb, temperature: float, with_entropy: bool, device):
    """Padded HF forward of one micro-batch's sequences; logprobs (and entropies) back in the packed
    target-aligned layout (0 at every sequence's first token), as ``packed_logprobs`` gives them."""
    cu = mb.cu_seqlens.tolist()
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    B, L = len(lens), max(lens)
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for b, (a, n) in enumerate(zip(cu[:-1], lens)):
        ids[b, :n] = mb.token_ids[a:a + n]
        mask[b, :n] = 1
    ids, mask = ids.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float() / temperature  # [B, L, V]
    logsm = torch.log_softmax(logits[:, :-1], dim=-1)
    lp = logsm.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logsm.exp() * logsm).sum(-1) if with_entropy else None

    def packed(x):
        x = torch.cat([x.new_zeros(B, 1), x], dim=1)
        return torch.cat([x[b, :n] for b, n in enumerate(lens)])

    return packed(lp), (packed(ent) if with_entropy else None)


def reference_loss(mb, logp, old, ent, loss_cfg: LossConfig, device) -> torch.Tensor:
    """The same policy loss rl_step computes for a non-IPA micro-batch, by the reference backend."""
    if mb.ipa is not None:
        raise ValueError("naive step: IPA micro-batches are not covered (the shapes here have none)")
    adv = mb.advantages.to(device, torch.float32) if mb.advantages is not None else None
    kw = mb.loss_kwargs()
    kw.pop("advantages")  # passed on their own (adv above), as rl_step does
    if mb.segments is not None:
        kw.update(mb.segments)
        adv = kw.pop("advantages").to(device, torch.float32)
    kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return policy_loss(logp, old, config=loss_cfg, entropy=ent, advantages=adv, backend="reference", **kw).loss


def naive_step(model, opt, shape: Shape, device) -> float:
    """HF-style: padded no-grad forward for the old logprobs, padded forward with full logits,
    the reference loss, backward, gradient clipping, AdamW.  Returns the summed loss."""
    total = 0.0
    for mb in shape.mbs:
        if mb.is_empty:
            continue
        model.eval()
        with torch.no_grad():
            old, _ = _padded_logprobs(model, mb, shape.temperature, False, device)
        model.train()
        logp, ent = _padded_logprobs(model, mb, shape.temperature, True, device)
        loss = reference_loss(mb, logp, old, ent, shape.loss_cfg, device)
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), shape.optim.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


@contextlib.contextmanager
def patched(*triples):
    """Set ``obj.name = value`` for each (obj, name, value); restore afterwards (instance attributes
    that shadowed nothing are deleted again)."""
    saved = [(o, n, o.__dict__[n] if n in vars(o) else None, n in vars(o)) for o, n, _ in triples]
    for o, n, v in triples:
        setattr(o, n, v)
    try:
        yield
    finally:
        for o, n, v, had in reversed(saved):
            if had:
                setattr(o, n, v)
            else:
                delattr(o, n)


def naive_head():
    """arl's step with the logprob head's ``naive`` backend ([T, V] logits) instead of the fused op."""
    import arl.model.packed as P

    fused = P.fused_logprobs
    return patched((P, "fused_logprobs", lambda *a, **k: fused(*a, **{**k, "backend": "naive"})))


class PhaseTimer:
    def __init__(self, device):
        self.device, self.s = device, defaultdict(float)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def wrap(self, phase: str, fn, grad_only: bool = False):
        def timed(*a, **k):
            if grad_only and not torch.is_grad_enabled():  # the old pass's forwards count as that pass
                return fn(*a, **k)
            self._sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self._sync()
            self.s[phase] += time.perf_counter() - t0
            return out

        return timed


def instrumented(tr, timer: PhaseTimer):
    """Timers around the functions an rl_step calls: the packed forward (grad-enabled calls),
    the logprob head and the loss, DeepSpeed's backward and optimizer step, the old-logp pass."""
    import arl.model.packed as P
    import arl.algo.objectives as OB

    return patched(
        (P, "packed_hidden_states", timer.wrap("forward", P.packed_hidden_states, grad_only=True)),
        (P, "_head_logprobs", timer.wrap("head+loss", P._head_logprobs, grad_only=True)),
        (OB, "policy_loss", timer.wrap("head+loss", OB.policy_loss)),
        (OB, "ipa_mixed_loss", timer.wrap("head+loss", OB.ipa_mixed_loss)),
        (tr.engine, "backward", timer.wrap("backward", tr.engine.backward)),
        (tr.engine, "step", timer.wrap("optimizer", tr.engine.step)),
        (tr, "old_logprobs", timer.wrap("old_logp_pass", tr.old_logprobs)),
    )


# ---------------------------------------------------------------- measuring
def _rss_reset() -> None:
    """Reset the kernel's peak-RSS mark of this process (VmHWM), so the next read is one variant's."""
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def _rss_peak_mb() -> Optional[float]:
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    return None


def _release() -> None:
    """Free what the last variant held: cycles (DeepSpeed's hooks), then the C heap's free pages,
    which glibc keeps (and RSS counts) after the small activation buffers are freed."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# bytes per parameter each variant holds: weights + gradients (+ AdamW's two moments); arl's
# DeepSpeed ZeRO-1/2 engine also keeps an fp32 master partition, a gradient partition and a reduce
# bucket of min(P, reduce_bucket_size) elements, which one rank fills with every gradient
_STATE_COPIES = {"raw": 2, "naive": 4, "arl": 6}
_REDUCE_BUCKET = 5e8  # DeepSpeed's default reduce_bucket_size (elements)


def memory_estimate(shape: Shape, variant: str) -> dict:
    """A rough estimate of one variant's resident memory (``gib``): this process's RSS now plus what the
    build adds (``new_gib``): parameter states, activations of the largest micro-batch (saved per
    layer and token: ~12 hidden + 5 intermediate floats) and the head's logits
    ([tokens, V] fp32, ~3 live copies for raw's and the naive head's; the naive step's padded batch, ~5)."""
    P, c = shape.params, shape.arch
    kind = "arl" if variant.startswith("arl") else variant
    states = _STATE_COPIES[kind] * P * 4
    if kind == "arl" and shape.zero_stage in (1, 2):
        states += min(P, _REDUCE_BUCKET) * 4
    tok = max(mb.num_tokens for mb in shape.mbs)
    if kind == "naive":
        cu = [mb.cu_seqlens.tolist() for mb in shape.mbs if not mb.is_empty]
        tok = max((len(x) - 1) * max(b - a for a, b in zip(x[:-1], x[1:])) for x in cu)
    acts = tok * c.num_hidden_layers * (12 * c.hidden_size + 5 * c.intermediate_size) * 4
    head = tok * c.vocab_size * 4 * (5 if kind == "naive" else 3 if variant in ("raw", "arl_naive_head") else 0)
    import psutil

    base = psutil.Process().memory_info().rss  # this process before the build (libraries, the batch)
    new = states + acts + head
    return {"params": P, "gib": round((base + new) / 2**30, 2), "new_gib": round(new / 2**30, 2)}


def _check_fits(shape: Shape, variant: str) -> dict:
    import psutil

    est = memory_estimate(shape, variant)
    avail = psutil.virtual_memory().available / 2**30
    print(f"[{shape.name}] {variant}: memory estimate {est['gib']:.2f} GiB ({est['params'] / 1e6:.0f}M params), "
          f"available {avail:.2f} GiB", flush=True)
    if est["new_gib"] > avail:
        raise SystemExit(f"{shape.name}/{variant}: needs about {est['new_gib']:.1f} GiB more, only {avail:.1f} GiB available "
                         f"(fewer --large-seqs / --large-budget / --large-layers)")
    return est


def _plain(shape: Shape, device, with_opt: bool):
    model = shape.make_model().to(device)
    o = shape.optim
    opt = (torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
           if with_opt else None)
    return model, opt


def _trainer(shape: Shape, **kw):
    from arl.trainer import PolicyTrainer

    tr = PolicyTrainer(shape.make_model(), optim=shape.optim, zero_stage=shape.zero_stage, total_steps=10**6,
                       temperature=shape.temperature, **kw)
    if tr.old_pass_needed(1):
        raise RuntimeError(f"{shape.name}: the model keeps the old-logp pass ({tr.train_randomness})")
    return tr


def _v_raw(shape, device):
    model, _ = _plain(shape, device, with_opt=False)
    return lambda: raw_step(model, shape.mbs, device)


def _v_naive(shape, device):
    model, opt = _plain(shape, device, with_opt=True)
    return lambda: naive_step(model, opt, shape, device)


def _v_arl(shape, device):
    tr = _trainer(shape, head_grad_in_forward=True)
    return lambda: tr.rl_step(shape.mbs, None, shape.loss_cfg)


def _v_arl_share_prefix(shape, device):
    tr = _trainer(shape, head_grad_in_forward=True)
    return lambda: tr.rl_step(shape.mbs_shared, None, shape.loss_cfg)


def _v_arl_with_old_pass(shape, device):
    tr = _trainer(shape)
    call = lambda: tr.rl_step(shape.mbs, tr.old_logprobs(shape.mbs), shape.loss_cfg)  # noqa: E731
    call.trainer = tr  # the breakdown runs on this variant's trainer
    return call


def _v_arl_recompute_head(shape, device):
    tr = _trainer(shape, head_grad_in_forward=False)
    return lambda: tr.rl_step(shape.mbs, None, shape.loss_cfg)


def _v_arl_naive_head(shape, device):
    tr = _trainer(shape, head_grad_in_forward=False)

    def call():
        with naive_head():
            return tr.rl_step(shape.mbs, None, shape.loss_cfg)

    return call


# name -> builder(shape, device) -> one step's callable (holding its own model and optimizer, all
# built from the same seed or checkpoint: the same initial weights).  Measured one at a time.
VARIANT_BUILDERS = {
    "raw": _v_raw,
    "naive": _v_naive,
    "arl": _v_arl,
    "arl_with_old_pass": _v_arl_with_old_pass,
    "arl_recompute_head": _v_arl_recompute_head,
    "arl_naive_head": _v_arl_naive_head,
    "arl_share_prefix": _v_arl_share_prefix,  # the calc shapes only (measure_share)
}


def _breakdown(tr, shape: Shape, reps: int, device) -> dict:
    """Phase times of the step with the old pass, averaged over ``reps`` instrumented steps."""
    timer = PhaseTimer(device)
    for _ in range(reps):
        t0 = time.perf_counter()
        with instrumented(tr, timer):
            tr.rl_step(shape.mbs, tr.old_logprobs(shape.mbs), shape.loss_cfg)
        timer.s["total"] += time.perf_counter() - t0
    parts = {k: v / reps for k, v in timer.s.items()}
    parts["other"] = parts["total"] - sum(v for k, v in parts.items() if k != "total")
    return parts


def _measure_variant(shape: Shape, name: str, reps: int, device, warm: bool) -> dict:
    """Build one variant, warm it up (lazily created optimizer state, kernels, caches), one step
    under the allocation profiler (peak beyond what exists before it), ``reps`` timed steps; free."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    est = _check_fits(shape, name)
    _rss_reset()
    call = VARIANT_BUILDERS[name](shape, device)
    first = call() if warm else None
    total, _, out = peak_bytes(call, device)
    first = out if first is None else first
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - t0)
    parts = _breakdown(call.trainer, shape, reps, device) if hasattr(call, "trainer") else None
    res = {"step_s": statistics.median(times), "peak_mb": round(total / 2**20, 1), "first": first,
           "rss_peak_mb": _rss_peak_mb(), "estimate_gib": est["gib"], "parts": parts}
    del call
    _release()
    return res


def _ratio(a, b, digits: int = 4):
    return round(a / b, digits) if a is not None and b is not None else None


def measure(shape: Shape, reps: int, device, warm_all: bool = True, variants=None) -> dict:
    """Every variant on the same micro-batches, one after another (one model and optimizer held at
    a time: at the large shape two at once do not fit a 24 GiB machine); without ``warm_all`` only
    the first variant gets a warm-up step (--quick)."""
    mbs = shape.mbs
    tokens = sum(mb.num_tokens for mb in mbs)
    import psutil

    names = [n for n in VARIANT_BUILDERS if (variants is None and n != "arl_share_prefix") or n in (variants or ())]
    worst = max(names, key=lambda n: memory_estimate(shape, n)["new_gib"])
    if memory_estimate(shape, worst)["new_gib"] > psutil.virtual_memory().available / 2**30:
        _check_fits(shape, worst)  # fail before any variant ran
    runs = {name: _measure_variant(shape, name, reps, device, warm=warm_all or i == 0)
            for i, name in enumerate(names)}
    step_s = {k: r["step_s"] for k, r in runs.items()}
    parts = runs["arl_with_old_pass"]["parts"] if "arl_with_old_pass" in runs else {}
    gif = runs["arl"]["first"].get("head_grad_in_forward", 0.0)
    loss_diff = None
    if "naive" in runs:  # both first steps ran on the initial weights: the naive step computes arl's loss
        first_naive, first_arl = runs["naive"]["first"], runs["arl"]["first"]
        loss_diff = abs(first_naive - first_arl["loss"]) / max(abs(first_arl["loss"]), 1e-12)
        if loss_diff > 1e-3:
            raise RuntimeError(f"{shape.name}: the naive step's loss {first_naive} differs from arl's {first_arl['loss']}")
    tps = {k: tokens / v for k, v in step_s.items()}
    s_ = step_s.get
    return {
        "shape": shape.describe, "tokens": tokens, "micro_batches": sum(not mb.is_empty for mb in mbs),
        "step_s": {k: round(v, 4) for k, v in step_s.items()},
        "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "peak_mb": {k: r["peak_mb"] for k, r in runs.items()},
        "rss_peak_mb": {k: r["rss_peak_mb"] for k, r in runs.items()},
        "memory_estimate_gib": {k: r["estimate_gib"] for k, r in runs.items()},
        "breakdown_s": {k: round(v, 4) for k, v in parts.items()},
        "efficiency_vs_raw": _ratio(s_("raw"), s_("arl")),
        "speedup_vs_naive": _ratio(s_("naive"), s_("arl")),
        "old_logp_pass_saved": (round(1.0 - step_s["arl"] / step_s["arl_with_old_pass"], 4)
                                if "arl_with_old_pass" in step_s else None),
        "old_logp_pass_saved_s": (round(step_s["arl_with_old_pass"] - step_s["arl"], 4)
                                  if "arl_with_old_pass" in step_s else None),
        "fused_head_step_time_ratio": _ratio(s_("arl"), s_("arl_naive_head")),
        "recompute_head_step_time_ratio": _ratio(s_("arl_recompute_head"), s_("arl_naive_head")),
        "grad_in_forward_step_time_ratio": _ratio(s_("arl"), s_("arl_recompute_head")),
        "head_grad_in_forward": gif,
        "naive_loss_rel_diff": None if loss_diff is None else float(f"{loss_diff:.3g}"),
    }


def measure_share(shape: Shape, reps: int, device, warm: bool = True) -> dict:
    """Today's step (``arl``) and the shared-prefix step (``arl_share_prefix``) on the same batch:
    step time, tokens computed, peak memory; their first steps' losses (same initial weights) must
    agree, or the bench fails.  Without ``warm`` the profiled step is each variant's warm-up."""
    runs = {name: _measure_variant(shape, name, reps, device, warm=warm) for name in ("arl", "arl_share_prefix")}
    packs = {"arl": shape.mbs, "arl_share_prefix": shape.mbs_shared}
    la, lb = runs["arl"]["first"]["loss"], runs["arl_share_prefix"]["first"]["loss"]
    loss_diff = abs(la - lb) / max(abs(la), 1e-12)
    if loss_diff > 1e-4:
        raise RuntimeError(f"{shape.name}: the shared-prefix step's loss {lb} differs from today's {la}")
    step_s = {k: r["step_s"] for k, r in runs.items()}
    return {
        "shape": shape.describe, "tokens": sum(mb.num_tokens for mb in shape.mbs),
        "computed_tokens": {k: sum(mb.computed_tokens for mb in m) for k, m in packs.items()},
        "micro_batches": {k: sum(not mb.is_empty for mb in m) for k, m in packs.items()},
        "step_s": {k: round(v, 4) for k, v in step_s.items()},
        "peak_mb": {k: r["peak_mb"] for k, r in runs.items()},
        "rss_peak_mb": {k: r["rss_peak_mb"] for k, r in runs.items()},
        "head_grad_in_forward": {k: r["first"].get("head_grad_in_forward") for k, r in runs.items()},
        "share_prefix_speedup": _ratio(step_s["arl"], step_s["arl_share_prefix"], 3),
        "loss_rel_diff": float(f"{loss_diff:.3g}"),
    }


def report_share(name: str, r: dict) -> None:
    print(f"[{name}] {r['tokens']} tokens  {r['shape']}", flush=True)
    for k in r["step_s"]:
        print(f"[{name}] {k:18s} step {r['step_s'][k]:9.4f} s  computed {r['computed_tokens'][k]:6d} tokens in "
              f"{r['micro_batches'][k]} micro-batches  peak {r['peak_mb'][k]:9.1f} MiB  RSS peak "
              f"{r['rss_peak_mb'][k]} MiB", flush=True)
    print(f"[{name}] share_prefix_speedup {r['share_prefix_speedup']}  loss_rel_diff {r['loss_rel_diff']}", flush=True)


def report(name: str, r: dict) -> None:
    print(f"[{name}] {r['tokens']} tokens in {r['micro_batches']} micro-batches  {r['shape']}", flush=True)
    for k in r["step_s"]:
        print(f"[{name}] {k:18s} step {r['step_s'][k]:9.4f} s  {r['tokens_per_s'][k]:10.1f} tok/s  "
              f"peak {r['peak_mb'][k]:9.1f} MiB  RSS peak {r['rss_peak_mb'][k]} MiB "
              f"(estimate {r['memory_estimate_gib'][k]} GiB)", flush=True)
    b = r["breakdown_s"]
    if b:
        print(f"[{name}] breakdown of an arl step with the old pass: "
              + "  ".join(f"{k} {v:.4f} s" for k, v in b.items()), flush=True)
    print(f"[{name}] efficiency_vs_raw {r['efficiency_vs_raw']}  speedup_vs_naive {r['speedup_vs_naive']}  "
          f"old_logp_pass_saved {r['old_logp_pass_saved']}  fused_head_step_time_ratio "
          f"{r['fused_head_step_time_ratio']}  recompute_head_step_time_ratio {r['recompute_head_step_time_ratio']}  "
          f"grad_in_forward_step_time_ratio {r['grad_in_forward_step_time_ratio']} "
          f"(grad-in-forward head on {r['head_grad_in_forward']:.0%} of arl's micro-batches)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 tasks, a shrunk large shape, 1 rep")
    ap.add_argument("--shapes", default="main,large",
                    help="comma-separated: main, large, calc (SmolLM2 calculator batch, today's step vs share_prefix), "
                         "main_share (the main shape, today's step vs share_prefix)")
    ap.add_argument("--calc-groups", default="4,8", help="group sizes of the calc shape")
    ap.add_argument("--calc-tasks", type=int, default=None, help="groups per calc batch (default 4, quick 2)")
    ap.add_argument("--calc-layers", type=int, default=None, help="layers at the calc shape (default 30, quick 4)")
    ap.add_argument("--reps", type=int, default=None, help="timed steps per variant (median; default 5, quick 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: every core available)")
    ap.add_argument("--large-seqs", type=int, default=16)
    ap.add_argument("--large-len", default="96,256", help="min,max trajectory length at the large shape")
    ap.add_argument("--large-budget", type=int, default=1024, help="micro_batch_tokens at the large shape")
    ap.add_argument("--large-layers", type=int, default=None, help="override the large shape's layer count")
    ap.add_argument("--large-zero-stage", type=int, choices=(0, 1, 2, 3), default=0,
                    help="arl's ZeRO stage at the large shape (one rank: nothing to partition, and stage 2's "
                         "master copy, gradient partition and bucket would add 3 model sizes; default 0)")
    ap.add_argument("--large-variants", default=None,
                    help="comma-separated subset of the variants at the large shape (arl always runs)")
    ap.add_argument("--warm", choices=("all", "first"), default=None,
                    help="a warm-up step for every variant, or only the first (then the profiled step warms "
                         "the others up; default: all, --quick: first)")
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in ("main", "large", "calc", "main_share")]
    if bad or not shapes:
        ap.error(f"--shapes: unknown {bad or shapes}; choose from main, large, calc, main_share")
    lens = tuple(int(x) for x in args.large_len.split(","))
    if len(lens) != 2 or not 2 <= lens[0] <= lens[1]:
        ap.error(f"--large-len: expected min,max with 2 <= min <= max, got {args.large_len!r}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = args.threads or len(os.sched_getaffinity(0))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # what init_distributed applies on CPU
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from arl.procs import free_port
    from arl.trainer.dist import init_distributed, set_rank_env

    set_rank_env(0, 1, free_port())
    init_distributed(device.type)
    torch.set_num_threads(threads)
    reps = args.reps or (1 if args.quick else 5)
    results = {}
    for G in ([int(g) for g in args.calc_groups.split(",")] if "calc" in shapes else []):
        shape = calc_shape(args.quick, G, args.calc_tasks or (2 if args.quick else 4), args.calc_layers)
        results[shape.name] = measure_share(shape, reps, device, warm=(args.warm or ("first" if args.quick else "all"))
                                            == "all")
        report_share(shape.name, results[shape.name])
    if "main_share" in shapes:
        shape = main_shape(args.quick, share=True)
        results[shape.name] = measure_share(shape, reps, device, warm=(args.warm or ("first" if args.quick else "all"))
                                            == "all")
        report_share(shape.name, results[shape.name])
    for name in [s for s in shapes if s not in ("calc", "main_share")]:
        shape = (main_shape(args.quick) if name == "main" else
                 large_shape(args.quick, args.large_seqs, lens, args.large_budget, args.large_layers,
                             args.large_zero_stage))
        warm = args.warm or ("first" if args.quick else "all")
        subset = None
        if name == "large" and args.large_variants:
            subset = set(args.large_variants.split(",")) | {"arl"}
            bad = subset - set(VARIANT_BUILDERS)
            if bad:
                ap.error(f"--large-variants: unknown {sorted(bad)}; choose from {list(VARIANT_BUILDERS)}")
        results[name] = measure(shape, reps, device, warm_all=warm == "all", variants=subset)
        report(name, results[name])
    head = results.get("main") or results.get("large")
    summary = {
        "bench": "trainer", "quick": bool(args.quick), "device": str(device), "torch_threads": torch.get_num_threads(),
        "reps": reps,
        **({k: head[k] for k in ("efficiency_vs_raw", "speedup_vs_naive", "old_logp_pass_saved",
                                 "fused_head_step_time_ratio", "grad_in_forward_step_time_ratio", "peak_mb")}
           if head else {}),
        **{f"share_prefix_speedup_{k[5:]}": r["share_prefix_speedup"] for k, r in results.items()
           if k.startswith("calc_")},
        **({"share_prefix_speedup_main": results["main_share"]["share_prefix_speedup"]}
           if "main_share" in results else {}),
        **({"efficiency_vs_raw_large": results["large"]["efficiency_vs_raw"],
            "fused_head_step_time_ratio_large": results["large"]["fused_head_step_time_ratio"],
            "grad_in_forward_step_time_ratio_large": results["large"]["grad_in_forward_step_time_ratio"]}
           if "large" in results else {}),
        "targets": TARGETS, "shapes": results,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
