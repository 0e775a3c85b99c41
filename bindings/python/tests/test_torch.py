"""moeblaze.torch against the plain-PyTorch reference: outputs, gradients, gradcheck, the module."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the reference implementation is PyTorch

import moeblaze as mb
import reference as ref
from moeblaze import torch as mbt
from conftest import run_python

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda unavailable")


def experts_problem(seed, T, d, h, E, k, act, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=gen, dtype=torch.float64)
    _, w_gate, w_up, w_down = ref.random_weights(E, d, h, act, generator=gen)
    ids, g = ref.random_routing(T, E, k, generator=gen)
    cast = lambda t: None if t is None else t.to(dtype=dtype, device=device)  # noqa: E731
    return (cast(x), ids.to(device), g.to(device=device, dtype=mbt.routing_dtype(dtype)),
            cast(w_gate), cast(w_up), cast(w_down))


TOLERANCES = {torch.float64: (1e-10, 1e-12), torch.float32: (1e-4, 1e-5),
              torch.bfloat16: (5e-2, 5e-2), torch.float16: (1e-2, 1e-2)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["swiglu", "gelu", "reglu"])
def test_moe_experts_matches_reference(seed, device, dtype, act):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 is CPU only")
    T, d, h, E, k = 10, 16, 8, 4, 2
    inputs = experts_problem(seed, T, d, h, E, k, act, dtype, device)
    leaves = [t.clone().requires_grad_(t.is_floating_point()) if t is not None else None
              for t in inputs]
    x, ids, g, w_gate, w_up, w_down = leaves
    y = mbt.moe_experts(x, ids, g, w_gate, w_up, w_down, activation=act)
    assert y.dtype == dtype and y.device.type == device
    dy = torch.randn(T, d, generator=torch.Generator().manual_seed(seed + 1),
                     dtype=torch.float64)
    y.backward(dy.to(dtype=dtype, device=device))

    ref_leaves = [t.detach().cpu().double().requires_grad_(t.is_floating_point())
                  if t is not None else None for t in inputs]
    rx, rids, rg, rw_gate, rw_up, rw_down = ref_leaves
    y_ref = ref.experts(rx, rids, rg, rw_gate, rw_up, rw_down, act)
    (y_ref * dy).sum().backward()
    rtol, atol = TOLERANCES[dtype]
    scale = max(1.0, float(y_ref.detach().abs().max()))
    torch.testing.assert_close(y.detach().cpu().double(), y_ref.detach(), rtol=rtol,
                               atol=atol * scale)
    for name, mine, theirs in (("x", x, rx), ("g", g, rg), ("w_gate", w_gate, rw_gate),
                               ("w_up", w_up, rw_up), ("w_down", w_down, rw_down)):
        if mine is None:
            continue
        grad_scale = max(1.0, float(theirs.grad.abs().max()))
        torch.testing.assert_close(mine.grad.cpu().double(), theirs.grad, rtol=rtol,
                                   atol=atol * grad_scale, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("act", ["swiglu", "silu", "relu2"])
@pytest.mark.parametrize("checkpoint", ["save_all", "save_preact", "recompute"])
def test_moe_experts_gradcheck_float64(seed, act, checkpoint):
    torch.manual_seed(seed)
    x, ids, g, w_gate, w_up, w_down = experts_problem(seed, 3, 4, 3, 3, 2, act, torch.float64)
    leaves = [t.requires_grad_(True) if t is not None else None
              for t in (x, g, w_gate, w_up, w_down)]
    x, g, w_gate, w_up, w_down = leaves

    def fn(x, g, w_gate, w_up, w_down):
        # gradcheck backpropagates through one graph many times: keep the saved buffer intact.
        return mbt.moe_experts(x, ids, g, w_gate, w_up, w_down, activation=act,
                               checkpoint=checkpoint, consume_saved=False)

    assert torch.autograd.gradcheck(fn, (x, g, w_gate, w_up, w_down), eps=1e-6, atol=1e-7,
                                    rtol=1e-5)


def test_moe_layer_gradcheck_float64(seed):
    torch.manual_seed(seed)
    T, d, h, E, k = 4, 5, 3, 4, 2
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = [w.requires_grad_(True) for w in ref.random_weights(E, d, h, "swiglu",
                                                                  generator=gen)]

    def fn(x, w_router, w_gate, w_up, w_down):
        y, losses, _, _, _ = mbt.moe_layer(x, w_router, w_gate, w_up, w_down, top_k=k,
                                           aux_loss_coeff=0.5, z_loss_coeff=0.25,
                                           consume_saved=False)
        return y, losses

    assert torch.autograd.gradcheck(fn, (x, *weights), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_needs_input_grad_passes_null():
    x, ids, g, w_gate, w_up, w_down = experts_problem(0, 5, 4, 3, 3, 2, "swiglu", torch.float64)
    w_down.requires_grad_(True)
    y = mbt.moe_experts(x, ids, g, w_gate, w_up, w_down)
    y.sum().backward()
    assert w_down.grad is not None and x.grad is None and w_gate.grad is None
    # No grad required at all: inference path (no saved buffer), same values.
    with torch.no_grad():
        y2 = mbt.moe_experts(x, ids, g, w_gate, w_up, w_down.detach())
    torch.testing.assert_close(y.detach(), y2, rtol=0, atol=0)


def test_saved_buffer_goes_through_saved_tensor_hooks():
    x, ids, g, w_gate, w_up, w_down = experts_problem(1, 6, 8, 4, 3, 2, "swiglu", torch.float32)
    x.requires_grad_(True)
    packed = []

    def pack(tensor):
        packed.append((tensor.dtype, tensor.numel()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = mbt.moe_experts(x, ids, g, w_gate, w_up, w_down)
    layer = mbt.get_layer(torch.device("cpu"), d_model=8, d_ffn=4, num_experts=3, top_k=2,
                          activation="swiglu", dtype="float32", checkpoint="save_preact")
    saved_size = layer.saved_size(mb._lib.PASS_EXPERTS_FORWARD, 6)
    # The buffer is the affine size bound: the library's size plus at most the parts' alignment.
    saved = [n for dtype, n in packed if dtype == torch.uint8]
    assert len(saved) == 1 and saved_size <= saved[0] < saved_size + 256 * 8, (saved, saved_size)
    y.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("checkpoint", ["save_all", "save_preact", "recompute"])
def test_consume_saved_same_gradients_and_second_backward(device, checkpoint):
    """consume_saved (the default) gives the gradients of consume_saved=False bit for bit; a
    second backward through the same graph recomputes the consumed activations from x first and
    gives the same gradients again."""
    x, ids, g, w_gate, w_up, w_down = experts_problem(7, 37, 16, 24, 5, 2, "swiglu",
                                                      torch.bfloat16, device)
    grads = {}
    for consume in (False, True):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, g, w_gate, w_up, w_down)]
        lx, lg, lgate, lup, ldown = leaves
        y = mbt.moe_experts(lx, ids, lg, lgate, lup, ldown, checkpoint=checkpoint,
                            consume_saved=consume)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y)
        y.backward(dy, retain_graph=True)
        grads[consume] = [t.grad.clone() for t in leaves]
        before = mbt.recompute_count
        for t in leaves:
            t.grad = None
        y.backward(dy)
        assert mbt.recompute_count == before + (1 if consume else 0)
        for first, second in zip(grads[consume], [t.grad for t in leaves]):
            assert torch.equal(first, second)
    for plain, consumed in zip(grads[False], grads[True]):
        assert torch.equal(plain, consumed)


@pytest.mark.parametrize("device", DEVICES)
def test_consumed_record_survives_a_saved_tensor_hook(device):
    """The record that a backward consumed the saved activations outlives the tensor object the
    backward received: a saved-tensor hook that unpacks to t.detach() (a new object over the same
    storage) must not make the second backward skip its recompute (on the GPU it would read the
    overwritten activations)."""
    x, ids, g, w_gate, w_up, w_down = experts_problem(7, 37, 16, 24, 5, 2, "swiglu",
                                                      torch.bfloat16, device)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, g, w_gate, w_up, w_down)]
    lx, lg, lgate, lup, ldown = leaves
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t.detach()):
        y = mbt.moe_experts(lx, ids, lg, lgate, lup, ldown, consume_saved=True)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y)
    first = torch.autograd.grad(y, leaves, dy, retain_graph=True)
    before = mbt.recompute_count
    second = torch.autograd.grad(y, leaves, dy)
    assert mbt.recompute_count == before + 1
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_moe_experts_rejects_bad_input():
    x, ids, g, w_gate, w_up, w_down = experts_problem(0, 5, 4, 3, 3, 2, "swiglu", torch.float32)
    with pytest.raises(TypeError, match="g"):
        mbt.moe_experts(x, ids, g.double(), w_gate, w_up, w_down)
    with pytest.raises(ValueError, match="w_up"):
        mbt.moe_experts(x, ids, g, w_gate, None, w_down)
    bad_ids = ids.clone()
    bad_ids[0, 0] = 7
    with pytest.raises(mb.InvalidArgumentError) as info:
        mbt.moe_experts(x, bad_ids, g, w_gate, w_up, w_down)
    assert info.value.message  # carries the library's text


def test_unaligned_views_are_handled():
    x, ids, g, w_gate, w_up, w_down = experts_problem(2, 6, 8, 4, 3, 2, "swiglu", torch.float32)
    big = torch.cat([torch.zeros(1, 8), x])
    view = big[1:]  # contiguous, 32 bytes in: fine; make one that is 4 bytes off
    odd = torch.cat([torch.zeros(1), x.reshape(-1)])[1:].view(6, 8)
    assert odd.data_ptr() % 16 != 0
    y_odd = mbt.moe_experts(odd, ids, g, w_gate, w_up, w_down)
    y = mbt.moe_experts(view, ids, g, w_gate, w_up, w_down)
    torch.testing.assert_close(y_odd, y, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ["swiglu", "relu"])
def test_moe_module_matches_reference(seed, device, act):
    torch.manual_seed(seed)
    dtype = torch.float64 if device == "cpu" else torch.float32
    module = mbt.MoE(8, 6, 4, top_k=2, activation=act, aux_loss_coeff=0.01, z_loss_coeff=0.001,
                     dtype=dtype, device=device)
    assert (module.w_up is None) == (act not in ref.GATED)
    assert float(module.w_gate.detach().abs().max()) <= 1 / 8 ** 0.5
    x = torch.randn(2, 5, 8, dtype=dtype, device=device, requires_grad=True)
    y, aux, z = module(x)
    assert y.shape == x.shape and aux.dim() == 0 and z.dim() == 0
    loss = y.square().sum() + aux + z
    loss.backward()

    params = [p.detach().cpu().double().requires_grad_(True) if p is not None else None
              for p in (module.w_router, module.w_gate, module.w_up, module.w_down)]
    rx = x.detach().cpu().double().reshape(-1, 8).requires_grad_(True)
    coeffs = (float(torch.tensor(0.01, dtype=torch.float32)),
              float(torch.tensor(0.001, dtype=torch.float32)))
    y_ref, aux_ref, z_ref, _, _ = ref.layer(rx, *params, top_k=2, act=act,
                                            aux_loss_coeff=coeffs[0], z_loss_coeff=coeffs[1])
    (y_ref.square().sum() + aux_ref + z_ref).backward()
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y.detach().cpu().double().reshape(-1, 8), y_ref.detach(), **tol)
    torch.testing.assert_close(aux.detach().cpu().double(), aux_ref.detach(), **tol)
    torch.testing.assert_close(z.detach().cpu().double(), z_ref.detach(), **tol)
    torch.testing.assert_close(x.grad.cpu().double().reshape(-1, 8), rx.grad, **tol)
    for mine, theirs in zip((module.w_router, module.w_gate, module.w_up, module.w_down), params):
        if mine is not None:
            torch.testing.assert_close(mine.grad.cpu().double(), theirs.grad, **tol)
    assert int(module.last_expert_counts.sum()) == 10 * 2


def test_moe_module_trains():
    torch.manual_seed(0)
    teacher = mbt.MoE(8, 16, 4, top_k=2)
    student = mbt.MoE(8, 16, 4, top_k=2)
    optimizer = torch.optim.SGD(student.parameters(), lr=10.0)
    x = torch.randn(64, 8)
    with torch.no_grad():
        target, _, _ = teacher(x)
    losses = []
    for _ in range(60):
        y, aux, z = student(x)
        loss = torch.nn.functional.mse_loss(y, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]


def test_caches_reuse_plans():
    device = torch.device("cpu")
    a = mbt.get_layer(device, d_model=4, d_ffn=4, num_experts=2, top_k=1)
    b = mbt.get_layer(device, d_model=4, d_ffn=4, num_experts=2, top_k=1)
    c = mbt.get_layer(device, d_model=4, d_ffn=4, num_experts=2, top_k=2)
    assert a is b and a is not c
    assert mbt.get_context(device) is a.context


def test_annealed_aux_loss_coeff_keeps_the_plan_cache_bounded(monkeypatch):
    """The coefficients are part of a plan's configuration, so annealing aux_loss_coeff makes a
    plan per value: the cache keeps the MAX_CACHED_LAYERS most recently used ones (it grew without
    bound), and a backward whose plan was evicted after its forward gets the same gradients."""
    monkeypatch.setattr(mbt, "MAX_CACHED_LAYERS", 4)
    mbt.clear_caches()
    torch.manual_seed(0)
    module = mbt.MoE(8, 16, 4, top_k=2, dtype=torch.float64)
    x = torch.randn(12, 8, dtype=torch.float64)
    aux = []
    for step in range(12):
        module.aux_loss_coeff = 0.01 * (step + 1)
        y, aux_loss, _ = module(x)
        (y.square().mean() + aux_loss).backward()
        aux.append(float(aux_loss.detach()) / module.aux_loss_coeff)
        assert len(mbt._layers) <= 4
    # the loss scales with the coefficient (a float in the plan's configuration)
    np.testing.assert_allclose(aux, aux[0], rtol=1e-6)
    # evicted between forward and backward: the plan is made again from its configuration
    module.aux_loss_coeff = 0.5
    y, aux_loss, _ = module(x)
    loss = y.square().mean() + aux_loss
    expected = torch.autograd.grad(loss, module.w_router, retain_graph=True)[0]
    for step in range(8):
        mbt.get_layer(torch.device("cpu"), d_model=8, d_ffn=16, num_experts=4, top_k=2,
                      aux_loss_coeff=1.0 + step)
    assert len(mbt._layers) <= 4
    torch.testing.assert_close(torch.autograd.grad(loss, module.w_router)[0], expected,
                               rtol=0, atol=0)
    mbt.clear_caches()


@needs_cuda
def test_cuda_uses_current_stream():
    x, ids, g, w_gate, w_up, w_down = experts_problem(3, 64, 32, 16, 4, 2, "swiglu",
                                                      torch.float32, "cuda")
    y_default = mbt.moe_experts(x, ids, g, w_gate, w_up, w_down)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y_side = mbt.moe_experts(x, ids, g, w_gate, w_up, w_down)
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(y_side, y_default, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Refused uses: forward-mode AD, loose arguments, oversized token counts
# ------------------------------------------------------------------------------------------------


def test_forward_mode_ad_is_refused_not_silently_zero():
    """The operators have a reverse-mode formula only: a tangent would be dropped silently."""
    import torch.autograd.forward_ad as fwAD

    T, d, h, E, k = 6, 8, 16, 4, 2
    x, ids, g, w_gate, w_up, w_down = experts_problem(0, T, d, h, E, k, "swiglu", torch.float64)
    w_router = torch.randn(E, d, dtype=torch.float64)
    v = torch.ones_like(x)
    layer = lambda x: mbt.moe_layer(x, w_router, w_gate, w_up, w_down, top_k=k)[0]  # noqa: E731
    experts = lambda x: mbt.moe_experts(x, ids, g, w_gate, w_up, w_down)  # noqa: E731
    for fn in (layer, experts):
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            torch.func.jvp(fn, (x,), (v,))
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            torch.func.jacfwd(fn)(x)
        with fwAD.dual_level():
            with pytest.raises(NotImplementedError, match="forward-mode AD"):
                fn(fwAD.make_dual(x, v))
            fn(x)  # inside a dual level, inputs without a tangent are fine
    # a tangent on a weight (g here) is refused as well; the module path too
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda g: mbt.moe_experts(x, ids, g, w_gate, w_up, w_down), (g,),
                       (torch.ones_like(g),))
    module = mbt.MoE(d, h, E, top_k=k, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda x: module(x)[0], (x,), (v,))
    if not mbt.CUSTOM_OPS:
        return  # the autograd.Function fallback does not support vmap
    # vmap (no tangent) still works
    batched = torch.func.vmap(experts)(x.unsqueeze(0).repeat(2, 1, 1))
    torch.testing.assert_close(batched[1], experts(x), rtol=0, atol=0)


@pytest.mark.parametrize("options,error,name", [
    (dict(top_k=2.9), TypeError, "top_k"), (dict(top_k=True), TypeError, "top_k"),
    (dict(top_k="2"), TypeError, "top_k"), (dict(top_k=2, renormalize="no"), TypeError,
                                           "renormalize"),
    (dict(top_k=2, renormalize=1), TypeError, "renormalize"),
    (dict(top_k=2, aux_loss_coeff="0.5"), TypeError, "aux_loss_coeff"),
    (dict(top_k=2, z_loss_coeff=None), TypeError, "z_loss_coeff"),
    (dict(top_k=2, consume_saved="yes"), TypeError, "consume_saved")])
def test_moe_layer_converts_arguments_strictly(options, error, name):
    x, _, _, w_gate, w_up, w_down = experts_problem(0, 5, 4, 3, 4, 2, "swiglu", torch.float32)
    w_router = torch.randn(4, 4)
    with pytest.raises(error, match=name):
        mbt.moe_layer(x, w_router, w_gate, w_up, w_down, **options)
    ids, g = ref.random_routing(5, 4, 2)
    if name == "consume_saved":
        with pytest.raises(error, match=name):
            mbt.moe_experts(x, ids, g.float(), w_gate, w_up, w_down,
                            consume_saved=options["consume_saved"])
    # numpy scalars are numbers and bools
    mbt.moe_layer(x, w_router, w_gate, w_up, w_down, top_k=np.int64(2), renormalize=np.True_,
                  aux_loss_coeff=np.float32(0.5))


@pytest.mark.parametrize("args,options,error,name", [
    ((8, 16, 4), dict(top_k=1.5), TypeError, "top_k"),
    ((8, 16, 4), dict(top_k=5), ValueError, "top_k"),
    ((8, 16, 4), dict(top_k=0), ValueError, "top_k"),
    ((8, 16, 0), {}, ValueError, "num_experts"),
    ((8, 16, 2000), {}, ValueError, "num_experts"),
    ((0, 16, 4), {}, ValueError, "d_model"),
    ((8, 16.0, 4), {}, TypeError, "d_ffn"),
    ((8, 16, 4), dict(aux_loss_coeff=-1.0), ValueError, "aux_loss_coeff"),
    ((8, 16, 4), dict(z_loss_coeff=float("nan")), ValueError, "z_loss_coeff"),
    ((8, 16, 4), dict(aux_loss_coeff="0.1"), TypeError, "aux_loss_coeff"),
    ((8, 16, 4), dict(renormalize="no"), TypeError, "renormalize"),
    ((8, 16, 4), dict(consume_saved=0), TypeError, "consume_saved"),
    ((8, 16, 4), dict(checkpoint="none"), ValueError, "checkpoint"),
    ((8, 16, 4), dict(score_function="softmax"), ValueError, "score_function")])
def test_moe_module_checks_its_settings_at_construction(args, options, error, name):
    with pytest.raises(error, match=name):
        mbt.MoE(*args, **options)


def test_moe_module_settings_are_converted():
    module = mbt.MoE(np.int64(8), 16, 4, top_k=np.int32(2), aux_loss_coeff=np.float32(0.5))
    assert type(module.top_k) is int and module.top_k == 2 and type(module.d_model) is int
    assert type(module.aux_loss_coeff) is float
    assert "top_k=2," in repr(module)


_OVERSIZED_SETUP = """
import resource, sys
import torch
import moeblaze as mb, moeblaze.torch as mbt
T, d, h, E, k = (1 << 30) + 1, 1, 1, 2, 2  # T * k = 2^31 + 2
w = (torch.randn(E, d), torch.randn(E, h, d), torch.randn(E, h, d), torch.randn(E, d, h))
mbt.moe_layer(torch.zeros(2, d), *w, top_k=k)  # everything loaded
with torch.autocast("cpu", dtype=torch.bfloat16):
    mbt.moe_layer(torch.zeros(2, d), *w, top_k=k)
