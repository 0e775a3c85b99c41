"""PyTorch integration: `moe_experts` (an autograd function) and `MoE` (an nn.Module).

CPU tensors run on moeblaze's CPU backend, CUDA tensors on the CUDA backend of the tensor's device
and on torch's current stream. Saved buffers and workspaces come from torch's allocator
(torch.empty(uint8) on the tensor's device), so the caching allocator, memory statistics and
saved-tensor hooks all see them. Uses only APIs present in torch 1.13 through 2.x.
"""

from __future__ import annotations

import ctypes
import math
import threading
from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from . import _lib
from .core import Context, Layer

_STORAGE_DTYPES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}
_ALIGNMENT = 16

# ------------------------------------------------------------------------------------------------
# Caches: one context per (backend, device); one layer plan per (backend, device, config)
# ------------------------------------------------------------------------------------------------

_cache_lock = threading.Lock()
_contexts = {}
_layers = {}


def _backend_of(device: torch.device) -> Tuple[str, int]:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return "cuda", index
    if device.type == "cpu":
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
    """The cached layer plan for `config` on `device`'s backend (plans are immutable)."""
    key = _backend_of(device) + tuple(sorted(config.items()))
    with _cache_lock:
        layer = _layers.get(key)
    if layer is None:
        layer = Layer(get_context(device), **config)
        with _cache_lock:
            layer = _layers.setdefault(key, layer)
    return layer


def clear_caches() -> None:
    with _cache_lock:
        _layers.clear()
        _contexts.clear()


# ------------------------------------------------------------------------------------------------
# Tensor plumbing
# ------------------------------------------------------------------------------------------------


def _storage_name(dtype: torch.dtype) -> str:
    if dtype not in _STORAGE_DTYPES:
        raise TypeError(f"moeblaze: unsupported dtype {dtype}; use one of "
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


def _ptr(tensor: Optional[torch.Tensor]) -> Optional[int]:
    return None if tensor is None else tensor.data_ptr()


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


def _check(tensor: torch.Tensor, name: str, shape, dtype: torch.dtype, device: torch.device):
    if tensor.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {tensor.dtype}")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name}: expected device {device}, got {tensor.device}")


def _claim_saved(ctx) -> None:
    """A backward that consumes the saved buffer may run once per forward: with retain_graph=True
    a second one would read overwritten activations, so it raises instead of returning wrong
    gradients."""
    if ctx.flags & _lib.BACKWARD_CONSUME_SAVED:
        if getattr(ctx, "consumed", False):
            raise RuntimeError(
                "moeblaze: this layer's saved activations were consumed by an earlier backward "
                "(consume_saved=True, the default); to backpropagate through the same graph "
                "twice (retain_graph=True), call it with consume_saved=False")
        ctx.consumed = True


# ------------------------------------------------------------------------------------------------
# Experts: given ids and g
# ------------------------------------------------------------------------------------------------


class _ExpertsFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, ids, g, w_gate, w_up, w_down, layer, consume_saved):
        T = x.shape[0]
        device = x.device
        x, ids, g, w_gate, w_up, w_down = map(_ready, (x, ids, g, w_gate, w_up, w_down))
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        training = any(ctx.needs_input_grad)
        saved_size = layer.saved_size(_lib.PASS_EXPERTS_FORWARD, T) if training else 0
        saved = _bytes(device, saved_size) if training else None
        # A training forward writes its indices (and u under save_all) into `saved`.
        workspace_size = layer.workspace_size(_lib.PASS_EXPERTS_FORWARD, T,
                                              _lib.FORWARD_WITH_SAVED if training else 0)
        workspace = _bytes(device, workspace_size)
        args = _lib.ForwardArgs.create()
        args.num_tokens = T
        args.x, args.ids, args.g = _ptr(x), _ptr(ids), _ptr(g)
        args.w_gate, args.w_up, args.w_down = _ptr(w_gate), _ptr(w_up), _ptr(w_down)
        args.y = _ptr(y)
        args.saved, args.saved_bytes = _ptr(saved), saved_size
        args.workspace, args.workspace_bytes = _ptr(workspace), workspace_size
        with _DeviceScope(device) as stream:
            layer._lib.moeblaze_experts_forward(layer.handle, ctypes.byref(args), stream)
        if training:
            ctx.layer = layer
            ctx.saved_size = saved_size
            ctx.flags = _lib.BACKWARD_CONSUME_SAVED if consume_saved else 0
            ctx.save_for_backward(x, ids, g, w_gate, w_up, w_down, saved)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, ids, g, w_gate, w_up, w_down, saved = ctx.saved_tensors
        _claim_saved(ctx)
        layer = ctx.layer
        need_x, _, need_g, need_gate, need_up, need_down, _, _ = ctx.needs_input_grad
        T = x.shape[0]
        dy = _ready(dy.to(x.dtype))
        dx = torch.empty_like(x) if need_x else None
        dg = torch.empty_like(g) if need_g else None
        dw_gate = torch.empty_like(w_gate) if need_gate else None
        dw_up = torch.empty_like(w_up) if need_up and w_up is not None else None
        dw_down = torch.empty_like(w_down) if need_down else None
        workspace_size = layer.workspace_size(_lib.PASS_EXPERTS_BACKWARD, T, ctx.flags)
        workspace = _bytes(x.device, workspace_size)
        args = _lib.BackwardArgs.create()
        args.flags = ctx.flags
        args.num_tokens = T
        args.dy, args.x, args.ids, args.g = _ptr(dy), _ptr(x), _ptr(ids), _ptr(g)
        args.w_gate, args.w_up, args.w_down = _ptr(w_gate), _ptr(w_up), _ptr(w_down)
        args.saved, args.saved_bytes = _ptr(saved), ctx.saved_size
        args.dx, args.dg = _ptr(dx), _ptr(dg)
        args.dw_gate, args.dw_up, args.dw_down = _ptr(dw_gate), _ptr(dw_up), _ptr(dw_down)
        args.workspace, args.workspace_bytes = _ptr(workspace), workspace_size
        with _DeviceScope(x.device) as stream:
            layer._lib.moeblaze_experts_backward(layer.handle, ctypes.byref(args), stream)
        return dx, None, dg, dw_gate, dw_up, dw_down, None, None


