"""Drive libmoeblaze.so straight through ctypes (no moeblaze package): the C API step by step.

    python3 examples/python/ctypes_direct.py       # after `pip install ./bindings/python`
    MOEBLAZE_LIBRARY=build/src/libmoeblaze.so python3 examples/python/ctypes_direct.py

The library is looked up in order: $MOEBLAZE_LIBRARY, the installed `moeblaze` package's folder
(located without importing it), a build tree of this checkout (build*/src), then the dynamic
linker's path (libmoeblaze.so.0).

Declares the two argument structs and the few functions it uses, then trains the experts of an
MoE layer (fixed routing: moeblaze_experts_forward / moeblaze_experts_backward) to imitate a
random teacher with SGD. Needs only numpy. Exits non-zero if the loss did not fall.
"""

import ctypes
import glob
import importlib.util
import os
import sys

import numpy as np


def find_library():
    """The first libmoeblaze of: $MOEBLAZE_LIBRARY, the installed package, this checkout's build."""
    if os.environ.get("MOEBLAZE_LIBRARY"):
        return os.environ["MOEBLAZE_LIBRARY"]
    spec = importlib.util.find_spec("moeblaze")  # finds the package, does not import it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = os.path.join(folder, "libmoeblaze.so.0")
        if os.path.exists(candidate):
            return candidate
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    builds = sorted(glob.glob(os.path.join(checkout, "build*", "src", "libmoeblaze.so.0")),
                    key=os.path.getmtime, reverse=True)
    return builds[0] if builds else "libmoeblaze.so.0"


LIBRARY = find_library()
lib = ctypes.CDLL(LIBRARY)

P = ctypes.c_void_p
status_t = ctypes.c_int32


class LayerConfig(ctypes.Structure):  # moeblaze_layer_config_t
    _fields_ = [("struct_size", ctypes.c_uint32), ("dtype", ctypes.c_int32),
                ("d_model", ctypes.c_int64), ("d_ffn", ctypes.c_int64),
                ("num_experts", ctypes.c_int64), ("top_k", ctypes.c_int64),
                ("activation", ctypes.c_int32), ("checkpoint", ctypes.c_int32),
                ("score_function", ctypes.c_int32), ("renormalize", ctypes.c_int32),
                ("aux_loss_coeff", ctypes.c_float), ("z_loss_coeff", ctypes.c_float),
                ("deterministic", ctypes.c_int32), ("reserved0", ctypes.c_int32)]


