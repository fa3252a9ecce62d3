"""model.name_or_path: a local directory, or a hub id found in the local HF cache (a fake cache
here, through HF_HUB_CACHE), never the network; anything else is one line naming the key and
both places tried, at start-up and under --dry-run."""
import json

import pytest

from arl.config import load_config
from arl.prepare import model_dir_for
from arl.model.resolve import resolve_model
from arl.train import main

REPO = "someorg/SmallModel-Instruct"


def _model_dir(path):
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=320, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=32).save_pretrained(path)
    return path


def _fake_cache(root, repo=REPO, with_config=True):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    if with_config:
        _model_dir(snap)
    else:
        (snap / "tokenizer.json").write_text("{}")
    return snap


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_local_directory_is_itself(tmp_path, hf_cache):
    d = _model_dir(tmp_path / "m")
    assert resolve_model(str(d)) == str(d)


def test_hub_id_from_the_local_cache(hf_cache):
    snap = _fake_cache(hf_cache)
    assert resolve_model(REPO) == str(snap)


@pytest.mark.parametrize("what", ["missing", "cached_without_config", "dir_without_config", "bad_id"])
def test_anything_else_is_one_line_naming_the_key(what, tmp_path, hf_cache):
    name = {"missing": "nobody/nothing", "cached_without_config": REPO, "bad_id": "a/b/c/d",
            "dir_without_config": str(tmp_path)}[what]
    if what == "cached_without_config":
        _fake_cache(hf_cache, with_config=False)
    with pytest.raises(ValueError) as e:
        resolve_model(name)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"model.name_or_path: {name} is neither a local model directory nor in the local "
                          f"Hugging Face cache (tried ")
    assert msg.endswith(f" and {hf_cache})")


def test_the_launcher_uses_the_resolved_directory(hf_cache):
    snap = _fake_cache(hf_cache)
    assert model_dir_for(load_config(None, [f"model.name_or_path={REPO}"])) == str(snap)
    with pytest.raises(ValueError, match="model.name_or_path: nobody/nothing is neither"):
        model_dir_for(load_config(None, ["model.name_or_path=nobody/nothing"]))


def test_dry_run(hf_cache, capsys):
    snap = _fake_cache(hf_cache)
    assert main(["--dry-run", f"model.name_or_path={REPO}"]) == 0
    assert f"model OK: {snap}" in capsys.readouterr().out
    # not on this machine: fails at once, with the line
    assert main(["--dry-run", "model.name_or_path=nobody/nothing"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "config error: model.name_or_path: nobody/nothing is neither" in err
    # ... unless model.arch plans it (a big run planned where its weights are not): a warning
    arch = "model.arch={hidden: 64, layers: 2, heads: 4, kv_heads: 2, intermediate: 128, vocab_size: 1000}"
    assert main(["--dry-run", "model.name_or_path=nobody/nothing", arch]) == 0
    out = capsys.readouterr()
    assert "warning: model.name_or_path: nobody/nothing is neither" in out.err
    assert "planned from model.arch" in out.out
    # the run itself (not a dry run) stops before starting anything
    assert main(["model.name_or_path=nobody/nothing", arch]) == 2
    assert "config error: model.name_or_path: nobody/nothing" in capsys.readouterr().err


def test_dry_run_warns_when_model_arch_is_not_the_model(hf_cache, capsys):
    """The estimate comes from model.arch; when the model is here and says otherwise, the dry run
    names each field that differs (and still passes: the plan is the user's)."""
    snap = _fake_cache(hf_cache)
    real = json.loads((snap / "config.json").read_text())
    same = (f"model.arch={{hidden: {real['hidden_size']}, layers: {real['num_hidden_layers']}, "
            f"heads: {real['num_attention_heads']}, kv_heads: {real['num_key_value_heads']}, "
            f"intermediate: {real['intermediate_size']}, vocab_size: {real['vocab_size']}, "
            f"tie_word_embeddings: {str(real.get('tie_word_embeddings', False)).lower()}}}")
    assert main(["--dry-run", f"model.name_or_path={REPO}", same]) == 0
    assert "model.arch differs" not in capsys.readouterr().err
    other = same.replace(f"layers: {real['num_hidden_layers']}", f"layers: {real['num_hidden_layers'] + 1}")
    assert main(["--dry-run", f"model.name_or_path={REPO}", other]) == 0
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if "model.arch differs" in ln]
    assert len(line) == 1
    assert f"layers={real['num_hidden_layers'] + 1} (num_hidden_layers={real['num_hidden_layers']})" in line[0]
    assert "hidden=" not in line[0]
