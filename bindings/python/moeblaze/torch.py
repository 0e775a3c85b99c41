"""PyTorch integration: registered operators `moeblaze::*`, `moe_layer`, `moe_experts` and `MoE`.

CPU tensors run on moeblaze's CPU backend, CUDA tensors on the CUDA backend of the tensor's device
and on torch's current stream. Every buffer the library needs (outputs, the saved buffer that
carries activations from forward to backward, the workspace) is a tensor from torch's allocator
(the caching allocator on CUDA), so memory statistics, saved-tensor hooks and CUDA graphs see them;
a call never synchronises with the host.

On torch >= 2.4 the four library calls are `torch.library` custom operators with fake (meta)
implementations and registered autograd formulas:

- ``torch.ops.moeblaze.layer_forward`` / ``layer_backward``: router + experts (the whole layer);
- ``torch.ops.moeblaze.experts_forward`` / ``experts_backward``: experts for given ``ids``, ``g``.

so ``torch.compile(fullgraph=True)`` traces through them without graph breaks, ``torch.export``
exports them, and activation checkpointing and FSDP see ordinary operators. The fake
implementations size every output from the library's size queries (the saved buffer's size is an
affine bound in the token count, see `_SavedSize`), so dynamic token counts work. On older torch
the same code runs as `torch.autograd.Function`s (no compile or export support).

Autocast: inside ``torch.autocast(device, dtype)`` `moe_layer`, `moe_experts` and `MoE` run in the
autocast dtype (x and the weights are cast to it; fp64 is left alone, as torch does).
"""

from __future__ import annotations

import collections
import ctypes
import math
import os
import threading
import weakref
from typing import List, Optional, Sequence, Tuple

import torch
import torch.autograd.forward_ad as _forward_ad

from . import _args, _lib
from .core import Context, Layer

_STORAGE_DTYPES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}
_ALIGNMENT = 16

#: True when the operators are registered with torch.library (torch >= 2.4). Setting the
#: environment variable MOEBLAZE_TORCH_CUSTOM_OPS=0 selects the autograd.Function fallback instead
#: (the older torch's path, kept testable).
CUSTOM_OPS = (hasattr(torch, "library") and hasattr(torch.library, "custom_op")
              and hasattr(torch.library, "register_fake")
              and os.environ.get("MOEBLAZE_TORCH_CUSTOM_OPS", "1") != "0")

# ------------------------------------------------------------------------------------------------
# Caches: one context per (backend, device); one layer plan per (backend, device, config)
# ------------------------------------------------------------------------------------------------

#: How many layer plans the cache keeps, least recently used first out. The coefficients are part
#: of a plan's configuration (the C API takes them nowhere else), so a run that anneals
#: aux_loss_coeff makes a new plan per value: without a bound the cache would grow with every one.
#: An evicted plan is destroyed once no caller holds it, and made again when it is used again.
MAX_CACHED_LAYERS = 32

_cache_lock = threading.Lock()
_contexts = {}
_layers = collections.OrderedDict()


def _backend_of(device: torch.device) -> Tuple[str, int]:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return "cuda", index
    if device.type in ("cpu", "meta"):  # meta: size queries of the fake implementations
        return "cpu", 0
    raise NotImplementedError(f"moeblaze supports CPU and CUDA tensors, not {device.type}")


def get_context(device: torch.device) -> Context:
    key = _backend_of(device)
    with _cache_lock:
        context = _contexts.get(key)
        if context is None:
            context = _contexts[key] = Context(*key)
        return context


def get_layer(device: torch.device, **config) -> Layer:
    """The cached layer plan for `config` on `device`'s backend (plans are immutable); the cache
    keeps the MAX_CACHED_LAYERS most recently used plans."""
    key = _backend_of(device) + tuple(sorted(config.items()))
    with _cache_lock:
        layer = _layers.get(key)
        if layer is not None:
            _layers.move_to_end(key)
            return layer
    layer = Layer(get_context(device), **config)
    with _cache_lock:
        layer = _layers.setdefault(key, layer)
        _layers.move_to_end(key)
        evicted = [_layers.popitem(last=False) for _ in range(len(_layers) - MAX_CACHED_LAYERS)]
    del evicted  # destroyed here, outside the lock, unless a caller still holds one
    return layer


def _size_layer(device: torch.device, **config) -> Layer:
    """A plan for size queries only. Sizes are the same on every backend (one layout), so the fake
    implementations use the CPU plan: tracing never creates a CUDA context."""
    return get_layer(torch.device("cpu"), **config)


def clear_caches() -> None:
    with _cache_lock:
        _layers.clear()
        _contexts.clear()


# ------------------------------------------------------------------------------------------------
# Tensor plumbing
# ------------------------------------------------------------------------------------------------


def _storage_name(dtype: torch.dtype, name: str = "x") -> str:
    if dtype not in _STORAGE_DTYPES:
        raise TypeError(f"{name}: unsupported dtype {dtype}; moeblaze takes one of "
                        f"{', '.join(str(d) for d in _STORAGE_DTYPES)}")
    return _STORAGE_DTYPES[dtype]


