"""Framework-neutral execute calls on DLPack tensors (numpy, torch, CuPy, JAX, ...).

The caller provides every tensor, outputs and the workspace/saved buffers included (uint8
tensors of at least the queried sizes), on the layer's device; moeblaze reads their DLPack
descriptions (legacy `dltensor` capsules, which every producer supports) without taking ownership:
the capsules are kept alive for the call and then released normally. Tensors must be dense and
row-major. `stream` is the consumer stream handed to `__dlpack__` (CUDA: an int cudaStream_t;
producers make the data ready on it) and to moeblaze.

    from moeblaze import dlpack
    ws = torch.empty(layer.workspace_size(PASS_LAYER_FORWARD, T), dtype=torch.uint8, device=dev)
    dlpack.layer_forward(layer, x=x, w_router=wr, w_gate=wg, w_up=wu, w_down=wd, y=y,
                         workspace=ws, stream=torch.cuda.current_stream().cuda_stream)
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional, Tuple

from . import _lib

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13
KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT = 0, 1, 2, 4


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

# moeblaze dtype code -> (DLPack code, bits)
_STORAGE = {_lib.DTYPE_F32: (KDL_FLOAT, 32), _lib.DTYPE_BF16: (KDL_BFLOAT, 16),
            _lib.DTYPE_F16: (KDL_FLOAT, 16), _lib.DTYPE_F64: (KDL_FLOAT, 64)}


@dataclass
class TensorView:
    """A borrowed view of a DLPack tensor; valid while `capsule` (kept here) lives."""
    pointer: int
    device_type: int
    device_id: int
    dtype: Tuple[int, int]
    shape: Tuple[int, ...]
    nbytes: int
    capsule: object


def view(tensor, stream: Optional[int] = None, name: str = "tensor") -> TensorView:
    """Reads a tensor's DLPack description (without consuming it) and checks it is dense."""
    if hasattr(tensor, "__dlpack__"):
        if stream is None:
            capsule = tensor.__dlpack__()
        else:
            # DLPack forbids 0 for CUDA (ambiguous): 1 names the legacy default stream, which is
            # what a NULL cudaStream_t (torch's default stream handle, 0) means to moeblaze.
            capsule = tensor.__dlpack__(stream=1 if stream == 0 else stream)
    elif type(tensor).__name__ == "PyCapsule":
        capsule = tensor  # already a capsule
    else:
        raise TypeError(f"{name}: expected a DLPack tensor (an object with __dlpack__, or a "
                        f"'dltensor' capsule), got {type(tensor).__name__}")
    address = _get_pointer(capsule, b"dltensor")
    managed = DLManagedTensor.from_address(address)
    t = managed.dl_tensor
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.dtype.lanes != 1:
        raise ValueError(f"{name}: vector dtypes are not supported")
    if t.strides:
        expected = 1
        for axis in reversed(range(t.ndim)):
            if shape[axis] != 1 and t.strides[axis] != expected:
                raise ValueError(f"{name}: must be dense and row-major (strides "
                                 f"{[t.strides[i] for i in range(t.ndim)]})")
            expected *= shape[axis]
    count = 1
    for extent in shape:
        count *= extent
    pointer = (t.data or 0) + t.byte_offset
    return TensorView(pointer=pointer, device_type=t.device.device_type,
                      device_id=t.device.device_id, dtype=(t.dtype.code, t.dtype.bits),
                      shape=shape, nbytes=count * t.dtype.bits // 8, capsule=capsule)


class _Binder:
    """Collects views for one call and checks device, dtype and shape against the layer."""

    def __init__(self, layer, stream):
        self.layer, self.stream, self.views = layer, stream, []
        backend = layer.context.backend
        self.device_types = {KDL_CPU, KDL_CUDA_HOST} if backend == _lib.BACKEND_CPU else \
            {KDL_CUDA, KDL_CUDA_MANAGED}
        self.device_id = layer.context.device

    def __call__(self, tensor, name, shape=None, dtype=None, min_bytes=None) -> Optional[int]:
        if tensor is None:
            return None
        v = view(tensor, self.stream, name)
        self.views.append(v)  # keep the capsule alive until the call returns
        if v.device_type not in self.device_types or (
                v.device_type in (KDL_CUDA, KDL_CUDA_MANAGED) and v.device_id != self.device_id):
            raise ValueError(f"{name}: on DLPack device ({v.device_type}, {v.device_id}), not on "
                             f"the layer's device")
        if dtype is not None and v.dtype != dtype:
            raise TypeError(f"{name}: DLPack dtype (code, bits) = {v.dtype}, expected {dtype}")
        if shape is not None and v.shape != tuple(shape):
            raise ValueError(f"{name}: shape {list(v.shape)}, expected {list(shape)}")
        if min_bytes is not None and v.nbytes < min_bytes:
            raise ValueError(f"{name}: {v.nbytes} bytes, at least {min_bytes} needed")
        return v.pointer


def _num_tokens(x, stream) -> int:
    """T of x, which must be a 2-D [T, d_model] DLPack tensor."""
    shape = view(x, stream, "x").shape
    if len(shape) != 2:
        raise ValueError(f"x: expected a 2-D [T, d_model] tensor, got shape {list(shape)}")
    return shape[0]


def _layer_types(layer):
    storage = _STORAGE[layer.config.dtype]
    routing = (KDL_FLOAT, 64) if layer.config.dtype == _lib.DTYPE_F64 else (KDL_FLOAT, 32)
    return storage, routing, (KDL_INT, 32), (KDL_UINT, 8)


def layer_forward(layer, *, x, w_router, w_gate, w_up, w_down, y, workspace=None, saved=None,
                  logits_out=None, ids_out=None, g_out=None, expert_counts=None, losses=None,
                  stream: Optional[int] = None) -> None:
    """moeblaze_layer_forward on DLPack tensors. `saved` None = inference. `workspace`: at least
    layer.workspace_size(PASS_LAYER_FORWARD, T) bytes, or with `saved` (training) at least
    layer.workspace_size(PASS_LAYER_FORWARD, T, FORWARD_WITH_SAVED), which is smaller."""
    storage, routing, i32, u8 = _layer_types(layer)
    bind = _Binder(layer, stream)
    T = _num_tokens(x, stream)
    E, k, d, h = layer.num_experts, layer.top_k, layer.d_model, layer.d_ffn
    args = _lib.ForwardArgs.create()
    args.num_tokens = T
    args.x = bind(x, "x", (T, d), storage)
    args.w_router = bind(w_router, "w_router", (E, d), storage)
    args.w_gate = bind(w_gate, "w_gate", (E, h, d), storage)
    args.w_up = bind(w_up if layer.gated else None, "w_up", (E, h, d), storage)
    args.w_down = bind(w_down, "w_down", (E, d, h), storage)
    args.y = bind(y, "y", (T, d), storage)
    args.logits_out = bind(logits_out, "logits_out", (T, E), routing)
    args.ids_out = bind(ids_out, "ids_out", (T, k), i32)
    args.g_out = bind(g_out, "g_out", (T, k), routing)
    args.expert_counts = bind(expert_counts, "expert_counts", (E,), i32)
    args.losses = bind(losses, "losses", (2,), routing)
    saved_bytes = layer.saved_size(_lib.PASS_LAYER_FORWARD, T) if saved is not None else 0
    args.saved, args.saved_bytes = bind(saved, "saved", None, u8, saved_bytes), saved_bytes
    # Training (a saved buffer) needs only the FORWARD_WITH_SAVED size; a larger buffer is fine.
    ws_flags = _lib.FORWARD_WITH_SAVED if saved is not None else 0
    ws_bytes = layer.workspace_size(_lib.PASS_LAYER_FORWARD, T, ws_flags)
    args.workspace = bind(workspace, "workspace", None, u8, ws_bytes)
    args.workspace_bytes = ws_bytes
    layer._lib.moeblaze_layer_forward(layer.handle, ctypes.byref(args), stream)


def layer_backward(layer, *, saved, dy, x, w_router, w_gate, w_up, w_down, workspace=None,
                   dx=None, dw_router=None, dw_gate=None, dw_up=None, dw_down=None,
                   d_logits=None, d_losses=None, accumulate: bool = False,
                   consume_saved: bool = False, stream: Optional[int] = None) -> None:
    """moeblaze_layer_backward on DLPack tensors; gradient outputs left None are skipped.

    consume_saved: sets MOEBLAZE_BACKWARD_CONSUME_SAVED: the backward may overwrite `saved`, which
    is then good for no further backward, and needs only
    layer.workspace_size(PASS_LAYER_BACKWARD, T, BACKWARD_CONSUME_SAVED) bytes of workspace."""
    storage, routing, _, u8 = _layer_types(layer)
    bind = _Binder(layer, stream)
    T = _num_tokens(x, stream)
    E, d, h = layer.num_experts, layer.d_model, layer.d_ffn
    gated = layer.gated
    args = _lib.BackwardArgs.create()
    args.flags = (_lib.BACKWARD_ACCUMULATE_WGRAD if accumulate else 0) | (
        _lib.BACKWARD_CONSUME_SAVED if consume_saved else 0)
    args.num_tokens = T
    args.dy = bind(dy, "dy", (T, d), storage)
    args.d_losses = bind(d_losses, "d_losses", (2,), routing)
    args.x = bind(x, "x", (T, d), storage)
    args.w_router = bind(w_router, "w_router", (E, d), storage)
    args.w_gate = bind(w_gate, "w_gate", (E, h, d), storage)
    args.w_up = bind(w_up if gated else None, "w_up", (E, h, d), storage)
    args.w_down = bind(w_down, "w_down", (E, d, h), storage)
    saved_bytes = layer.saved_size(_lib.PASS_LAYER_FORWARD, T)
    args.saved, args.saved_bytes = bind(saved, "saved", None, u8, saved_bytes), saved_bytes
    args.dx = bind(dx, "dx", (T, d), storage)
    args.dw_router = bind(dw_router, "dw_router", (E, d), storage)
    args.dw_gate = bind(dw_gate, "dw_gate", (E, h, d), storage)
    args.dw_up = bind(dw_up if gated else None, "dw_up", (E, h, d), storage)
    args.dw_down = bind(dw_down, "dw_down", (E, d, h), storage)
    args.d_logits = bind(d_logits, "d_logits", (T, E), routing)
    ws_bytes = layer.workspace_size(_lib.PASS_LAYER_BACKWARD, T, args.flags)
    args.workspace = bind(workspace, "workspace", None, u8, ws_bytes)
    args.workspace_bytes = ws_bytes
    layer._lib.moeblaze_layer_backward(layer.handle, ctypes.byref(args), stream)
