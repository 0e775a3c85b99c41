"""moeblaze.jax (XLA FFI custom calls) against a plain jax.numpy reference.

CPU: float64 forward and gradients under jit for every activation and checkpoint policy, the whole
layer for every score function, the 16/32-bit dtypes, batching, reuse of the residuals, bad inputs.
GPU (a CUDA build of the shim and a JAX that sees a CUDA device; skipped visibly otherwise):
bfloat16 against the reference and bitwise repeatability.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)  # float64 reference and float64 layers (CPU)

import jax.numpy as jnp  # noqa: E402

from moeblaze import _lib  # noqa: E402
from moeblaze import jax as mbj  # noqa: E402

ACTIVATIONS = sorted(_lib.ACTIVATIONS)
CHECKPOINTS = sorted(_lib.CHECKPOINTS)
GATED = _lib.GATED_ACTIVATIONS
HAS_CUDA = "cuda" in mbj.platforms()
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="no CUDA: libmoeblaze_xla was built without the CUDA backend or JAX "
    "sees no CUDA device")

CPU = jax.devices("cpu")[0]


@pytest.fixture(autouse=True)
def arrays_on_the_cpu():
    """Arrays are made on the CPU unless a test moves them (the GPU tests do): the float64 cases
    run on the CPU backend on a GPU machine too, and references are computed there in float64."""
    with jax.default_device(CPU):
        yield


# ------------------------------------------------------------------------------------------------
# The reference: the header's math in plain jax.numpy
# ------------------------------------------------------------------------------------------------


def activation_ref(name, a, b):
    gelu = lambda v: jax.nn.gelu(v, approximate=False)  # noqa: E731  (exact erf form)
    return {
        "swiglu": lambda: jax.nn.silu(a) * b,
        "geglu": lambda: gelu(a) * b,
        "reglu": lambda: jax.nn.relu(a) * b,
        "silu": lambda: jax.nn.silu(a),
        "gelu": lambda: gelu(a),
        "relu": lambda: jax.nn.relu(a),
        "relu2": lambda: jax.nn.relu(a) ** 2,
    }[name]()


def experts_ref(x, ids, g, w_gate, w_up, w_down, act):
    """y[t] = sum_j g[t,j] * w_down[e] @ act(w_gate[e] @ x[t], w_up[e] @ x[t]), e = ids[t,j]."""
    a = jnp.einsum("td,tjhd->tjh", x, w_gate[ids])
    b = jnp.einsum("td,tjhd->tjh", x, w_up[ids]) if act in GATED else None
    y2 = jnp.einsum("tjh,tjdh->tjd", activation_ref(act, a, b), w_down[ids])
    return jnp.einsum("tj,tjd->td", g.astype(x.dtype), y2)


def layer_ref(x, w_router, w_gate, w_up, w_down, top_k, activation="swiglu",
              score_function="softmax_topk",
              renormalize=False, aux_loss_coeff=0.0, z_loss_coeff=0.0):
    """Returns y, aux, z, ids. Top-k selection carries no gradient (ids from the forward)."""
    route = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    logits = x.astype(route) @ w_router.astype(route).T
    T, E = logits.shape
    if score_function == "softmax_topk":
        scores = jax.nn.softmax(logits, axis=-1)
    elif score_function == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = logits
    _, ids = jax.lax.top_k(jax.lax.stop_gradient(scores), top_k)  # ties: lower id first
    picked = jnp.take_along_axis(scores, ids, axis=-1)
    if score_function == "topk_softmax":
        g = jax.nn.softmax(picked, axis=-1)
    else:
        g = picked / picked.sum(-1, keepdims=True) if renormalize else picked
    y = experts_ref(x, ids, g, w_gate, w_up, w_down, activation)
    if score_function == "sigmoid":
        s = jax.nn.sigmoid(logits)
        probs = s / s.sum(-1, keepdims=True)
    else:
        probs = jax.nn.softmax(logits, axis=-1)
    # The layer configuration holds the coefficients as float32 (moeblaze_layer_config_t).
    aux_loss_coeff, z_loss_coeff = float(np.float32(aux_loss_coeff)), float(np.float32(z_loss_coeff))
    counts = jnp.zeros(E, route).at[ids.reshape(-1)].add(1.0)
    aux = aux_loss_coeff * E * jnp.sum(counts / (T * top_k) * probs.mean(0))
    z = z_loss_coeff * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return y, aux, z, ids.astype(jnp.int32)


# ------------------------------------------------------------------------------------------------
# Problems
# ------------------------------------------------------------------------------------------------


def weights(rng, E, d, h, act, dtype):
    def u(shape, fan_in):
        return jnp.asarray(rng.uniform(-1, 1, shape) / np.sqrt(fan_in), dtype)
    return (u((E, d), d), u((E, h, d), d), u((E, h, d), d) if act in GATED else None,
            u((E, d, h), h))


def routing(rng, T, E, k):
    ids = np.array([rng.permutation(E)[:k] for _ in range(T)], np.int32).reshape(T, k)
    return jnp.asarray(ids), rng.uniform(0.1, 1.0, (T, k))


def experts_problem(seed, T, d, h, E, k, act, dtype=jnp.float64):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, d)), dtype)
    _, w_gate, w_up, w_down = weights(rng, E, d, h, act, dtype)
    ids, g = routing(rng, T, E, k)
    g = jnp.asarray(g, mbj.routing_dtype(dtype))
    dy = jnp.asarray(rng.standard_normal((T, d)), dtype)
    return x, ids, g, w_gate, w_up, w_down, dy


def assert_close(name, mine, ref, rtol):
    mine = np.asarray(mine, np.float64)
    ref = np.asarray(ref, np.float64)
    assert mine.shape == ref.shape, f"{name}: shape {mine.shape} != {ref.shape}"
    assert np.all(np.isfinite(mine)), f"{name}: non-finite values"
    err = np.linalg.norm(mine - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= rtol, f"{name}: relative error {err:.3g} > {rtol:.3g}"


def experts_grads(fn, x, ids, g, w_gate, w_up, w_down, dy, act):
    """y and the gradients of sum(y * dy) w.r.t. x, g and the weights, through jit."""
    diff = (x, g, w_gate, w_up, w_down) if act in GATED else (x, g, w_gate, w_down)

    def loss(*diff_args):
        if act in GATED:
            xx, gg, wg, wu, wd = diff_args
        else:
            (xx, gg, wg, wd), wu = diff_args, None
        y = fn(xx, ids, gg, wg, wu, wd)
        return jnp.sum(y.astype(jnp.float64) * dy.astype(jnp.float64)), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(diff))),
                                               has_aux=True))(*diff)
    names = ("x", "g", "w_gate", "w_up", "w_down") if act in GATED else (
        "x", "g", "w_gate", "w_down")
    return y, dict(zip(names, grads))


# ------------------------------------------------------------------------------------------------
# Experts, float64 on the CPU
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_experts_float64_matches_reference(seed, act, checkpoint):
    T, d, h, E, k = 13, 16, 24, 5, 2
    x, ids, g, w_gate, w_up, w_down, dy = experts_problem(seed, T, d, h, E, k, act)

    def mine(*a):
        return mbj.moe_experts(*a, activation=act, checkpoint=checkpoint)

    def ref(*a):
        return experts_ref(*a, act)

    y, grads = experts_grads(mine, x, ids, g, w_gate, w_up, w_down, dy, act)
    y_ref, grads_ref = experts_grads(ref, x, ids, g, w_gate, w_up, w_down, dy, act)
    assert y.dtype == jnp.float64
    assert_close("y", y, y_ref, 1e-12)
    for name in grads_ref:
        assert grads[name].dtype == grads_ref[name].dtype
        assert_close(f"d{name}", grads[name], grads_ref[name], 1e-11)
    # Inference (no saved buffer) gives the training forward's output.
    y_infer = jax.jit(mine)(x, ids, g, w_gate, w_up, w_down)
    np.testing.assert_array_equal(np.asarray(y_infer), np.asarray(y))


def test_checkpoint_policies_give_identical_bits(seed):
    x, ids, g, w_gate, w_up, w_down, dy = experts_problem(seed, 11, 8, 12, 4, 3, "swiglu",
                                                          jnp.float32)
    results = []
    for checkpoint in CHECKPOINTS:
        fn = lambda *a, c=checkpoint: mbj.moe_experts(*a, checkpoint=c)  # noqa: E731
        y, grads = experts_grads(fn, x, ids, g, w_gate, w_up, w_down, dy, "swiglu")
        results.append([np.asarray(y)] + [np.asarray(v) for v in grads.values()])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def test_experts_leading_dims_and_vmap(seed):
    B, S, d, h, E, k = 2, 5, 8, 6, 4, 2
    x, ids, g, w_gate, w_up, w_down, _ = experts_problem(seed, B * S, d, h, E, k, "swiglu")
    y_flat = mbj.moe_experts(x, ids, g, w_gate, w_up, w_down)
    y = mbj.moe_experts(x.reshape(B, S, d), ids.reshape(B, S, k), g.reshape(B, S, k), w_gate,
                        w_up, w_down)
    assert y.shape == (B, S, d)
    np.testing.assert_array_equal(np.asarray(y).reshape(B * S, d), np.asarray(y_flat))
    y_vmap = jax.vmap(lambda xx, ii, gg: mbj.moe_experts(xx, ii, gg, w_gate, w_up, w_down))(
        x.reshape(B, S, d), ids.reshape(B, S, k), g.reshape(B, S, k))
    assert_close("y (vmap)", y_vmap, y, 1e-14)


def test_residuals_serve_two_backward_passes(seed):
    """consume_saved lets the backward overwrite the saved activations; XLA then copies the
    residual when one forward feeds two backward passes, so both give the same gradients."""
    x, ids, g, w_gate, w_up, w_down, dy = experts_problem(seed, 9, 8, 12, 4, 2, "geglu")
    for consume in (True, False):
        y, pullback = jax.vjp(lambda xx, wg: mbj.moe_experts(
            xx, ids, g, wg, w_up, w_down, activation="geglu", consume_saved=consume), x, w_gate)
        first = pullback(dy)
        second = pullback(dy)
        for a, b in zip(first, second):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        ref = jax.vjp(lambda xx, wg: experts_ref(xx, ids, g, wg, w_up, w_down, "geglu"), x,
                      w_gate)[1](dy)
        assert_close("dx", first[0], ref[0], 1e-11)
        assert_close("dw_gate", first[1], ref[1], 1e-11)


def test_experts_no_tokens():
    d, h, E, k = 8, 6, 4, 2
    x, ids, g, w_gate, w_up, w_down, dy = experts_problem(0, 0, d, h, E, k, "swiglu")
    y, grads = experts_grads(mbj.moe_experts, x, ids, g, w_gate, w_up, w_down, dy, "swiglu")
    assert y.shape == (0, d)
    for name in ("w_gate", "w_up", "w_down"):
        assert not np.any(np.asarray(grads[name])), f"d{name} of no tokens must be zero"


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2),
                                        (jnp.float16, 3e-3)])
def test_experts_lower_precision_cpu(seed, dtype, rtol):
    T, d, h, E, k = 16, 32, 24, 6, 2
    x, ids, g, w_gate, w_up, w_down, dy = experts_problem(seed, T, d, h, E, k, "swiglu", dtype)
    y, grads = experts_grads(mbj.moe_experts, x, ids, g, w_gate, w_up, w_down, dy, "swiglu")
    assert y.dtype == dtype and grads["g"].dtype == jnp.float32
    up = lambda a: a.astype(jnp.float64)  # noqa: E731
    y_ref, grads_ref = experts_grads(lambda *a: experts_ref(*a, "swiglu"), up(x), ids, up(g),
                                     up(w_gate), up(w_up), up(w_down), up(dy), "swiglu")
    assert_close("y", y, y_ref, rtol)
    for name in grads_ref:
        assert grads[name].dtype == (jnp.float32 if name == "g" else dtype)
        assert_close(f"d{name}", grads[name], grads_ref[name], 2 * rtol)


# ------------------------------------------------------------------------------------------------
# Whole layer
# ------------------------------------------------------------------------------------------------


LAYER_CASES = [
    ("swiglu", "save_preact", "softmax_topk", False),
    ("swiglu", "recompute", "softmax_topk", True),
    ("gelu", "save_all", "topk_softmax", False),
    ("relu2", "save_preact", "sigmoid", True),
    ("reglu", "recompute", "sigmoid", False),
]


@pytest.mark.parametrize("act,checkpoint,score_function,renormalize", LAYER_CASES)
def test_layer_float64_matches_reference(seed, act, checkpoint, score_function, renormalize):
    T, d, h, E, k = 12, 16, 20, 6, 3
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, d)))
    w_router, w_gate, w_up, w_down = weights(rng, E, d, h, act, jnp.float64)
    dy = jnp.asarray(rng.standard_normal((T, d)))
    opts = dict(top_k=k, activation=act, score_function=score_function, renormalize=renormalize,
                aux_loss_coeff=0.01, z_loss_coeff=0.001)

    def objective(fn):
        def loss(xx, wr, wg, wu, wd):
            y, aux, z = fn(xx, wr, wg, wu, wd)[:3]
            return jnp.sum(y * dy) + 3.0 * aux + 5.0 * z, (y, aux, z)
        argnums = (0, 1, 2, 3, 4) if act in GATED else (0, 1, 2, 4)
        return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))

    mine = objective(lambda *a: mbj.moe_layer(*a, checkpoint=checkpoint, **opts))
    ref = objective(lambda *a: layer_ref(*a, **opts))
    (_, (y, aux, z)), grads = mine(x, w_router, w_gate, w_up, w_down)
    (_, (y_ref, aux_ref, z_ref)), grads_ref = ref(x, w_router, w_gate, w_up, w_down)
    assert aux.shape == () and aux.dtype == jnp.float64
    assert_close("y", y, y_ref, 1e-12)
    assert_close("aux_loss", aux, aux_ref, 1e-12)
    assert_close("z_loss", z, z_ref, 1e-12)
    assert float(aux) > 0 and float(z) > 0
    names = ("dx", "dw_router", "dw_gate", "dw_up", "dw_down") if act in GATED else (
        "dx", "dw_router", "dw_gate", "dw_down")
    for name, a, b in zip(names, grads, grads_ref):
        assert_close(name, a, b, 1e-10)

    y2, _, _, counts = mbj.moe_layer(x, w_router, w_gate, w_up, w_down, checkpoint=checkpoint,
                                     return_expert_counts=True, **opts)
    ids_ref = layer_ref(x, w_router, w_gate, w_up, w_down, **opts)[3]
    np.testing.assert_array_equal(np.asarray(counts),
                                  np.bincount(np.asarray(ids_ref).ravel(), minlength=E))
    assert int(np.asarray(counts).sum()) == T * k


def test_layer_float32_leading_dims(seed):
    B, S, d, h, E, k = 2, 6, 16, 12, 4, 2
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((B, S, d)), jnp.float32)
    w_router, w_gate, w_up, w_down = weights(rng, E, d, h, "swiglu", jnp.float32)
    y, aux, z = jax.jit(lambda xx: mbj.moe_layer(xx, w_router, w_gate, w_up, w_down, top_k=k,
                                                 aux_loss_coeff=0.1))(x)
    assert y.shape == x.shape and y.dtype == jnp.float32 and aux.dtype == jnp.float32
    assert float(z) == 0.0  # z_loss_coeff = 0
    up = lambda a: a.astype(jnp.float64)  # noqa: E731
    y_ref, aux_ref, _, _ = layer_ref(up(x).reshape(-1, d), up(w_router), up(w_gate), up(w_up),
                                     up(w_down), k, aux_loss_coeff=0.1)
    assert_close("y", y.reshape(-1, d), y_ref, 1e-5)
    assert_close("aux_loss", aux, aux_ref, 1e-5)


# ------------------------------------------------------------------------------------------------
# Bad inputs: clear Python errors at trace time, library errors as XLA errors
# ------------------------------------------------------------------------------------------------


def small_experts(act="swiglu"):
    return experts_problem(1, 4, 8, 6, 4, 2, act)[:6]


@pytest.mark.parametrize("mutate,error,match", [
    (lambda a: a.update(x=a["x"].astype(jnp.int32)), TypeError, "x: dtype int32"),
    (lambda a: a.update(ids=a["ids"].astype(jnp.int64)), TypeError, "ids: expected dtype int32"),
    (lambda a: a.update(g=a["g"].astype(jnp.float32)), TypeError, "g: expected dtype float64"),
    (lambda a: a.update(ids=a["ids"][:3]), ValueError, "ids: expected shape"),
    (lambda a: a.update(w_down=a["w_down"][:, :, :5]), ValueError, "w_down: expected shape"),
    (lambda a: a.update(w_gate=a["w_gate"][0]), ValueError, "w_gate: expected"),
    (lambda a: a.update(w_up=a["w_up"].astype(jnp.float32)), TypeError, "w_up: expected dtype"),
    (lambda a: a.update(w_up=None), ValueError, "w_up is required"),
    (lambda a: a.update(activation="silu"), ValueError, "w_up must be None"),
    (lambda a: a.update(activation="swish"), ValueError, "activation: unknown 'swish'"),
    (lambda a: a.update(checkpoint="all"), ValueError, "checkpoint: unknown 'all'"),
])
def test_experts_bad_inputs_raise_before_xla(mutate, error, match):
    x, ids, g, w_gate, w_up, w_down = small_experts()
    args = dict(x=x, ids=ids, g=g, w_gate=w_gate, w_up=w_up, w_down=w_down)
    mutate(args)
    with pytest.raises(error, match=match):
        mbj.moe_experts(**args)
    arrays = {k: v for k, v in args.items() if hasattr(v, "shape")}
    static = {k: v for k, v in args.items() if not hasattr(v, "shape")}
    with pytest.raises(error, match=match):  # the same under jit: raised while tracing
        jax.jit(lambda a: mbj.moe_experts(**a, **static))(arrays)


def test_top_k_larger_than_experts_raises():
    x, ids, g, w_gate, w_up, w_down = experts_problem(1, 4, 8, 6, 2, 2, "swiglu")[:6]
    w_router = jnp.zeros((2, 8))
    with pytest.raises(ValueError, match=r"top_k = 3 must be in 1..min\(num_experts = 2"):
        mbj.moe_layer(x, w_router, w_gate, w_up, w_down, top_k=3)
    with pytest.raises(ValueError, match="top_k = 3"):
        mbj.moe_experts(x, jnp.zeros((4, 3), jnp.int32), jnp.zeros((4, 3)), w_gate, w_up, w_down)
    with pytest.raises(ValueError, match="w_router: expected shape"):
        mbj.moe_layer(x, jnp.zeros((3, 8)), w_gate, w_up, w_down, top_k=1)
    with pytest.raises(ValueError, match="aux_loss_coeff"):
        mbj.moe_layer(x, w_router, w_gate, w_up, w_down, top_k=1, aux_loss_coeff=-1.0)
    with pytest.raises(ValueError, match="score_function: unknown"):
        mbj.moe_layer(x, w_router, w_gate, w_up, w_down, top_k=1, score_function="max")
    with pytest.raises(TypeError, match="top_k: expected an int"):
        mbj.moe_layer(x, w_router, w_gate, w_up, w_down, top_k=1.5)


@pytest.mark.parametrize("options,error,name", [
    (dict(aux_loss_coeff="0.5"), TypeError, "aux_loss_coeff"),
    (dict(z_loss_coeff=None), TypeError, "z_loss_coeff"),
    (dict(renormalize="no"), TypeError, "renormalize"),
    (dict(consume_saved=1), TypeError, "consume_saved")])
def test_layer_options_are_converted_strictly(options, error, name):
    x, _, _, w_gate, w_up, w_down = experts_problem(1, 4, 8, 6, 2, 2, "swiglu")[:6]
    with pytest.raises(error, match=name):
        mbj.moe_layer(x, jnp.zeros((2, 8)), w_gate, w_up, w_down, top_k=1, **options)


def test_zero_d_model_is_named():
    T, h, E = 6, 16, 4
    zeros = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    with pytest.raises(ValueError, match=r"x: d_model \(the last dimension\) must be positive"):
        mbj.moe_layer(zeros(T, 0), zeros(E, 0), zeros(E, h, 0), zeros(E, h, 0), zeros(E, 0, h),
                      top_k=1)
    with pytest.raises(ValueError, match="x: d_model"):
        mbj.moe_experts(zeros(T, 0), np.zeros((T, 1), np.int32), zeros(T, 1), zeros(E, h, 0),
                        zeros(E, h, 0), zeros(E, 0, h))


def test_library_error_reaches_python_with_its_message():
    """An expert id out of range passes every shape check; the CPU backend rejects it and its
    message arrives as the XLA error."""
    x, ids, g, w_gate, w_up, w_down = small_experts()
    bad_ids = ids.at[2, 1].set(7)  # E = 4
    with pytest.raises(Exception, match="moeblaze_experts_fwd") as info:
        jax.block_until_ready(jax.jit(mbj.moe_experts)(x, bad_ids, g, w_gate, w_up, w_down))
    assert "id" in str(info.value)


def test_shim_checks_buffers_itself():
    """A direct FFI call with inconsistent buffers is refused by the handler, naming the buffer."""
    mbj.platforms()  # registers the targets
    x, ids, g, w_gate, w_up, w_down = small_experts()
    call = jax.ffi.ffi_call("moeblaze_experts_fwd", (
        jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((0,), jnp.uint8),
        jax.ShapeDtypeStruct((1 << 16,), jnp.uint8)))
    with pytest.raises(Exception, match="moeblaze_experts_fwd: w_down: expected shape"):
        jax.block_until_ready(call(x, ids, g, w_gate, w_up, w_down[:, :, :3],
                                   activation=np.int32(0), checkpoint=np.int32(1)))
    with pytest.raises(Exception, match="moeblaze_experts_fwd: g: expected dtype float64"):
        jax.block_until_ready(call(x, ids, g.astype(jnp.float32), w_gate, w_up, w_down,
                                   activation=np.int32(0), checkpoint=np.int32(1)))
    with pytest.raises(Exception, match="workspace"):  # too small: the library says how much
        small = jax.ffi.ffi_call("moeblaze_experts_fwd", (
            jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((0,), jnp.uint8),
            jax.ShapeDtypeStruct((0,), jnp.uint8)))
        jax.block_until_ready(small(x, ids, g, w_gate, w_up, w_down, activation=np.int32(0),
                                    checkpoint=np.int32(1)))


def test_shim_names_bad_attributes_and_dtypes():
    """A direct FFI call's attributes are validated (by creating the plan) before the buffers are
    checked against them, and every dtype is named in the message."""
    mbj.platforms()
    x, ids, g, w_gate, w_up, w_down = small_experts()
    call = jax.ffi.ffi_call("moeblaze_experts_fwd", (
        jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((0,), jnp.uint8),
        jax.ShapeDtypeStruct((1 << 16,), jnp.uint8)))
    # Not "w_up must be empty": 99 is no activation, gated or not.
    with pytest.raises(Exception, match="moeblaze_experts_fwd: .*config.activation = 99"):
        jax.block_until_ready(call(x, ids, g, w_gate, w_up, w_down, activation=np.int32(99),
                                   checkpoint=np.int32(1)))
    int_call = jax.ffi.ffi_call("moeblaze_experts_fwd", (
        jax.ShapeDtypeStruct(x.shape, jnp.int8), jax.ShapeDtypeStruct((0,), jnp.uint8),
        jax.ShapeDtypeStruct((1 << 16,), jnp.uint8)))
    with pytest.raises(Exception, match="x: dtype int8 is not one of"):
        jax.block_until_ready(int_call(x.astype(jnp.int8), ids, g, w_gate, w_up, w_down,
                                       activation=np.int32(0), checkpoint=np.int32(1)))
    with pytest.raises(Exception, match="y: expected dtype float64, got int8"):
        jax.block_until_ready(int_call(x, ids, g, w_gate, w_up, w_down, activation=np.int32(0),
                                       checkpoint=np.int32(1)))


def test_size_query_plans_are_bounded(monkeypatch):
    """The loss coefficients are part of a plan's configuration: an annealed coefficient makes a
    plan per value, of which moeblaze.jax keeps the MAX_CACHED_PLANS most recently used."""
    monkeypatch.setattr(mbj, "MAX_CACHED_PLANS", 4)
    x, _, _, w_gate, w_up, w_down = small_experts()
    w_router = jnp.asarray(np.random.default_rng(3).standard_normal((4, 8)))
    first = mbj.moe_layer(x, w_router, w_gate, w_up, w_down, top_k=2, aux_loss_coeff=0.5)
    for i in range(10):
        mbj.moe_layer(x, w_router, w_gate, w_up, w_down, top_k=2, aux_loss_coeff=0.01 * (i + 1))
        assert mbj._cached_plans()["sizes"] <= 4
    again = mbj.moe_layer(x, w_router, w_gate, w_up, w_down, top_k=2, aux_loss_coeff=0.5)
    for a, b in zip(first, again):  # the evicted plan is made again
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_shim_plans_are_bounded():
    """libmoeblaze_xla keeps at most shim_max execution plans (least recently used go): handlers
    find theirs by key at every call, so a compiled program whose plan was evicted still runs."""
    x, _, _, w_gate, w_up, w_down = small_experts()
    w_router = jnp.asarray(np.random.default_rng(4).standard_normal((4, 8)))
    step = jax.jit(lambda xx: mbj.moe_layer(xx, w_router, w_gate, w_up, w_down, top_k=2,
                                            aux_loss_coeff=0.75))
    first = step(x)
    limit = mbj._cached_plans()["shim_max"]
    for i in range(limit + 8):
        jax.block_until_ready(mbj.moe_layer(x, w_router, w_gate, w_up, w_down, top_k=1,
                                            aux_loss_coeff=1e-3 * (i + 1)))
    assert mbj._cached_plans()["shim"] <= limit
    for a, b in zip(first, step(x)):  # compiled before its plan was evicted
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_traced_loss_coefficient_is_refused_with_the_remedy(seed):
    """A coefficient is compiled into the call; a traced one is refused with the remedy: pass 1.0
    and scale the returned loss, which the losses' linearity makes exact."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((6, 8)))
    w_router, w_gate, w_up, w_down = weights(rng, 4, 8, 6, "swiglu", jnp.float64)
    with pytest.raises(TypeError, match="aux_loss_coeff must be a Python number, not a traced"):
        jax.jit(lambda c: mbj.moe_layer(x, w_router, w_gate, w_up, w_down, top_k=2,
                                        aux_loss_coeff=c))(0.25)

    def objective(wr, c, scaled):
        y, aux, z = mbj.moe_layer(x, wr, w_gate, w_up, w_down, top_k=2,
                                  aux_loss_coeff=1.0 if scaled else c,
                                  z_loss_coeff=1.0 if scaled else c)
        return jnp.sum(y) + (c * (aux + z) if scaled else aux + z)

    scaled = jax.jit(jax.value_and_grad(lambda wr, c: objective(wr, c, True)))(w_router, 0.25)
    fixed = jax.value_and_grad(lambda wr: objective(wr, 0.25, False))(w_router)
    assert_close("loss", scaled[0], fixed[0], 1e-14)
    assert_close("dw_router", scaled[1], fixed[1], 1e-14)


