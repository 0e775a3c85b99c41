"""JAX integration: `moe_experts` and `moe_layer` as XLA FFI custom calls, differentiable with
`jax.custom_vjp`, usable under `jax.jit`, `jax.grad` and `jax.vmap`, and on several devices
through `jax.shard_map` (token-parallel; see the README: the calls have no sharding rule, so under
a plain `jit` XLA gathers sharded operands and runs the call on the whole batch on every device).

The calls run in the compiled XLA program through libmoeblaze_xla (bindings/python/xla), whose
handlers call the C API: on the CPU synchronously, on CUDA on XLA's stream. The forward returns the
saved buffer (uint8) as the residual of `custom_vjp`; every workspace is an extra uint8 result that
XLA allocates and frees around the call. Their sizes are queried here at trace time, for each
platform the program may be lowered for (`jax.lax.platform_dependent`). No Python runs while the
program executes.

dtypes: x and the weights float32, bfloat16, float16, or float64 (CPU only; needs
`jax.config.update("jax_enable_x64", True)`); g and the losses are in the routing dtype, float64
for float64 x and float32 otherwise.

The shim is found through $MOEBLAZE_XLA_LIBRARY (a file or folder), the package folder, the folder
of the loaded libmoeblaze, or the build trees of a source checkout.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import glob
import os
import threading
from pathlib import Path
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import _args, _lib
from .core import Context, Layer

__all__ = ["moe_experts", "moe_layer", "routing_dtype", "shim_path", "platforms",
           "MAX_CACHED_PLANS"]

_STORAGE_DTYPES = {
    np.dtype(jnp.float32): "float32",
    np.dtype(jnp.bfloat16): "bfloat16",
    np.dtype(jnp.float16): "float16",
    np.dtype(jnp.float64): "float64",
}
_SHIM_NAME = "libmoeblaze_xla.so"

# FFI target name -> handler symbol stem (the shim exports <stem>Cpu and, with CUDA, <stem>Cuda).
_TARGETS = {
    "moeblaze_experts_fwd": "MoeblazeXlaExpertsForward",
    "moeblaze_experts_bwd": "MoeblazeXlaExpertsBackward",
    "moeblaze_layer_fwd": "MoeblazeXlaLayerForward",
    "moeblaze_layer_bwd": "MoeblazeXlaLayerBackward",
}

# ------------------------------------------------------------------------------------------------
# The shim: found, loaded and registered once per process
# ------------------------------------------------------------------------------------------------

_register_lock = threading.Lock()
_registered = None  # tuple of the moeblaze backends registered with XLA ("cpu", "cuda")
_shim_path = None


def _shim_candidates() -> list:
    env = os.environ.get("MOEBLAZE_XLA_LIBRARY")
    if env:
        path = Path(env)
        return [str(path / _SHIM_NAME) if path.is_dir() else env]  # an explicit choice only
    package = Path(__file__).resolve().parent
    candidates = [package / _SHIM_NAME]
    core_dir = Path(_lib.library_path()).resolve().parent
    # A build tree keeps the core in <build>/src and the shim in <build>/bindings/python.
    candidates += [core_dir / _SHIM_NAME, core_dir.parent / "bindings" / "python" / _SHIM_NAME]
    repo_root = package.parent.parent.parent
    if (repo_root / "include" / "moeblaze.h").is_file():
        found = glob.glob(str(repo_root / "build*" / "bindings" / "python" / _SHIM_NAME))
        candidates += sorted(found, key=os.path.getmtime, reverse=True)
    return [str(c) for c in candidates]


def _jax_has_cuda() -> bool:
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


def _register() -> tuple:
    """Loads libmoeblaze, then the shim (which links that same library), and registers its
    handlers with XLA. Returns the backends registered."""
    global _registered, _shim_path
    with _register_lock:
        if _registered is not None:
            return _registered
        _lib.lib()  # the core first: the shim's NEEDED libmoeblaze.so.N then resolves to it
        errors = []
        shim = None
        for candidate in _shim_candidates():
            if not os.path.exists(candidate):
                errors.append(f"{candidate}: no such file")
                continue
            try:
                shim = ctypes.CDLL(candidate)
            except OSError as error:
                errors.append(f"{candidate}: {error}")
                continue
            _shim_path = os.path.realpath(candidate)
            break
        if shim is None:
            raise OSError("libmoeblaze_xla (the XLA FFI handlers of moeblaze.jax) not found; "
                          "build it with CMake (-DMOEBLAZE_BUILD_BINDINGS=ON and a Python that "
                          "has jax) or set MOEBLAZE_XLA_LIBRARY. Tried:\n  " + "\n  ".join(errors))
        shim.MoeblazeXlaAbiVersion.restype = ctypes.c_int32
        shim.MoeblazeXlaHasCuda.restype = ctypes.c_int32
        abi = shim.MoeblazeXlaAbiVersion()
        if abi != _lib.EXPECTED_ABI_VERSION:
            raise _lib.VersionMismatchError(
                _lib.ERR_VERSION_MISMATCH,
                f"{_shim_path} was built for moeblaze ABI {abi}, these bindings need "
                f"{_lib.EXPECTED_ABI_VERSION}")
        backends = ["cpu"]
        platforms = [("cpu", "Cpu")]
        if shim.MoeblazeXlaHasCuda() and _jax_has_cuda():
            backends.append("cuda")
            platforms.append(("CUDA", "Cuda"))
        for target, stem in _TARGETS.items():
            for platform, suffix in platforms:
                handler = getattr(shim, stem + suffix)
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform=platform)
        _registered = tuple(backends)
        return _registered


def shim_path() -> str:
    """The path of the loaded libmoeblaze_xla (loading and registering it on first use)."""
    _register()
    return _shim_path


def platforms() -> tuple:
    """The moeblaze backends whose handlers are registered with XLA: ("cpu",) or
    ("cpu", "cuda") (the shim was built with CUDA and JAX sees a CUDA device)."""
    return _register()


# ------------------------------------------------------------------------------------------------
# Layer plans for the size queries (the shim keeps its own plans for execution)
# ------------------------------------------------------------------------------------------------


class _Config(NamedTuple):
    """A layer configuration: static for jit (hashable), the nondiff argument of custom_vjp."""
    dtype: str
    d_model: int
    d_ffn: int
    num_experts: int
    top_k: int
    activation: str
    checkpoint: str
    score_function: str = "softmax_topk"
    renormalize: bool = False
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    consume_saved: bool = True

    def layer_kwargs(self) -> dict:
        fields = self._asdict()
        del fields["consume_saved"]
        return fields

    def attrs(self) -> dict:
        """The FFI attributes every handler of this configuration takes."""
        return {"activation": np.int32(_lib.ACTIVATIONS[self.activation]),
                "checkpoint": np.int32(_lib.CHECKPOINTS[self.checkpoint])}

    def layer_attrs(self) -> dict:
        attrs = self.attrs()
        attrs.update(top_k=np.int64(self.top_k),
                     score_function=np.int32(_lib.SCORE_FUNCTIONS[self.score_function]),
                     renormalize=np.int32(bool(self.renormalize)),
                     aux_loss_coeff=np.float32(self.aux_loss_coeff),
                     z_loss_coeff=np.float32(self.z_loss_coeff))
        return attrs

    @property
    def gated(self) -> bool:
        return self.activation in _lib.GATED_ACTIVATIONS


#: How many size-query plans are kept (the most recently used). The loss coefficients are part of
#: a plan's configuration, so a run that anneals aux_loss_coeff makes a new plan per value: without
#: a bound the cache would grow with every one. An evicted plan is destroyed once no caller holds
#: it, and made again when it is used again. (The shim bounds its own plans likewise.)
MAX_CACHED_PLANS = 32

_plan_lock = threading.Lock()
_contexts = {}
_plans = collections.OrderedDict()


def _plan(backend: str, config: _Config) -> Layer:
    """The size-query plan of `config` on `backend` (device 0: sizes depend on the configuration
    and the token count only); the cache keeps the MAX_CACHED_PLANS most recently used."""
    key = (backend, config._replace(consume_saved=True))
    with _plan_lock:
        plan = _plans.get(key)
        if plan is None:
            context = _contexts.get(backend)
            if context is None:
                context = _contexts[backend] = Context(backend, 0, num_threads=1)
            plan = _plans[key] = Layer(context, **config.layer_kwargs())
        _plans.move_to_end(key)
        evicted = [_plans.popitem(last=False) for _ in range(len(_plans) - MAX_CACHED_PLANS)]
    del evicted  # destroyed here, outside the lock, unless a caller still holds one
    return plan


def _cached_plans() -> dict:
    """How many layer plans are cached now (tests, diagnostics): {"sizes": this module's
    size-query plans, "shim": libmoeblaze_xla's execution plans, of which it keeps at most
    "shim_max"}."""
    shim = ctypes.CDLL(shim_path())  # loaded already: the same handle
    shim.MoeblazeXlaCachedPlans.restype = ctypes.c_int64
    shim.MoeblazeXlaMaxCachedPlans.restype = ctypes.c_int64
    with _plan_lock:
        sizes = len(_plans)
    return {"sizes": sizes, "shim": shim.MoeblazeXlaCachedPlans(),
            "shim_max": shim.MoeblazeXlaMaxCachedPlans()}


class _Sizes(NamedTuple):
    saved: int
    forward_train: int  # workspace of a forward that fills `saved`
    forward_infer: int  # workspace of a forward without `saved`
    backward: int       # workspace of the backward (with CONSUME_SAVED when configured)


def _sizes(config: _Config, num_tokens: int, whole_layer: bool) -> dict:
    """{backend: _Sizes} for every registered backend that supports `config`. The CPU plan is
    created first, so an invalid configuration raises the library's message here, at trace time."""
    forward = _lib.PASS_LAYER_FORWARD if whole_layer else _lib.PASS_EXPERTS_FORWARD
    backward = _lib.PASS_LAYER_BACKWARD if whole_layer else _lib.PASS_EXPERTS_BACKWARD
    backward_flags = _lib.BACKWARD_CONSUME_SAVED if config.consume_saved else 0
    sizes = {}
    for backend in _register():
        try:
            plan = _plan(backend, config)
        except _lib.NotSupportedError:
            if backend == "cpu":
                raise
            continue  # e.g. float64 on CUDA: that platform gets no lowering
        sizes[backend] = _Sizes(
            saved=plan.saved_size(forward, num_tokens),
            forward_train=plan.workspace_size(forward, num_tokens, _lib.FORWARD_WITH_SAVED),
            forward_infer=plan.workspace_size(forward, num_tokens, 0),
            backward=plan.workspace_size(backward, num_tokens, backward_flags))
    return sizes


