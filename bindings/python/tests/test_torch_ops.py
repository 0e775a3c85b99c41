"""moeblaze.torch as registered operators: opcheck, torch.compile (fullgraph, dynamic token counts,
CUDA graphs), torch.export, autocast, gradcheck of the default MoE, activation checkpointing, the
saved buffer's size bound, and the input errors of the module. CUDA cases skip (visibly) without a
GPU; the CPU cases are what CI runs."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import moeblaze as mb  # noqa: E402
from moeblaze import torch as mbt  # noqa: E402

needs_ops = pytest.mark.skipif(not mbt.CUSTOM_OPS,
                               reason="torch.library custom operators need torch >= 2.4")
HAVE_CUDA = torch.cuda.is_available() and mb.backend_available("cuda")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAVE_CUDA, reason="CUDA variant: needs a GPU and a library with the CUDA backend"))]
needs_cuda = pytest.mark.skipif(not HAVE_CUDA,
                                reason="CUDA variant: needs a GPU and a library with the CUDA "
                                       "backend")


class Net(torch.nn.Module):
    """A linear layer around an MoE: the compiled graph holds ordinary ops and moeblaze's."""

    def __init__(self, d=16, h=24, E=6, k=2, device="cpu", dtype=torch.float32, **moe_kwargs):
        super().__init__()
        self.inp = torch.nn.Linear(d, d, device=device, dtype=dtype)
        self.moe = mbt.MoE(d, h, E, top_k=k, aux_loss_coeff=0.01, z_loss_coeff=0.001,
                           device=device, dtype=dtype, **moe_kwargs)

    def forward(self, x):
        y, aux, z = self.moe(torch.tanh(self.inp(x)))
        return (y.float().square().mean() + aux + z), y


def _grads(module):
    """Gradients by parameter name as in Net, without a wrapper's prefix (_orig_mod., inner.)."""
    grads = {}
    for name, p in module.named_parameters():
        for prefix in ("_orig_mod.", "inner."):
            name = name[len(prefix):] if name.startswith(prefix) else name
        grads[name] = p.grad.detach().clone()
    return grads


def _run(module, x):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    loss, y = module(x)
    loss.backward()
    return loss.detach(), y.detach(), x.grad.detach(), _grads(module)


def _assert_same(eager, compiled, rtol, atol):
    loss_e, y_e, dx_e, grads_e = eager
    loss_c, y_c, dx_c, grads_c = compiled
    torch.testing.assert_close(y_c, y_e, rtol=rtol, atol=atol)
    torch.testing.assert_close(loss_c, loss_e, rtol=rtol, atol=atol)
    torch.testing.assert_close(dx_c, dx_e, rtol=rtol, atol=atol)
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        assert torch.isfinite(grads_c[name]).all(), name
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


# ------------------------------------------------------------------------------------------------
# opcheck: schemas, fake implementations, autograd registration, AOT dispatch
# ------------------------------------------------------------------------------------------------


# The forward operators' `saved` output has alignment gaps the library never writes, so their
# bytes differ from call to call: opcheck's eager-vs-AOT output comparison does not apply to it
# (the compile tests below compare every meaningful output instead).
_FORWARD_OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _layer_args(seed, device, T=9, d=8, h=6, E=4, k=2, training=True):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *s: (torch.randn(*s, generator=gen) * 0.5).to(device)  # noqa: E731
    x, w_router = make(T, d), make(E, d)
    w_gate, w_up, w_down = make(E, h, d), make(E, h, d), make(E, d, h)
    return [x, w_router, w_gate, w_up, w_down, k, "swiglu", "save_preact", "softmax_topk", False,
            0.01, 0.001, training, False]


