"""The numpy API on the CPU backend against the plain-PyTorch reference (reference.py)."""

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the reference implementation is PyTorch

import moeblaze as mb
import reference as ref
from conftest import HEADER, run_python

# The config stores the loss coefficients as C floats: the reference must use the same values.
AUX, Z = float(np.float32(0.01)), float(np.float32(0.001))
ACTIVATIONS = ["swiglu", "geglu", "reglu", "silu", "gelu", "relu", "relu2"]


def make_problem(seed, T=7, d=8, h=6, E=5, act="swiglu", dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=gen, dtype=torch.float64).to(dtype)
    w_router, w_gate, w_up, w_down = ref.random_weights(E, d, h, act, dtype, gen)
    return x, w_router, w_gate, w_up, w_down


def np_(t):
    return None if t is None else t.detach().numpy()


def test_versions():
    text = HEADER.read_text()
    parts = {p: int(re.search(rf"#define MOEBLAZE_VERSION_{p} (\d+)", text).group(1))
             for p in ("MAJOR", "MINOR", "PATCH")}
    assert mb.get_version() == parts["MAJOR"] * 10000 + parts["MINOR"] * 100 + parts["PATCH"]
    assert mb.get_abi_version() == mb.ABI_VERSION
    assert "moeblaze" in mb.build_info()
    assert mb.backend_available("cpu")


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("score_function,renormalize",
                         [("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", False),
                          ("sigmoid", True)])