_BACKEND_OF_PLATFORM = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}


def _concrete_value(a):
    """The concrete array under eager transformations' tracers (grad, vjp, vmap run op by op and
    wrap it: primal or val), or None under jit, where the value does not exist yet."""
    for _ in range(64):
        if not isinstance(a, jax.core.Tracer):
            return a if isinstance(a, jax.Array) else None
        inner = getattr(a, "primal", None)
        a = inner if inner is not None else getattr(a, "val", None)
    return None


def _concrete_backend(operands) -> Optional[str]:
    """The backend that runs an eager call on these operands: that of their device when every
    operand is a concrete array (under eager transformations too) on one platform, else None
    (traced by jit, or mixed)."""
    backends = set()
    for a in operands:
        if a is None:
            continue
        a = _concrete_value(a)
        if a is None:
            return None
        for device in a.devices():
            backends.add(_BACKEND_OF_PLATFORM.get(device.platform))
    return backends.pop() if len(backends) == 1 else None


def _per_platform(sizes: dict, call, *operands):
    """Runs `call(backend_sizes, *operands)` with the sizes of the platform that runs it. An eager
    call runs where its operands live, which need not be the default device's platform (the one
    lax.platform_dependent picks outside jit), so concrete operands choose; traced ones get one
    branch per backend through lax.platform_dependent (only the lowered platform's is compiled)."""
    if len(sizes) == 1:
        (only,) = sizes.values()
        return call(only, *operands)
    backend = _concrete_backend(operands)
    if backend in sizes:
        return call(sizes[backend], *operands)
    branches = {backend: functools.partial(call, s) for backend, s in sizes.items()}
    return jax.lax.platform_dependent(*operands, **branches)