@needs_ops
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_layer_ops(seed, device):
    args = _layer_args(seed, device)
    for t in args[:5]:
        t.requires_grad_(True)
    torch.library.opcheck(torch.ops.moeblaze.layer_forward.default, args,
                          test_utils=_FORWARD_OPCHECKS)
    x, w_router, w_gate, w_up, w_down = [t.detach() for t in args[:5]]
    y, losses, counts, ids, g, saved = torch.ops.moeblaze.layer_forward(
        x, w_router, w_gate, w_up, w_down, *args[5:])
    assert int(counts.sum()) == x.shape[0] * 2
    dy, d_losses = torch.randn_like(y), torch.ones_like(losses)
    # consume_saved=False: the buffer is reused by opcheck's repeated calls
    torch.library.opcheck(torch.ops.moeblaze.layer_backward.default,
                          [dy, d_losses, x, w_router, w_gate, w_up, w_down, saved, *args[5:12],
                           False, True, True, True, True, True])


@needs_ops
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_experts_ops(seed, device):
    gen = torch.Generator().manual_seed(seed)
    T, d, h, E, k = 7, 8, 6, 4, 2
    x = torch.randn(T, d, generator=gen).to(device).requires_grad_(True)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).int().to(device)
    g = torch.rand(T, k, generator=gen).to(device).requires_grad_(True)
    w_gate, w_up = (torch.randn(E, h, d, generator=gen).to(device).requires_grad_(True)
                    for _ in range(2))
    w_down = torch.randn(E, d, h, generator=gen).to(device).requires_grad_(True)
    args = [x, ids, g, w_gate, w_up, w_down, "swiglu", "save_preact", True, False]
    torch.library.opcheck(torch.ops.moeblaze.experts_forward.default, args,
                          test_utils=_FORWARD_OPCHECKS)
    plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    y, saved = torch.ops.moeblaze.experts_forward(*plain)
    torch.library.opcheck(torch.ops.moeblaze.experts_backward.default,
                          [torch.randn_like(y), *plain[:6], saved, "swiglu", "save_preact", False,
                           True, True, True, True, True])


# ------------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------------


@needs_ops
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_no_graph_breaks_same_results(seed, device):
    torch.manual_seed(seed)
    torch._dynamo.reset()
    net = Net(device=device)
    x = torch.randn(3, 11, 16, device=device)
    explanation = torch._dynamo.explain(net)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    eager = _run(net, x)
    compiled = _run(torch.compile(net, fullgraph=True), x)
    _assert_same(eager, compiled, rtol=1e-5, atol=1e-6)
    assert net.moe.last_expert_counts is not None
    assert int(net.moe.last_expert_counts.sum()) == 3 * 11 * 2


@needs_ops
def test_compiled_graph_calls_the_operators():
    """The forward and backward graphs hold moeblaze's operators (not a fallback to eager)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    seen = []

    def backend(gm, example_inputs):
        def compiler(graph_module, inputs):
            seen.extend(str(node.target) for node in graph_module.graph.nodes
                        if node.op == "call_function")
            return make_boxed_func(graph_module.forward)
        return aot_module_simplified(gm, example_inputs, fw_compiler=compiler,
                                     bw_compiler=compiler)

    torch._dynamo.reset()
    net = Net()
    loss, _ = torch.compile(net, backend=backend, fullgraph=True)(torch.randn(5, 16))
    loss.backward()
    assert "moeblaze.layer_forward.default" in seen
    assert "moeblaze.layer_backward.default" in seen


@needs_ops
def test_compile_dynamic_token_counts():
    """Token counts that change between calls: one dynamic graph (the saved buffer's size is an
    affine expression of the symbolic count), results equal to eager for each."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    net = Net()
    compiled = torch.compile(net, fullgraph=True, dynamic=True)
    for T in (5, 17, 64, 1):
        x = torch.randn(T, 16)
        _assert_same(_run(net, x), _run(compiled, x), rtol=1e-5, atol=1e-6)


