"""What a helper call costs the Triton interpreter (TRITON_INTERPRET=1): one 16-program kernel whose
body applies a 3-op function 5 times, written inline, as a ``@triton.jit`` helper, and as a plain
function (how arl/ops/policy_loss/triton_parts.py runs its helpers under the interpreter).  Process
CPU time per launch (median of ``--repeats``), so the figure holds on a loaded machine; the last
stdout line is one JSON object.

    python bench/probe_triton_helpers.py
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates anything

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

PROGRAMS, CALLS, BLOCK = 16, 5, 256


def _plain(x, y):
    return tl.where(x > y, x * 2.0, y - 1.0)


_jitted = triton.jit(_plain)


@triton.jit
def _inline_kernel(x_ptr, o_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    for _ in tl.static_range(N):
        x = tl.where(x > 0.5, x * 2.0, 0.5 - 1.0)
    tl.store(o_ptr + offs, x)


@triton.jit
def _jit_helper_kernel(x_ptr, o_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    for _ in tl.static_range(N):
        x = _jitted(x, 0.5)
    tl.store(o_ptr + offs, x)


@triton.jit
def _plain_helper_kernel(x_ptr, o_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    for _ in tl.static_range(N):
        x = _plain(x, 0.5)
    tl.store(o_ptr + offs, x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    x = torch.rand(PROGRAMS * BLOCK)
    outs, ms = {}, {}
    for name, k in (("inline", _inline_kernel), ("jit_helper", _jit_helper_kernel), ("plain_helper", _plain_helper_kernel)):
        o = torch.empty_like(x)
        k[(PROGRAMS,)](x, o, N=CALLS, BLOCK=BLOCK)
        ts = []
        for _ in range(args.repeats):
            t0 = time.process_time()
            k[(PROGRAMS,)](x, o, N=CALLS, BLOCK=BLOCK)
            ts.append(time.process_time() - t0)
        outs[name], ms[name] = o, statistics.median(ts) * 1e3
    assert torch.equal(outs["inline"], outs["jit_helper"]) and torch.equal(outs["inline"], outs["plain_helper"])
    calls = PROGRAMS * CALLS
    out = {"cpu_ms_per_launch": {k: round(v, 2) for k, v in ms.items()},
           "extra_ms_per_call": {k: round((ms[k] - ms["inline"]) / calls, 3) for k in ("jit_helper", "plain_helper")},
           "programs": PROGRAMS, "calls_per_program": CALLS, "triton": triton.__version__}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
