"""Host side of the Triton policy loss: options from the one table (options.py), scratch buffers,
the launch of ``triton_kernel._policy_loss_kernel`` and the deterministic reduction of its
per-sequence partials into the loss, the metrics and 1/D.  Imported only where Triton runs."""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .config import LossConfig
from .options import FOPTS, IOPTS, KL, LEVEL, LOSS_AGG, MISMATCH_MODE, compute_dtype, kernel_options, kernel_tensors
from .spec import METRIC_KEYS
from .triton_kernel import NPART, _policy_loss_kernel
from .types import KernelLaunch, LossInputs

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_PARAM_CACHE: dict = {}


def _params(fo: dict, has_clamp: bool, cdt: torch.dtype, device: torch.device) -> torch.Tensor:
    """The scalar options as one small float64 tensor (cached: no copy per call); the kernel rounds
    them to the compute dtype, except log2(gamma), the compute dtype's smallest normal number and the
    in-pass eps (float64 like the estimator)."""
    names = ("clip_low", "clip_high", "dual_clip", "gamma", "mismatch_low", "mismatch_high", "kl_beta",
             "entropy_coef", "log_ratio_clamp", "adv_eps")
    key = tuple(fo[n] for n in names) + (has_clamp, cdt, str(device))
    t = _PARAM_CACHE.get(key)
    if t is None:
        vals = [1.0 - fo["clip_low"], 1.0 + fo["clip_high"], fo["dual_clip"], math.log2(fo["gamma"]),
                fo["mismatch_low"], fo["mismatch_high"], fo["kl_beta"], fo["entropy_coef"],
                fo["log_ratio_clamp"] if has_clamp else math.inf, torch.finfo(cdt).tiny, fo["adv_eps"]]
        t = torch.tensor(vals + [0.0] * (16 - len(vals)), dtype=torch.float64, device=device)
        if len(_PARAM_CACHE) > 256:
            _PARAM_CACHE.clear()
        _PARAM_CACHE[key] = t
    return t


def _launch_sizes(T: int, N: int, cu: torch.Tensor, block: Optional[int]) -> tuple[int, int]:
    """(BLOCK, num_warps).  The interpreter pays per op, not per element: one big block covering the
    longest sequence; on a GPU 1024-token blocks over 4 warps."""
    if block is not None:  # tests force small blocks to cross block edges
        return block, 4
    if _INTERPRET:
        longest = int((cu[1:] - cu[:-1]).max().item()) if N else 1
        return min(max(triton.next_power_of_2(max(longest, 1)), 16), 4096), 1
    return 1024, 4


def _reduce_parts(parts: torch.Tensor, io: dict, fo: dict, has_entropy: bool, cdt, dev) -> tuple:
    """``(loss, stats)`` from the kernel's [N, NPART] per-sequence partials: the normalizer D, the loss and
    the metrics, reduced on the device in a fixed order (deterministic, no device->host sync)."""
    tot = parts.sum(0)
    ntok = parts[:, 1]
    n_tr = tot[1]
    agg = io["loss_agg"]
    if io["has_normalizer"]:
        D = torch.full((), fo["normalizer"], dtype=torch.float64, device=dev)  # a fill, not a host copy
    elif agg == LOSS_AGG["token-mean"]:
        D = n_tr
    else:
        S = (ntok > 0).sum().to(torch.float64)
        if agg == LOSS_AGG["seq-mean-token-sum-norm"]:
            Lc = ntok.max() if not io["has_agg_constant"] else torch.full((), fo["agg_constant"], dtype=torch.float64,
                                                                          device=dev)
            D = S * Lc
        else:
            D = S
    D = D.clamp_min(1e-30)
    loss = (tot[0] / D).to(cdt)
    nf = n_tr.clamp_min(1.0)
    m = {
        "clip_frac": tot[2] / nf,
        "dual_clip_frac": tot[3] / nf,
        "mismatch_masked_frac": tot[4] / nf,
        "approx_kl": tot[5] / nf,
        "ratio_mean": tot[6] / nf,
        "ratio_max": torch.where(n_tr > 0, parts[:, 7].max(), torch.zeros_like(n_tr)),
        "adv_nonzero_frac": tot[8] / nf,
        "tokens_kept": tot[9],
        "pg_loss": tot[10] / nf,
        "kl_mean": tot[11] / nf if io["kl"] != KL["off"] else torch.zeros_like(n_tr),
        "entropy_mean": tot[12] / nf if has_entropy else torch.zeros_like(n_tr),
    }
    stats = torch.stack([m[k].to(cdt).reshape(()) for k in METRIC_KEYS] + [1.0 / D.to(cdt)])
    return loss, stats


