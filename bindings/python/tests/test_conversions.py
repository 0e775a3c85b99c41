"""Arguments are converted strictly: a value that is not an integer, or does not fit the C type,
raises an error naming the argument instead of being truncated (int(8.5)), parsed (int('8')),
wrapped by ctypes (2**64 + 8 -> 8) or narrowed by numpy (int64 ids beyond int32, float64 arrays to
float32, bool arrays to ids)."""

import ctypes

import numpy as np
import pytest

import moeblaze as mb
from moeblaze import _lib

BASE = dict(d_model=4, d_ffn=3, num_experts=4, top_k=2, dtype="float32")


def layer(**overrides):
    config = dict(BASE)
    config.update(overrides)
    return mb.Layer(**config)


@pytest.mark.parametrize("field", ["d_model", "d_ffn", "num_experts", "top_k"])
@pytest.mark.parametrize("value", [8.5, 4.0, "8", b"8", None, True, np.float64(4.0), 3 + 0j])
def test_non_integer_sizes_are_type_errors(field, value):
    with pytest.raises(TypeError, match=field):
        layer(**{field: value})


@pytest.mark.parametrize("field", ["d_model", "d_ffn", "num_experts", "top_k"])
@pytest.mark.parametrize("value", [2**64 + 8, 2**63, -(2**63) - 1, 2**100])
def test_sizes_beyond_int64_are_overflow_errors(field, value):
    with pytest.raises(OverflowError, match=field):
        layer(**{field: value})


def test_numpy_integers_are_integers():
    built = layer(d_model=np.int64(4), num_experts=np.int32(4), top_k=np.uint8(2))
    assert (built.d_model, built.num_experts, built.top_k) == (4, 4, 2)


@pytest.mark.parametrize("field", ["aux_loss_coeff", "z_loss_coeff"])
@pytest.mark.parametrize("value", ["0.1", None, True, 1j])
def test_coefficients_must_be_real_numbers(field, value):
    with pytest.raises(TypeError, match=field):
        layer(**{field: value})


@pytest.mark.parametrize("field", ["renormalize", "deterministic"])
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, 1.0])
def test_flags_must_be_bools(field, value):
    with pytest.raises(TypeError, match=field):  # bool("no") would be True
        layer(**{field: value})


def test_numpy_bools_are_bools():
    assert layer(renormalize=np.True_, deterministic=np.bool_(True)).config.renormalize == 1


@pytest.mark.parametrize("value", [2**31, -(2**31) - 1, 2**40])
def test_enum_codes_beyond_int32_are_overflow_errors(value):
    with pytest.raises(OverflowError, match="activation"):
        layer(activation=value)


def test_context_arguments():
    with pytest.raises(TypeError, match="device"):
        mb.Context("cpu", 0.5)
    with pytest.raises(OverflowError, match="device"):
        mb.Context("cpu", 2**32)  # would wrap to device 0
    context = mb.Context("cpu", 0)
    with pytest.raises(TypeError, match="num_threads"):
        context.set_num_threads("2")
    with pytest.raises(OverflowError, match="num_threads"):
        context.set_num_threads(2**32 + 2)  # would wrap to 2


def test_size_queries():
    built = layer()
    with pytest.raises(TypeError, match="num_tokens"):
        built.workspace_size(_lib.PASS_LAYER_FORWARD, 4.5)
    with pytest.raises(OverflowError, match="num_tokens"):
        built.saved_size(_lib.PASS_LAYER_FORWARD, 2**64 + 4)  # would wrap to 4
    with pytest.raises(OverflowError, match="pass_code"):
        built.workspace_size(2**32 + _lib.PASS_LAYER_FORWARD, 4)
    with pytest.raises(OverflowError, match="flags"):
        built.workspace_size(_lib.PASS_LAYER_BACKWARD, 4, flags=2**32 + 1)


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.int32, np.uint32])
def test_int64_ids_beyond_int32_are_refused_not_narrowed(dtype):
    built = layer()
    ids = np.array([[0, 1], [2, 3]], dtype=np.int64)
    ok = ids.astype(dtype)
    built.routing_build(ok)  # in range: any integer dtype is accepted
    for bad in (2**32 + 1, 2**31):  # 2**32 + 1 would narrow to 1, a valid id
        wide = ids.copy()
        wide[1, 0] = bad
        if np.iinfo(dtype).max < bad:
            continue
        with pytest.raises(OverflowError, match="ids"):
            built.routing_build(wide.astype(dtype))
    if np.iinfo(dtype).min < -(2**32):
        wide = ids.copy()
        wide[0, 1] = -(2**32) + 1  # would narrow to 1
        with pytest.raises(OverflowError, match="ids"):
            built.routing_build(wide.astype(dtype))


def test_ids_of_float_dtype_are_type_errors():
    with pytest.raises(TypeError, match="ids"):
        layer().routing_build(np.array([[0.0, 1.0], [2.0, 3.0]]))


def test_bool_ids_are_type_errors():
    """numpy casts bools to int32 (even under casting='safe'): True, False would be experts 1, 0."""
    built = layer()
    ids = np.array([[True, False], [False, True]])
    with pytest.raises(TypeError,
                       match=r"^ids: expected an integer array \(int32\), got dtype bool"):
        built.routing_build(ids)
    x, g = np.ones((2, 4), np.float32), np.full((2, 2), 0.5, np.float32)
    weights = (np.ones((4, 3, 4), np.float32), np.ones((4, 3, 4), np.float32),
               np.ones((4, 4, 3), np.float32))
    with pytest.raises(TypeError, match="ids"):
        built.experts_forward(x, ids, g, *weights)
    with pytest.raises(TypeError, match="ids"):
        built.router_backward(np.zeros((2, 4), np.float32), ids, g)
    built.experts_forward(x, ids.astype(np.int64), g, *weights)  # integer ids stay accepted


