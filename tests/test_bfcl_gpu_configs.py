"""The GPU recipes for BFCL (examples/bfcl/gpu/*.yaml) dry-run here, planned from ``model.arch``
(Qwen3's weights are not on this machine), and fit one 80 GB GPU; bench/gpu_check.sh's bfcl stage
runs the multi-turn recipe with overrides that validate too."""
import glob
import os
import re
import shlex

import pytest

pytest.importorskip("bfcl_eval", reason="bash install.sh --bfcl")

from arl.config import load_config  # noqa: E402
from arl.eval_bfcl import DEFAULTS  # noqa: E402
from arl.train import main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "examples", "bfcl", "gpu", "*.yaml")))
# Qwen3's config.json (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
# intermediate_size, vocab_size, tie_word_embeddings)
QWEN3 = {"qwen3-0.6b": (1024, 28, 16, 8, 3072, 151936, True), "qwen3-1.7b": (2048, 28, 16, 8, 6144, 151936, True),
         "qwen3-8b": (4096, 36, 32, 8, 12288, 151936, False)}
GPU_CHECK = os.path.join(ROOT, "bench", "gpu_check.sh")


def test_every_size_has_both_recipes():
    names = {os.path.basename(c) for c in CONFIGS}
    assert names == {"qwen3-0.6b_single.yaml", "qwen3-0.6b_multi.yaml", "qwen3-1.7b_single.yaml",
                     "qwen3-1.7b_multi.yaml", "qwen3-8b_lora_single.yaml", "qwen3-8b_lora_multi.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_recipe_dry_runs_and_fits_one_80gb_gpu(path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # env.kwargs.split is a repo-root path
    name = os.path.basename(path)
    cfg = load_config(path)
    a = cfg.model.arch
    assert (a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, a.vocab_size,
            a.tie_word_embeddings) == QWEN3[name.split("_")[0]]
    assert cfg.model.name_or_path == "Qwen/" + name.split("_")[0].replace("qwen3", "Qwen3").replace("b", "B")
    assert (cfg.model.lora is not None) == ("_lora_" in name)
    assert cfg.env.name == "bfcl" and cfg.env.tool_parser == "hermes" and cfg.layout.device == "cuda"
    if name.endswith("_multi.yaml"):
        assert cfg.env.kwargs["categories"] == ["multi_turn_base"] and cfg.env.max_turns >= 16
        assert cfg.rollout.max_total_tokens >= 8192
    else:
        assert cfg.env.kwargs["split"] == "examples/bfcl/split.json" and cfg.env.max_turns == 1
    assert main(["--config", path, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "env OK: bfcl" in out and "planned from model.arch" in out
    assert "schedule: colocated, alternating" in out
    peak = float(re.search(r"^  peak +([\d.]+) GiB", out, re.M).group(1))
    assert peak <= cfg.layout.gpu_memory_gib == 80


def _script():
    with open(GPU_CHECK) as f:
        return f.read()


def test_gpu_check_bfcl_stage_is_opt_in():
    text = _script()
    default = re.search(r"^STAGES=\$\{STAGES:-([^}]*)\}", text, re.M).group(1).split()
    assert "bfcl" not in default and "bfcl_train" not in default  # it needs a model the node is given


def test_gpu_check_bfcl_stage_overrides_validate(capsys, monkeypatch, tmp_path):
    """The stage's eval limits and its two-step training overrides, as the script writes them."""
    monkeypatch.chdir(ROOT)
    text = _script().replace("\\\n", " ")
    config = re.search(r"BFCL_CONFIG=\$\{BFCL_CONFIG:-(\S+)\}", text).group(1)
    assert os.path.isfile(config)
    limits = shlex.split(re.search(r'BFCL_LIMITS="([^"]*)"', text).group(1))
    cfg = load_config(config, DEFAULTS + ['env.kwargs.categories=["multi_turn_base"]'] + limits)
    assert cfg.rollout.max_total_tokens == load_config(config).rollout.max_total_tokens
    assert cfg.env.kwargs["system_prompt"] == "/no_think"
    line = re.search(r"stage bfcl_train \d+ python3 -m arl\.train (.*)", text).group(1)
    overrides = [t for t in shlex.split(line) if "=" in t]
    assert "trainer.steps=2" in overrides
    subst = {"$BFCL_MODEL": "Qwen/Qwen3-0.6B", "$BFCL_RUN": str(tmp_path / "run")}
    overrides = [re.sub(r"\$BFCL_\w+", lambda m: subst[m.group(0)], t) for t in overrides]
    assert main(["--config", config, "--dry-run", *overrides]) == 0
    assert "env OK: bfcl" in capsys.readouterr().out