def _bytes(n: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((int(n),), jnp.uint8)


def _like(a) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype)


# ------------------------------------------------------------------------------------------------
# Inside jax.shard_map: the mesh axes a value varies over (its "vma" type)
# ------------------------------------------------------------------------------------------------


def _varying_axes(*arrays) -> frozenset:
    """The manual mesh axes (of an enclosing jax.shard_map) over which any of `arrays` varies:
    empty outside shard_map or with check_vma=False."""
    axes = set()
    for a in arrays:
        if a is None:
            continue
        aval = jax.typeof(a)
        mat = getattr(aval, "mat", None)
        axes.update(mat.varying if mat is not None else getattr(aval, "vma", ()))
    return frozenset(axes)


def _vary(axes: frozenset, *arrays) -> list:
    """Each array cast to vary over all of `axes` (jax.lax.pcast(..., to="varying")). Done before
    the custom_vjp call, so that inside it every operand and every result of the FFI call has one
    type, and so that the cast's transpose, a psum over the shards, turns the per-shard gradients
    of a replicated weight into the gradient of the whole batch."""
    out = []
    for a in arrays:
        missing = tuple(axis for axis in axes if axis not in _varying_axes(a))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return out


def _typed(results: tuple, axes: frozenset, like) -> tuple:
    """The FFI call's result types, varying over `axes` like its operands. jax.ffi.ffi_call takes
    the results' shard_map type from result_shape_dtypes only: without this a per-shard result
    would be typed as replicated, so shard_map would accept a per-shard value for out_specs=P()
    (returning one shard's) and reject the custom_vjp backward's gradients."""
    if not axes:
        return results
    # The type names the (abstract) mesh of the enclosing shard_map: that of the operand `like`.
    mesh = jax.typeof(like).sharding.mesh
    if hasattr(jax.sharding, "ManualAxisType"):
        kind = {"manual_axis_type": jax.sharding.ManualAxisType(varying=axes)}
    else:  # older JAX
        kind = {"vma": axes}
    return tuple(jax.ShapeDtypeStruct(
        r.shape, r.dtype, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
        **kind) for r in results)