class ForwardArgs(ctypes.Structure):  # moeblaze_forward_args_t
    _fields_ = [("struct_size", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("num_tokens", ctypes.c_int64)] + [(name, P) for name in (
                    "x", "w_router", "w_gate", "w_up", "w_down", "ids", "g", "y", "logits_out",
                    "ids_out", "g_out", "expert_counts", "losses", "saved")] + [
                ("saved_bytes", ctypes.c_size_t), ("workspace", P),
                ("workspace_bytes", ctypes.c_size_t)]


class BackwardArgs(ctypes.Structure):  # moeblaze_backward_args_t
    _fields_ = [("struct_size", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("num_tokens", ctypes.c_int64)] + [(name, P) for name in (
                    "dy", "d_losses", "x", "w_router", "w_gate", "w_up", "w_down", "ids", "g",
                    "saved")] + [("saved_bytes", ctypes.c_size_t)] + [(name, P) for name in (
                        "dx", "dw_router", "dw_gate", "dw_up", "dw_down", "dg", "d_logits",
                        "workspace")] + [("workspace_bytes", ctypes.c_size_t)]


def declare(name, restype, *argtypes):
    function = getattr(lib, name)
    function.restype, function.argtypes = restype, list(argtypes)
    return function


last_error = declare("moeblaze_last_error", ctypes.c_char_p)


def checked(name, *argtypes):
    function = declare(name, status_t, *argtypes)

    def call(*args):
        status = function(*args)
        if status != 0:
            raise RuntimeError(f"{name} failed ({status}): {last_error().decode()}")
    return call


config_init = checked("moeblaze_layer_config_init", ctypes.POINTER(LayerConfig), ctypes.c_size_t)
context_create = checked("moeblaze_context_create", ctypes.POINTER(P), ctypes.c_int32,
                         ctypes.c_int32)
context_destroy = checked("moeblaze_context_destroy", P)
layer_create = checked("moeblaze_layer_create", ctypes.POINTER(P), P, ctypes.POINTER(LayerConfig))
layer_destroy = checked("moeblaze_layer_destroy", P)
workspace_size = checked("moeblaze_layer_workspace_size", P, ctypes.c_int32, ctypes.c_int64,
                         ctypes.POINTER(ctypes.c_size_t))
saved_size = checked("moeblaze_layer_saved_size", P, ctypes.c_int32, ctypes.c_int64,
                     ctypes.POINTER(ctypes.c_size_t))
forward_args_init = checked("moeblaze_forward_args_init", ctypes.POINTER(ForwardArgs),
                            ctypes.c_size_t)
backward_args_init = checked("moeblaze_backward_args_init", ctypes.POINTER(BackwardArgs),
                             ctypes.c_size_t)
experts_forward = checked("moeblaze_experts_forward", P, ctypes.POINTER(ForwardArgs), P)
experts_backward = checked("moeblaze_experts_backward", P, ctypes.POINTER(BackwardArgs), P)

BACKEND_CPU, DTYPE_F32, PASS_EXPERTS_FORWARD, PASS_EXPERTS_BACKWARD = 1, 0, 3, 4
D, H, E, K, T = 16, 32, 4, 2, 256


def aligned_bytes(size):
    """Workspace and saved buffers must be 16-byte aligned."""
    raw = np.empty(size + 64, np.uint8)
    offset = (-raw.ctypes.data) % 64
    return raw[offset:offset + size]


def query(function, layer, pass_code):
    size = ctypes.c_size_t()
    function(layer, pass_code, T, ctypes.byref(size))
    return size.value


def main():
    print(f"library: {LIBRARY}")
    assert lib.moeblaze_get_abi_version() == 0, "built for ABI 0"
    context, layer = P(), P()
    context_create(ctypes.byref(context), BACKEND_CPU, 0)
    config = LayerConfig()
    config_init(ctypes.byref(config), ctypes.sizeof(config))
    config.dtype, config.d_model, config.d_ffn = DTYPE_F32, D, H
    config.num_experts, config.top_k = E, K
    layer_create(ctypes.byref(layer), context, ctypes.byref(config))

    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, D)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)  # fixed routing
    g = rng.dirichlet(np.ones(K), size=T).astype(np.float32)

    def weights(scale):
        def u(shape, fan_in):
            return (rng.uniform(-scale, scale, shape) / np.sqrt(fan_in)).astype(np.float32)
        return [u((E, H, D), D), u((E, H, D), D), u((E, D, H), H)]  # w_gate, w_up, w_down

    teacher, student = weights(3.0), weights(1.0)
    saved = aligned_bytes(query(saved_size, layer, PASS_EXPERTS_FORWARD))
    fwd_ws = aligned_bytes(query(workspace_size, layer, PASS_EXPERTS_FORWARD))
    bwd_ws = aligned_bytes(query(workspace_size, layer, PASS_EXPERTS_BACKWARD))

    def forward(w, y, keep_saved):
        args = ForwardArgs()
        forward_args_init(ctypes.byref(args), ctypes.sizeof(args))
        args.num_tokens = T
        args.x, args.ids, args.g = x.ctypes.data, ids.ctypes.data, g.ctypes.data
        args.w_gate, args.w_up, args.w_down = (a.ctypes.data for a in w)
        args.y = y.ctypes.data
        if keep_saved:
            args.saved, args.saved_bytes = saved.ctypes.data, saved.nbytes
        args.workspace, args.workspace_bytes = fwd_ws.ctypes.data, fwd_ws.nbytes
        experts_forward(layer, ctypes.byref(args), None)

    target = np.empty((T, D), np.float32)
    forward(teacher, target, keep_saved=False)
    y = np.empty((T, D), np.float32)
    grads = [np.empty_like(w) for w in student]
    losses, lr = [], 2.0
    for step in range(150):
        forward(student, y, keep_saved=True)
        error = y - target
        losses.append(float(np.mean(error ** 2)))
        dy = ((2.0 / error.size) * error).astype(np.float32)
        args = BackwardArgs()
        backward_args_init(ctypes.byref(args), ctypes.sizeof(args))
        args.num_tokens = T
        args.dy, args.x, args.ids, args.g = dy.ctypes.data, x.ctypes.data, ids.ctypes.data, \
            g.ctypes.data
        args.w_gate, args.w_up, args.w_down = (a.ctypes.data for a in student)
        args.saved, args.saved_bytes = saved.ctypes.data, saved.nbytes
        args.dw_gate, args.dw_up, args.dw_down = (a.ctypes.data for a in grads)  # dx, dg: NULL
        args.workspace, args.workspace_bytes = bwd_ws.ctypes.data, bwd_ws.nbytes
        experts_backward(layer, ctypes.byref(args), None)
        for w, dw in zip(student, grads):
            w -= lr * dw
        if step % 25 == 0 or step == 149:
            print(f"step {step:4d}  mse {losses[-1]:.6f}")

    layer_destroy(layer)
    context_destroy(context)
    ratio = losses[-1] / losses[0]
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f} ({ratio:.3f} of the initial loss)")
    return 0 if ratio < 0.5 else 1


if __name__ == "__main__":
    sys.exit(main())
