"""Context and Layer over the ctypes binding, with a numpy API for the CPU backend.

Handles are owned by Python objects: `close()` (or a `with` block, or garbage collection) destroys
them. Layers are immutable and may be used from several threads at once (the library's contract);
the numpy methods allocate fresh outputs, workspace and saved buffers per call, so concurrent calls
share nothing mutable.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import _args, _lib

ALIGNMENT = 64  # the library needs 16; 64 keeps vector loads on cache lines


# ------------------------------------------------------------------------------------------------
# numpy helpers
# ------------------------------------------------------------------------------------------------


def aligned_empty(shape, dtype, alignment: int = ALIGNMENT) -> np.ndarray:
    """np.empty whose data pointer is a multiple of `alignment`."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in np.atleast_1d(shape)) if np.ndim(shape) else (int(shape),)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def aligned_zeros(shape, dtype, alignment: int = ALIGNMENT) -> np.ndarray:
    out = aligned_empty(shape, dtype, alignment)
    out.fill(0)
    return out


def float_to_bfloat16_bits(values) -> np.ndarray:
    """Rounds float values to bfloat16 (round-to-nearest-even) and returns the bit patterns."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))
    out = (rounded >> 16).astype(np.uint16)
    out[is_nan] = ((bits[is_nan] >> 16) | 0x40).astype(np.uint16)  # keep NaN quiet
    return out


def bfloat16_bits_to_float(bits) -> np.ndarray:
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _storage_numpy_dtype(dtype_code: int) -> np.dtype:
    return np.dtype({_lib.DTYPE_F32: np.float32, _lib.DTYPE_F16: np.float16,
                     _lib.DTYPE_F64: np.float64, _lib.DTYPE_BF16: np.uint16}[dtype_code])


def _ptr(array: Optional[np.ndarray]) -> Optional[int]:
    return None if array is None else array.ctypes.data


def _nbytes(array: Optional[np.ndarray]) -> int:
    return 0 if array is None else array.nbytes


class _OwnedHandle:
    """A library handle the object owns. `close()` (also on leaving a ``with`` block and on garbage
    collection) destroys it once with the library function named by `_destroy`; `handle` raises
    afterwards."""

    _destroy = ""  # the moeblaze_*_destroy function of the subclass's handle type

    @property
    def handle(self):
        if self._handle is None:
            raise ValueError(f"moeblaze {type(self).__name__} is closed")
        return self._handle

    def close(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None:
            getattr(self._lib, self._destroy)(handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing sensible to report
            pass


# ------------------------------------------------------------------------------------------------
# Context
# ------------------------------------------------------------------------------------------------


class Context(_OwnedHandle):
    """One backend on one device. `Context()` is the CPU reference backend."""

    _destroy = "moeblaze_context_destroy"

    def __init__(self, backend="cpu", device: int = 0, num_threads: Optional[int] = None):
        self._lib = _lib.lib()
        handle = _lib.context_t()
        self._lib.moeblaze_context_create(ctypes.byref(handle),
                                          _lib.lookup(_lib.BACKENDS, backend, "backend"),
                                          _args.integer(device, "device", "int32"))
        self._handle = handle
        backend_code, device_id = ctypes.c_int32(), ctypes.c_int32()
        self._lib.moeblaze_context_get_info(handle, ctypes.byref(backend_code),
                                            ctypes.byref(device_id))
        self.backend = backend_code.value
        self.device = device_id.value
        if num_threads is not None:
            self.set_num_threads(num_threads)

    @property
    def backend_name(self) -> str:
        return {v: k for k, v in _lib.BACKENDS.items()}.get(self.backend, str(self.backend))

    def set_num_threads(self, num_threads: int) -> None:
        self._lib.moeblaze_context_set_num_threads(
            self.handle, _args.integer(num_threads, "num_threads", "int32"))

    def __repr__(self):
        state = "closed" if self._handle is None else f"{self.backend_name}:{self.device}"
        return f"moeblaze.Context({state})"


_default_context = None
_default_context_lock = threading.Lock()


def default_context() -> Context:
    """A process-wide CPU context, created on first use."""
    global _default_context
    with _default_context_lock:
        if _default_context is None:
            _default_context = Context("cpu", 0)
        return _default_context


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------


@dataclass
class LayerForwardResult:
    y: np.ndarray              # [T,d] storage dtype
    logits: np.ndarray         # [T,E] routing dtype
    ids: np.ndarray            # [T,k] int32
    g: np.ndarray              # [T,k] routing dtype
    expert_counts: np.ndarray  # [E] int32
    losses: np.ndarray         # [2] routing dtype: aux, z (already scaled by their coefficients)
    saved: Optional[np.ndarray]  # opaque uint8 state for backward; None for inference

    @property
    def aux_loss(self) -> float:
        return float(self.losses[0])

    @property
    def z_loss(self) -> float:
        return float(self.losses[1])


@dataclass
class LayerGradients:
    dx: Optional[np.ndarray]
    dw_router: Optional[np.ndarray]
    dw_gate: Optional[np.ndarray]
    dw_up: Optional[np.ndarray]
    dw_down: Optional[np.ndarray]
    d_logits: Optional[np.ndarray]


@dataclass
class ExpertsForwardResult:
    y: np.ndarray
    expert_counts: np.ndarray
    saved: Optional[np.ndarray]


@dataclass
class ExpertsGradients:
    dx: Optional[np.ndarray]
    dg: Optional[np.ndarray]
    dw_gate: Optional[np.ndarray]
    dw_up: Optional[np.ndarray]
    dw_down: Optional[np.ndarray]


@dataclass
class RouterResult:
    ids: np.ndarray
    g: np.ndarray
    expert_counts: np.ndarray
    losses: np.ndarray


@dataclass
class RoutingIndices:
    expert_offsets: np.ndarray        # [E+1] int32
    expert_token_indices: np.ndarray  # [N] int32
    token_index_map: np.ndarray       # [N] int32


# ------------------------------------------------------------------------------------------------
# Layer
# ------------------------------------------------------------------------------------------------


def make_config(*, d_model, d_ffn, num_experts, top_k=1, activation="swiglu", dtype="float32",
                checkpoint="save_preact", score_function="softmax_topk", renormalize=False,
                aux_loss_coeff=0.0, z_loss_coeff=0.0, deterministic=True) -> _lib.LayerConfig:
    """A moeblaze_layer_config_t filled from Python names (validated by the library on create)."""
    config = _lib.LayerConfig.create()
    config.dtype = _lib.lookup(_lib.DTYPES, dtype, "dtype")
    config.d_model = _args.integer(d_model, "d_model")
    config.d_ffn = _args.integer(d_ffn, "d_ffn")
    config.num_experts = _args.integer(num_experts, "num_experts")
    config.top_k = _args.integer(top_k, "top_k")
    config.activation = _lib.lookup(_lib.ACTIVATIONS, activation, "activation")
    config.checkpoint = _lib.lookup(_lib.CHECKPOINTS, checkpoint, "checkpoint")
    config.score_function = _lib.lookup(_lib.SCORE_FUNCTIONS, score_function, "score_function")
    config.renormalize = 1 if _args.flag(renormalize, "renormalize") else 0
    config.aux_loss_coeff = _args.real(aux_loss_coeff, "aux_loss_coeff")
    config.z_loss_coeff = _args.real(z_loss_coeff, "z_loss_coeff")
    config.deterministic = 1 if _args.flag(deterministic, "deterministic") else 0
    return config


def needed(need, valid, what: str = "gradients") -> set:
    """The names in `need` (a collection of names), each one of `valid`. A bare string is refused
    (set('dx') is {'d', 'x'}), and so is an unknown name: either would silently skip outputs."""
    if isinstance(need, (str, bytes)):
        raise ValueError(f"need: expected a collection of names such as ({need!r},), got the "
                         f"string {need!r}; valid names: {sorted(valid)}")
    need = set(need)
    unknown = need - set(valid)
    if unknown:
        raise ValueError(f"need: unknown {what} {sorted(unknown, key=str)}; expected some of "
                         f"{sorted(valid)}")
    return need


def _name_of(table: dict, code: int) -> str:
    for name, value in table.items():
        if value == code:
            return name
    return str(code)


class Layer(_OwnedHandle):
    """An immutable MoE layer plan on a context. Keyword arguments as in make_config()."""

    _destroy = "moeblaze_layer_destroy"

    def __init__(self, context: Optional[Context] = None, **config_kwargs):
        self.context = context if context is not None else default_context()
        self._lib = _lib.lib()
        config = make_config(**config_kwargs)
        handle = _lib.layer_t()
        self._lib.moeblaze_layer_create(ctypes.byref(handle), self.context.handle,
                                        ctypes.byref(config))
        self._handle = handle
        validated = _lib.LayerConfig.create()
        self._lib.moeblaze_layer_get_config(handle, ctypes.byref(validated))
        self.config = validated
        self.d_model = validated.d_model
        self.d_ffn = validated.d_ffn
        self.num_experts = validated.num_experts
        self.top_k = validated.top_k
        self.dtype = _name_of(_lib.DTYPES, validated.dtype)
        self.activation = _name_of(_lib.ACTIVATIONS, validated.activation)
        self.checkpoint = _name_of(_lib.CHECKPOINTS, validated.checkpoint)
        self.score_function = _name_of(_lib.SCORE_FUNCTIONS, validated.score_function)
        self.gated = self.activation in _lib.GATED_ACTIVATIONS
        self.storage_dtype = _storage_numpy_dtype(validated.dtype)
        self.routing_dtype = np.dtype(np.float64 if validated.dtype == _lib.DTYPE_F64
                                      else np.float32)

    # -- lifetime ---------------------------------------------------------------------------------

    def __repr__(self):
        return (f"moeblaze.Layer(d_model={self.d_model}, d_ffn={self.d_ffn}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"activation={self.activation!r}, dtype={self.dtype!r}, "
                f"checkpoint={self.checkpoint!r})")

    # -- sizes ------------------------------------------------------------------------------------

    def workspace_size(self, pass_code: int, num_tokens: int, flags: int = 0) -> int:
        """Workspace bytes of one call of `pass_code`; `flags`: the BACKWARD_* flags a backward
        call will be made with (BACKWARD_CONSUME_SAVED may need less), or FORWARD_WITH_SAVED for
        a forward call that is given a saved buffer (training: needs less)."""
        size = ctypes.c_size_t()
        self._lib.moeblaze_layer_workspace_size_with_flags(
            self.handle, _args.integer(pass_code, "pass_code", "int32"),
            _args.integer(num_tokens, "num_tokens"), _args.integer(flags, "flags", "uint32"),
            ctypes.byref(size))
        return size.value

    def saved_size(self, pass_code: int, num_tokens: int) -> int:
        size = ctypes.c_size_t()
        self._lib.moeblaze_layer_saved_size(self.handle,
                                            _args.integer(pass_code, "pass_code", "int32"),
                                            _args.integer(num_tokens, "num_tokens"),
                                            ctypes.byref(size))
        return size.value

    # -- numpy plumbing ---------------------------------------------------------------------------

    def _require_host(self):
        if self.context.backend != _lib.BACKEND_CPU:
            raise ValueError("the numpy API needs a CPU context; use moeblaze.torch or the raw "
                             "ctypes calls for device memory")

    def _storage_input(self, array, name: str, shape) -> np.ndarray:
        array = np.asarray(array)
        if self.storage_dtype == np.uint16 and array.dtype != np.uint16:
            # bfloat16 layers take bit patterns, or floats, which are rounded (documented); an
            # integer or bool array is neither
            if array.dtype.kind != "f":
                raise TypeError(f"{name}: expected uint16 bfloat16 bit patterns or a floating "
                                f"array, got dtype {array.dtype}")
            array = float_to_bfloat16_bits(array)
        return self._input(array, name, shape, self.storage_dtype)

    def _input(self, array, name: str, shape, dtype) -> np.ndarray:
        array = _args.array_as(np.asarray(array), dtype, name)  # value-preserving casts only
        shape = tuple(int(s) for s in shape)
        if array.shape != shape:
            raise ValueError(f"{name}: expected shape {list(shape)}, got {list(array.shape)}")
        if not array.flags.c_contiguous or array.ctypes.data % ALIGNMENT:
            copy = aligned_empty(shape, dtype)
            copy[...] = array
            array = copy
        return array

    def _workspace(self, pass_code: int, num_tokens: int, flags: int = 0) -> Optional[np.ndarray]:
        size = self.workspace_size(pass_code, num_tokens, flags)
        return aligned_empty(size, np.uint8) if size else None

    def _num_tokens(self, x, pass_code: int) -> int:
        """T of x [T, d_model], which the library checks (through a size query of `pass_code`)
        before any input is copied or output allocated: a T with T * top_k >= 2^31 is refused
        with the library's message, not after gigabytes of allocations."""
        x = np.asarray(x)
        if x.ndim != 2:
            raise ValueError(f"x: expected a 2-D [T, d_model] array, got shape {list(x.shape)}")
        T = int(x.shape[0])
        self.workspace_size(pass_code, T)
        return T

    def _weights(self, w_gate, w_up, w_down):
        E, h, d = self.num_experts, self.d_ffn, self.d_model
        w_gate = self._storage_input(w_gate, "w_gate", (E, h, d))
        if self.gated:
            if w_up is None:
                raise ValueError(f"w_up is required for the gated activation {self.activation!r}")
            w_up = self._storage_input(w_up, "w_up", (E, h, d))
        else:
            w_up = None
        w_down = self._storage_input(w_down, "w_down", (E, d, h))
        return w_gate, w_up, w_down

    # -- whole layer ------------------------------------------------------------------------------

    def forward(self, x, w_router, w_gate, w_up, w_down, *, training: bool = True
                ) -> LayerForwardResult:
        """Router + experts. x [T,d]; w_router [E,d]; w_gate/w_up [E,h,d]; w_down [E,d,h]."""
        self._require_host()
        T = self._num_tokens(x, _lib.PASS_LAYER_FORWARD)
        E, k, d = self.num_experts, self.top_k, self.d_model
        x = self._storage_input(x, "x", (T, d))
        w_router = self._storage_input(w_router, "w_router", (E, d))
        w_gate, w_up, w_down = self._weights(w_gate, w_up, w_down)
        result = LayerForwardResult(
            y=aligned_empty((T, d), self.storage_dtype),
            logits=aligned_empty((T, E), self.routing_dtype),
            ids=aligned_empty((T, k), np.int32),
            g=aligned_empty((T, k), self.routing_dtype),
            expert_counts=aligned_empty((E,), np.int32),
            losses=aligned_empty((2,), self.routing_dtype),
            saved=None)
        if training:
            saved_size = self.saved_size(_lib.PASS_LAYER_FORWARD, T)
            result.saved = aligned_empty(saved_size, np.uint8)
        workspace = self._workspace(_lib.PASS_LAYER_FORWARD, T,
                                    _lib.FORWARD_WITH_SAVED if training else 0)
        args = _lib.ForwardArgs.create()
        args.num_tokens = T
        args.x, args.w_router = _ptr(x), _ptr(w_router)
        args.w_gate, args.w_up, args.w_down = _ptr(w_gate), _ptr(w_up), _ptr(w_down)
        args.y, args.logits_out = _ptr(result.y), _ptr(result.logits)
        args.ids_out, args.g_out = _ptr(result.ids), _ptr(result.g)
        args.expert_counts, args.losses = _ptr(result.expert_counts), _ptr(result.losses)
        args.saved, args.saved_bytes = _ptr(result.saved), _nbytes(result.saved)
        args.workspace, args.workspace_bytes = _ptr(workspace), _nbytes(workspace)
        self._lib.moeblaze_layer_forward(self.handle, ctypes.byref(args), None)
        return result

    #: The gradient names of backward() and experts_backward() (their `need`).
    GRADIENTS = frozenset({"dx", "dw_router", "dw_gate", "dw_up", "dw_down", "d_logits"})
    EXPERTS_GRADIENTS = frozenset({"dx", "dg", "dw_gate", "dw_up", "dw_down"})

    def backward(self, saved, dy, x, w_router, w_gate, w_up, w_down, *, d_losses=None,
                 need=("dx", "dw_router", "dw_gate", "dw_up", "dw_down"), grads_out=None,
                 accumulate: bool = False) -> LayerGradients:
        """Every gradient of forward(). `saved` is LayerForwardResult.saved (or the result itself).
        `need` names the gradients to compute (others are skipped: NULL), some of `GRADIENTS`
        ("dx", "dw_router", "dw_gate", "dw_up", "dw_down", "d_logits"). `d_losses` [2] defaults
        to {1, 1}. With `accumulate=True` the weight gradients are added into `grads_out`'s
        arrays; without `grads_out` they are added into zeros (the same as accumulate=False)."""
        self._require_host()
        if isinstance(saved, LayerForwardResult):
            saved = saved.saved
        if saved is None:
            raise ValueError("saved is None: the forward pass ran with training=False")
        T = self._num_tokens(x, _lib.PASS_LAYER_BACKWARD)
        E, d = self.num_experts, self.d_model
        x = self._storage_input(x, "x", (T, d))
        dy = self._storage_input(dy, "dy", (T, d))
        w_router = self._storage_input(w_router, "w_router", (E, d))
        w_gate, w_up, w_down = self._weights(w_gate, w_up, w_down)
        saved = self._input(saved, "saved", (np.asarray(saved).size,), np.uint8)
        if d_losses is not None:
            d_losses = self._input(d_losses, "d_losses", (2,), self.routing_dtype)
        need = needed(need, self.GRADIENTS)
        # accumulate=True adds the weight gradients into what the arrays hold: fresh ones are zeros
        wgrad = aligned_zeros if accumulate else aligned_empty
        grads = grads_out if grads_out is not None else LayerGradients(
            dx=aligned_empty((T, d), self.storage_dtype) if "dx" in need else None,
            dw_router=wgrad(w_router.shape, self.storage_dtype) if "dw_router" in need else None,
            dw_gate=wgrad(w_gate.shape, self.storage_dtype) if "dw_gate" in need else None,
            dw_up=wgrad(w_up.shape, self.storage_dtype)
            if "dw_up" in need and w_up is not None else None,
            dw_down=wgrad(w_down.shape, self.storage_dtype) if "dw_down" in need else None,
            d_logits=aligned_empty((T, E), self.routing_dtype) if "d_logits" in need else None)
        if grads_out is not None:  # written in place: must already be exactly right
            expected = {"dx": ((T, d), self.storage_dtype),
                        "dw_router": (w_router.shape, self.storage_dtype),
                        "dw_gate": (w_gate.shape, self.storage_dtype),
                        "dw_up": (w_gate.shape, self.storage_dtype),
                        "dw_down": (w_down.shape, self.storage_dtype),
                        "d_logits": ((T, E), self.routing_dtype)}
            for name, (shape, dtype) in expected.items():
                array = getattr(grads, name)
                if array is not None and (array.shape != tuple(shape) or array.dtype != dtype
                                          or not array.flags.c_contiguous
                                          or not array.flags.writeable):
                    raise ValueError(f"grads_out.{name}: need a writeable C-contiguous {dtype} "
                                     f"array of shape {list(shape)}")
            if not self.gated:
                grads.dw_up = None
        workspace = self._workspace(_lib.PASS_LAYER_BACKWARD, T)
        args = _lib.BackwardArgs.create()
        args.flags = _lib.BACKWARD_ACCUMULATE_WGRAD if accumulate else 0
        args.num_tokens = T
        args.dy, args.d_losses, args.x, args.w_router = _ptr(dy), _ptr(d_losses), _ptr(x), \
            _ptr(w_router)
        args.w_gate, args.w_up, args.w_down = _ptr(w_gate), _ptr(w_up), _ptr(w_down)
        args.saved, args.saved_bytes = _ptr(saved), _nbytes(saved)
        args.dx, args.dw_router = _ptr(grads.dx), _ptr(grads.dw_router)
        args.dw_gate, args.dw_up, args.dw_down = _ptr(grads.dw_gate), _ptr(grads.dw_up), \
            _ptr(grads.dw_down)
        args.d_logits = _ptr(grads.d_logits)
        args.workspace, args.workspace_bytes = _ptr(workspace), _nbytes(workspace)
        self._lib.moeblaze_layer_backward(self.handle, ctypes.byref(args), None)
        return grads

    # -- experts ----------------------------------------------------------------------------------

    def experts_forward(self, x, ids, g, w_gate, w_up, w_down, *, training: bool = True
                        ) -> ExpertsForwardResult:
        """Expert MLPs + weighted combine for given routing. ids [T,k] int32, g [T,k]."""
        self._require_host()
        T = self._num_tokens(x, _lib.PASS_EXPERTS_FORWARD)
        k, d = self.top_k, self.d_model
        x = self._storage_input(x, "x", (T, d))
        ids = self._input(ids, "ids", (T, k), np.int32)
        g = self._input(g, "g", (T, k), self.routing_dtype)
        w_gate, w_up, w_down = self._weights(w_gate, w_up, w_down)
        result = ExpertsForwardResult(y=aligned_empty((T, d), self.storage_dtype),
                                      expert_counts=aligned_empty((self.num_experts,), np.int32),
                                      saved=None)
        if training:
            result.saved = aligned_empty(self.saved_size(_lib.PASS_EXPERTS_FORWARD, T), np.uint8)
        workspace = self._workspace(_lib.PASS_EXPERTS_FORWARD, T,
                                    _lib.FORWARD_WITH_SAVED if training else 0)
        args = _lib.ForwardArgs.create()
        args.num_tokens = T
        args.x, args.ids, args.g = _ptr(x), _ptr(ids), _ptr(g)
        args.w_gate, args.w_up, args.w_down = _ptr(w_gate), _ptr(w_up), _ptr(w_down)
        args.y, args.expert_counts = _ptr(result.y), _ptr(result.expert_counts)
        args.saved, args.saved_bytes = _ptr(result.saved), _nbytes(result.saved)
        args.workspace, args.workspace_bytes = _ptr(workspace), _nbytes(workspace)
        self._lib.moeblaze_experts_forward(self.handle, ctypes.byref(args), None)
        return result

    def experts_backward(self, saved, dy, x, ids, g, w_gate, w_up, w_down, *,
                         need=("dx", "dg", "dw_gate", "dw_up", "dw_down")) -> ExpertsGradients:
        """The gradients of experts_forward(); `need` names those to compute, some of
        `EXPERTS_GRADIENTS` ("dx", "dg", "dw_gate", "dw_up", "dw_down")."""
        self._require_host()
        if isinstance(saved, ExpertsForwardResult):
            saved = saved.saved
        if saved is None:
            raise ValueError("saved is None: the forward pass ran with training=False")
        T = self._num_tokens(x, _lib.PASS_EXPERTS_BACKWARD)
        k, d = self.top_k, self.d_model
        x = self._storage_input(x, "x", (T, d))
        dy = self._storage_input(dy, "dy", (T, d))
        ids = self._input(ids, "ids", (T, k), np.int32)
        g = self._input(g, "g", (T, k), self.routing_dtype)
        w_gate, w_up, w_down = self._weights(w_gate, w_up, w_down)
        saved = self._input(saved, "saved", (np.asarray(saved).size,), np.uint8)
        need = needed(need, self.EXPERTS_GRADIENTS)
        grads = ExpertsGradients(
            dx=aligned_empty((T, d), self.storage_dtype) if "dx" in need else None,
            dg=aligned_empty((T, k), self.routing_dtype) if "dg" in need else None,
            dw_gate=aligned_empty(w_gate.shape, self.storage_dtype) if "dw_gate" in need else None,
            dw_up=aligned_empty(w_up.shape, self.storage_dtype)
            if "dw_up" in need and w_up is not None else None,
            dw_down=aligned_empty(w_down.shape, self.storage_dtype) if "dw_down" in need else None)
        workspace = self._workspace(_lib.PASS_EXPERTS_BACKWARD, T)
        args = _lib.BackwardArgs.create()
        args.num_tokens = T
        args.dy, args.x, args.ids, args.g = _ptr(dy), _ptr(x), _ptr(ids), _ptr(g)
        args.w_gate, args.w_up, args.w_down = _ptr(w_gate), _ptr(w_up), _ptr(w_down)
        args.saved, args.saved_bytes = _ptr(saved), _nbytes(saved)
        args.dx, args.dg = _ptr(grads.dx), _ptr(grads.dg)
        args.dw_gate, args.dw_up, args.dw_down = _ptr(grads.dw_gate), _ptr(grads.dw_up), \
            _ptr(grads.dw_down)
        args.workspace, args.workspace_bytes = _ptr(workspace), _nbytes(workspace)
        self._lib.moeblaze_experts_backward(self.handle, ctypes.byref(args), None)
        return grads

    # -- router and routing -----------------------------------------------------------------------

    def router_forward(self, logits) -> RouterResult:
        """logits [T,E] routing dtype -> ids, g, per-expert counts and the (scaled) losses."""
        self._require_host()
        logits = np.asarray(logits)
        if logits.ndim != 2:
            raise ValueError(f"logits: expected [T, E], got shape {list(logits.shape)}")
        T, E, k = int(logits.shape[0]), self.num_experts, self.top_k
        self.workspace_size(_lib.PASS_ROUTER_FORWARD, T)  # the library's T check, before copies
        logits = self._input(logits, "logits", (T, E), self.routing_dtype)
        result = RouterResult(ids=aligned_empty((T, k), np.int32),
                              g=aligned_empty((T, k), self.routing_dtype),
                              expert_counts=aligned_empty((E,), np.int32),
                              losses=aligned_empty((2,), self.routing_dtype))
        workspace = self._workspace(_lib.PASS_ROUTER_FORWARD, T)
        self._lib.moeblaze_router_forward(self.handle, T, _ptr(logits), _ptr(result.ids),
                                          _ptr(result.g), _ptr(result.expert_counts),
                                          _ptr(result.losses), _ptr(workspace),
                                          _nbytes(workspace), None)
        return result

    def router_backward(self, logits, ids, dg, d_losses=None) -> np.ndarray:
        """d_logits [T,E] from dg [T,k] (and d_losses [2], default {1, 1})."""
        self._require_host()
        logits = np.asarray(logits)
        if logits.ndim != 2:
            raise ValueError(f"logits: expected [T, E], got shape {list(logits.shape)}")
        T, E, k = int(logits.shape[0]), self.num_experts, self.top_k
        self.workspace_size(_lib.PASS_ROUTER_BACKWARD, T)  # the library's T check, before copies
        logits = self._input(logits, "logits", (T, E), self.routing_dtype)
        ids = self._input(ids, "ids", (T, k), np.int32)
        dg = self._input(dg, "dg", (T, k), self.routing_dtype)
        if d_losses is not None:
            d_losses = self._input(d_losses, "d_losses", (2,), self.routing_dtype)
        d_logits = aligned_empty((T, E), self.routing_dtype)
        workspace = self._workspace(_lib.PASS_ROUTER_BACKWARD, T)
        self._lib.moeblaze_router_backward(self.handle, T, _ptr(logits), _ptr(ids), _ptr(dg),
                                           _ptr(d_losses), _ptr(d_logits), _ptr(workspace),
                                           _nbytes(workspace), None)
        return d_logits

    def routing_build(self, ids) -> RoutingIndices:
        """The index structures (expert_offsets, expert_token_indices, token_index_map)."""
        self._require_host()
        ids = np.asarray(ids)
        if ids.ndim != 2:
            raise ValueError(f"ids: expected [T, k], got shape {list(ids.shape)}")
        T, k, E = int(ids.shape[0]), self.top_k, self.num_experts
        self.workspace_size(_lib.PASS_ROUTING_BUILD, T)  # the library's T check, before copies
        ids = self._input(ids, "ids", (T, k), np.int32)
        result = RoutingIndices(expert_offsets=aligned_empty((E + 1,), np.int32),
                                expert_token_indices=aligned_empty((T * k,), np.int32),
                                token_index_map=aligned_empty((T * k,), np.int32))
        workspace = self._workspace(_lib.PASS_ROUTING_BUILD, T)
        self._lib.moeblaze_routing_build(self.handle, T, _ptr(ids), _ptr(result.expert_offsets),
                                         _ptr(result.expert_token_indices),
                                         _ptr(result.token_index_map), _ptr(workspace),
                                         _nbytes(workspace), None)
        return result


# ------------------------------------------------------------------------------------------------
# Module-level conveniences
# ------------------------------------------------------------------------------------------------


def get_version() -> int:
    return _lib.lib().moeblaze_get_version()


def get_abi_version() -> int:
    return _lib.lib().moeblaze_get_abi_version()


def build_info() -> str:
    return _lib.lib().moeblaze_get_build_info().decode("utf-8", "replace")


def backend_available(backend) -> bool:
    return bool(_lib.lib().moeblaze_backend_available(
        _lib.lookup(_lib.BACKENDS, backend, "backend")))


def status_name(status: int) -> str:
    return _lib.lib().moeblaze_status_name(_args.integer(status, "status", "int32")).decode(
        "utf-8", "replace")


def status_string(status: int) -> str:
    return _lib.lib().moeblaze_status_string(_args.integer(status, "status", "int32")).decode(
        "utf-8", "replace")