def moe_experts(x: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, w_gate: torch.Tensor,
                w_up: Optional[torch.Tensor], w_down: torch.Tensor, *, activation: str = "swiglu",
                checkpoint: str = "save_preact", consume_saved: bool = True) -> torch.Tensor:
    """y[t] = sum_j g[t,j] * expert_{ids[t,j]}(x[t]), differentiable in x, g and the weights.

    x [T,d] (float32/bfloat16/float16/float64), ids [T,k] int32, g [T,k] in the routing dtype
    (float64 for float64 x, else float32), w_gate/w_up [E,h,d], w_down [E,d,h]; w_up is None for
    non-gated activations.

    consume_saved: the backward writes its activation gradients over the saved activations
    (MOEBLAZE_BACKWARD_CONSUME_SAVED), which lowers the backward's peak memory by their size and
    gives the same gradients bit for bit. The graph can then be backpropagated once only: a second
    backward through it (retain_graph=True) raises; pass False to allow it."""
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, d_model], got shape {list(x.shape)}")
    if ids.dim() != 2 or w_gate.dim() != 3:
        raise ValueError("ids must be [T, k] and w_gate [E, d_ffn, d_model]")
    T, d = x.shape
    k = ids.shape[1]
    E, h = w_gate.shape[0], w_gate.shape[1]
    device = x.device
    activation = activation.lower()
    gated = activation in _lib.GATED_ACTIVATIONS
    _check(ids, "ids", (T, k), torch.int32, device)
    _check(g, "g", (T, k), routing_dtype(x.dtype), device)
    _check(w_gate, "w_gate", (E, h, d), x.dtype, device)
    _check(w_down, "w_down", (E, d, h), x.dtype, device)
    if gated:
        if w_up is None:
            raise ValueError(f"w_up is required for the gated activation {activation!r}")
        _check(w_up, "w_up", (E, h, d), x.dtype, device)
    elif w_up is not None:
        raise ValueError(f"w_up must be None for the non-gated activation {activation!r}")
    layer = get_layer(device, d_model=d, d_ffn=h, num_experts=E, top_k=k, activation=activation,
                      dtype=_storage_name(x.dtype), checkpoint=checkpoint.lower())
    return _ExpertsFunction.apply(x, ids, g, w_gate, w_up, w_down, layer, bool(consume_saved))


# ------------------------------------------------------------------------------------------------
# Whole layer
# ------------------------------------------------------------------------------------------------