@needs_ops
def test_compile_moe_experts(seed):
    """moe_experts inside a compiled function with routing computed by torch ops."""
    torch.manual_seed(seed)
    torch._dynamo.reset()
    T, d, h, E, k = 13, 8, 12, 5, 2
    w_router = torch.randn(E, d, requires_grad=True)
    w_gate, w_up = (torch.randn(E, h, d).mul_(0.3).requires_grad_(True) for _ in range(2))
    w_down = torch.randn(E, d, h).mul_(0.3).requires_grad_(True)

    def layer(x):
        probs = torch.softmax(x @ w_router.t(), dim=-1)
        g, ids = torch.topk(probs, k, dim=-1)
        g = g / g.sum(-1, keepdim=True)
        return mbt.moe_experts(x, ids.int(), g, w_gate, w_up, w_down)

    x = torch.randn(T, d, requires_grad=True)
    results = []
    for fn in (layer, torch.compile(layer, fullgraph=True)):
        for p in (x, w_router, w_gate, w_up, w_down):
            p.grad = None
        y = fn(x)
        y.square().sum().backward()
        results.append([y.detach()] + [p.grad.clone() for p in (x, w_router, w_gate, w_up,
                                                               w_down)])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@needs_cuda
@needs_ops
def test_compile_reduce_overhead_cuda_graphs():
    """mode="reduce-overhead" (CUDA graphs): replayed steps give the eager results."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    net = Net(device="cuda")
    compiled = torch.compile(net, mode="reduce-overhead", fullgraph=True)
    x = torch.randn(4, 32, 16, device="cuda")
    eager = _run(net, x)
    for _ in range(4):  # warm-up, record, then replays
        result = _run(compiled, x)
    _assert_same(eager, result, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# torch.export
# ------------------------------------------------------------------------------------------------


@needs_ops
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strict", [False, True])
def test_export(seed, device, strict):
    torch.manual_seed(seed)
    net = Net(device=device)
    x = torch.randn(2, 9, 16, device=device)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    program = torch.export.export(net, (x,), dynamic_shapes={"x": {0: batch, 1: seq}},
                                  strict=strict)
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert "moeblaze.layer_forward.default" in targets
    for shape in ((2, 9, 16), (3, 5, 16)):
        x = torch.randn(*shape, device=device)
        loss, y = program.module()(x)
        loss_e, y_e = net(x)
        torch.testing.assert_close(y, y_e, rtol=0, atol=0)
        torch.testing.assert_close(loss, loss_e, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------------
# autocast
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_bfloat16_runs_the_layer_in_bfloat16(seed, device):
    torch.manual_seed(seed)
    moe = mbt.MoE(16, 24, 6, top_k=2, aux_loss_coeff=0.01, device=device)
    x = torch.randn(20, 16, device=device, requires_grad=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        y, aux, _ = moe(x)
    assert y.dtype == torch.bfloat16 and aux.dtype == torch.float32
    (y.float().square().sum() + aux).backward()
    assert x.grad.dtype == torch.float32 and moe.w_gate.grad.dtype == torch.float32
    # the same as running a bf16 copy of the layer on bf16 inputs
    twin = mbt.MoE(16, 24, 6, top_k=2, aux_loss_coeff=0.01, device=device,
                   dtype=torch.bfloat16)
    twin.load_state_dict({k: v.to(torch.bfloat16) for k, v in moe.state_dict().items()})
    x16 = x.detach().to(torch.bfloat16).requires_grad_(True)
    y16, aux16, _ = twin(x16)
    assert torch.equal(y.detach(), y16.detach()) and torch.equal(aux.detach(), aux16.detach())
    (y16.float().square().sum() + aux16).backward()
    torch.testing.assert_close(moe.w_gate.grad, twin.w_gate.grad.float(), rtol=0, atol=0)
    # fp64 is left alone, as torch's autocast does
    moe64 = mbt.MoE(16, 24, 6, top_k=2, device=device, dtype=torch.float64) \
        if device == "cpu" else None
    if moe64 is not None:
        with torch.autocast(device, dtype=torch.bfloat16):
            y64, _, _ = moe64(x.detach().double())
        assert y64.dtype == torch.float64


@needs_ops
def test_autocast_under_compile():
    torch.manual_seed(0)
    torch._dynamo.reset()
    net = Net()
    x = torch.randn(12, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_e, y_e = net(x)
        loss_c, y_c = torch.compile(net, fullgraph=True)(x)
    assert y_c.dtype == torch.bfloat16
    assert torch.equal(y_c, y_e)


# ------------------------------------------------------------------------------------------------
# gradcheck, retain_graph, activation checkpointing
# ------------------------------------------------------------------------------------------------


def _functional(module):
    names = [name for name, _ in module.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in module.parameters()]

    def fn(x, *values):
        return torch.func.functional_call(module, dict(zip(names, values)), (x,))
    return fn, params


@pytest.mark.parametrize("device", ["cpu"])
def test_gradcheck_default_moe(seed, device):
    """A default MoE (consume_saved=True) in float64: gradcheck backpropagates many times through
    one graph, each later backward recomputing the consumed activations."""
    torch.manual_seed(seed)
    moe = mbt.MoE(5, 3, 4, top_k=2, aux_loss_coeff=0.5, z_loss_coeff=0.25, dtype=torch.float64)
    assert moe.consume_saved
    fn, params = _functional(moe)
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    before = mbt.recompute_count
    assert torch.autograd.gradcheck(fn, (x, *params))
    assert mbt.recompute_count > before


@pytest.mark.parametrize("device", DEVICES)
def test_retain_graph_second_backward_equals_first(seed, device):
    torch.manual_seed(seed)
    moe = mbt.MoE(16, 24, 6, top_k=2, aux_loss_coeff=0.01, device=device)
    x = torch.randn(40, 16, device=device, requires_grad=True)
    y, aux, z = moe(x)
    loss = y.square().sum() + aux + z
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in (x, *moe.parameters())]
    for p in (x, *moe.parameters()):
        p.grad = None
    before = mbt.recompute_count
    loss.backward()
    assert mbt.recompute_count == before + 1
    for a, b in zip(first, (x.grad, *[p.grad for p in moe.parameters()])):
        assert torch.equal(a, b)


class _FillRecorder:
    """Records the size of every tensor a zero-filling op creates or fills while active."""

    FILLS = ("zeros", "zeros_like", "new_zeros", "zero_", "fill_", "full", "full_like")

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        sizes = self.sizes = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func.overloadpacket.__name__ in _FillRecorder.FILLS:
                    first = out if isinstance(out, torch.Tensor) else args[0]
                    sizes.append(first.numel() * first.element_size())
                return out

        self.mode = Mode()


@needs_ops
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("api", ["experts", "layer"])
def test_backward_materialises_no_gradient_of_the_saved_buffer(seed, device, api):
    """`saved` and the routing outputs are not differentiable: autograd must not hand the backward
    a zero tensor of their size (as large as the activations, it would raise the backward's
    peak by that much)."""
    torch.manual_seed(seed)
    T, d, h, E, k = 64, 32, 48, 4, 2
    x = torch.randn(T, d, device=device, requires_grad=True)
    w = [(torch.randn(*s, device=device) * 0.1).requires_grad_()
         for s in ((E, h, d), (E, h, d), (E, d, h))]
    if api == "experts":
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int().to(device)
        g = torch.rand(T, k, device=device, requires_grad=True)
        y = mbt.moe_experts(x, ids, g, *w)
    else:
        w_router = torch.randn(E, d, device=device, requires_grad=True)
        y = mbt.moe_layer(x, w_router, *w, top_k=k, aux_loss_coeff=0.01)[0]
    recorder = _FillRecorder()
    with recorder.mode:
        y.backward(torch.randn_like(y))
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(size < x.numel() * x.element_size() for size in recorder.sizes), recorder.sizes


def test_consumed_record_holds_only_live_buffers():
    """The host-side record of consumed buffers forgets a buffer when it is freed: a long run
    does not grow it."""
    import gc

    torch.manual_seed(0)
    moe = mbt.MoE(8, 16, 4, top_k=2)
    for step in range(20):
        y, _, _ = moe(torch.randn(10 + step, 8))
        y.sum().backward()
    gc.collect()
    assert len(mbt._consumed) == 0
    outputs = moe(torch.randn(10, 8))
    loss = outputs[0].sum()
    loss.backward(retain_graph=True)
    assert len(mbt._consumed) == 1  # alive and consumed: a second backward must recompute
    del outputs, loss  # the graph, and with it the saved buffer
    gc.collect()
    assert len(mbt._consumed) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing(seed, device, use_reentrant):
    torch.manual_seed(seed)
    net = Net(device=device)
    x = torch.randn(30, 16, device=device)
    plain = _run(net, x)

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=use_reentrant)

    checkpointed = _run(Checkpointed(net), x)
    _assert_same(plain, checkpointed, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# The saved buffer: size bound, torch allocations, no host synchronisation
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", ["save_all", "save_preact", "recompute"])
@pytest.mark.parametrize("activation,dtype", [("swiglu", "bfloat16"), ("relu", "float32"),
                                              ("geglu", "float64")])
def test_saved_size_bound_covers_every_token_count(checkpoint, activation, dtype):
    for E, k in ((8, 2), (64, 8), (3, 1)):
        layer = mbt.get_layer(torch.device("cpu"), d_model=24, d_ffn=40, num_experts=E, top_k=k,
                              activation=activation, dtype=dtype, checkpoint=checkpoint)
        for pass_code in (mb._lib.PASS_LAYER_FORWARD, mb._lib.PASS_EXPERTS_FORWARD):
            for T in list(range(0, 700)) + [4093, 65536, 1 << 20]:
                exact = layer.saved_size(pass_code, T)
                bound = mbt._saved_bytes(layer, pass_code, T)
                assert exact <= bound < exact + 256 * 12, (E, k, pass_code, T, exact, bound)


@needs_cuda
def test_cuda_buffers_from_the_caching_allocator_and_no_host_sync():
    torch.manual_seed(0)
    moe = mbt.MoE(64, 128, 8, top_k=2, aux_loss_coeff=0.01, device="cuda",
                  dtype=torch.bfloat16)
    x = torch.randn(512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x)  # plans and contexts are created outside the checked region
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, aux, z = moe(x)
        held = torch.cuda.memory_allocated() - before
        (y.float().square().sum() + aux + z).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    layer = mbt.get_layer(torch.device("cuda"), d_model=64, d_ffn=128, num_experts=8, top_k=2,
                          activation="swiglu", dtype="bfloat16", checkpoint="save_preact",
                          score_function="softmax_topk", renormalize=False,
                          aux_loss_coeff=0.01, z_loss_coeff=0.0)
    assert held >= layer.saved_size(mb._lib.PASS_LAYER_FORWARD, 512)


# ------------------------------------------------------------------------------------------------
# Input errors of the module and the functions
# ------------------------------------------------------------------------------------------------


def test_module_blames_x_for_a_dtype_mismatch():
    moe = mbt.MoE(8, 16, 4, top_k=2)
    with pytest.raises(TypeError, match=r"^x: expected dtype torch.float32.*module with "
                                        r"\.to\(torch.float64\)"):
        moe(torch.randn(3, 8, dtype=torch.float64))
    # An integer x: converting the module to it would be no advice.
    with pytest.raises(TypeError, match=r"x must be floating point: convert it with "
                                        r"\.to\(torch.float32\)"):
        moe(torch.ones(3, 8, dtype=torch.int32))


def test_module_names_a_wrong_last_dimension():
    moe = mbt.MoE(8, 16, 4, top_k=2)
    with pytest.raises(ValueError, match=r"^x: expected a last dimension of d_model = 8, got "
                                         r"shape \[3, 5\]"):
        moe(torch.randn(3, 5))
    with pytest.raises(ValueError, match="^x: expected a last dimension"):
        moe(torch.randn(40))  # 40 = 5 * 8 elements: a reshape alone would accept it


def test_token_count_mismatch_names_the_argument():
    T, d, h, E, k = 6, 8, 4, 4, 2
    x = torch.randn(T, d)
    ids = torch.zeros(T + 1, k, dtype=torch.int32)
    ids[:, 1] = 1
    g = torch.rand(T + 1, k)
    w = torch.randn(E, h, d)
    with pytest.raises(ValueError, match=r"^ids: expected 6 rows \(the tokens of x\), got 7"):
        mbt.moe_experts(x, ids, g, w, w.clone(), torch.randn(E, d, h))
    with pytest.raises(ValueError, match=r"^g: expected shape \[6, 2\]"):
        mbt.moe_experts(x, ids[:T], g, w, w.clone(), torch.randn(E, d, h))
    with pytest.raises(TypeError, match=r"^ids: expected dtype torch.int32, got torch.int64; "
                                        r"convert with ids.to\(torch.int32\)"):
        mbt.moe_experts(x, ids[:T].long(), g[:T], w, w.clone(), torch.randn(E, d, h))


def test_functional_layer_names_the_weight_and_x():
    x = torch.randn(5, 8, dtype=torch.float64)
    w_router = torch.randn(4, 8)
    w = torch.randn(4, 6, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"^w_router: expected dtype torch.float64 \(that of x\)"):
        mbt.moe_layer(x, w_router, w, w.clone(), torch.randn(4, 8, 6, dtype=torch.float64),
                      top_k=2)
    with pytest.raises(ValueError, match=r"^top_k: expected 1..min\(num_experts=4"):
        mbt.moe_layer(x, w_router.double(), w, w.clone(),
                      torch.randn(4, 8, 6, dtype=torch.float64), top_k=5)
    with pytest.raises(TypeError, match=r"^x: unsupported dtype torch.int64"):
        mbt.moe_layer(x.long(), w_router, w, w.clone(), w, top_k=2)


# ------------------------------------------------------------------------------------------------
# The autograd.Function fallback (torch < 2.4), selected by MOEBLAZE_TORCH_CUSTOM_OPS=0
# ------------------------------------------------------------------------------------------------


@needs_ops
def test_fallback_without_custom_ops_gives_the_same_results():
    script = r"""
