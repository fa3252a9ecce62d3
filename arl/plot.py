"""``python -m arl.plot RUN_DIR [RUN_DIR2 ...] [--out curves.png] [--x step|wall]``: render one or
more run directories (their ``metrics.jsonl``) into one PNG grid of curves.

Each panel is a title and a list of glob patterns over metric keys (``fnmatch``); a pattern also
matches under any prefix (``clip_frac`` matches ``train/clip_frac``).  Panels with no matching key in any run are
left out.  Several runs share each panel (one colour per run, one line style per series), which is
how IPA and GRPO runs are compared.

``--group NAME=DIR,DIR,...`` (repeatable) draws one metric (``--key``, default held-out success)
instead: per group the mean over its runs and their min-max band, e.g. one method's seeds.
"""
from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path
from typing import Optional, Sequence

from .metrics.logger import METRICS_FILE, read_metrics

# (title, key patterns) -- order is the grid order
PANELS = (
    ("reward", ("reward/mean", "reward/q50", "rollout/reward_mean")),
    ("success rate", ("success/train", "success/heldout*", "success/eval*")),
    ("KL", ("approx_kl", "kl_mean", "kl_to_ref*")),
    ("clip / mismatch-masked fraction", ("clip_frac", "dual_clip_frac", "mismatch_masked_frac")),
    ("entropy", ("entropy_mean", "entropy/turn_*")),
    ("grad norm", ("grad_norm",)),
    ("length (tokens)", ("len/tokens_mean", "len/tokens_max", "len/failed_tokens_max", "len/success_tokens_max")),
    ("turns", ("len/turns_mean", "len/turns_max")),
    ("advantages", ("adv/nonzero_frac", "adv/zero_var_group_frac", "adv/negative_frac")),
    ("tool calls", ("tools/valid_rate", "tools/repeat_rate")),
    ("staleness", ("rollout/staleness_mean", "rollout/staleness_max")),
    ("rollout tokens / s", ("rollout/*tokens_per_s",)),
    ("train tokens / s", ("train/*tokens_per_s", "train_tokens_per_s")),
    ("logprob of successful trajectories", ("logp/success_mean",)),
    ("filtered / masked", ("status/filtered", "status/masked")),
    ("critic fit", ("value/explained_var", "value/adv_outcome_corr", "value/prompt_ev_ceiling", "value/state_ev_ceiling",
                    "value/progress_ev_ceiling")),
    ("value vs return by turn", ("value/calib/turn*",)),
)
X_AXES = {"step": "step", "wall": "wall_s"}
_STYLES = ("-", "--", ":", "-.")


def load_run(run_dir) -> list:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"{run_dir}: no {METRICS_FILE} (not a run directory?)")
    recs = read_metrics(path)
    if not recs:
        raise ValueError(f"{path}: holds no records")
    return recs


def _series(recs: list, patterns: Sequence[str]) -> list:
    keys = {k for r in recs for k in r if k not in ("step", "wall_s")}
    out = []
    for p in patterns:
        for k in sorted(set(fnmatch.filter(keys, p)) | set(fnmatch.filter(keys, "*/" + p))):
            if k not in out:
                out.append(k)
    return out