# ------------------------------------------------------------------------------------------------
# Argument checks (at trace time, before anything reaches XLA)
# ------------------------------------------------------------------------------------------------


def routing_dtype(dtype) -> np.dtype:
    """The dtype of g, dg and the losses for a layer of storage dtype `dtype`."""
    return np.dtype(jnp.float64) if np.dtype(dtype) == np.dtype(jnp.float64) \
        else np.dtype(jnp.float32)


def _as_array(value, name: str):
    if value is None:
        raise TypeError(f"{name}: expected an array, got None")
    if not isinstance(value, (jax.Array, jax.core.Tracer)):
        # numpy arrays and the like get JAX's dtype first (float64 -> float32 without
        # jax_enable_x64), as XLA will see them: checks and plans use the dtype that runs.
        value = jnp.asarray(value)
    return value


def _as_arrays(**values) -> list:
    """_as_array() of each keyword argument, in order, named by its keyword."""
    return [_as_array(value, name) for name, value in values.items()]


def _check_x(x) -> str:
    """Checks x [..., d_model]; returns the name of its storage dtype."""
    dtype = np.dtype(x.dtype)
    if dtype not in _STORAGE_DTYPES:
        raise TypeError(f"x: dtype {dtype} is not supported; use one of "
                        f"{', '.join(_STORAGE_DTYPES.values())}")
    if x.ndim < 1:
        raise ValueError("x: expected [..., d_model], got a scalar")
    if x.shape[-1] < 1:
        raise ValueError(f"x: d_model (the last dimension) must be positive, got shape "
                         f"{list(x.shape)}")
    return _STORAGE_DTYPES[dtype]


