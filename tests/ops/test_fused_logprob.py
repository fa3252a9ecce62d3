"""Fused lm_head -> logprob (+ entropy): every backend against naive log_softmax + gather, on
values and on gradients to hidden and weight (fp32, 1e-5), odd sizes that are not multiples of
the tiles, temperature != 1, entropy on and off.  Triton runs under TRITON_INTERPRET=1."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from arl.ops.logprob import available_logprob_backends, fused_logprobs, naive_logprobs

# small tiles / blocks so every loop runs several partial iterations on these odd sizes
BACKENDS = {
    "torch_chunked": dict(tile_t=8, tile_v=16),
    "torch_chunked_default": dict(),
    "triton": dict(blocks=(16, 32, 16)),
    "triton_default": dict(),
}
TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(T=37, H=24, V=101, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g, dtype=dtype)
    w = (torch.randn(V, H, generator=g, dtype=dtype) * 0.4)
    y = torch.randint(0, V, (T,), generator=g)
    gl = torch.randn(T, generator=g, dtype=dtype)
    ge = torch.randn(T, generator=g, dtype=dtype)
    return h, w, y, gl, ge


def _run(fn, h, w, y, gl, ge, temp, ent, **kw):
    h = h.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    lp, e = fn(h, w, y, temp, ent, **kw)
    loss = (lp * gl).sum() + ((e * ge).sum() if ent else 0.0)
    gh, gw = torch.autograd.grad(loss, (h, w))
    return lp, e, gh, gw


def _backend(name):
    base = name.removesuffix("_default")
    if base not in available_logprob_backends():
        pytest.skip(f"{base} not available here")
    return base, BACKENDS[name]


def _on(base, *xs):
    """Compiled Triton needs CUDA tensors; under the interpreter (no GPU) it runs on the CPU ones."""
    dev = "cuda" if base == "triton" and torch.cuda.is_available() else "cpu"
    return tuple(x.to(dev) for x in xs)


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("ent", [False, True])
@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_matches_naive_values_and_grads(name, ent, temp):
    base, tiles = _backend(name)
    h, w, y, gl, ge = _on(base, *_inputs())
    got = _run(lambda *a: fused_logprobs(*a, backend=base, **tiles), h, w, y, gl, ge, temp, ent)
    ref = _run(naive_logprobs, h.double(), w.double(), y, gl.double(), ge.double(), temp, ent)
    names = ("logp", "entropy", "grad_hidden", "grad_weight")
    for n, a, b in zip(names, got, ref):
        if b is None:
            assert a is None, n
            continue
        assert a.dtype == torch.float32, n
        torch.testing.assert_close(a, b.float(), **TOL, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("name", ["torch_chunked", "triton"])
def test_entropy_gradient_alone_and_weight_only(name):
    base, tiles = _backend(name)
    h, w, y, gl, ge = _on(base, *_inputs(T=19, V=67, seed=1))
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    _, e = fused_logprobs(hh, ww, y, 1.3, True, backend=base, **tiles)
    gh, gw = torch.autograd.grad((e * ge).sum(), (hh, ww))
    hr, wr = h.double().requires_grad_(True), w.double().requires_grad_(True)
    _, er = naive_logprobs(hr, wr, y, 1.3, True)
    ghr, gwr = torch.autograd.grad((er * ge.double()).sum(), (hr, wr))
    torch.testing.assert_close(gh, ghr.float(), **TOL)
    torch.testing.assert_close(gw, gwr.float(), **TOL)
    # only the weight requires grad (frozen trunk)
    ww = w.clone().requires_grad_(True)
    lp, _ = fused_logprobs(h, ww, y, backend=base, **tiles)
    (gw2,) = torch.autograd.grad((lp * gl).sum(), (ww,))
    wr = w.double().requires_grad_(True)
    (gwr2,) = torch.autograd.grad((naive_logprobs(h.double(), wr, y)[0] * gl.double()).sum(), (wr,))
    torch.testing.assert_close(gw2, gwr2.float(), **TOL)


def test_chunked_gradcheck_float64():
    h, w, y, _, _ = _inputs(T=7, H=5, V=11, seed=2, dtype=torch.float64)
    h.requires_grad_(True)
    w.requires_grad_(True)
    fn = lambda a, b: fused_logprobs(a, b, y, 0.9, True, backend="torch_chunked", tile_t=3, tile_v=4)
    assert torch.autograd.gradcheck(fn, (h, w))


class _MaxNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.max = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max = max(self.max, t.numel())
        return out


def test_chunked_never_materializes_t_by_v():
    T, H, V = 64, 16, 512
    h, w, y, gl, ge = _inputs(T=T, H=H, V=V, seed=3)
    h.requires_grad_(True)
    w.requires_grad_(True)
    with _MaxNumel() as mode:
        lp, e = fused_logprobs(h, w, y, 1.0, True, backend="torch_chunked", tile_t=16, tile_v=128)
        ((lp * gl).sum() + (e * ge).sum()).backward()
    assert mode.max <= max(16 * 128, V * H), mode.max  # tiles and grad_weight; never T * V
    assert mode.max < T * V


@pytest.mark.parametrize("name", ["torch_chunked", "triton"])
def test_bf16_inputs_close_to_naive(name):
    base, _ = _backend(name)
    tiles = dict(tile_v=32) if base == "torch_chunked" else dict(blocks=(16, 32, 16))
    h, w, y, _, _ = _on(base, *_inputs(T=33, H=32, V=90, seed=4))
    lp, e = fused_logprobs(h.bfloat16(), w.bfloat16(), y, 1.0, True, backend=base, **tiles)
    lr, er = naive_logprobs(h.bfloat16().double(), w.bfloat16().double(), y, 1.0, True)
    torch.testing.assert_close(lp, lr.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(e, er.float(), atol=2e-2, rtol=2e-2)


def test_auto_picks_a_cpu_backend_and_empty_input():
    h, w, y, _, _ = _inputs(T=5, V=13)
    lp, e = fused_logprobs(h, w, y)
    assert e is None and lp.shape == (5,)
    lr, _ = naive_logprobs(h.double(), w.double(), y, 1.0, False)
    torch.testing.assert_close(lp.double(), lr, atol=1e-5, rtol=1e-5)
    lp, e = fused_logprobs(h, w, y, 0.7, True)
    lr, er = naive_logprobs(h.double(), w.double(), y, 0.7, True)
    torch.testing.assert_close(lp.double(), lr, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(e.double(), er, atol=1e-5, rtol=1e-5)
    lp0, e0 = fused_logprobs(h[:0], w, y[:0], with_entropy=True)
    assert lp0.shape == (0,) and e0.shape == (0,)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda h, w, y: (h, w, y + 200), "targets: id"),
        (lambda h, w, y: (h, w, y - 100), "targets: id"),
        (lambda h, w, y: (h, w[:, :3], y), "weight: hidden size"),
        (lambda h, w, y: (h, w, y.float()), "targets: expected integer"),
        (lambda h, w, y: (h, w, y[:-1]), "targets: expected"),
        (lambda h, w, y: (h[0], w, y), "hidden: expected"),
        (lambda h, w, y: (h, w.double(), y), "weight: dtype"),
    ],
)
def test_bad_input_raises(mutate, match):
    h, w, y, _, _ = _inputs(T=5, V=13)
    with pytest.raises(ValueError, match=match):
        fused_logprobs(*mutate(h, w, y))


@pytest.mark.parametrize("temp", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_temperature_raises(temp):
    h, w, y, _, _ = _inputs(T=5, V=13)
    with pytest.raises(ValueError, match="temperature"):
        fused_logprobs(h, w, y, temperature=temp)


def test_unknown_backend_raises():
    h, w, y, _, _ = _inputs(T=5, V=13)
    with pytest.raises(ValueError, match="backend: unknown"):
        fused_logprobs(h, w, y, backend="nope")


def _gpu_inputs(T, H, V, seed):
    h, w, y, gl, ge = _inputs(T=T, H=H, V=V, seed=seed)
    w = w * (24 / H) ** 0.5  # logits of the same spread as the CPU tests' (std ~2), whatever H
    return tuple(x.cuda() for x in (h, w, y, gl, ge))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["triton", "torch_chunked"])
@pytest.mark.parametrize("shape", [(37, 24, 101), (1000, 256, 5000)])
@pytest.mark.parametrize("ent", [False, True])
def test_gpu_backends_match_naive(backend, shape, ent):
    """Default (GPU) blocks / whole-vocab tiles: fp32 at 1e-5 against float64; bf16 close, grads too."""
    if backend not in available_logprob_backends():
        pytest.skip(f"{backend} not available")
    T, H, V = shape
    h, w, y, gl, ge = _gpu_inputs(T, H, V, seed=5)
    got = _run(lambda *a: fused_logprobs(*a, backend=backend), h, w, y, gl, ge, 0.8, ent)
    ref = _run(naive_logprobs, h.double(), w.double(), y, gl.double(), ge.double(), 0.8, ent)
    for n, a, b in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, ref):
        if b is not None:
            torch.testing.assert_close(a, b.float(), **TOL, msg=lambda m, n=n: f"{n}: {m}")
    hb, wb = h.bfloat16(), w.bfloat16()
    got = _run(lambda *a: fused_logprobs(*a, backend=backend), hb, wb, y, gl, ge, 0.8, True)
    ref = _run(naive_logprobs, hb.double(), wb.double(), y, gl.double(), ge.double(), 0.8, True)
    for n, a, b in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, ref):
        scale = float(b.abs().max())  # bf16 grads: about 3 significant digits of the largest entry
        torch.testing.assert_close(a.double(), b, atol=2e-2 * max(scale, 1.0), rtol=2e-2, msg=lambda m, n=n: f"{n}: {m}")
