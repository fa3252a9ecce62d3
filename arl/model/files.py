"""Writing a model directory: model + tokenizer (safetensors) into a sibling temp dir, then one
rename, so a reader (or a concurrent writer) never sees a half-written directory."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping, Optional


def save_model_dir(out: Path, model, tokenizer, extra: Optional[Mapping[str, str]] = None) -> Path:
    """Save ``model`` and ``tokenizer`` to ``out`` (replaced whole), plus ``extra`` text files."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