def _expect(array, name: str, shape, dtype) -> None:
    if np.dtype(array.dtype) != np.dtype(dtype):
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype)}, got {np.dtype(array.dtype)}")
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(array.shape)}")


def _check_names(activation: str, checkpoint: str) -> tuple:
    activation = str(activation).lower()
    checkpoint = str(checkpoint).lower()
    if activation not in _lib.ACTIVATIONS:
        raise ValueError(f"activation: unknown {activation!r}; expected one of "
                         f"{sorted(_lib.ACTIVATIONS)}")
    if checkpoint not in _lib.CHECKPOINTS:
        raise ValueError(f"checkpoint: unknown {checkpoint!r}; expected one of "
                         f"{sorted(_lib.CHECKPOINTS)}")
    return activation, checkpoint


def _check_weights(x2, w_gate, w_up, w_down, activation: str):
    """Checks the expert weights against x [T, d]; returns (E, h, w_up or an empty array)."""
    if w_gate.ndim != 3:
        raise ValueError(f"w_gate: expected [num_experts, d_ffn, d_model], got shape "
                         f"{list(w_gate.shape)}")
    E, h, d = (int(n) for n in w_gate.shape)
    if d != x2.shape[1]:
        raise ValueError(f"w_gate: expected shape [E, d_ffn, {x2.shape[1]}] (d_model of x), got "
                         f"{list(w_gate.shape)}")
    if E < 1 or h < 1:
        raise ValueError(f"w_gate: num_experts and d_ffn must be positive, got shape "
                         f"{list(w_gate.shape)}")
    if E > _lib.MAX_EXPERTS:
        raise ValueError(f"w_gate: num_experts = {E} exceeds {_lib.MAX_EXPERTS}")
    _expect(w_gate, "w_gate", (E, h, d), x2.dtype)
    _expect(w_down, "w_down", (E, d, h), x2.dtype)
    if activation in _lib.GATED_ACTIVATIONS:
        if w_up is None:
            raise ValueError(f"w_up is required for the gated activation {activation!r}")
        w_up = _as_array(w_up, "w_up")
        _expect(w_up, "w_up", (E, h, d), x2.dtype)
    else:
        if w_up is not None:
            raise ValueError(f"w_up must be None for the non-gated activation {activation!r}")
        w_up = jnp.zeros((0,), x2.dtype)
    return E, h, w_up


def _check_top_k(top_k, num_experts: int, num_tokens: int) -> int:
    """top_k as an int, checked against the experts and the token count (T * k < 2^31)."""
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        raise TypeError(f"top_k: expected an int, got {type(top_k).__name__}")
    top_k = int(top_k)
    if not 1 <= top_k <= min(num_experts, _lib.MAX_TOP_K):
        raise ValueError(f"top_k = {top_k} must be in 1..min(num_experts = {num_experts}, "
                         f"{_lib.MAX_TOP_K})")
    if num_tokens * top_k >= _lib.MAX_ROUTED_ROWS:
        raise ValueError(f"tokens * top_k = {num_tokens} * {top_k} must be below 2^31")
    return top_k


# ------------------------------------------------------------------------------------------------
# The FFI calls, one forward and one backward for the experts and the layer targets alike
# ------------------------------------------------------------------------------------------------


def _attrs(config: _Config, whole_layer: bool) -> dict:
    return config.layer_attrs() if whole_layer else config.attrs()