class _LayerFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, w_router, w_gate, w_up, w_down, layer, consume_saved):
        T, d = x.shape
        E, k = layer.num_experts, layer.top_k
        device = x.device
        x, w_router, w_gate, w_up, w_down = map(_ready, (x, w_router, w_gate, w_up, w_down))
        route_dtype = routing_dtype(x.dtype)
        y = torch.empty((T, d), dtype=x.dtype, device=device)
        losses = torch.empty(2, dtype=route_dtype, device=device)
        counts = torch.empty(E, dtype=torch.int32, device=device)
        ids = torch.empty((T, k), dtype=torch.int32, device=device)
        g = torch.empty((T, k), dtype=route_dtype, device=device)
        training = any(ctx.needs_input_grad)
        saved_size = layer.saved_size(_lib.PASS_LAYER_FORWARD, T) if training else 0
        saved = _bytes(device, saved_size) if training else None
        workspace_size = layer.workspace_size(_lib.PASS_LAYER_FORWARD, T,
                                              _lib.FORWARD_WITH_SAVED if training else 0)
        workspace = _bytes(device, workspace_size)
        args = _lib.ForwardArgs.create()
        args.num_tokens = T
        args.x, args.w_router = _ptr(x), _ptr(w_router)
        args.w_gate, args.w_up, args.w_down = _ptr(w_gate), _ptr(w_up), _ptr(w_down)
        args.y, args.losses, args.expert_counts = _ptr(y), _ptr(losses), _ptr(counts)
        args.ids_out, args.g_out = _ptr(ids), _ptr(g)
        args.saved, args.saved_bytes = _ptr(saved), saved_size
        args.workspace, args.workspace_bytes = _ptr(workspace), workspace_size
        with _DeviceScope(device) as stream:
            layer._lib.moeblaze_layer_forward(layer.handle, ctypes.byref(args), stream)
        ctx.mark_non_differentiable(counts, ids, g)
        if training:
            ctx.layer = layer
            ctx.saved_size = saved_size
            ctx.flags = _lib.BACKWARD_CONSUME_SAVED if consume_saved else 0
            ctx.save_for_backward(x, w_router, w_gate, w_up, w_down, saved)
        return y, losses, counts, ids, g

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, d_losses, _d_counts, _d_ids, _d_g):
        x, w_router, w_gate, w_up, w_down, saved = ctx.saved_tensors
        _claim_saved(ctx)
        layer = ctx.layer
        need_x, need_router, need_gate, need_up, need_down, _, _ = ctx.needs_input_grad
        T = x.shape[0]
        dy = _ready(dy.to(x.dtype))
        d_losses = _ready(d_losses.to(routing_dtype(x.dtype)))
        dx = torch.empty_like(x) if need_x else None
        dw_router = torch.empty_like(w_router) if need_router else None
        dw_gate = torch.empty_like(w_gate) if need_gate else None
        dw_up = torch.empty_like(w_up) if need_up and w_up is not None else None
        dw_down = torch.empty_like(w_down) if need_down else None
        workspace_size = layer.workspace_size(_lib.PASS_LAYER_BACKWARD, T, ctx.flags)
        workspace = _bytes(x.device, workspace_size)
        args = _lib.BackwardArgs.create()
        args.flags = ctx.flags
        args.num_tokens = T
        args.dy, args.d_losses, args.x, args.w_router = _ptr(dy), _ptr(d_losses), _ptr(x), \
            _ptr(w_router)
        args.w_gate, args.w_up, args.w_down = _ptr(w_gate), _ptr(w_up), _ptr(w_down)
        args.saved, args.saved_bytes = _ptr(saved), ctx.saved_size
        args.dx, args.dw_router = _ptr(dx), _ptr(dw_router)
        args.dw_gate, args.dw_up, args.dw_down = _ptr(dw_gate), _ptr(dw_up), _ptr(dw_down)
        args.workspace, args.workspace_bytes = _ptr(workspace), workspace_size
        with _DeviceScope(x.device) as stream:
            layer._lib.moeblaze_layer_backward(layer.handle, ctypes.byref(args), stream)
        return dx, dw_router, dw_gate, dw_up, dw_down, None, None


def moe_layer(x: torch.Tensor, w_router: torch.Tensor, w_gate: torch.Tensor,
              w_up: Optional[torch.Tensor], w_down: torch.Tensor, *, top_k: int,
              activation: str = "swiglu", checkpoint: str = "save_preact",
              score_function: str = "softmax_topk", renormalize: bool = False,
              aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
              consume_saved: bool = True):
    """The whole layer (router + experts), differentiable in x and every weight.

    Returns (y [T,d], losses [2] = (aux, z) in the routing dtype, expert_counts [E] int32,
    ids [T,k] int32, g [T,k]). consume_saved: as in moe_experts()."""
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, d_model], got shape {list(x.shape)}")
    T, d = x.shape
    E, h = w_gate.shape[0], w_gate.shape[1]
    device = x.device
    activation = activation.lower()
    _check(w_router, "w_router", (E, d), x.dtype, device)
    _check(w_gate, "w_gate", (E, h, d), x.dtype, device)
    _check(w_down, "w_down", (E, d, h), x.dtype, device)
    if activation in _lib.GATED_ACTIVATIONS:
        if w_up is None:
            raise ValueError(f"w_up is required for the gated activation {activation!r}")
        _check(w_up, "w_up", (E, h, d), x.dtype, device)
    elif w_up is not None:
        raise ValueError(f"w_up must be None for the non-gated activation {activation!r}")
    layer = get_layer(device, d_model=d, d_ffn=h, num_experts=E, top_k=int(top_k),
                      activation=activation, dtype=_storage_name(x.dtype),
                      checkpoint=checkpoint.lower(), score_function=score_function.lower(),
                      renormalize=bool(renormalize), aux_loss_coeff=float(aux_loss_coeff),
                      z_loss_coeff=float(z_loss_coeff))
    return _LayerFunction.apply(x, w_router, w_gate, w_up, w_down, layer, bool(consume_saved))


