"""moeblaze.dlpack on numpy arrays and torch tensors equals the numpy API."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the reference implementation is PyTorch

import moeblaze as mb
from moeblaze import _lib, dlpack


def problem(seed, T=9, d=8, h=6, E=4):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return f(T, d), f(E, d), f(E, h, d), f(E, h, d), f(E, d, h), f(T, d)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_forward_backward_match_numpy_api(seed, framework):
    x, w_router, w_gate, w_up, w_down, dy = problem(seed)
    layer = mb.Layer(d_model=8, d_ffn=6, num_experts=4, top_k=2)
    expected = layer.forward(x, w_router, w_gate, w_up, w_down)
    expected_grads = layer.backward(expected, dy, x, w_router, w_gate, w_up, w_down)

    wrap = (lambda a: a) if framework == "numpy" else torch.from_numpy
    empty = (lambda shape, dt: mb.aligned_empty(shape, dt)) if framework == "numpy" else \
        (lambda shape, dt: torch.from_numpy(mb.aligned_empty(shape, dt)))
    T = x.shape[0]
    y, ids = empty((T, 8), np.float32), empty((T, 2), np.int32)
    saved = empty(layer.saved_size(_lib.PASS_LAYER_FORWARD, T), np.uint8)
    ws = empty(max(layer.workspace_size(_lib.PASS_LAYER_FORWARD, T),
                   layer.workspace_size(_lib.PASS_LAYER_BACKWARD, T)), np.uint8)
    inputs = dict(x=wrap(x), w_router=wrap(w_router), w_gate=wrap(w_gate), w_up=wrap(w_up),
                  w_down=wrap(w_down))
    dlpack.layer_forward(layer, **inputs, y=y, ids_out=ids, saved=saved, workspace=ws)
    np.testing.assert_array_equal(np.asarray(y), expected.y)
    np.testing.assert_array_equal(np.asarray(ids), expected.ids)
    dx, dw_gate = empty((T, 8), np.float32), empty((4, 6, 8), np.float32)
    dlpack.layer_backward(layer, saved=saved, dy=wrap(dy), **inputs, dx=dx, dw_gate=dw_gate,
                          workspace=ws)
    np.testing.assert_array_equal(np.asarray(dx), expected_grads.dx)
    np.testing.assert_array_equal(np.asarray(dw_gate), expected_grads.dw_gate)
    # The same backward allowed to consume the saved buffer (the CPU backend ignores it): same bits.
    dx2 = empty((T, 8), np.float32)
    dlpack.layer_backward(layer, saved=saved, dy=wrap(dy), **inputs, dx=dx2, workspace=ws,
                          consume_saved=True)
    np.testing.assert_array_equal(np.asarray(dx2), expected_grads.dx)


def test_rejects_wrong_dtype_shape_and_strides():
    x, w_router, w_gate, w_up, w_down, _ = problem(0)
    layer = mb.Layer(d_model=8, d_ffn=6, num_experts=4, top_k=2)
    y = mb.aligned_empty((9, 8), np.float32)
    ws = mb.aligned_empty(layer.workspace_size(_lib.PASS_LAYER_FORWARD, 9) + 1, np.uint8)
    kwargs = dict(x=x, w_router=w_router, w_gate=w_gate, w_up=w_up, w_down=w_down, y=y,
                  workspace=ws)
    with pytest.raises(TypeError, match="w_gate"):
        dlpack.layer_forward(layer, **{**kwargs, "w_gate": w_gate.astype(np.float64)})
    with pytest.raises(ValueError, match="w_down"):
        dlpack.layer_forward(layer, **{**kwargs, "w_down": w_gate})
    with pytest.raises(ValueError, match="row-major"):
        dlpack.layer_forward(layer, **{**kwargs, "x": np.asfortranarray(x)})
    with pytest.raises(ValueError, match="workspace"):
        dlpack.layer_forward(layer, **{**kwargs, "workspace": ws[:0]})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda unavailable")
def test_cuda_tensors_match_cpu():
    x, w_router, w_gate, w_up, w_down, _ = problem(1)
    cpu = mb.Layer(d_model=8, d_ffn=6, num_experts=4, top_k=2)
    expected = cpu.forward(x, w_router, w_gate, w_up, w_down, training=False).y
    gpu = mb.Layer(mb.Context("cuda", torch.cuda.current_device()), d_model=8, d_ffn=6,
                   num_experts=4, top_k=2)
    t = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    y = torch.empty(9, 8, device="cuda")
    ws = torch.empty(max(gpu.workspace_size(_lib.PASS_LAYER_FORWARD, 9), 1), dtype=torch.uint8,
                     device="cuda")
    dlpack.layer_forward(gpu, x=t(x), w_router=t(w_router), w_gate=t(w_gate), w_up=t(w_up),
                         w_down=t(w_down), y=y, workspace=ws,
                         stream=torch.cuda.current_stream().cuda_stream)
    np.testing.assert_allclose(y.cpu().numpy(), expected, rtol=1e-4, atol=1e-5)


def test_bad_x_is_named():
    layer = mb.Layer(d_model=8, d_ffn=6, num_experts=4, top_k=2)
    _, w_router, w_gate, w_up, w_down, _ = problem(0)
    weights = dict(w_router=w_router, w_gate=w_gate, w_up=w_up, w_down=w_down,
                   y=np.zeros((9, 8), np.float32))
    with pytest.raises(ValueError, match=r"x: expected a 2-D \[T, d_model\] tensor, got shape "
                                         r"\[\]"):
        dlpack.layer_forward(layer, x=np.ones((), np.float32), **weights)
    with pytest.raises(TypeError, match="x: expected a DLPack tensor .* got list"):
        dlpack.layer_forward(layer, x=[[1.0] * 8] * 9, **weights)
    with pytest.raises(TypeError, match="w_gate: expected a DLPack tensor"):
        dlpack.layer_forward(layer, x=np.zeros((9, 8), np.float32),
                             **dict(weights, w_gate=w_gate.tolist()))
