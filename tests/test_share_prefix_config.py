"""``trainer.share_prefix: auto`` (the default): on for the CPU layout whose attention has the
shared-prefix path, off on GPU (not measured there yet) and for other attention; the dry run says
which and why; ``true`` with an attention that has no path is one line."""
import pytest

from arl.config import ConfigError, load_config
from arl.train import main

TINY, GPU = "configs/tiny_cpu.yaml", "configs/qwen2.5-7b_8gpu.yaml"


@pytest.mark.parametrize("path, overrides, on", [
    (TINY, [], True),
    (TINY, ["model.attn_implementation=varlen_sdpa"], True),
    (TINY, ["model.attn_implementation=hf_sdpa_packed"], False),
    (TINY, ["trainer.share_prefix=false"], False),
    (TINY, ["trainer.share_prefix=true"], True),
    (GPU, [], False),
    (GPU, ["trainer.share_prefix=true", "model.attn_implementation=auto"], True),
])
def test_auto_resolves_per_layout_and_attention(path, overrides, on):
    assert load_config(path, overrides).shares_prefix() is on


def test_true_without_a_shared_prefix_attention_is_one_line():
    with pytest.raises(ConfigError, match="trainer.share_prefix: needs model.attn_implementation auto or varlen_sdpa"):
        load_config(TINY, ["trainer.share_prefix=true", "model.attn_implementation=hf_sdpa_packed"])


@pytest.mark.parametrize("path, overrides, line", [
    (TINY, [], "share_prefix: on (each shared prefix computed once) (auto: the CPU layout)"),
    (TINY, ["model.attn_implementation=hf_sdpa_packed"],
     "share_prefix: off (auto: attn_implementation hf_sdpa_packed has no shared-prefix path)"),
    (TINY, ["trainer.share_prefix=false"], "share_prefix: off"),
    (GPU, [], "share_prefix: off (auto: GPU: not measured there yet)"),
])
def test_dry_run_says_whether_and_why(capsys, path, overrides, line):
    assert main(["--config", path, "--dry-run", *overrides]) == 0
    assert line in capsys.readouterr().out.splitlines()