def _init_moe_module(module: torch.nn.Module, d_model: int, d_ffn: int, num_experts: int,
                     top_k: int, num_local_experts: int, activation: str, checkpoint: str,
                     score_function: str, renormalize: bool, aux_loss_coeff: float,
                     z_loss_coeff: float, dtype, device) -> None:
    """The settings and (uninitialised) parameters shared by MoE and the expert-parallel layer:
    the router weight over all `num_experts`, expert weights for `num_local_experts` of them."""
    factory = {"dtype": dtype, "device": device}
    module.d_model, module.d_ffn = d_model, d_ffn
    module.num_experts, module.top_k = num_experts, top_k
    module.activation = activation.lower()
    if module.activation not in _lib.ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}")
    module.checkpoint = checkpoint
    module.score_function = score_function
    module.renormalize = renormalize
    module.aux_loss_coeff = aux_loss_coeff
    module.z_loss_coeff = z_loss_coeff
    local = num_local_experts
    module.w_router = torch.nn.Parameter(torch.empty(num_experts, d_model, **factory))
    module.w_gate = torch.nn.Parameter(torch.empty(local, d_ffn, d_model, **factory))
    if module.activation in _lib.GATED_ACTIVATIONS:
        module.w_up = torch.nn.Parameter(torch.empty(local, d_ffn, d_model, **factory))
    else:
        module.register_parameter("w_up", None)
    module.w_down = torch.nn.Parameter(torch.empty(local, d_model, d_ffn, **factory))
    module.last_expert_counts = None


def _reset_moe_parameters(module: torch.nn.Module) -> None:
    """nn.Linear's default (kaiming_uniform, a=sqrt(5)) is U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    with torch.no_grad():
        for weight, fan_in in ((module.w_router, module.d_model), (module.w_gate, module.d_model),
                               (module.w_up, module.d_model), (module.w_down, module.d_ffn)):
            if weight is not None:
                bound = 1.0 / math.sqrt(fan_in)
                weight.uniform_(-bound, bound)


class MoE(torch.nn.Module):
    """A token-choice MoE layer: router (no bias) + `num_experts` expert MLPs, top-k routing.

    forward(x [..., d_model]) -> (y [..., d_model], aux_loss, z_loss). The losses are already scaled
    by their coefficients (0 when a coefficient is 0); add them to the training objective.

    With `process_group=pg` the layer is expert parallel: `MoE(...)` returns a
    `moeblaze.distributed.ExpertParallelMoE` whose experts are split contiguously over the ranks
    of `pg` and whose tokens travel to them through torch.distributed.

    `consume_saved=True` (the default): the backward writes its activation gradients over the
    saved activations, lowering the peak memory by their size, with the same gradients; a second
    backward through the same graph (retain_graph=True, gradcheck) then raises: pass False."""

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
        self.consume_saved = consume_saved  # see moe_experts()
        _init_moe_module(self, d_model, d_ffn, num_experts, top_k, num_experts, activation,
                         checkpoint, score_function, renormalize, aux_loss_coeff, z_loss_coeff,
                         dtype, device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_moe_parameters(self)

    def forward(self, x: torch.Tensor):
        shape = x.shape
        y, losses, counts, _, _ = moe_layer(
            x.reshape(-1, self.d_model), self.w_router, self.w_gate, self.w_up, self.w_down,
            top_k=self.top_k, activation=self.activation, checkpoint=self.checkpoint,
            score_function=self.score_function, renormalize=self.renormalize,
            aux_loss_coeff=self.aux_loss_coeff, z_loss_coeff=self.z_loss_coeff,
            consume_saved=self.consume_saved)
        self.last_expert_counts = counts
        return y.reshape(shape), losses[0], losses[1]

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ffn={self.d_ffn}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, activation={self.activation!r}, "
                f"checkpoint={self.checkpoint!r}")