def _forward(config: _Config, training: bool, whole_layer: bool, outputs: tuple, operands: tuple):
    """Calls the forward target on `operands` (x first) for the results `outputs`, to which it
    appends the saved buffer and the workspace. Returns the results and saved."""
    target = "moeblaze_layer_fwd" if whole_layer else "moeblaze_experts_fwd"
    sizes = _sizes(config, operands[0].shape[0], whole_layer)

    axes = _varying_axes(*operands)

    def call(s: _Sizes, *operands):
        saved_bytes = s.saved if training else 0  # no saved buffer: an inference forward
        workspace = s.forward_train if training else s.forward_infer
        *results, saved, _ = jax.ffi.ffi_call(
            target, _typed(outputs + (_bytes(saved_bytes), _bytes(workspace)), axes, operands[0]),
            vmap_method="sequential")(*operands, **_attrs(config, whole_layer))
        return (*results, saved)

    return _per_platform(sizes, call, *operands)


def _backward(config: _Config, whole_layer: bool, gradients: tuple, operands: tuple):
    """Calls the backward target on `operands` (dy first, the saved buffer last) for the results
    `gradients`, to which it appends saved_out and the workspace. Returns the gradients."""
    target = "moeblaze_layer_bwd" if whole_layer else "moeblaze_experts_bwd"
    sizes = _sizes(config, operands[0].shape[0], whole_layer)
    consume = config.consume_saved
    axes = _varying_axes(*operands)

    def call(s: _Sizes, *operands):
        saved = operands[-1]
        outputs = gradients + (_bytes(saved.shape[0] if consume else 0), _bytes(s.backward))
        *results, _, _ = jax.ffi.ffi_call(
            target, _typed(outputs, axes, operands[0]), vmap_method="sequential",
            # The backward may overwrite the saved activations: XLA must treat saved as consumed.
            input_output_aliases={len(operands) - 1: len(gradients)} if consume else None)(
                *operands, consume_saved=np.int32(consume), **_attrs(config, whole_layer))
        return tuple(results)

    return _per_platform(sizes, call, *operands)


# ------------------------------------------------------------------------------------------------
# Experts: given ids and g
# ------------------------------------------------------------------------------------------------


def _experts_forward(config: _Config, training: bool, x, ids, g, w_gate, w_up, w_down):
    return _forward(config, training, False, (_like(x),), (x, ids, g, w_gate, w_up, w_down))


def _experts_backward(config: _Config, dy, x, ids, g, w_gate, w_up, w_down, saved):
    gradients = (_like(x), _like(g), _like(w_gate), _like(w_up), _like(w_down))
    return _backward(config, False, gradients, (dy, x, ids, g, w_gate, w_up, w_down, saved))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _experts(config, x, ids, g, w_gate, w_up, w_down):
    y, _ = _experts_forward(config, False, x, ids, g, w_gate, w_up, w_down)
    return y


def _experts_vjp_forward(config, x, ids, g, w_gate, w_up, w_down):
    y, saved = _experts_forward(config, True, x, ids, g, w_gate, w_up, w_down)
    return y, (x, ids, g, w_gate, w_up, w_down, saved)


def _experts_vjp_backward(config, residuals, dy):
    x, ids, g, w_gate, w_up, w_down, saved = residuals
    dx, dg, dw_gate, dw_up, dw_down = _experts_backward(config, dy.astype(x.dtype), x, ids, g,
                                                        w_gate, w_up, w_down, saved)
    return dx, None, dg, dw_gate, dw_up, dw_down


_experts.defvjp(_experts_vjp_forward, _experts_vjp_backward)