import torch
from moeblaze import torch as mbt
assert not mbt.CUSTOM_OPS
torch.manual_seed(0)
moe = mbt.MoE(8, 12, 4, top_k=2, aux_loss_coeff=0.01, dtype=torch.float64)
x = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
y, aux, z = moe(x)
(y.square().sum() + aux).backward()
torch.save({"y": y.detach(), "dx": x.grad, "dw": moe.w_gate.grad}, OUT)
"""
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"moeblaze_fallback_{os.getpid()}.pt")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(mb.__file__)))
    env = dict(os.environ, MOEBLAZE_TORCH_CUSTOM_OPS="0",
               PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", f"OUT = {out!r}\n" + script], check=True, env=env,
                   cwd=os.path.dirname(os.path.abspath(__file__)))
    try:
        theirs = torch.load(out)
    finally:
        os.remove(out)
    torch.manual_seed(0)
    moe = mbt.MoE(8, 12, 4, top_k=2, aux_loss_coeff=0.01, dtype=torch.float64)
    x = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    y, aux, z = moe(x)
    (y.square().sum() + aux).backward()
    assert torch.equal(theirs["y"], y.detach())
    assert torch.equal(theirs["dx"], x.grad)
    assert torch.equal(theirs["dw"], moe.w_gate.grad)