def routing_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of logits, g, dg and the losses for a layer of storage dtype `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _ready(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Contiguous and 16-byte aligned (a contiguous view into a larger tensor may not be)."""
    if tensor is None:
        return None
    tensor = tensor.contiguous()
    if tensor.data_ptr() % _ALIGNMENT:
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _bytes(device: torch.device, size: int) -> torch.Tensor:
    # At least one element so data_ptr() is a real allocation even when the size is 0.
    return torch.empty(max(int(size), 1), dtype=torch.uint8, device=device)


class _DeviceScope:
    """On CUDA: makes the tensor's device current and yields its current stream; on CPU: NULL."""

    def __init__(self, device: torch.device):
        self.device = device
        self.guard = None

    def __enter__(self):
        if self.device.type != "cuda":
            return None
        self.guard = torch.cuda.device(self.device)
        self.guard.__enter__()
        return torch.cuda.current_stream(self.device).cuda_stream

    def __exit__(self, *exc):
        if self.guard is not None:
            self.guard.__exit__(*exc)


def _shape(tensor: torch.Tensor) -> List:
    return [int(s) if isinstance(s, int) else s for s in tensor.shape]


def _check(tensor: torch.Tensor, name: str, shape, dtype: torch.dtype, device: torch.device,
           dtype_source: str = "x"):
    if tensor.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (that of {dtype_source}), got "
                        f"{tensor.dtype}")
    if tensor.dim() != len(shape) or any(a != b for a, b in zip(tensor.shape, shape)):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {_shape(tensor)}")
    if tensor.device != device:
        raise ValueError(f"{name}: expected device {device} (that of x), got {tensor.device}")


def _check_x(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [T, d_model] tensor, got shape {_shape(x)}")
    _storage_name(x.dtype)


def _check_expert_weights(x, w_gate, w_up, w_down, activation: str):
    """Validates the expert weights against x; returns (E, h)."""
    if not isinstance(w_gate, torch.Tensor) or w_gate.dim() != 3:
        raise ValueError("w_gate: expected a 3-D [num_experts, d_ffn, d_model] tensor, got "
                         f"{_shape(w_gate) if isinstance(w_gate, torch.Tensor) else w_gate}")
    d = x.shape[1]
    E, h = w_gate.shape[0], w_gate.shape[1]
    _check(w_gate, "w_gate", (E, h, d), x.dtype, x.device)
    _check(w_down, "w_down", (E, d, h), x.dtype, x.device)
    if activation not in _lib.ACTIVATIONS:
        raise ValueError(f"activation: unknown {activation!r}; expected one of "
                         f"{sorted(_lib.ACTIVATIONS)}")
    if activation in _lib.GATED_ACTIVATIONS:
        if w_up is None:
            raise ValueError(f"w_up: required for the gated activation {activation!r}")
        _check(w_up, "w_up", (E, h, d), x.dtype, x.device)
    elif w_up is not None:
        raise ValueError(f"w_up: must be None for the non-gated activation {activation!r}")
    return E, h


def _check_names(checkpoint: str, score_function: Optional[str] = None) -> None:
    if checkpoint not in _lib.CHECKPOINTS:
        raise ValueError(f"checkpoint: unknown {checkpoint!r}; expected one of "
                         f"{sorted(_lib.CHECKPOINTS)}")
    if score_function is not None and score_function not in _lib.SCORE_FUNCTIONS:
        raise ValueError(f"score_function: unknown {score_function!r}; expected one of "
                         f"{sorted(_lib.SCORE_FUNCTIONS)}")


def _layer_config(x, w_gate, top_k, activation, checkpoint, score_function, renormalize,
                  aux_loss_coeff, z_loss_coeff) -> dict:
    return dict(d_model=int(x.shape[1]), d_ffn=int(w_gate.shape[1]),
                num_experts=int(w_gate.shape[0]), top_k=int(top_k), activation=activation,
                dtype=_storage_name(x.dtype), checkpoint=checkpoint,
                score_function=score_function, renormalize=bool(renormalize),
                aux_loss_coeff=float(aux_loss_coeff), z_loss_coeff=float(z_loss_coeff))


def _experts_config(x, w_gate, top_k, activation, checkpoint) -> dict:
    return dict(d_model=int(x.shape[1]), d_ffn=int(w_gate.shape[1]),
                num_experts=int(w_gate.shape[0]), top_k=int(top_k), activation=activation,
                dtype=_storage_name(x.dtype), checkpoint=checkpoint)


# ------------------------------------------------------------------------------------------------
# The saved buffer: an affine size bound, and which buffers a backward has consumed
# ------------------------------------------------------------------------------------------------


class _SavedSize:
    """bytes(T) = intercept + slope * T >= moeblaze_layer_saved_size(pass, T) for every T.

    The library's saved layout is a list of parts whose sizes are affine in T, each starting on
    an aligned boundary, so saved_size(T) - slope * T is periodic in T with the alignment as
    period. The bound takes the largest value over one period; it is exact up to the alignment
    padding (a few hundred bytes). An affine size lets fake tensors with a symbolic token count
    describe the buffer, and the real operator allocates the same size. The period is the
    library's part alignment; the measurement checks the periodicity it relies on."""

    PERIOD = 256

    def __init__(self, layer: Layer, pass_code: int):
        P = self.PERIOD
        sizes = [layer.saved_size(pass_code, t) for t in range(2 * P + 1)]
        slope, remainder = divmod(sizes[2 * P] - sizes[P], P)
        if remainder or any(sizes[t + P] - sizes[t] != slope * P for t in range(P + 1)):
            raise _lib.InternalError(_lib.ERR_INTERNAL,
                                     "moeblaze.torch: the library's saved size is not affine "
                                     f"with period {P} in the token count", "saved_size")
        self.slope = slope
        self.intercept = max(sizes[t] - slope * t for t in range(P))

    def __call__(self, num_tokens):
        return self.intercept + self.slope * num_tokens


_saved_size_lock = threading.Lock()


def _saved_bytes(layer: Layer, pass_code: int, num_tokens):
    """The saved buffer's size for `num_tokens` (an int or a SymInt) tokens."""
    cache = layer.__dict__.setdefault("_saved_sizes", {})
    sizer = cache.get(pass_code)
    if sizer is None:
        with _saved_size_lock:
            sizer = cache.get(pass_code) or cache.setdefault(pass_code,
                                                             _SavedSize(layer, pass_code))
    return sizer(num_tokens)


class _ConsumedBuffers:
    """The saved buffers whose activations a backward overwrote (MOEBLAZE_BACKWARD_CONSUME_SAVED).

    Kept on the host, keyed by (device, address): the operators' Python bodies run on every call
    (eager and compiled graphs alike), so a later backward on the same buffer knows, without
    reading the device, that it must first recompute the activations from x. A forward that
    fills a buffer at an address clears its mark, and so does the end of the buffer's storage (a
    finalizer on the storage, which torch keeps as one Python object: a tensor object over it can
    die while the buffer lives on, e.g. behind a saved-tensor hook that returns t.detach()), so the
    record holds only live buffers."""

    def __init__(self):
        self._lock = threading.Lock()
        self._keys = set()

    @staticmethod
    def _key(saved: torch.Tensor):
        return (str(saved.device), saved.data_ptr())

    def mark(self, saved: torch.Tensor) -> None:
        key = self._key(saved)
        with self._lock:
            if key in self._keys:
                return
            self._keys.add(key)
        weakref.finalize(saved.untyped_storage(), self._discard, key)

    def clear(self, saved: torch.Tensor) -> None:
        self._discard(self._key(saved))

    def _discard(self, key) -> None:
        with self._lock:
            self._keys.discard(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def __contains__(self, saved: torch.Tensor) -> bool:
        with self._lock:
            return self._key(saved) in self._keys


_consumed = _ConsumedBuffers()

#: How many backward calls had to recompute consumed activations (for tests and diagnostics).
recompute_count = 0


def _note_recompute() -> None:
    global recompute_count
    recompute_count += 1


# ------------------------------------------------------------------------------------------------
# Operator bodies (real tensors): validate, allocate with torch, call the library
# ------------------------------------------------------------------------------------------------


def _empty_grad(reference: torch.Tensor) -> torch.Tensor:
    """The placeholder an operator returns for a gradient it was told to skip."""
    return reference.new_empty((0,))


def _layer_forward_checks(x, w_router, w_gate, w_up, w_down, top_k, activation, checkpoint,
                          score_function):
    _check_x(x)
    _check_names(checkpoint, score_function)
    E, h = _check_expert_weights(x, w_gate, w_up, w_down, activation)
    _check(w_router, "w_router", (E, x.shape[1]), x.dtype, x.device)
    if not 1 <= int(top_k) <= min(E, _lib.MAX_TOP_K):
        raise ValueError(f"top_k: expected 1..min(num_experts={E}, {_lib.MAX_TOP_K}), got "
                         f"{top_k}")
    return E, h


def _layer_forward_body(x, w_router, w_gate, w_up, w_down, top_k, activation, checkpoint,
                        score_function, renormalize, aux_loss_coeff, z_loss_coeff, training,
                        saved_out=None):
    """Runs moeblaze_layer_forward; `saved_out`: refill this buffer (recomputation)."""
    _layer_forward_checks(x, w_router, w_gate, w_up, w_down, top_k, activation, checkpoint,
                          score_function)
    config = _layer_config(x, w_gate, top_k, activation, checkpoint, score_function,
                           renormalize, aux_loss_coeff, z_loss_coeff)
    layer = get_layer(x.device, **config)
    T, d = x.shape
    E, k = layer.num_experts, layer.top_k
    device = x.device
    # The size queries first: they are also the library's check of T (T * top_k < 2^31), so a too
    # large T fails with its message before the copies below and gigabytes of allocations.
    saved_bytes = _saved_bytes_for(layer, _lib.PASS_LAYER_FORWARD, T, training, saved_out)
    workspace_size = layer.workspace_size(_lib.PASS_LAYER_FORWARD, T,
                                          _lib.FORWARD_WITH_SAVED if saved_bytes > 0 else 0)
    x, w_router, w_gate, w_up, w_down = map(_ready, (x, w_router, w_gate, w_up, w_down))
    route_dtype = routing_dtype(x.dtype)
    y = torch.empty((T, d), dtype=x.dtype, device=device)
    losses = torch.empty(2, dtype=route_dtype, device=device)
    counts = torch.empty(E, dtype=torch.int32, device=device)
    ids = torch.empty((T, k), dtype=torch.int32, device=device)
    g = torch.empty((T, k), dtype=route_dtype, device=device)
    saved = saved_out if saved_out is not None else torch.empty(saved_bytes, dtype=torch.uint8,
                                                                  device=device)
    with_saved = saved_bytes > 0
    workspace = _bytes(device, workspace_size)
    args = _lib.ForwardArgs.create()
    args.num_tokens = T
    args.x, args.w_router = x.data_ptr(), w_router.data_ptr()
    args.w_gate, args.w_down = w_gate.data_ptr(), w_down.data_ptr()
    args.w_up = None if w_up is None else w_up.data_ptr()
    args.y, args.losses, args.expert_counts = y.data_ptr(), losses.data_ptr(), counts.data_ptr()
    args.ids_out, args.g_out = ids.data_ptr(), g.data_ptr()
    if with_saved:
        args.saved, args.saved_bytes = saved.data_ptr(), saved.numel()
    args.workspace, args.workspace_bytes = workspace.data_ptr(), workspace_size
    with _DeviceScope(device) as stream:
        layer._lib.moeblaze_layer_forward(layer.handle, ctypes.byref(args), stream)
    if with_saved:
        _consumed.clear(saved)
    return y, losses, counts, ids, g, saved


def _layer_backward_body(dy, d_losses, x, w_router, w_gate, w_up, w_down, saved, top_k,
                         activation, checkpoint, score_function, renormalize, aux_loss_coeff,
                         z_loss_coeff, consume_saved, need_x, need_router, need_gate, need_up,
                         need_down):
    E, h = _layer_forward_checks(x, w_router, w_gate, w_up, w_down, top_k, activation,
                                 checkpoint, score_function)
    config = _layer_config(x, w_gate, top_k, activation, checkpoint, score_function,
                           renormalize, aux_loss_coeff, z_loss_coeff)
    layer = get_layer(x.device, **config)
    T = x.shape[0]
    _check(dy, "dy", tuple(x.shape), dy.dtype, x.device)
    _check(d_losses, "d_losses", (2,), d_losses.dtype, x.device)
    _check_saved(saved, layer, _lib.PASS_LAYER_FORWARD, T, x.device)
    if saved in _consumed:  # a second backward through the same graph: refill the activations
        _layer_forward_body(x, w_router, w_gate, w_up, w_down, top_k, activation, checkpoint,
                            score_function, renormalize, aux_loss_coeff, z_loss_coeff, True,
                            saved_out=saved)
        _note_recompute()
    flags = _lib.BACKWARD_CONSUME_SAVED if consume_saved else 0
    x, w_router, w_gate, w_up, w_down = map(_ready, (x, w_router, w_gate, w_up, w_down))
    dy = _ready(dy.to(x.dtype))
    d_losses = _ready(d_losses.to(routing_dtype(x.dtype)))
    dx = torch.empty_like(x) if need_x else None
    dw_router = torch.empty_like(w_router) if need_router else None
    dw_gate = torch.empty_like(w_gate) if need_gate else None
    dw_up = torch.empty_like(w_up) if need_up and w_up is not None else None
    dw_down = torch.empty_like(w_down) if need_down else None
    workspace_size = layer.workspace_size(_lib.PASS_LAYER_BACKWARD, T, flags)
    workspace = _bytes(x.device, workspace_size)
    args = _lib.BackwardArgs.create()
    args.flags = flags
    args.num_tokens = T
    args.dy, args.d_losses = dy.data_ptr(), d_losses.data_ptr()
    args.x, args.w_router = x.data_ptr(), w_router.data_ptr()
    args.w_gate, args.w_down = w_gate.data_ptr(), w_down.data_ptr()
    args.w_up = None if w_up is None else w_up.data_ptr()
    args.saved, args.saved_bytes = saved.data_ptr(), saved.numel()
    args.dx, args.dw_router = _ptr_or_none(dx), _ptr_or_none(dw_router)
    args.dw_gate, args.dw_up = _ptr_or_none(dw_gate), _ptr_or_none(dw_up)
    args.dw_down = _ptr_or_none(dw_down)
    args.workspace, args.workspace_bytes = workspace.data_ptr(), workspace_size
    with _DeviceScope(x.device) as stream:
        layer._lib.moeblaze_layer_backward(layer.handle, ctypes.byref(args), stream)
    if consume_saved:
        _consumed.mark(saved)
    return tuple(g if g is not None else _empty_grad(x)
                 for g in (dx, dw_router, dw_gate, dw_up, dw_down))


def _saved_bytes_for(layer: Layer, pass_code: int, T: int, training: bool,
                     saved_out: Optional[torch.Tensor]) -> int:
    """The saved buffer's size of a forward: `saved_out`'s (a refill), the layer's when training,
    else 0 (an inference forward)."""
    if saved_out is not None:
        return saved_out.numel()
    return _saved_bytes(layer, pass_code, T) if training else 0


def _ptr_or_none(tensor: Optional[torch.Tensor]) -> Optional[int]:
    return None if tensor is None else tensor.data_ptr()


def _check_saved(saved, layer: Layer, pass_code: int, T: int, device) -> None:
    if not isinstance(saved, torch.Tensor) or saved.dtype != torch.uint8 or saved.dim() != 1:
        raise ValueError("saved: expected the 1-D uint8 tensor a training forward returned")
    if saved.device != device:
        raise ValueError(f"saved: expected device {device} (that of x), got {saved.device}")
    needed = layer.saved_size(pass_code, T)
    if saved.numel() < needed:
        raise ValueError(f"saved: {saved.numel()} bytes, but a forward of {T} tokens fills "
                         f"{needed}: it is not the buffer of this forward (or the forward ran "
                         "without gradients)")
    if not saved.is_contiguous() or saved.data_ptr() % _ALIGNMENT:
        raise ValueError("saved: must be contiguous and 16-byte aligned, as the forward returned "
                         "it")


def _experts_checks(x, ids, g, w_gate, w_up, w_down, activation, checkpoint):
    _check_x(x)
    _check_names(checkpoint)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("ids: expected a 2-D [T, top_k] int32 tensor, got "
                         f"{_shape(ids) if isinstance(ids, torch.Tensor) else ids}")
    T, k = x.shape[0], ids.shape[1]
    if ids.shape[0] != T:
        raise ValueError(f"ids: expected {T} rows (the tokens of x), got {ids.shape[0]}")
    if ids.dtype != torch.int32:
        raise TypeError(f"ids: expected dtype torch.int32, got {ids.dtype}; convert with "
                        f"ids.to(torch.int32) (torch.topk's indices are int64)")
    if ids.device != x.device:
        raise ValueError(f"ids: expected device {x.device} (that of x), got {ids.device}")
    E, h = _check_expert_weights(x, w_gate, w_up, w_down, activation)
    _check(g, "g", (T, k), routing_dtype(x.dtype), x.device,
           dtype_source=f"routing for {x.dtype} x")
    return E, h, k


def _experts_forward_body(x, ids, g, w_gate, w_up, w_down, activation, checkpoint, training,
                          saved_out=None):
    _, _, k = _experts_checks(x, ids, g, w_gate, w_up, w_down, activation, checkpoint)
    layer = get_layer(x.device, **_experts_config(x, w_gate, k, activation, checkpoint))
    T = x.shape[0]
    device = x.device
    # The size queries first (the library's check of T, before any copy or allocation).
    saved_bytes = _saved_bytes_for(layer, _lib.PASS_EXPERTS_FORWARD, T, training, saved_out)
    workspace_size = layer.workspace_size(_lib.PASS_EXPERTS_FORWARD, T,
                                          _lib.FORWARD_WITH_SAVED if saved_bytes > 0 else 0)
    x, ids, g, w_gate, w_up, w_down = map(_ready, (x, ids, g, w_gate, w_up, w_down))
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    saved = saved_out if saved_out is not None else torch.empty(saved_bytes, dtype=torch.uint8,
                                                                  device=device)
    with_saved = saved_bytes > 0
    workspace = _bytes(device, workspace_size)
    args = _lib.ForwardArgs.create()
    args.num_tokens = T
    args.x, args.ids, args.g = x.data_ptr(), ids.data_ptr(), g.data_ptr()
    args.w_gate, args.w_down = w_gate.data_ptr(), w_down.data_ptr()
    args.w_up = None if w_up is None else w_up.data_ptr()
    args.y = y.data_ptr()
    if with_saved:
        args.saved, args.saved_bytes = saved.data_ptr(), saved.numel()
    args.workspace, args.workspace_bytes = workspace.data_ptr(), workspace_size
    with _DeviceScope(device) as stream:
        layer._lib.moeblaze_experts_forward(layer.handle, ctypes.byref(args), stream)
    if with_saved:
        _consumed.clear(saved)
    return y, saved


def _experts_backward_body(dy, x, ids, g, w_gate, w_up, w_down, saved, activation, checkpoint,
                           consume_saved, need_x, need_g, need_gate, need_up, need_down):
    _, _, k = _experts_checks(x, ids, g, w_gate, w_up, w_down, activation, checkpoint)
    layer = get_layer(x.device, **_experts_config(x, w_gate, k, activation, checkpoint))
    T = x.shape[0]
    _check(dy, "dy", tuple(x.shape), dy.dtype, x.device)
    _check_saved(saved, layer, _lib.PASS_EXPERTS_FORWARD, T, x.device)
    if saved in _consumed:  # a second backward through the same graph: refill the activations
        _experts_forward_body(x, ids, g, w_gate, w_up, w_down, activation, checkpoint, True,
                              saved_out=saved)
        _note_recompute()
    flags = _lib.BACKWARD_CONSUME_SAVED if consume_saved else 0
    x, ids, g, w_gate, w_up, w_down = map(_ready, (x, ids, g, w_gate, w_up, w_down))
    dy = _ready(dy.to(x.dtype))
    dx = torch.empty_like(x) if need_x else None
    dg = torch.empty_like(g) if need_g else None
    dw_gate = torch.empty_like(w_gate) if need_gate else None
    dw_up = torch.empty_like(w_up) if need_up and w_up is not None else None
    dw_down = torch.empty_like(w_down) if need_down else None
    workspace_size = layer.workspace_size(_lib.PASS_EXPERTS_BACKWARD, T, flags)
    workspace = _bytes(x.device, workspace_size)
    args = _lib.BackwardArgs.create()
    args.flags = flags
    args.num_tokens = T
    args.dy, args.x, args.ids, args.g = dy.data_ptr(), x.data_ptr(), ids.data_ptr(), g.data_ptr()
    args.w_gate, args.w_down = w_gate.data_ptr(), w_down.data_ptr()
    args.w_up = None if w_up is None else w_up.data_ptr()
    args.saved, args.saved_bytes = saved.data_ptr(), saved.numel()
    args.dx, args.dg = _ptr_or_none(dx), _ptr_or_none(dg)
    args.dw_gate, args.dw_up = _ptr_or_none(dw_gate), _ptr_or_none(dw_up)
    args.dw_down = _ptr_or_none(dw_down)
    args.workspace, args.workspace_bytes = workspace.data_ptr(), workspace_size
    with _DeviceScope(x.device) as stream:
        layer._lib.moeblaze_experts_backward(layer.handle, ctypes.byref(args), stream)
    if consume_saved:
        _consumed.mark(saved)
    return tuple(t if t is not None else _empty_grad(x)
                 for t in (dx, dg, dw_gate, dw_up, dw_down))


# ------------------------------------------------------------------------------------------------
# Fake (meta) bodies: shapes only, from the size queries; the library never runs
# ------------------------------------------------------------------------------------------------


def _layer_forward_fake(x, w_router, w_gate, w_up, w_down, top_k, activation, checkpoint,
                        score_function, renormalize, aux_loss_coeff, z_loss_coeff, training):
    E, _ = _layer_forward_checks(x, w_router, w_gate, w_up, w_down, top_k, activation,
                                 checkpoint, score_function)
    T, d = x.shape
    k = int(top_k)
    route_dtype = routing_dtype(x.dtype)
    saved_size = 0
    if training:
        layer = _size_layer(x.device, **_layer_config(x, w_gate, top_k, activation, checkpoint,
                                                      score_function, renormalize,
                                                      aux_loss_coeff, z_loss_coeff))
        saved_size = _saved_bytes(layer, _lib.PASS_LAYER_FORWARD, T)
    return (x.new_empty((T, d)), x.new_empty((2,), dtype=route_dtype),
            x.new_empty((E,), dtype=torch.int32), x.new_empty((T, k), dtype=torch.int32),
            x.new_empty((T, k), dtype=route_dtype), x.new_empty((saved_size,), dtype=torch.uint8))


def _layer_backward_fake(dy, d_losses, x, w_router, w_gate, w_up, w_down, saved, top_k,
                         activation, checkpoint, score_function, renormalize, aux_loss_coeff,
                         z_loss_coeff, consume_saved, need_x, need_router, need_gate, need_up,
                         need_down):
    _layer_forward_checks(x, w_router, w_gate, w_up, w_down, top_k, activation, checkpoint,
                          score_function)
    outputs = []
    for need, like in ((need_x, x), (need_router, w_router), (need_gate, w_gate),
                       (need_up and w_up is not None, w_up), (need_down, w_down)):
        outputs.append(torch.empty_like(like) if need else _empty_grad(x))
    return tuple(outputs)


def _experts_forward_fake(x, ids, g, w_gate, w_up, w_down, activation, checkpoint, training):
    _, _, k = _experts_checks(x, ids, g, w_gate, w_up, w_down, activation, checkpoint)
    saved_size = 0
    if training:
        layer = _size_layer(x.device, **_experts_config(x, w_gate, k, activation, checkpoint))
        saved_size = _saved_bytes(layer, _lib.PASS_EXPERTS_FORWARD, x.shape[0])
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((saved_size,), dtype=torch.uint8))


def _experts_backward_fake(dy, x, ids, g, w_gate, w_up, w_down, saved, activation, checkpoint,
                           consume_saved, need_x, need_g, need_gate, need_up, need_down):
    _experts_checks(x, ids, g, w_gate, w_up, w_down, activation, checkpoint)
    outputs = []
    for need, like in ((need_x, x), (need_g, g), (need_gate, w_gate),
                       (need_up and w_up is not None, w_up), (need_down, w_down)):
        outputs.append(torch.empty_like(like) if need else _empty_grad(x))
    return tuple(outputs)


# ------------------------------------------------------------------------------------------------
# Autograd formulas (shared by the registered operators and the autograd.Function fallback)
# ------------------------------------------------------------------------------------------------

# Positions of the forward operators' arguments.
_LAYER_TENSORS = 5   # x, w_router, w_gate, w_up, w_down
_EXPERTS_TENSORS = 6  # x, ids, g, w_gate, w_up, w_down


def _layer_setup_context(ctx, inputs, output):
    (x, w_router, w_gate, w_up, w_down, top_k, activation, checkpoint, score_function,
     renormalize, aux_loss_coeff, z_loss_coeff, training, consume_saved) = inputs
    _, _, counts, ids, g, saved = output
    ctx.mark_non_differentiable(counts, ids, g, saved)
    # Unmaterialised gradients: autograd would otherwise pass a zero tensor the size of every
    # non-differentiable output to the backward, `saved` included (as large as the activations).
    ctx.set_materialize_grads(False)
    ctx.config = (top_k, activation, checkpoint, score_function, renormalize, aux_loss_coeff,
                  z_loss_coeff)
    ctx.consume_saved = consume_saved
    ctx.training = training
    ctx.save_for_backward(x, w_router, w_gate, w_up, w_down, saved)


def _layer_backward_formula(ctx, dy, d_losses, *_unused):
    x, w_router, w_gate, w_up, w_down, saved = ctx.saved_tensors
    if not ctx.training:
        raise RuntimeError("moeblaze: backward through a layer forward that ran with "
                           "training=False (no saved buffer)")
    need = tuple(bool(n) for n in ctx.needs_input_grad[:_LAYER_TENSORS])
    if dy is None:
        dy = torch.zeros_like(x)
    if d_losses is None:
        d_losses = x.new_zeros((2,), dtype=routing_dtype(x.dtype))
    grads = _call_layer_backward(dy, d_losses, x, w_router, w_gate, w_up, w_down, saved,
                                 *ctx.config, ctx.consume_saved, *need)
    grads = tuple(grad if wanted else None for grad, wanted in zip(grads, need))
    return grads + (None,) * 9


def _experts_setup_context(ctx, inputs, output):
    (x, ids, g, w_gate, w_up, w_down, activation, checkpoint, training, consume_saved) = inputs
    _, saved = output
    ctx.mark_non_differentiable(saved)
    ctx.set_materialize_grads(False)  # no zero gradient the size of `saved` (as above)
    ctx.config = (activation, checkpoint)
    ctx.consume_saved = consume_saved
    ctx.training = training
    ctx.save_for_backward(x, ids, g, w_gate, w_up, w_down, saved)


def _experts_backward_formula(ctx, dy, *_unused):
    x, ids, g, w_gate, w_up, w_down, saved = ctx.saved_tensors
    if not ctx.training:
        raise RuntimeError("moeblaze: backward through an experts forward that ran with "
                           "training=False (no saved buffer)")
    n = ctx.needs_input_grad
    need = (bool(n[0]), bool(n[2]), bool(n[3]), bool(n[4]), bool(n[5]))
    if dy is None:
        dy = torch.zeros_like(x)
    dx, dg, dw_gate, dw_up, dw_down = _call_experts_backward(
        dy, x, ids, g, w_gate, w_up, w_down, saved, *ctx.config, ctx.consume_saved, *need)
    pick = lambda grad, wanted: grad if wanted else None  # noqa: E731
    return (pick(dx, need[0]), None, pick(dg, need[1]), pick(dw_gate, need[2]),
            pick(dw_up, need[3]), pick(dw_down, need[4]), None, None, None, None)


# ------------------------------------------------------------------------------------------------
# Registration
# ------------------------------------------------------------------------------------------------

if CUSTOM_OPS:
    from torch import Tensor

    @torch.library.custom_op("moeblaze::layer_forward", mutates_args=())
    def _layer_forward_op(x: Tensor, w_router: Tensor, w_gate: Tensor, w_up: Optional[Tensor],
                          w_down: Tensor, top_k: int, activation: str, checkpoint: str,
                          score_function: str, renormalize: bool, aux_loss_coeff: float,
                          z_loss_coeff: float, training: bool, consume_saved: bool
                          ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """moeblaze_layer_forward -> (y, losses, expert_counts, ids, g, saved). `saved` is empty
        unless `training`; `consume_saved` only tells the backward what it may do with it."""
        return _layer_forward_body(x, w_router, w_gate, w_up, w_down, top_k, activation,
                                   checkpoint, score_function, renormalize, aux_loss_coeff,
                                   z_loss_coeff, training)

    @_layer_forward_op.register_fake
    def _(x, w_router, w_gate, w_up, w_down, top_k, activation, checkpoint, score_function,
          renormalize, aux_loss_coeff, z_loss_coeff, training, consume_saved):
        return _layer_forward_fake(x, w_router, w_gate, w_up, w_down, top_k, activation,
                                   checkpoint, score_function, renormalize, aux_loss_coeff,
                                   z_loss_coeff, training)

    # The backward may overwrite the activations in `saved` (consume_saved). The operator does not
    # declare that mutation: `saved` is private to one forward/backward pair, nothing else reads
    # it, and a later backward on the same buffer recomputes the activations first
    # (_ConsumedBuffers). Declaring it would make functionalisation copy the whole buffer.
    @torch.library.custom_op("moeblaze::layer_backward", mutates_args=())
    def _layer_backward_op(dy: Tensor, d_losses: Tensor, x: Tensor, w_router: Tensor,
                           w_gate: Tensor, w_up: Optional[Tensor], w_down: Tensor, saved: Tensor,
                           top_k: int, activation: str, checkpoint: str, score_function: str,
                           renormalize: bool, aux_loss_coeff: float, z_loss_coeff: float,
                           consume_saved: bool, need_x: bool, need_w_router: bool,
                           need_w_gate: bool, need_w_up: bool, need_w_down: bool
                           ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """moeblaze_layer_backward -> (dx, dw_router, dw_gate, dw_up, dw_down); a gradient that
        is not needed comes back as an empty tensor."""
        return _layer_backward_body(dy, d_losses, x, w_router, w_gate, w_up, w_down, saved,
                                    top_k, activation, checkpoint, score_function, renormalize,
                                    aux_loss_coeff, z_loss_coeff, consume_saved, need_x,
                                    need_w_router, need_w_gate, need_w_up, need_w_down)

    _layer_backward_op.register_fake(_layer_backward_fake)

    @torch.library.custom_op("moeblaze::experts_forward", mutates_args=())
    def _experts_forward_op(x: Tensor, ids: Tensor, g: Tensor, w_gate: Tensor,
                            w_up: Optional[Tensor], w_down: Tensor, activation: str,
                            checkpoint: str, training: bool, consume_saved: bool
                            ) -> Tuple[Tensor, Tensor]:
        """moeblaze_experts_forward -> (y, saved); `saved` is empty unless `training`."""
        return _experts_forward_body(x, ids, g, w_gate, w_up, w_down, activation, checkpoint,
                                     training)

    @_experts_forward_op.register_fake
    def _(x, ids, g, w_gate, w_up, w_down, activation, checkpoint, training, consume_saved):
        return _experts_forward_fake(x, ids, g, w_gate, w_up, w_down, activation, checkpoint,
                                     training)

    @torch.library.custom_op("moeblaze::experts_backward", mutates_args=())
    def _experts_backward_op(dy: Tensor, x: Tensor, ids: Tensor, g: Tensor, w_gate: Tensor,
                             w_up: Optional[Tensor], w_down: Tensor, saved: Tensor,
                             activation: str, checkpoint: str, consume_saved: bool, need_x: bool,
                             need_g: bool, need_w_gate: bool, need_w_up: bool, need_w_down: bool
                             ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """moeblaze_experts_backward -> (dx, dg, dw_gate, dw_up, dw_down); a gradient that is not
        needed comes back as an empty tensor."""
        return _experts_backward_body(dy, x, ids, g, w_gate, w_up, w_down, saved, activation,
                                      checkpoint, consume_saved, need_x, need_g, need_w_gate,
                                      need_w_up, need_w_down)

    _experts_backward_op.register_fake(_experts_backward_fake)

    _layer_forward_op.register_autograd(_layer_backward_formula,
                                        setup_context=_layer_setup_context)
    _experts_forward_op.register_autograd(_experts_backward_formula,
                                          setup_context=_experts_setup_context)

    def _call_layer_forward(*args):
        return torch.ops.moeblaze.layer_forward(*args)

    def _call_layer_backward(*args):
        return torch.ops.moeblaze.layer_backward(*args)

    def _call_experts_forward(*args):
        return torch.ops.moeblaze.experts_forward(*args)

    def _call_experts_backward(*args):
        return torch.ops.moeblaze.experts_backward(*args)

else:  # torch < 2.4: the same bodies and formulas as autograd.Functions

    class _LayerFunction(torch.autograd.Function):

        @staticmethod
        def forward(ctx, *inputs):
            output = _layer_forward_body(*inputs[:-1])
            _layer_setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return _layer_backward_formula(ctx, *grads)

    class _ExpertsFunction(torch.autograd.Function):

        @staticmethod
        def forward(ctx, *inputs):
            output = _experts_forward_body(*inputs[:-1])
            _experts_setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return _experts_backward_formula(ctx, *grads)

    def _call_layer_forward(*args):
        return _LayerFunction.apply(*args)

    def _call_layer_backward(*args):
        return _layer_backward_body(*args)

    def _call_experts_forward(*args):
        return _ExpertsFunction.apply(*args)

    def _call_experts_backward(*args):
        return _experts_backward_body(*args)


# ------------------------------------------------------------------------------------------------
# Autocast
# ------------------------------------------------------------------------------------------------

_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast runs `device_type` ops in, or None when autocast is off there."""
    if device_type not in ("cpu", "cuda"):
        return None
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError):  # torch < 2.4
        if device_type == "cuda":
            return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None


def _autocast(tensors: Sequence[Optional[torch.Tensor]], device_type: str):
    """Casts floating tensors (not fp64) to the autocast dtype of `device_type`, as torch's
    autocast does for its matmul ops; returns them unchanged when autocast is off."""
    dtype = _autocast_dtype(device_type)
    if dtype is None:
        return list(tensors)
    return [t.to(dtype) if t is not None and t.dtype in _AUTOCAST_ELIGIBLE else t
            for t in tensors]


def _check_tokens_before_autocast(x: torch.Tensor, top_k) -> None:
    """The library's check of x's token count (T * top_k < 2^31) when autocast is about to cast x:
    the operator bodies query sizes before their copies, but the cast comes first and would copy
    an oversized x. An invalid top_k is left to the argument checks. Eager only: inside
    torch.compile's tracing T may be symbolic."""
    if _compiling():
        return
    dtype = _autocast_dtype(x.device.type)
    if dtype is None or x.dtype not in _AUTOCAST_ELIGIBLE or x.dtype == dtype:
        return  # no cast of x: the body checks T before any copy
    if not isinstance(top_k, int) or not 1 <= top_k <= _lib.MAX_TOP_K:
        return
    _lib.check_routed_rows(int(x.shape[0]), top_k)


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _refuse_forward_ad(*tensors) -> None:
    """Raises NotImplementedError when an input carries a forward-mode tangent (torch.func.jvp,
    jacfwd, torch.autograd.forward_ad): the operators have only a reverse-mode formula, and
    torch.library has no jvp hook for custom operators, so the tangent would silently be dropped
    (a zero or missing output tangent). Inside torch.compile's tracing nothing is checked (the
    check is eager Python)."""
    if _compiling():
        return
    for tensor in tensors:
        if tensor is not None and _forward_ad.unpack_dual(tensor).tangent is not None:
            raise NotImplementedError(
                "moeblaze: forward-mode AD (torch.func.jvp / jacfwd, torch.autograd.forward_ad) "
                "is not supported: moeblaze's operators have a reverse-mode formula only; use "
                "reverse mode (backward(), torch.autograd.grad)")


def _compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


# ------------------------------------------------------------------------------------------------
# Public functions
# ------------------------------------------------------------------------------------------------


def moe_experts(x: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, w_gate: torch.Tensor,
                w_up: Optional[torch.Tensor], w_down: torch.Tensor, *, activation: str = "swiglu",
                checkpoint: str = "save_preact", consume_saved: bool = True) -> torch.Tensor:
    """y[t] = sum_j g[t,j] * expert_{ids[t,j]}(x[t]), differentiable in x, g and the weights.

    x [T,d] (float32/bfloat16/float16/float64), ids [T,k] int32, g [T,k] in the routing dtype
    (float64 for float64 x, else float32), w_gate/w_up [E,h,d], w_down [E,d,h]; w_up is None for
    non-gated activations. Under autocast, x and the weights run in the autocast dtype.

    consume_saved: the backward writes its activation gradients over the saved activations
    (MOEBLAZE_BACKWARD_CONSUME_SAVED), which lowers the backward's peak memory by their size and
    gives the same gradients bit for bit. A second backward through the same graph
    (retain_graph=True, gradcheck) first recomputes the activations from x (one more forward),
    so it stays correct; consume_saved=False keeps them instead."""
    _check_x(x)
    consume_saved = _args.flag(consume_saved, "consume_saved")
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        _check_tokens_before_autocast(x, int(ids.shape[1]))
    x, w_gate, w_up, w_down = _autocast((x, w_gate, w_up, w_down), x.device.type)
    activation, checkpoint = str(activation).lower(), str(checkpoint).lower()
    _experts_checks(x, ids, g, w_gate, w_up, w_down, activation, checkpoint)
    _refuse_forward_ad(x, g, w_gate, w_up, w_down)
    training = _wants_grad(x, g, w_gate, w_up, w_down)
    y, _ = _call_experts_forward(x, ids, g, w_gate, w_up, w_down, activation, checkpoint,
                                 training, consume_saved)
    return y


def moe_layer(x: torch.Tensor, w_router: torch.Tensor, w_gate: torch.Tensor,
              w_up: Optional[torch.Tensor], w_down: torch.Tensor, *, top_k: int,
              activation: str = "swiglu", checkpoint: str = "save_preact",
              score_function: str = "softmax_topk", renormalize: bool = False,
              aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
              consume_saved: bool = True):
    """The whole layer (router + experts), differentiable in x and every weight.

    Returns (y [T,d], losses [2] = (aux, z) in the routing dtype, expert_counts [E] int32,
    ids [T,k] int32, g [T,k]). Under autocast, x and the weights run in the autocast dtype.
    top_k must be an int, renormalize and consume_saved bools, the coefficients real numbers.
    consume_saved: as in moe_experts()."""
    _check_x(x)
    top_k = _args.integer(top_k, "top_k")
    renormalize = _args.flag(renormalize, "renormalize")
    consume_saved = _args.flag(consume_saved, "consume_saved")
    aux_loss_coeff = _args.real(aux_loss_coeff, "aux_loss_coeff")
    z_loss_coeff = _args.real(z_loss_coeff, "z_loss_coeff")
    _check_tokens_before_autocast(x, top_k)
    x, w_router, w_gate, w_up, w_down = _autocast((x, w_router, w_gate, w_up, w_down),
                                                  x.device.type)
    activation, checkpoint = str(activation).lower(), str(checkpoint).lower()
    score_function = str(score_function).lower()
    _layer_forward_checks(x, w_router, w_gate, w_up, w_down, top_k, activation, checkpoint,
                          score_function)
    _refuse_forward_ad(x, w_router, w_gate, w_up, w_down)
    training = _wants_grad(x, w_router, w_gate, w_up, w_down)
    y, losses, counts, ids, g, _ = _call_layer_forward(
        x, w_router, w_gate, w_up, w_down, top_k, activation, checkpoint, score_function,
        renormalize, aux_loss_coeff, z_loss_coeff, training, consume_saved)
    return y, losses, counts, ids, g


# ------------------------------------------------------------------------------------------------
# Modules
# ------------------------------------------------------------------------------------------------


def _init_moe_module(module: torch.nn.Module, d_model: int, d_ffn: int, num_experts: int,
                     top_k: int, num_local_experts: int, activation: str, checkpoint: str,
                     score_function: str, renormalize: bool, aux_loss_coeff: float,
                     z_loss_coeff: float, dtype, device) -> None:
    """The settings and (uninitialised) parameters shared by MoE and the expert-parallel layer:
    the router weight over all `num_experts`, expert weights for `num_local_experts` of them.
    Every setting is checked here, so a bad one fails at construction, naming the argument."""
    factory = {"dtype": dtype, "device": device}
    d_model, d_ffn = _positive(d_model, "d_model"), _positive(d_ffn, "d_ffn")
    num_experts, top_k = _positive(num_experts, "num_experts"), _positive(top_k, "top_k")
    if num_experts > _lib.MAX_EXPERTS:
        raise ValueError(f"num_experts = {num_experts} exceeds {_lib.MAX_EXPERTS}")
    if top_k > min(num_experts, _lib.MAX_TOP_K):
        raise ValueError(f"top_k: expected 1..min(num_experts={num_experts}, {_lib.MAX_TOP_K}), "
                         f"got {top_k}")
    module.d_model, module.d_ffn = d_model, d_ffn
    module.num_experts, module.top_k = num_experts, top_k
    module.activation = str(activation).lower()
    if module.activation not in _lib.ACTIVATIONS:
        raise ValueError(f"activation: unknown {activation!r}; expected one of "
                         f"{sorted(_lib.ACTIVATIONS)}")
    _check_names(str(checkpoint).lower(), str(score_function).lower())
    module.checkpoint = checkpoint
    module.score_function = score_function
    module.renormalize = _args.flag(renormalize, "renormalize")
    module.aux_loss_coeff = _coefficient(aux_loss_coeff, "aux_loss_coeff")
    module.z_loss_coeff = _coefficient(z_loss_coeff, "z_loss_coeff")
    local = num_local_experts
    module.w_router = torch.nn.Parameter(torch.empty(num_experts, d_model, **factory))
    module.w_gate = torch.nn.Parameter(torch.empty(local, d_ffn, d_model, **factory))
    if module.activation in _lib.GATED_ACTIVATIONS:
        module.w_up = torch.nn.Parameter(torch.empty(local, d_ffn, d_model, **factory))
    else:
        module.register_parameter("w_up", None)
    module.w_down = torch.nn.Parameter(torch.empty(local, d_model, d_ffn, **factory))
    module.last_expert_counts = None


def _positive(value, name: str) -> int:
    value = _args.integer(value, name)
    if value < 1:
        raise ValueError(f"{name} = {value} must be >= 1")
    return value


def _coefficient(value, name: str) -> float:
    value = _args.real(value, name)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} = {value} must be finite and >= 0")
    return value


def _reset_moe_parameters(module: torch.nn.Module) -> None:
    """nn.Linear's default (kaiming_uniform, a=sqrt(5)) is U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    with torch.no_grad():
        for weight, fan_in in ((module.w_router, module.d_model), (module.w_gate, module.d_model),
                               (module.w_up, module.d_model), (module.w_down, module.d_ffn)):
            if weight is not None:
                bound = 1.0 / math.sqrt(fan_in)
                weight.uniform_(-bound, bound)


def _check_module_input(module: torch.nn.Module, x) -> None:
    """x against the module: its last dimension and, outside autocast, its dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != module.d_model:
        raise ValueError(f"x: expected a last dimension of d_model = {module.d_model}, got "
                         f"shape {_shape(x)}")
    weight = module.w_router
    if x.dtype != weight.dtype and _autocast_dtype(x.device.type) is None:
        advice = (f"convert x, or the module with .to({x.dtype})" if x.dtype.is_floating_point
                  else f"x must be floating point: convert it with .to({weight.dtype})")
        raise TypeError(f"x: expected dtype {weight.dtype} (that of the layer's parameters), got "
                        f"{x.dtype}; {advice}")
    if x.device != weight.device:
        raise ValueError(f"x: expected device {weight.device} (that of the layer's parameters), "
                         f"got {x.device}")


class MoE(torch.nn.Module):
    """A token-choice MoE layer: router (no bias) + `num_experts` expert MLPs, top-k routing.

    forward(x [..., d_model]) -> (y [..., d_model], aux_loss, z_loss). The losses are already scaled
    by their coefficients (0 when a coefficient is 0); add them to the training objective.
    `last_expert_counts` holds the tokens routed to each expert by the latest forward.

    With `process_group=pg` the layer is expert parallel: `MoE(...)` returns a
    `moeblaze.distributed.ExpertParallelMoE` whose experts are split contiguously over the ranks
    of `pg` and whose tokens travel to them through torch.distributed.

    `consume_saved=True` (the default): the backward writes its activation gradients over the
    saved activations, lowering the peak memory by their size, with the same gradients; a second
    backward through the same graph (retain_graph=True, gradcheck) recomputes them from x first.
    Works with torch.compile (fullgraph), torch.export, autocast and activation checkpointing."""

    # The expert-parallel class, registered by moeblaze.distributed when it is imported (it builds
    # on this module, so this module does not import it: no import cycle).
    expert_parallel_class = None

    def __new__(cls, *args, process_group=None, **kwargs):
        if cls is MoE and process_group is not None:
            if MoE.expert_parallel_class is None:
                raise RuntimeError("MoE(process_group=...) is expert parallel: import "
                                   "moeblaze.distributed first")
            return MoE.expert_parallel_class(*args, process_group=process_group, **kwargs)
        return super().__new__(cls)

    def __init__(self, d_model: int, d_ffn: int, num_experts: int, top_k: int = 1, *,
                 activation: str = "swiglu", checkpoint: str = "save_preact",
                 score_function: str = "softmax_topk", renormalize: bool = False,
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0, dtype=None, device=None,
                 process_group=None, consume_saved: bool = True):
        super().__init__()
        self.consume_saved = _args.flag(consume_saved, "consume_saved")  # see moe_experts()
        _init_moe_module(self, d_model, d_ffn, num_experts, top_k, num_experts, activation,
                         checkpoint, score_function, renormalize, aux_loss_coeff, z_loss_coeff,
                         dtype, device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_moe_parameters(self)

    def forward(self, x: torch.Tensor):
        _check_module_input(self, x)
        shape = x.shape
        y, losses, counts, _, _ = moe_layer(
            x.reshape(-1, self.d_model), self.w_router, self.w_gate, self.w_up, self.w_down,
            top_k=self.top_k, activation=self.activation, checkpoint=self.checkpoint,
            score_function=self.score_function, renormalize=self.renormalize,
            aux_loss_coeff=self.aux_loss_coeff, z_loss_coeff=self.z_loss_coeff,
            consume_saved=self.consume_saved)
        if not _exporting():
            self.last_expert_counts = counts
        return y.reshape(shape), losses[0], losses[1]

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ffn={self.d_ffn}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, activation={self.activation!r}, "
                f"checkpoint={self.checkpoint!r}")


def _exporting() -> bool:
    """True while torch.export traces, which forbids assigning tensor attributes to modules.

    Reads the flag behind torch.compiler.is_exporting(): torch.compile's tracer answers True to
    that function itself, also when it is not exporting, and module attributes may be set there."""
    return bool(getattr(getattr(torch, "compiler", None), "_is_exporting_flag", False))
