"""Arguments are converted strictly: a value that is not an integer, or does not fit the C type,
raises an error naming the argument instead of being truncated (int(8.5)), parsed (int('8')),
wrapped by ctypes (2**64 + 8 -> 8) or narrowed by numpy (int64 ids beyond int32)."""

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