def test_numpy_float64_inputs_without_x64_run_as_float32(seed):
    """Without jax_enable_x64 JAX takes numpy float64 arrays as float32 (and int64 as int32):
    moeblaze.jax checks and sizes them as such, eagerly and under jit alike."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, 8))
    w_router, w_gate, w_up, w_down = (np.asarray(w) for w in weights(rng, 4, 8, 6, "swiglu",
                                                                       jnp.float64))
    ids = np.asarray(routing(rng, 5, 4, 2)[0], np.int64)
    g = rng.uniform(0.1, 1.0, (5, 2))
    with jax.enable_x64(False):
        f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
        ref = mbj.moe_layer(f32(x), f32(w_router), f32(w_gate), f32(w_up), f32(w_down), top_k=2)
        eager = mbj.moe_layer(x, w_router, w_gate, w_up, w_down, top_k=2)
        jitted = jax.jit(lambda xx: mbj.moe_layer(xx, w_router, w_gate, w_up, w_down, top_k=2))(x)
        for mine in (eager, jitted):
            for a, b in zip(mine, ref):
                assert a.dtype == jnp.float32
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        y = jax.jit(lambda xx: mbj.moe_experts(xx, ids, g, w_gate, w_up, w_down))(x)
        y_ref = mbj.moe_experts(f32(x), jnp.asarray(ids, jnp.int32), f32(g), f32(w_gate),
                                f32(w_up), f32(w_down))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))


def test_each_platform_gets_its_own_workspace_size(monkeypatch):
    """With CPU and CUDA handlers registered, the program carries one branch per platform
    (lax.platform_dependent) and each lowering keeps only its own, with its own sizes. Simulated
    here with a stand-in "cuda" plan whose workspace is 4096 bytes larger."""
    real_plan = mbj._plan

    class Padded:
        def __init__(self, plan):
            self.plan = plan

        def saved_size(self, *args):
            return self.plan.saved_size(*args)

        def workspace_size(self, *args):
            return self.plan.workspace_size(*args) + 4096

    monkeypatch.setattr(mbj, "_registered", ("cpu", "cuda"))
    monkeypatch.setattr(mbj, "_plan", lambda backend, config: real_plan("cpu", config)
                        if backend == "cpu" else Padded(real_plan("cpu", config)))
    x, ids, g, w_gate, w_up, w_down = small_experts()
    config = mbj._Config(dtype="float64", d_model=8, d_ffn=6, num_experts=4, top_k=2,
                         activation="swiglu", checkpoint="save_preact")
    cpu_bytes = real_plan("cpu", config).workspace_size(_lib.PASS_EXPERTS_FORWARD, 4, 0)
    step = jax.jit(lambda xx: mbj.moe_experts(xx, ids, g, w_gate, w_up, w_down))
    for platform, size in (("cpu", cpu_bytes), ("cuda", cpu_bytes + 4096)):
        text = step.trace(x).lower(lowering_platforms=(platform,)).as_text()
        assert f"tensor<{size}xui8>" in text, platform
        assert text.count("moeblaze_experts_fwd") == 1, platform
    # Run on the CPU: the CPU branch.
    assert_close("y", step(x), experts_ref(x, ids, g, w_gate, w_up, w_down, "swiglu"), 1e-12)


def test_eager_calls_take_the_sizes_of_their_operands_platform():
    """Outside jit a call runs where its operands live, whatever the default device (on which
    lax.platform_dependent would decide): the operands choose the sizes, under eager grad, vjp
    and vmap too; under jit the choice is left to the lowering."""
    x = jnp.ones((4, 8), jnp.float32)
    assert mbj._concrete_backend([x, None]) == "cpu"
    assert mbj._concrete_backend([x, np.ones(3)]) is None  # not a jax array: no decision here
    seen = []

    def probe(v):
        seen.append(mbj._concrete_backend([v]))
        return (v * v).sum()

    jax.grad(probe)(x)
    jax.vjp(probe, x)
    jax.vmap(probe)(x)
    jax.jit(probe)(x)
    assert seen == ["cpu", "cpu", "cpu", None]


def test_repeatable_on_cpu(seed):
    x, ids, g, w_gate, w_up, w_down, dy = experts_problem(seed, 17, 16, 8, 4, 2, "swiglu",
                                                          jnp.float32)
    first = experts_grads(mbj.moe_experts, x, ids, g, w_gate, w_up, w_down, dy, "swiglu")
    second = experts_grads(mbj.moe_experts, x, ids, g, w_gate, w_up, w_down, dy, "swiglu")
    np.testing.assert_array_equal(np.asarray(first[0]), np.asarray(second[0]))
    for name in first[1]:
        np.testing.assert_array_equal(np.asarray(first[1][name]), np.asarray(second[1][name]))


# ------------------------------------------------------------------------------------------------
# GPU: bfloat16 against the reference, bitwise repeatability
# ------------------------------------------------------------------------------------------------


def on_gpu(*arrays):
    device = jax.devices("cuda")[0]
    return [None if a is None else jax.device_put(a, device) for a in arrays]


@needs_cuda
@pytest.mark.parametrize("act", ["swiglu", "silu", "gelu"])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_gpu_experts_bfloat16_matches_reference(seed, act, checkpoint):
    T, d, h, E, k = 512, 256, 384, 8, 2
    host = experts_problem(seed, T, d, h, E, k, act, jnp.bfloat16)
    x, ids, g, w_gate, w_up, w_down, dy = on_gpu(*host)
    fn = lambda *a: mbj.moe_experts(*a, activation=act, checkpoint=checkpoint)  # noqa: E731
    y, grads = experts_grads(fn, x, ids, g, w_gate, w_up, w_down, dy, act)
    assert y.dtype == jnp.bfloat16 and next(iter(y.devices())).platform == "gpu"
    up = lambda a: None if a is None else a.astype(jnp.float64)  # noqa: E731
    xs, ids_h, gs, wgs, wus, wds, dys = host  # the reference: float64 on the CPU
    y_ref, grads_ref = experts_grads(lambda *a: experts_ref(*a, act), up(xs), ids_h, up(gs),
                                     up(wgs), up(wus), up(wds), up(dys), act)
    assert_close("y", y, y_ref, 2e-2)
    for name in grads_ref:
        assert_close(f"d{name}", grads[name], grads_ref[name], 3e-2)


@needs_cuda
def test_gpu_layer_bfloat16_matches_reference(seed):
    T, d, h, E, k = 1024, 256, 512, 8, 2
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, d)), jnp.bfloat16)
    w_router, w_gate, w_up, w_down = weights(rng, E, d, h, "swiglu", jnp.bfloat16)
    opts = dict(top_k=k, aux_loss_coeff=0.01, z_loss_coeff=0.001)
    xg, wrg, wgg, wug, wdg = on_gpu(x, w_router, w_gate, w_up, w_down)
    y, aux, z = jax.jit(lambda *a: mbj.moe_layer(*a, **opts))(xg, wrg, wgg, wug, wdg)
    assert next(iter(y.devices())).platform == "gpu"
    up = lambda a: a.astype(jnp.float64)  # noqa: E731
    y_ref, aux_ref, z_ref, _ = layer_ref(up(x), up(w_router), up(w_gate), up(w_up), up(w_down),
                                         **opts)
    # Near-tied router scores may pick another expert in bfloat16: compare in norm.
    assert_close("y", y, y_ref, 5e-2)
    assert_close("aux_loss", aux, aux_ref, 1e-2)
    assert_close("z_loss", z, z_ref, 1e-2)


@needs_cuda
def test_gpu_residuals_serve_two_backward_passes(seed):
    """On CUDA the backward overwrites the saved activations (consume_saved); XLA must hand a
    second backward of the same forward an intact copy, so both give the same bits."""
    host = experts_problem(seed, 256, 128, 192, 8, 2, "swiglu", jnp.bfloat16)
    x, ids, g, w_gate, w_up, w_down, dy = on_gpu(*host)
    _, pullback = jax.vjp(lambda xx, wg: mbj.moe_experts(xx, ids, g, wg, w_up, w_down), x,
                          w_gate)
    first = [np.asarray(a) for a in pullback(dy)]
    second = [np.asarray(a) for a in pullback(dy)]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    _, kept = jax.vjp(lambda xx, wg: mbj.moe_experts(xx, ids, g, wg, w_up, w_down,
                                                     consume_saved=False), x, w_gate)
    for a, b in zip(first, kept(dy)):
        np.testing.assert_array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8))


@needs_cuda
@pytest.mark.parametrize("whole_layer", [False, True])
def test_gpu_bitwise_repeatable(seed, whole_layer):
    T, d, h, E, k = 2048, 512, 768, 16, 4
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, d)), jnp.bfloat16)
    w_router, w_gate, w_up, w_down = weights(rng, E, d, h, "swiglu", jnp.bfloat16)
    ids, g = routing(rng, T, E, k)
    g = jnp.asarray(g, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((T, d)), jnp.bfloat16)
    args = on_gpu(x, w_router, ids, g, w_gate, w_up, w_down, dy)
    x, w_router, ids, g, w_gate, w_up, w_down, dy = args

    if whole_layer:
        def loss(xx, wr, wg, wu, wd):
            y, aux, z = mbj.moe_layer(xx, wr, wg, wu, wd, top_k=k, aux_loss_coeff=0.01)
            return jnp.sum((y * dy).astype(jnp.float32)) + aux
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
        run = lambda: step(x, w_router, w_gate, w_up, w_down)  # noqa: E731
    else:
        def loss(xx, gg, wg, wu, wd):
            y = mbj.moe_experts(xx, ids, gg, wg, wu, wd)
            return jnp.sum((y * dy).astype(jnp.float32))
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
        run = lambda: step(x, g, w_gate, w_up, w_down)  # noqa: E731

    first = jax.tree_util.tree_map(np.asarray, run())
    for _ in range(3):
        again = jax.tree_util.tree_map(np.asarray, run())
        for a, b in zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(again)):
            assert np.all(np.isfinite(a.astype(np.float32)))
            # the bytes: a 0-d array (the loss) cannot be viewed as another dtype
            np.testing.assert_array_equal(np.frombuffer(a.tobytes(), np.uint8),
                                          np.frombuffer(b.tobytes(), np.uint8))