def test_layer_forward_backward_f64_matches_reference(seed, act, score_function, renormalize):
    T, d, h, E, k = 7, 8, 6, 5, 2
    x, w_router, w_gate, w_up, w_down = make_problem(seed, T, d, h, E, act)
    layer = mb.Layer(d_model=d, d_ffn=h, num_experts=E, top_k=k, activation=act, dtype="float64",
                     score_function=score_function, renormalize=renormalize,
                     aux_loss_coeff=AUX, z_loss_coeff=Z)
    out = layer.forward(np_(x), np_(w_router), np_(w_gate), np_(w_up), np_(w_down))

    params = [t.clone().requires_grad_(True) if t is not None else None
              for t in (x, w_router, w_gate, w_up, w_down)]
    y_ref, aux_ref, z_ref, ids_ref, g_ref = ref.layer(*params, top_k=k, act=act,
                                                      score_function=score_function,
                                                      renormalize=renormalize,
                                                      aux_loss_coeff=AUX, z_loss_coeff=Z)
    np.testing.assert_array_equal(out.ids, ids_ref.numpy())
    np.testing.assert_allclose(out.g, g_ref.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(out.y, y_ref.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out.losses, [float(aux_ref.detach()), float(z_ref.detach())],
                               rtol=1e-10, atol=1e-14)
    np.testing.assert_array_equal(out.expert_counts,
                                  np.bincount(out.ids.ravel(), minlength=E))

    gen = torch.Generator().manual_seed(seed + 1)
    dy = torch.randn(T, d, generator=gen, dtype=torch.float64)
    d_losses = torch.tensor([0.7, 1.3], dtype=torch.float64)
    (y_ref * dy).sum().backward(retain_graph=True)
    (d_losses[0] * aux_ref + d_losses[1] * z_ref).backward()
    grads = layer.backward(out, np_(dy), np_(x), np_(w_router), np_(w_gate), np_(w_up),
                           np_(w_down), d_losses=d_losses.numpy())
    for name, mine, param in zip(("dx", "dw_router", "dw_gate", "dw_up", "dw_down"),
                                 (grads.dx, grads.dw_router, grads.dw_gate, grads.dw_up,
                                  grads.dw_down), params):
        if param is None:
            assert mine is None, name
            continue
        np.testing.assert_allclose(mine, param.grad.numpy(), rtol=1e-9, atol=1e-11,
                                   err_msg=name)


def test_layer_float32_close_to_float64_reference(seed):
    T, d, h, E, k = 16, 16, 12, 6, 2
    x, w_router, w_gate, w_up, w_down = make_problem(seed, T, d, h, E)
    layer = mb.Layer(d_model=d, d_ffn=h, num_experts=E, top_k=k, dtype="float32")
    out = layer.forward(*(np_(t).astype(np.float32) for t in (x, w_router, w_gate, w_up, w_down)))
    y_ref, _, _, ids_ref, _ = ref.layer(x, w_router, w_gate, w_up, w_down, top_k=k)
    assert out.y.dtype == np.float32 and out.g.dtype == np.float32
    np.testing.assert_array_equal(out.ids, ids_ref.numpy())
    np.testing.assert_allclose(out.y, y_ref.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("act", ["swiglu", "gelu"])
def test_checkpoint_policies_bitwise_identical(seed, act):
    T, d, h, E, k = 9, 8, 6, 4, 2
    x, w_router, w_gate, w_up, w_down = make_problem(seed, T, d, h, E, act, torch.float32)
    arrays = [np_(t) for t in (x, w_router, w_gate, w_up, w_down)]
    dy = np.random.default_rng(seed).standard_normal((T, d)).astype(np.float32)
    results = []
    for checkpoint in ("save_all", "save_preact", "recompute"):
        layer = mb.Layer(d_model=d, d_ffn=h, num_experts=E, top_k=k, activation=act,
                         checkpoint=checkpoint, dtype="float32")
        out = layer.forward(*arrays)
        grads = layer.backward(out, dy, *arrays)
        results.append((out.y, grads.dx, grads.dw_router, grads.dw_gate, grads.dw_down))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def test_saved_size_shrinks_with_policy():
    sizes = [mb.Layer(d_model=32, d_ffn=64, num_experts=4, top_k=2, checkpoint=c)
             .saved_size(mb._lib.PASS_LAYER_FORWARD, 100)
             for c in ("save_all", "save_preact", "recompute")]
    assert sizes[0] > sizes[1] > sizes[2] > 0


def test_training_forward_workspace_is_smaller():
    # FORWARD_WITH_SAVED drops the routing indices (and u under save_all) from a training
    # forward's workspace; the forward passes only, the backward ignores it.
    for checkpoint in ("save_all", "save_preact"):
        layer = mb.Layer(d_model=32, d_ffn=64, num_experts=4, top_k=2, checkpoint=checkpoint)
        for pass_code in (mb._lib.PASS_EXPERTS_FORWARD, mb._lib.PASS_LAYER_FORWARD):
            plain = layer.workspace_size(pass_code, 100)
            lean = layer.workspace_size(pass_code, 100, mb._lib.FORWARD_WITH_SAVED)
            assert 0 < lean < plain
            if checkpoint == "save_all" and pass_code == mb._lib.PASS_EXPERTS_FORWARD:
                assert plain - lean >= 100 * 2 * 64 * 4  # u: N*h float32
        backward = layer.workspace_size(mb._lib.PASS_LAYER_BACKWARD, 100)
        assert layer.workspace_size(mb._lib.PASS_LAYER_BACKWARD, 100,
                                    mb._lib.FORWARD_WITH_SAVED) == backward


@pytest.mark.parametrize("act", ["swiglu", "relu2"])
def test_experts_forward_backward_match_reference(seed, act):
    T, d, h, E, k = 6, 8, 5, 4, 3
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=gen, dtype=torch.float64, requires_grad=True)
    _, w_gate, w_up, w_down = [t.requires_grad_(True) if t is not None else None
                               for t in ref.random_weights(E, d, h, act, generator=gen)]
    ids, g = ref.random_routing(T, E, k, generator=gen)
    g.requires_grad_(True)
    layer = mb.Layer(d_model=d, d_ffn=h, num_experts=E, top_k=k, activation=act, dtype="float64")
    out = layer.experts_forward(np_(x), ids.numpy(), np_(g), np_(w_gate), np_(w_up), np_(w_down))
    y_ref = ref.experts(x, ids, g, w_gate, w_up, w_down, act)
    np.testing.assert_allclose(out.y, y_ref.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(out.expert_counts, np.bincount(ids.numpy().ravel(), minlength=E))
    dy = torch.randn(T, d, generator=gen, dtype=torch.float64)
    (y_ref * dy).sum().backward()
    grads = layer.experts_backward(out, dy.numpy(), np_(x), ids.numpy(), np_(g), np_(w_gate),
                                   np_(w_up), np_(w_down))
    np.testing.assert_allclose(grads.dx, x.grad.numpy(), rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(grads.dg, g.grad.numpy(), rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(grads.dw_gate, w_gate.grad.numpy(), rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(grads.dw_down, w_down.grad.numpy(), rtol=1e-9, atol=1e-11)
    if w_up is not None:
        np.testing.assert_allclose(grads.dw_up, w_up.grad.numpy(), rtol=1e-9, atol=1e-11)
    else:
        assert grads.dw_up is None


def test_experts_backward_skips_unneeded_gradients(seed):
    T, d, h, E, k = 5, 4, 3, 3, 2
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=gen, dtype=torch.float64)
    _, w_gate, w_up, w_down = ref.random_weights(E, d, h, "swiglu", generator=gen)
    ids, g = ref.random_routing(T, E, k, generator=gen)
    layer = mb.Layer(d_model=d, d_ffn=h, num_experts=E, top_k=k, dtype="float64")
    arrays = [x.numpy(), ids.numpy(), g.numpy(), w_gate.numpy(), w_up.numpy(), w_down.numpy()]
    out = layer.experts_forward(*arrays)
    full = layer.experts_backward(out, np.ones((T, d)), *arrays)
    only_dx = layer.experts_backward(out, np.ones((T, d)), *arrays, need=("dx",))
    assert only_dx.dw_gate is None and only_dx.dg is None
    np.testing.assert_array_equal(only_dx.dx, full.dx)


def test_router_forward_backward(seed):
    T, E, k = 11, 6, 2
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=gen, dtype=torch.float64, requires_grad=True)
    layer = mb.Layer(d_model=4, d_ffn=4, num_experts=E, top_k=k, dtype="float64",
                     aux_loss_coeff=AUX, z_loss_coeff=Z)
    out = layer.router_forward(logits.detach().numpy())
    ids_ref, g_ref = ref.route(logits, k)
    aux, z = ref.router_losses(logits, ids_ref, "softmax_topk", AUX, Z)
    np.testing.assert_array_equal(out.ids, ids_ref.numpy())
    np.testing.assert_allclose(out.g, g_ref.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(out.losses, [float(aux.detach()), float(z.detach())], rtol=1e-10)
    dg = torch.randn(T, k, generator=gen, dtype=torch.float64)
    ((g_ref * dg).sum() + aux + z).backward()  # d_losses = NULL means {1, 1}
    d_logits = layer.router_backward(logits.detach().numpy(), out.ids, dg.numpy())
    np.testing.assert_allclose(d_logits, logits.grad.numpy(), rtol=1e-9, atol=1e-12)


def test_routing_build_invariants(seed):
    T, E, k = 13, 5, 2
    gen = torch.Generator().manual_seed(seed)
    ids, _ = ref.random_routing(T, E, k, generator=gen)
    layer = mb.Layer(d_model=4, d_ffn=4, num_experts=E, top_k=k)
    r = layer.routing_build(ids.numpy())
    counts = np.bincount(ids.numpy().ravel(), minlength=E)
    np.testing.assert_array_equal(r.expert_offsets, np.concatenate([[0], np.cumsum(counts)]))
    for e in range(E):
        rows = r.expert_token_indices[r.expert_offsets[e]:r.expert_offsets[e + 1]]
        assert list(rows) == sorted(t for t in range(T) if e in ids[t].tolist())
    for t in range(T):
        for j in range(k):
            assert r.expert_token_indices[r.token_index_map[t * k + j]] == t


def test_deterministic_repeats_and_thread_counts(seed):
    T, d, h, E, k = 64, 16, 24, 8, 2
    x, w_router, w_gate, w_up, w_down = make_problem(seed, T, d, h, E, dtype=torch.float32)
    arrays = [np_(t) for t in (x, w_router, w_gate, w_up, w_down)]
    outputs = []
    for threads in (1, 2, 1):
        context = mb.Context("cpu", num_threads=threads)
        layer = mb.Layer(context, d_model=d, d_ffn=h, num_experts=E, top_k=k)
        out = layer.forward(*arrays)
        grads = layer.backward(out, np.ones((T, d), np.float32), *arrays)
        outputs.append((out.y, grads.dx, grads.dw_gate))
    for other in outputs[1:]:
        for a, b in zip(outputs[0], other):
            np.testing.assert_array_equal(a, b)


def test_bfloat16_layer_takes_and_returns_bits(seed):
    T, d, h, E, k = 8, 8, 8, 4, 2
    x, w_router, w_gate, w_up, w_down = make_problem(seed, T, d, h, E, dtype=torch.float32)
    arrays = [np_(t) for t in (x, w_router, w_gate, w_up, w_down)]
    layer = mb.Layer(d_model=d, d_ffn=h, num_experts=E, top_k=k, dtype="bfloat16")
    out = layer.forward(*arrays)  # float inputs are rounded to bfloat16 bit patterns
    assert out.y.dtype == np.uint16
    rounded = [mb.bfloat16_bits_to_float(mb.float_to_bfloat16_bits(a)) for a in arrays]
    ref32 = mb.Layer(d_model=d, d_ffn=h, num_experts=E, top_k=k, dtype="float32").forward(*rounded)
    np.testing.assert_array_equal(out.ids, ref32.ids)
    np.testing.assert_allclose(mb.bfloat16_bits_to_float(out.y), ref32.y, rtol=3e-2, atol=3e-2)


def test_bfloat16_rounding_is_nearest_even():
    values = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, np.inf], dtype=np.float32)
    bits = mb.float_to_bfloat16_bits(values)
    np.testing.assert_array_equal(mb.bfloat16_bits_to_float(bits),
                                  np.array([1.0, 1.0, 1.0 + 2**-6, -2.5, np.inf], np.float32))
    assert np.isnan(mb.bfloat16_bits_to_float(mb.float_to_bfloat16_bits(np.float32("nan"))))


def test_zero_tokens():
    layer = mb.Layer(d_model=4, d_ffn=4, num_experts=3, top_k=2)
    out = layer.forward(np.zeros((0, 4), np.float32), np.zeros((3, 4), np.float32),
                        *(np.zeros((3, 4, 4), np.float32) for _ in range(3)))
    assert out.y.shape == (0, 4)
    assert out.expert_counts.tolist() == [0, 0, 0]


def test_context_and_layer_close_are_idempotent():
    context = mb.Context()
    layer = mb.Layer(context, d_model=4, d_ffn=4, num_experts=2)
    layer.close()
    layer.close()
    with pytest.raises(ValueError, match="closed"):
        layer.saved_size(mb._lib.PASS_LAYER_FORWARD, 1)
    with context:
        pass
    assert "closed" in repr(context)


def test_accumulate_weight_gradients(seed):
    T, d, h, E, k = 6, 8, 6, 4, 2
    x, w_router, w_gate, w_up, w_down = make_problem(seed, T, d, h, E, dtype=torch.float64)
    arrays = [np_(t) for t in (x, w_router, w_gate, w_up, w_down)]
    layer = mb.Layer(d_model=d, d_ffn=h, num_experts=E, top_k=k, dtype="float64")
    dy = np.random.default_rng(seed).standard_normal((T, d))
    out = layer.forward(*arrays)
    once = layer.backward(out, dy, *arrays)
    grads = mb.LayerGradients(dx=None, dw_router=np.ones((E, d)), dw_gate=np.ones((E, h, d)),
                              dw_up=np.ones((E, h, d)), dw_down=np.ones((E, d, h)),
                              d_logits=None)
    layer.backward(out, dy, *arrays, grads_out=grads, accumulate=True)
    np.testing.assert_allclose(grads.dw_gate, once.dw_gate + 1, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads.dw_router, once.dw_router + 1, rtol=1e-12, atol=1e-12)
    grads.dw_down = np.ones((E, h, d))  # wrong shape: rejected before the library sees it
    with pytest.raises(ValueError, match="dw_down"):
        layer.backward(out, dy, *arrays, grads_out=grads, accumulate=True)


def test_accumulate_without_grads_out_adds_into_zeros(seed):
    """accumulate=True with fresh arrays: the same gradients as accumulate=False (zeros + grads),
    never whatever the uninitialised memory held."""
    T, d, h, E, k = 6, 8, 6, 4, 2
    x, w_router, w_gate, w_up, w_down = make_problem(seed, T, d, h, E, dtype=torch.float64)
    arrays = [np_(t) for t in (x, w_router, w_gate, w_up, w_down)]
    layer = mb.Layer(d_model=d, d_ffn=h, num_experts=E, top_k=k, dtype="float64")
    dy = np.random.default_rng(seed).standard_normal((T, d))
    out = layer.forward(*arrays)
    once = layer.backward(out, dy, *arrays)
    for _ in range(3):
        # leave freed memory of the gradients' sizes full of NaN, for np.empty to reuse
        dirty = [mb.aligned_empty(a.shape, np.float64) for a in arrays[1:] for _ in range(4)]
        for a in dirty:
            a.fill(np.nan)
        del dirty
        grads = layer.backward(out, dy, *arrays, accumulate=True)
        for name in ("dw_router", "dw_gate", "dw_up", "dw_down"):
            np.testing.assert_array_equal(getattr(grads, name), getattr(once, name), err_msg=name)
        np.testing.assert_array_equal(grads.dx, once.dx)


@pytest.mark.parametrize("need", ["dx", "dw_gate", b"dx"])
def test_need_as_a_bare_string_is_refused(seed, need):
    T, d, h, E, k = 5, 4, 3, 3, 2
    x, w_router, w_gate, w_up, w_down = make_problem(seed, T, d, h, E)
    arrays = [np_(t) for t in (x, w_router, w_gate, w_up, w_down)]
    layer = mb.Layer(d_model=d, d_ffn=h, num_experts=E, top_k=k, dtype="float64")
    out = layer.forward(*arrays)
    with pytest.raises(ValueError, match=r"need: .*string.*'dw_router'"):
        layer.backward(out, np.ones((T, d)), *arrays, need=need)
    experts = layer.experts_forward(arrays[0], out.ids, out.g, *arrays[2:])
    with pytest.raises(ValueError, match=r"need: .*string.*'dg'"):
        layer.experts_backward(experts, np.ones((T, d)), arrays[0], out.ids, out.g, *arrays[2:],
                               need=need)


def test_unknown_need_names_are_refused(seed):
    T, d, h, E, k = 5, 4, 3, 3, 2
    x, w_router, w_gate, w_up, w_down = make_problem(seed, T, d, h, E)
    arrays = [np_(t) for t in (x, w_router, w_gate, w_up, w_down)]
    layer = mb.Layer(d_model=d, d_ffn=h, num_experts=E, top_k=k, dtype="float64")
    out = layer.forward(*arrays)
    with pytest.raises(ValueError, match=re.escape("unknown gradients ['dX', 'dw_gates']; "
                                                   "expected some of ['d_logits', 'dw_down'")):
        layer.backward(out, np.ones((T, d)), *arrays, need=("dX", "dw_gates"))
    with pytest.raises(ValueError, match=r"unknown gradients \['dg'\]"):  # experts only
        layer.backward(out, np.ones((T, d)), *arrays, need=("dx", "dg"))
    experts = layer.experts_forward(arrays[0], out.ids, out.g, *arrays[2:])
    with pytest.raises(ValueError, match=r"unknown gradients \['d_g'\].*'dg'"):
        layer.experts_backward(experts, np.ones((T, d)), arrays[0], out.ids, out.g, *arrays[2:],
                               need=("d_g",))
    # the valid names still select (a list, a set, or none at all)
    grads = layer.backward(out, np.ones((T, d)), *arrays, need=["dx", "d_logits"])
    assert grads.dx is not None and grads.d_logits is not None and grads.dw_gate is None
    assert layer.backward(out, np.ones((T, d)), *arrays, need=set()).dx is None


_OVERSIZED = """
import resource
import numpy as np
import moeblaze as mb
T, d, h, E, k = (1 << 30) + 1, 1, 1, 2, 2  # T * k = 2^31 + 2
layer = mb.Layer(d_model=d, d_ffn=h, num_experts=E, top_k=k)
w = (np.ones((E, d), np.float32), np.ones((E, h, d), np.float32), np.ones((E, h, d), np.float32),
     np.ones((E, d, h), np.float32))
layer.forward(np.zeros((2, d), np.float32), *w)  # everything loaded
pages = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (pages + (1536 << 20), resource.RLIM_INFINITY))
x = np.broadcast_to(np.zeros((1, d), np.float32), (T, d))  # stride 0: no memory
ids = np.broadcast_to(np.array([[0, 1]], np.int32), (T, k))
g = np.broadcast_to(np.zeros((1, k), np.float32), (T, k))
calls = (("forward", lambda: layer.forward(x, *w)),
         ("experts_forward", lambda: layer.experts_forward(x, ids, g, *w[1:])),
         ("router_forward", lambda: layer.router_forward(np.broadcast_to(w[0][:, 0], (T, E)))),
         ("routing_build", lambda: layer.routing_build(ids)))
for name, call in calls:
    try:
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
    assert done.stdout.split("\n")[:4] == ["forward refused", "experts_forward refused",
                                           "router_forward refused", "routing_build refused"], \
        done.stdout + done.stderr[-2000:]