def moe_experts(x, ids, g, w_gate, w_up, w_down, *, activation: str = "swiglu",
                checkpoint: str = "save_preact", consume_saved: bool = True):
    """y[t] = sum_j g[t,j] * expert_{ids[t,j]}(x[t]), differentiable in x, g and the weights.

    x [..., d_model] (float32, bfloat16, float16, float64), ids [..., top_k] int32 (each token's
    experts, distinct), g [..., top_k] in the routing dtype (float64 for float64 x, else float32),
    w_gate and w_up [E, d_ffn, d_model], w_down [E, d_model, d_ffn]; w_up is None for the
    non-gated activations (silu, gelu, relu, relu2).

    activation: swiglu, geglu, reglu, silu, gelu, relu, relu2. checkpoint: what the forward keeps
    for the backward: save_all, save_preact, recompute (same results, less memory, more compute).
    consume_saved: the backward writes its activation gradients over the saved activations (CUDA:
    less peak memory, same bits); XLA treats the saved buffer as consumed and copies it only when
    the same forward feeds two backward passes.

    The CPU backend rejects an id out of range or repeated within a token with an error; the CUDA
    backend cannot check this without a host synchronisation and drops such pairs."""
    activation, checkpoint = _check_names(activation, checkpoint)
    x, ids, g, w_gate, w_down = _as_arrays(x=x, ids=ids, g=g, w_gate=w_gate, w_down=w_down)
    dtype = _check_x(x)
    if ids.ndim < 1:
        raise ValueError("ids: expected [..., top_k], got a scalar")
    lead = tuple(x.shape[:-1])
    d = int(x.shape[-1])
    k = int(ids.shape[-1])
    _expect(ids, "ids", lead + (k,), jnp.int32)
    _expect(g, "g", lead + (k,), routing_dtype(x.dtype))
    x2 = x.reshape(-1, d)
    T = int(x2.shape[0])
    E, h, w_up = _check_weights(x2, w_gate, w_up, w_down, activation)
    k = _check_top_k(k, E, T)
    config = _Config(dtype=dtype, d_model=d, d_ffn=h, num_experts=E, top_k=k,
                     activation=activation, checkpoint=checkpoint,
                     consume_saved=_args.flag(consume_saved, "consume_saved"))
    operands = (x2, ids.reshape(-1, k), g.reshape(-1, k), w_gate, w_up, w_down)
    y = _experts(config, *_vary(_varying_axes(*operands), *operands))
    return y.reshape(x.shape)


# ------------------------------------------------------------------------------------------------
# Whole layer: router projection, router, experts
# ------------------------------------------------------------------------------------------------


def _layer_forward(config: _Config, training: bool, x, w_router, w_gate, w_up, w_down):
    outputs = (_like(x), jax.ShapeDtypeStruct((2,), routing_dtype(x.dtype)),
               jax.ShapeDtypeStruct((config.num_experts,), jnp.int32))
    return _forward(config, training, True, outputs, (x, w_router, w_gate, w_up, w_down))


def _layer_backward(config: _Config, dy, d_losses, x, w_router, w_gate, w_up, w_down, saved):
    gradients = (_like(x), _like(w_router), _like(w_gate), _like(w_up), _like(w_down))
    return _backward(config, True, gradients,
                     (dy, d_losses, x, w_router, w_gate, w_up, w_down, saved))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _layer(config, x, w_router, w_gate, w_up, w_down):
    y, losses, counts, _ = _layer_forward(config, False, x, w_router, w_gate, w_up, w_down)
    return y, losses, counts


def _layer_vjp_forward(config, x, w_router, w_gate, w_up, w_down):
    y, losses, counts, saved = _layer_forward(config, True, x, w_router, w_gate, w_up, w_down)
    return (y, losses, counts), (x, w_router, w_gate, w_up, w_down, saved)


def _layer_vjp_backward(config, residuals, cotangents):
    x, w_router, w_gate, w_up, w_down, saved = residuals
    dy, d_losses, _ = cotangents  # expert counts are integers: no cotangent
    route = routing_dtype(x.dtype)
    return _layer_backward(config, dy.astype(x.dtype), d_losses.astype(route), x, w_router,
                           w_gate, w_up, w_down, saved)