def plot_runs(run_dirs: Sequence, out: Optional[str] = None, x: str = "step", ncols: int = 4) -> Path:
    """Draw the curves of ``run_dirs`` into ``out`` (default RUN_DIR/curves.png); returns its path."""
    if x not in X_AXES:
        raise ValueError(f"--x: {x!r} not in {sorted(X_AXES)}")
    if not run_dirs:
        raise ValueError("no run directory given")
    runs = [(Path(d).resolve().name or str(d), load_run(d)) for d in run_dirs]
    names = [n if [m for m, _ in runs].count(n) == 1 else f"{n}#{i}" for i, (n, _) in enumerate(runs)]
    panels = []
    for title, pats in PANELS:
        per_run = [_series(recs, pats) for _, recs in runs]
        if any(per_run):
            panels.append((title, per_run))
    if not panels:
        raise ValueError(f"{run_dirs[0]}: no plottable metric (keys like reward/mean, clip_frac, grad_norm)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(ncols, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.3 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    xkey = X_AXES[x]
    for ax, (title, per_run) in zip(axes.flat, panels):
        for r, ((_, recs), keys) in enumerate(zip(runs, per_run)):
            for s, k in enumerate(keys):
                pts = [(rec[xkey], rec[k]) for rec in recs if rec.get(k) is not None and rec.get(xkey) is not None]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                label = k if len(runs) == 1 else f"{names[r]}: {k}"
                ax.plot(xs, ys, _STYLES[s % len(_STYLES)], color=colors[r % len(colors)] if len(runs) > 1
                        else colors[s % len(colors)], label=label, lw=1.4, marker="." if len(xs) < 30 else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("wall time (s)" if x == "wall" else "step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="best")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("  vs  ".join(names), fontsize=11)
    fig.tight_layout()
    path = Path(out) if out else Path(run_dirs[0]) / "curves.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _group_curve(run_dirs: Sequence, key: str, xkey: str, zero: bool = False):
    """Mean, min and max of ``key`` over runs, on the union of their x values: each run holds its
    last value until its next record (a step function: what the run had reached by then); a run
    counts only from its first record on.  ``zero``: each run's x counts from its first record."""
    series = []
    for d in run_dirs:
        pts = sorted((r[xkey], r[key]) for r in load_run(d) if r.get(key) is not None and r.get(xkey) is not None)
        if pts:
            series.append([(px - pts[0][0], v) for px, v in pts] if zero else pts)
    xs = sorted({x for s in series for x, _ in s})
    mean, lo, hi = [], [], []
    for x in xs:
        vals = [next(v for px, v in reversed(s) if px <= x) for s in series if s[0][0] <= x]
        mean.append(sum(vals) / len(vals))
        lo.append(min(vals))
        hi.append(max(vals))
    return xs, mean, lo, hi, len(series)


def plot_groups(groups: dict, out, key: str = "success/heldout", x: str = "wall", zero: bool = False) -> Path:
    """One panel of ``key`` vs ``x``: per group (a name and its runs, e.g. one method's seeds) the
    mean over its runs and the min-max band; returns the PNG's path.  ``zero``: every run's x starts
    at its first record of ``key`` (e.g. the clock from the start policy's evaluation, whatever ran
    before it)."""
    if x not in X_AXES:
        raise ValueError(f"x: {x!r} not in {sorted(X_AXES)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = 0
    for i, (name, dirs) in enumerate(groups.items()):
        xs, mean, lo, hi, n = _group_curve(dirs, key, X_AXES[x], zero)
        if not xs:
            continue
        c = colors[i % len(colors)]
        ax.step(xs, mean, where="post", color=c, lw=1.6, label=f"{name} (n={n})")
        if n > 1:
            ax.fill_between(xs, lo, hi, step="post", color=c, alpha=0.15)
        drawn += 1
    if not drawn:
        raise ValueError(f"no run of {sorted(groups)} has {key!r}")
    ax.set_xlabel(("wall time (s)" if x == "wall" else "step") + (f" from the first {key}" if zero else ""))
    ax.set_ylabel(key)
    if key.startswith("success"):
        ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _parse_group(spec: str):
    name, sep, dirs = spec.partition("=")
    if not sep or not name or not dirs:
        raise ValueError(f"--group: {spec!r} is not NAME=DIR[,DIR...]")
    return name, [d for d in dirs.split(",") if d]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arl.plot", description="Render run directories into a PNG of curves.")
    ap.add_argument("run_dirs", nargs="*", metavar="RUN_DIR")
    ap.add_argument("--group", action="append", default=[], metavar="NAME=DIR[,DIR...]",
                    help="instead of RUN_DIRs: mean and min-max band of --key over each group's runs")
    ap.add_argument("--key", default="success/heldout", help="the metric of --group plots")
    ap.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/curves.png of the first run)")
    ap.add_argument("--x", default="step", choices=sorted(X_AXES), help="x axis: step or wall time")
    ap.add_argument("--zero", action="store_true",
                    help="--group: every run's x starts at its first --key record (e.g. after a warm start)")
    args = ap.parse_args(argv)
    try:
        if args.group:
            if args.run_dirs:
                raise ValueError("give RUN_DIRs or --group, not both")
            path = plot_groups(dict(_parse_group(g) for g in args.group), args.out or "curves.png", args.key, args.x,
                               args.zero)
        elif args.zero:
            raise ValueError("--zero: only with --group")
        else:
            path = plot_runs(args.run_dirs, args.out, args.x)
    except (ValueError, OSError) as e:
        print(f"arl.plot: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