pages = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (pages + (1536 << 20), resource.RLIM_INFINITY))
x = torch.zeros(1, d).expand(T, d)  # stride 0: no memory
ids, g = torch.zeros(1, k, dtype=torch.int32).expand(T, k), torch.zeros(1, k).expand(T, k)
calls = (("moe_layer", lambda: mbt.moe_layer(x, *w, top_k=k)),
         ("moe_experts", lambda: mbt.moe_experts(x, ids, g, w[1], w[2], w[3])))
"""

_OVERSIZED = _OVERSIZED_SETUP + """
for name, call in calls:
    try:
        call()
    except mb.InvalidArgumentError as error:
        assert "too large" in str(error), error
        print(name, "refused")
"""

# Under autocast x is cast (a copy: 2 GiB of bfloat16 here) before the operator's size query.
_OVERSIZED_AUTOCAST = _OVERSIZED_SETUP + """
module = mbt.MoE(d, h, E, top_k=k)
calls += (("MoE", lambda: module(x)),)
for name, call in calls:
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            call()
    except mb.InvalidArgumentError as error:
        assert "too large" in str(error), error
        print(name, "refused")
"""


def test_oversized_token_count_is_refused_before_allocating(tmp_path):
    """T * top_k >= 2^31: the library's size error, before gigabytes of copies and outputs (the
    child process may allocate at most 1.5 GB more)."""
    script = tmp_path / "oversized.py"
    script.write_text(_OVERSIZED)
    done = run_python(script)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["moe_layer refused", "moe_experts refused"], \
        done.stdout + done.stderr[-2000:]


def test_oversized_token_count_is_refused_before_the_autocast_cast(tmp_path):
    """The same under torch.autocast: T is checked before x is cast to the autocast dtype."""
    script = tmp_path / "oversized_autocast.py"
    script.write_text(_OVERSIZED_AUTOCAST)
    done = run_python(script)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:3] == ["moe_layer refused", "moe_experts refused",
                                           "MoE refused"], done.stdout + done.stderr[-2000:]
