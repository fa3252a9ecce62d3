"""Packed forward of tiny random Qwen2 and Llama models (built locally, fp32, no download):
packed logprobs / entropies / parameter gradients equal a per-sequence unpacked forward within
1e-5 for random lengths, for every CPU attention path, and a leaking path is caught."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from arl.model import packed_hidden_states, packed_logprobs, position_ids_from_cu_seqlens

VOCAB = 151
TOL = dict(atol=1e-5, rtol=1e-5)


def _model(family):
    cfg_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[family]
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed({"qwen2": 0, "llama": 1}[family])
    return model_cls(cfg).eval()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request):
    return _model(request.param)


def _pack(seed, n=None):
    g = torch.Generator().manual_seed(seed)
    n = n or int(torch.randint(1, 6, (1,), generator=g))
    lens = torch.randint(1, 40, (n,), generator=g)
    ids = torch.randint(0, VOCAB, (int(lens.sum()),), generator=g)
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    return ids, cu


def _unpacked(model, ids, cu, align, temp=1.0):
    """Per-sequence forward; float64 log_softmax of the model's own logits."""
    T = ids.shape[0]
    logp, ent = torch.zeros(T, dtype=torch.float64), torch.zeros(T, dtype=torch.float64)
    off = 1 if align == "target" else 0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        lg = model(input_ids=ids[a:b][None]).logits[0].double() / temp
        ls = lg[:-1].log_softmax(-1)
        logp[a + off:b - 1 + off] = ls.gather(1, ids[a + 1:b, None]).squeeze(1)
        ent[a + off:b - 1 + off] = -(ls.exp() * ls).sum(-1)
    return logp, ent


@pytest.mark.parametrize("attn", ["varlen_sdpa", "hf_sdpa_packed", "auto"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_equals_unpacked(model, attn, seed):
    ids, cu = _pack(seed)
    align = "target" if seed % 2 == 0 else "next"
    temp = 1.0 if seed < 2 else 0.8
    with torch.no_grad():
        lp, ent = packed_logprobs(model, ids, cu, temperature=temp, with_entropy=True, align=align, attn=attn)
        ref_lp, ref_ent = _unpacked(model, ids, cu, align, temp)
    torch.testing.assert_close(lp, ref_lp.float(), **TOL)
    torch.testing.assert_close(ent, ref_ent.float(), **TOL)
    # boundary slots are exactly zero: first token (target) / last token (next) of every sequence
    edge = cu[:-1].long() if align == "target" else cu[1:].long() - 1
    assert (lp[edge] == 0).all() and (ent[edge] == 0).all()
    assert model.config._attn_implementation == "sdpa"  # swapped back


def test_parameter_gradients_match(model):
    ids, cu = _pack(7, n=4)
    g = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(3))
    params = [p for p in model.parameters() if p.requires_grad]
    lp, _ = packed_logprobs(model, ids, cu)
    got = torch.autograd.grad((lp * g).sum(), params)
    total = 0.0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ls = model(input_ids=ids[a:b][None]).logits[0, :-1].log_softmax(-1)
        total = total + (ls.gather(1, ids[a + 1:b, None]).squeeze(1) * g[a + 1:b]).sum()
    ref = torch.autograd.grad(total, params)
    for p_got, p_ref in zip(got, ref):
        torch.testing.assert_close(p_got, p_ref, **TOL)


def test_a_leaking_pack_is_detected(model):
    """Sanity check of the test itself: one causal attention over the whole pack (positions not
    restarted) must disagree with the per-sequence reference."""
    ids, cu = _pack(11, n=3)
    with torch.no_grad():
        ref, _ = _unpacked(model, ids, cu, "target")
        leak = model(input_ids=ids[None]).logits[0, :-1].double().log_softmax(-1)
        leak = leak.gather(1, ids[1:, None]).squeeze(1)
    second = slice(int(cu[1]) + 1, int(cu[2]))
    assert (leak[second.start - 1:second.stop - 1] - ref[second]).abs().max() > 1e-3


def test_hidden_states_shape_and_position_ids():
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert position_ids_from_cu_seqlens(cu).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    m = _model("llama")
    ids = torch.arange(3, 11)
    with torch.no_grad():
        h = packed_hidden_states(m, ids, cu)
        # each sequence on its own through the base model: the final, normed hidden states
        ref = torch.cat([m.model(input_ids=ids[a:b][None]).last_hidden_state[0] for a, b in zip(cu[:-1], cu[1:])])
    assert h.shape == (8, 64)
    torch.testing.assert_close(h, ref, **TOL)


@pytest.mark.parametrize(
    "cu, match",
    [
        ([0, 3, 7], "cu_seqlens: must start at 0 and end at T=8"),
        ([1, 3, 8], "cu_seqlens: must start at 0"),
        ([0, 3, 3, 8], "cu_seqlens: sequence 1 has length 0"),
        ([0], "cu_seqlens: expected"),
    ],
)
def test_bad_cu_seqlens_raise(cu, match):
    m = _model("qwen2")
    with pytest.raises(ValueError, match=match):
        packed_logprobs(m, torch.arange(8), torch.tensor(cu, dtype=torch.int32))


def test_bad_options_raise():
    m = _model("qwen2")
    ids, cu = torch.arange(8), torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="attn: unknown"):
        packed_logprobs(m, ids, cu, attn="nope")
    with pytest.raises(ValueError, match="align: unknown"):
        packed_logprobs(m, ids, cu, align="nope")
    with pytest.raises(ValueError, match="input_ids"):
        packed_logprobs(m, ids[None], cu)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="flash_attention_2' is not available"):
            packed_logprobs(m, ids, cu, attn="flash_attention_2")


def test_gradient_checkpointing_gives_the_same_gradients():
    """model.gradient_checkpointing (the GPU configs' memory estimate assumes it) through the packed
    forward: recomputed activations, the same logprobs and parameter gradients."""
    ids, cu = _pack(3)
    grads = []
    for ckpt in (False, True):
        m = _model("qwen2").train()
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lp, _ = packed_logprobs(m, ids, cu)
        lp.sum().backward()
        grads.append((lp.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-6, rtol=0)
    for n, g in grads[0][1].items():
        torch.testing.assert_close(g, grads[1][1][n], atol=1e-6, rtol=1e-5, msg=n)
    # the checkpointed model stays on arl's attention (recomputation needs it); its ordinary forwards
    # are transformers' SDPA, unchanged
    from arl.model.packed import ARL_VARLEN_SDPA

    assert m.config._attn_implementation == ARL_VARLEN_SDPA
    x = ids[None, :30]
    with torch.no_grad():
        torch.testing.assert_close(m.eval()(x).logits, _model("qwen2")(x).logits, atol=1e-6, rtol=0)