_layer.defvjp(_layer_vjp_forward, _layer_vjp_backward)


def _static_coeff(value, name: str) -> float:
    """A loss coefficient as a float. It is an attribute of the compiled call, not an operand, so
    a traced value cannot be taken; the losses are linear in it, so scaling the loss does the
    same."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{name} must be a Python number, not a traced value: it is compiled into "
                        f"the XLA call (each value compiles anew). To vary it (annealing), pass "
                        f"{name}=1.0 and multiply the returned loss by the traced value")
    return _args.real(value, name)


def moe_layer(x, w_router, w_gate, w_up, w_down, *, top_k: int, activation: str = "swiglu",
              checkpoint: str = "save_preact", score_function: str = "softmax_topk",
              renormalize: bool = False, aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
              consume_saved: bool = True, return_expert_counts: bool = False):
    """The whole token-choice MoE layer (router projection, top-k routing, experts, combine),
    differentiable in x and every weight.

    x [..., d_model]; w_router [E, d_model]; w_gate, w_up [E, d_ffn, d_model]; w_down
    [E, d_model, d_ffn]; all of x's dtype; w_up is None for the non-gated activations.

    Returns (y [..., d_model], aux_loss, z_loss): the losses are scalars in the routing dtype,
    already scaled by their coefficients (0 when a coefficient is 0); add them to the training
    objective (the coefficients are held as float32, as in moeblaze_layer_config_t). The
    coefficients are compile-time constants: a schedule that varies them recompiles per value; pass
    1.0 and scale the returned losses instead (they are linear in the coefficients). With
    return_expert_counts=True a fourth result holds the tokens routed to each expert ([E] int32).

    score_function: softmax_topk (softmax, then top-k), topk_softmax (top-k logits, then softmax
    over them) or sigmoid; renormalize: divide each token's k weights by their sum (softmax_topk,
    sigmoid). activation, checkpoint, consume_saved: as in moe_experts()."""
    activation, checkpoint = _check_names(activation, checkpoint)
    score_function = str(score_function).lower()
    if score_function not in _lib.SCORE_FUNCTIONS:
        raise ValueError(f"score_function: unknown {score_function!r}; expected one of "
                         f"{sorted(_lib.SCORE_FUNCTIONS)}")
    aux_loss_coeff = _static_coeff(aux_loss_coeff, "aux_loss_coeff")
    z_loss_coeff = _static_coeff(z_loss_coeff, "z_loss_coeff")
    for name, coeff in (("aux_loss_coeff", aux_loss_coeff), ("z_loss_coeff", z_loss_coeff)):
        if not np.isfinite(coeff) or coeff < 0:
            raise ValueError(f"{name} = {coeff} must be finite and >= 0")
    renormalize = _args.flag(renormalize, "renormalize")
    consume_saved = _args.flag(consume_saved, "consume_saved")
    x, w_router, w_gate, w_down = _as_arrays(x=x, w_router=w_router, w_gate=w_gate, w_down=w_down)
    dtype = _check_x(x)
    d = int(x.shape[-1])
    x2 = x.reshape(-1, d)
    T = int(x2.shape[0])
    E, h, w_up = _check_weights(x2, w_gate, w_up, w_down, activation)
    _expect(w_router, "w_router", (E, d), x.dtype)
    k = _check_top_k(top_k, E, T)
    config = _Config(dtype=dtype, d_model=d, d_ffn=h, num_experts=E, top_k=k,
                     activation=activation, checkpoint=checkpoint, score_function=score_function,
                     renormalize=renormalize, aux_loss_coeff=aux_loss_coeff,
                     z_loss_coeff=z_loss_coeff, consume_saved=consume_saved)
    operands = (x2, w_router, w_gate, w_up, w_down)
    y, losses, counts = _layer(config, *_vary(_varying_axes(*operands), *operands))
    result = (y.reshape(x.shape), losses[0], losses[1])
    return result + (counts,) if return_expert_counts else result
