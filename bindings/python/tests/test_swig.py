"""Smoke tests of the SWIG module `moeblaze_swig` (built by CMake; PYTHONPATH gives its folder).

Skipped when the module is not importable, unless MOEBLAZE_REQUIRE_SWIG=1 (CTest sets it when the
module was built), so a broken build cannot hide behind a skip."""

import gc
import os
import re

import numpy as np
import pytest

if os.environ.get("MOEBLAZE_REQUIRE_SWIG") == "1":
    import moeblaze_swig as m
else:
    m = pytest.importorskip("moeblaze_swig")

import moeblaze as mb


def make_layer(ctx, **fields):
    config = m.moeblaze_layer_config_t()
    config.dtype = m.MOEBLAZE_DTYPE_F32
    config.d_model, config.d_ffn, config.num_experts, config.top_k = 8, 6, 4, 2
    for key, value in fields.items():
        setattr(config, key, value)
    return m.moeblaze_layer_create(ctx, config)


def test_versions_match_ctypes():
    assert m.moeblaze_get_abi_version() == m.MOEBLAZE_ABI_VERSION == mb.ABI_VERSION
    assert m.moeblaze_get_version() == m.MOEBLAZE_VERSION == mb.get_version()


def test_struct_init_sets_struct_size_and_defaults():
    config = m.moeblaze_layer_config_t()
    assert config.struct_size > 0
    assert config.top_k == 1 and config.deterministic == 1
    assert config.checkpoint == m.MOEBLAZE_CHECKPOINT_SAVE_PREACT
    with pytest.raises(AttributeError):
        config.struct_size = 1  # immutable: the init function owns it
    args = m.moeblaze_forward_args_t()
    assert args.x is None and args.y is None  # NULL pointers read as None
    args.x = 0x1000
    assert args.x == 0x1000


def test_status_raises_with_library_message():
    with pytest.raises(ValueError) as info:
        m.moeblaze_context_create(99, 0)
    assert info.value.status == m.MOEBLAZE_ERR_INVALID_ARGUMENT
    assert "backend" in str(info.value)
    ctx = m.moeblaze_context_create(m.MOEBLAZE_BACKEND_CPU, 0)
    with pytest.raises(ValueError, match="d_model"):
        make_layer(ctx, d_model=0)
    if not m.moeblaze_backend_available(m.MOEBLAZE_BACKEND_CUDA):
        with pytest.raises(NotImplementedError):
            m.moeblaze_context_create(m.MOEBLAZE_BACKEND_CUDA, 0)


def test_out_parameters_and_handles():
    ctx = m.moeblaze_context_create(m.MOEBLAZE_BACKEND_CPU, 0)
    assert m.moeblaze_context_get_info(ctx) == [m.MOEBLAZE_BACKEND_CPU, 0]
    layer = make_layer(ctx)
    saved = m.moeblaze_layer_saved_size(layer, m.MOEBLAZE_PASS_LAYER_FORWARD, 10)
    assert isinstance(saved, int) and saved > 0
    with pytest.raises(TypeError):
        m.moeblaze_layer_saved_size(ctx, m.MOEBLAZE_PASS_LAYER_FORWARD, 10)  # typed handles
    with pytest.raises(RuntimeError) as info:
        m.moeblaze_layer_saved_size(None, m.MOEBLAZE_PASS_LAYER_FORWARD, 10)
    assert info.value.status == m.MOEBLAZE_ERR_INVALID_HANDLE
    needed, text = m.moeblaze_copy_last_error(256)
    assert needed == len(text) + 1 and "layer" in text
    del ctx  # the layer keeps what it needs alive
    gc.collect()
    assert m.moeblaze_layer_saved_size(layer, m.MOEBLAZE_PASS_LAYER_FORWARD, 10) == saved


def test_layer_forward_matches_ctypes_package():
    rng = np.random.default_rng(0)
    T, d, h, E, k = 10, 8, 6, 4, 2
    arrays = [mb.aligned_empty(shape, np.float32) for shape in
              ((T, d), (E, d), (E, h, d), (E, h, d), (E, d, h))]
    for a in arrays:
        a[...] = rng.standard_normal(a.shape)
    x, w_router, w_gate, w_up, w_down = arrays
    ctx = m.moeblaze_context_create(m.MOEBLAZE_BACKEND_CPU, 0)
    layer = make_layer(ctx)
    y = mb.aligned_empty((T, d), np.float32)
    ws_size = m.moeblaze_layer_workspace_size(layer, m.MOEBLAZE_PASS_LAYER_FORWARD, T)
    workspace = mb.aligned_empty(max(ws_size, 1), np.uint8)
    args = m.moeblaze_forward_args_t()
    args.num_tokens = T
    args.x, args.w_router = x.ctypes.data, w_router.ctypes.data
    args.w_gate, args.w_up, args.w_down = w_gate.ctypes.data, w_up.ctypes.data, w_down.ctypes.data
    args.y = y.ctypes.data
    args.workspace, args.workspace_bytes = workspace.ctypes.data, ws_size
    m.moeblaze_layer_forward(layer, args, None)
    expected = mb.Layer(d_model=d, d_ffn=h, num_experts=E, top_k=k).forward(
        x, w_router, w_gate, w_up, w_down, training=False)
    np.testing.assert_array_equal(y, expected.y)
    args.workspace_bytes = 0
    if ws_size:
        with pytest.raises(RuntimeError) as info:
            m.moeblaze_layer_forward(layer, args, None)
        assert info.value.status == m.MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE


def _header_text():
    from conftest import HEADER
    return HEADER.read_text()


def test_every_header_constant_is_in_the_module():
    text = _header_text()
    constants = dict(re.findall(r"\b(MOEBLAZE_\w+) = (\d+)", text))
    constants.update(re.findall(r"#define (MOEBLAZE_\w+) (\d+)u?\b", text))
    assert len(constants) >= 40
    for name, value in constants.items():
        assert getattr(m, name) == int(value), name


def test_every_header_function_is_wrapped():
    declared = set(re.findall(r"MOEBLAZE_API [^;]*?\b(moeblaze_\w+)\s*\(", _header_text()))
    # The handles' destroy functions are called by the Python proxies, not wrapped.
    not_wrapped = {"moeblaze_context_destroy", "moeblaze_layer_destroy"}
    missing = sorted(f for f in declared - not_wrapped if not hasattr(m, f))
    assert not missing