def triton_launch(inp: LossInputs, cfg: LossConfig, normalizer: Optional[float], need_grad: bool = True,
                  block: Optional[int] = None) -> KernelLaunch:
    """One kernel launch: loss, unnormalized dL/dlogp and dL/dentropy, metrics and 1/D."""
    toks, idx = kernel_tensors(inp, cfg)
    iopts, fopts = kernel_options(cfg, normalizer, inp.group)
    io, fo = dict(zip(IOPTS, iopts)), dict(zip(FOPTS, fopts))
    logp = toks["logp"]
    entropy = toks.get("entropy")
    cdt = compute_dtype(inp)
    dev = logp.device
    T, N = logp.numel(), inp.n_seq
    adv, rew = idx.get("advantages"), idx.get("rewards")
    gst = idx.get("group_stats")
    cid = idx["chunk_ids"].to(torch.int32)
    cu = idx["cu_seqlens"].to(torch.int32)
    tok = lambda n: toks.get(n, logp)  # noqa: E731 - absent inputs are never read

    ratio, mis = io["ratio_level"], io["mismatch_level"]
    use_gamma = fo["gamma"] != 1.0
    need_rank = use_gamma or ratio == LEVEL["chunk"] or mis == LEVEL["chunk"]
    need_pass1 = (need_rank or ratio == LEVEL["sequence"] or mis == LEVEL["sequence"]
                  or io["loss_agg"] == LOSS_AGG["seq-mean-token-mean"])
    store_q = need_rank and mis in (LEVEL["token"], LEVEL["chunk"])
    ent_grad = entropy is not None and bool(io["entropy_term"])

    glogp = torch.empty(T, dtype=cdt, device=dev)
    gent = torch.empty(T, dtype=cdt, device=dev) if ent_grad else glogp
    parts = torch.empty((N, NPART), dtype=torch.float64, device=dev)
    if need_rank:  # per-sequence chunk tables (see triton_kernel.py)
        comp = torch.empty(T, dtype=torch.int32, device=dev)
        sd = torch.empty(T, dtype=torch.float64, device=dev)
        sk = torch.empty(T, dtype=torch.int32, device=dev)
        sq = torch.empty(T, dtype=torch.float64, device=dev) if store_q else sd
    else:
        comp, sd, sk, sq = cid, parts, cid, parts
    block, warps = _launch_sizes(T, N, cu, block)
    _policy_loss_kernel[(N,)](  # absent per-sequence inputs are never read: any tensor stands in
        logp, tok("old_logp"), tok("rollout_logp"), tok("ref_logp"), tok("entropy"), cid, cu,
        adv if adv is not None else rew, rew if rew is not None else adv,
        idx.get("group_index", cu), gst if gst is not None else parts, gst.shape[0] if gst is not None else 0,
        _params(fo, bool(io["has_clamp"]), cdt, dev), glogp, gent, parts, comp, sd, sq, sk,
        ADV_EST=io["adv_estimator"], CDT=tl.float64 if cdt == torch.float64 else tl.float32, RATIO=ratio, SURR=io["surrogate"],
        DUAL=bool(io["has_dual"]), POS_ONLY=bool(io["positive_only"]), USE_GAMMA=use_gamma,
        MIS=mis, TRUNC=io["mismatch_mode"] == MISMATCH_MODE["truncate"], KL=io["kl"],
        HAS_ENT=entropy is not None, ENT_GRAD=ent_grad, AGG=io["loss_agg"], NEED_PASS1=need_pass1,
        NEED_RANK=need_rank, STORE_Q=store_q, BLOCK=block, NPART_C=NPART, num_warps=warps,
    )

    loss, stats = _reduce_parts(parts, io, fo, entropy is not None, cdt, dev)
    return KernelLaunch(loss=loss, grad_logp=glogp if need_grad else None, stats=stats,
                        entropy_grad=(lambda scale: gent * scale) if ent_grad else None)