def float_problem(dtype, T=3, d=4, h=3, E=4):
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape in (
        ("x", (T, d)), ("w_router", (E, d)), ("w_gate", (E, h, d)), ("w_up", (E, h, d)),
        ("w_down", (E, d, h)))}


@pytest.mark.parametrize("name", ["x", "w_router", "w_gate", "w_up", "w_down"])
def test_float64_arrays_are_not_narrowed_to_float32(name):
    """A float32 layer refuses float64 activations and weights (numpy's same_kind cast would round
    them silently), naming the argument and the dtype it expects."""
    built = layer()
    arrays = float_problem(np.float32)
    arrays[name] = arrays[name].astype(np.float64)
    with pytest.raises(TypeError, match=f"^{name}: expected dtype float32, got float64"):
        built.forward(**arrays)
    if name != "w_router":
        ids, g = np.array([[0, 1], [2, 3], [1, 2]], np.int32), np.full((3, 2), 0.5, np.float32)
        with pytest.raises(TypeError, match=f"^{name}: expected dtype float32"):
            built.experts_forward(arrays["x"], ids, g, arrays["w_gate"], arrays["w_up"],
                                  arrays["w_down"])


def test_routing_arrays_are_not_narrowed():
    built = layer()
    logits = np.zeros((3, 4))  # float64
    with pytest.raises(TypeError, match="^logits: expected dtype float32, got float64"):
        built.router_forward(logits)
    arrays = float_problem(np.float32)
    ids = np.array([[0, 1], [2, 3], [1, 2]], np.int32)
    with pytest.raises(TypeError, match="^g: expected dtype float32, got float64"):
        built.experts_forward(arrays["x"], ids, np.full((3, 2), 0.5), arrays["w_gate"],
                              arrays["w_up"], arrays["w_down"])
    out = built.forward(**arrays)
    with pytest.raises(TypeError, match="^d_losses: expected dtype float32, got float64"):
        built.backward(out, np.ones((3, 4), np.float32), **arrays, d_losses=np.ones(2))
    with pytest.raises(TypeError, match="^x: expected dtype float32, got int64"):
        built.forward(**dict(arrays, x=np.ones((3, 4), np.int64)))  # not floating at all


def test_float_arrays_widen_losslessly():
    """float16 -> float32 -> float64 keeps every value: accepted, with the same results."""
    arrays = float_problem(np.float16)
    wide = {name: a.astype(np.float32) for name, a in arrays.items()}
    built = layer()
    out = built.forward(**arrays)
    np.testing.assert_array_equal(out.y, built.forward(**wide).y)
    built64 = layer(dtype="float64")
    np.testing.assert_array_equal(built64.forward(**wide).y,
                                  built64.forward(**{n: a.astype(np.float64)
                                                     for n, a in wide.items()}).y)
    half = layer(dtype="float16")
    with pytest.raises(TypeError, match="^x: expected dtype float16, got float32"):
        half.forward(**dict(arrays, x=wide["x"]))


def test_bfloat16_layers_take_bits_or_floats_only():
    """A bfloat16 layer takes uint16 bit patterns or floats (rounded to bfloat16, documented); an
    integer or bool array is neither and would be converted by value."""
    built = layer(dtype="bfloat16")
    arrays = float_problem(np.float32)
    built.forward(**arrays)
    for bad in (np.ones((3, 4), np.int32), np.ones((3, 4), bool)):
        with pytest.raises(TypeError, match="^x: expected uint16 bfloat16 bit patterns"):
            built.forward(**dict(arrays, x=bad))


def test_raw_struct_fields_refuse_what_their_c_type_cannot_hold():
    config = _lib.LayerConfig.create()
    with pytest.raises(OverflowError, match="LayerConfig.d_model"):
        config.d_model = 2**64 + 8
    with pytest.raises(TypeError, match="LayerConfig.d_model"):
        config.d_model = 8.5
    with pytest.raises(OverflowError, match="LayerConfig.dtype"):
        config.dtype = 2**32
    with pytest.raises(TypeError, match="LayerConfig.aux_loss_coeff"):
        config.aux_loss_coeff = "0.5"
    config.d_model = np.int64(16)
    assert config.d_model == 16
    args = _lib.ForwardArgs.create()
    with pytest.raises(OverflowError, match="ForwardArgs.flags"):
        args.flags = -1
    with pytest.raises(OverflowError, match="ForwardArgs.saved_bytes"):
        args.saved_bytes = -8
    args.x = None
    args.x = 4096
    assert args.x == 4096
    args.x = ctypes.c_void_p(8192)
    assert args.x == 8192


def test_ep_arguments():
    from moeblaze import ep
    with pytest.raises(TypeError, match="world_size"):
        ep.LocalGroup(1.0)
    with pytest.raises(OverflowError, match="world_size"):
        ep.LocalGroup(2**32 + 1)  # would wrap to 1
    with ep.LocalGroup(1) as group:
        with pytest.raises(TypeError, match="rank"):
            ep.EpLayer(rank="0", group=group, **BASE)
        with pytest.raises(OverflowError, match="rank"):
            ep.EpLayer(rank=2**32, group=group, **BASE)
