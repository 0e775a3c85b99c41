"""ctypes view of libmoeblaze: loader, ABI check, struct mirrors, signatures and error mapping.

Everything here mirrors include/moeblaze.h one to one; the idiomatic layers (moeblaze.numpy,
moeblaze.torch) build on it. ctypes (not SWIG) is the framework path because one pure-Python
package then serves every CPython version (SWIG 4.1 modules are tied to one Python minor).
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from pathlib import Path
from typing import Type, TypeVar

from . import _args

# ------------------------------------------------------------------------------------------------
# Constants (values frozen by the header; bindings/python/tests/test_layout.py checks them against it)
# ------------------------------------------------------------------------------------------------

EXPECTED_ABI_VERSION = 0  # MOEBLAZE_ABI_VERSION of the header these bindings mirror

OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_INVALID_HANDLE = 2
ERR_NOT_SUPPORTED = 3
ERR_INSUFFICIENT_WORKSPACE = 4
ERR_OUT_OF_MEMORY = 5
ERR_CUDA = 6
ERR_VERSION_MISMATCH = 7
ERR_NON_FINITE = 8
ERR_INTERNAL = 99

BACKEND_CPU = 1
BACKEND_CUDA = 2

DTYPE_F32 = 0
DTYPE_BF16 = 1
DTYPE_F16 = 2
DTYPE_F64 = 3

ACTIVATION_SWIGLU = 0
ACTIVATION_GEGLU = 1
ACTIVATION_REGLU = 2
ACTIVATION_SILU = 3
ACTIVATION_GELU = 4
ACTIVATION_RELU = 5
ACTIVATION_RELU2 = 6

CHECKPOINT_SAVE_ALL = 0
CHECKPOINT_SAVE_PREACT = 1
CHECKPOINT_RECOMPUTE = 2

SCORE_SOFTMAX_TOPK = 0
SCORE_TOPK_SOFTMAX = 1
SCORE_SIGMOID = 2

PASS_ROUTER_FORWARD = 0
PASS_ROUTER_BACKWARD = 1
PASS_ROUTING_BUILD = 2
PASS_EXPERTS_FORWARD = 3
PASS_EXPERTS_BACKWARD = 4
PASS_LAYER_FORWARD = 5
PASS_LAYER_BACKWARD = 6

# Expert parallelism (moeblaze_ep_*)
EP_TRANSPORT_NCCL = 1
EP_TRANSPORT_LOCAL = 2
EP_PASS_FORWARD_BEGIN = 0
EP_PASS_FORWARD_FINISH = 1
EP_PASS_BACKWARD = 2
EP_SAVED_HOME = 0
EP_SAVED_EXPERT = 1

MAX_EXPERTS = 1024
MAX_TOP_K = 32
MAX_ROUTED_ROWS = 1 << 31  # num_tokens * top_k stays below it: routing indices are int32
BACKWARD_ACCUMULATE_WGRAD = 1
BACKWARD_CONSUME_SAVED = 2
FORWARD_WITH_SAVED = 4

ACTIVATIONS = {
    "swiglu": ACTIVATION_SWIGLU,
    "geglu": ACTIVATION_GEGLU,
    "reglu": ACTIVATION_REGLU,
    "silu": ACTIVATION_SILU,
    "gelu": ACTIVATION_GELU,
    "relu": ACTIVATION_RELU,
    "relu2": ACTIVATION_RELU2,
}
GATED_ACTIVATIONS = frozenset({"swiglu", "geglu", "reglu"})
CHECKPOINTS = {
    "save_all": CHECKPOINT_SAVE_ALL,
    "save_preact": CHECKPOINT_SAVE_PREACT,
    "recompute": CHECKPOINT_RECOMPUTE,
}
SCORE_FUNCTIONS = {
    "softmax_topk": SCORE_SOFTMAX_TOPK,
    "topk_softmax": SCORE_TOPK_SOFTMAX,
    "sigmoid": SCORE_SIGMOID,
}
DTYPES = {"float32": DTYPE_F32, "bfloat16": DTYPE_BF16, "float16": DTYPE_F16, "float64": DTYPE_F64}
BACKENDS = {"cpu": BACKEND_CPU, "cuda": BACKEND_CUDA}


def lookup(table: dict, name, what: str) -> int:
    """Maps a case-insensitive name (or an already numeric code) through `table`."""
    if isinstance(name, int) and not isinstance(name, bool):
        return _args.integer(name, what, "int32")  # the library checks that it is a known code
    key = str(name).lower()
    if key not in table:
        raise ValueError(f"unknown {what} {name!r}; expected one of {sorted(table)}")
    return table[key]


# ------------------------------------------------------------------------------------------------
# Exceptions
# ------------------------------------------------------------------------------------------------


class MoeblazeError(Exception):
    """A moeblaze call failed. `status` is the moeblaze_status_t, `message` the library's text."""

    def __init__(self, status: int, message: str, function: str = ""):
        self.status = int(status)
        self.message = message
        self.function = function
        self.status_name = _status_name(self.status)
        # The library's message already names the function and the status; keep it verbatim.
        where = f"{function}: " if function else ""
        super().__init__(message if message else f"{where}{self.status_name}")


class InvalidArgumentError(MoeblazeError, ValueError):
    """MOEBLAZE_ERR_INVALID_ARGUMENT."""


class NotSupportedError(MoeblazeError, NotImplementedError):
    """MOEBLAZE_ERR_NOT_SUPPORTED."""


class OutOfMemoryError(MoeblazeError, MemoryError):
    """MOEBLAZE_ERR_OUT_OF_MEMORY."""


class MoeblazeRuntimeError(MoeblazeError, RuntimeError):
    """Every other failure status."""


class InvalidHandleError(MoeblazeRuntimeError):
    """MOEBLAZE_ERR_INVALID_HANDLE."""


class InsufficientWorkspaceError(MoeblazeRuntimeError):
    """MOEBLAZE_ERR_INSUFFICIENT_WORKSPACE."""


class CudaError(MoeblazeRuntimeError):
    """MOEBLAZE_ERR_CUDA."""


class VersionMismatchError(MoeblazeRuntimeError):
    """MOEBLAZE_ERR_VERSION_MISMATCH (struct_size, saved buffer or library ABI)."""


class NonFiniteError(MoeblazeRuntimeError):
    """MOEBLAZE_ERR_NON_FINITE."""


class InternalError(MoeblazeRuntimeError):
    """MOEBLAZE_ERR_INTERNAL: a bug in moeblaze."""


def check_routed_rows(num_tokens: int, top_k: int) -> None:
    """The library's token-count rule (src/common/checks.hpp), worded as the library words it, for
    a binding's check that must come before any library call (before a copy of the input)."""
    if num_tokens * top_k >= MAX_ROUTED_ROWS:
        raise InvalidArgumentError(ERR_INVALID_ARGUMENT, f"num_tokens = {num_tokens} is too large: "
                                   f"num_tokens * top_k ({top_k}) must be < 2^31")


_ERROR_CLASSES = {
    ERR_INVALID_ARGUMENT: InvalidArgumentError,
    ERR_INVALID_HANDLE: InvalidHandleError,
    ERR_NOT_SUPPORTED: NotSupportedError,
    ERR_INSUFFICIENT_WORKSPACE: InsufficientWorkspaceError,
    ERR_OUT_OF_MEMORY: OutOfMemoryError,
    ERR_CUDA: CudaError,
    ERR_VERSION_MISMATCH: VersionMismatchError,
    ERR_NON_FINITE: NonFiniteError,
    ERR_INTERNAL: InternalError,
}


def error_class(status: int) -> type:
    return _ERROR_CLASSES.get(int(status), MoeblazeRuntimeError)


def _status_name(status: int) -> str:
    if _lib_instance is not None:
        return _lib_instance.moeblaze_status_name(status).decode("utf-8", "replace")
    return f"status {status}"


# ------------------------------------------------------------------------------------------------
# Struct mirrors
# ------------------------------------------------------------------------------------------------

c_void_p = ctypes.c_void_p
c_int32_p = ctypes.POINTER(ctypes.c_int32)

_FIELD_KINDS = {ctypes.c_int32: "int32", ctypes.c_uint32: "uint32", ctypes.c_int64: "int64",
                ctypes.c_size_t: "size_t", ctypes.c_float: "float", ctypes.c_void_p: "pointer"}


_Struct = TypeVar("_Struct", bound="_CheckedStructure")


class _CheckedStructure(ctypes.Structure):
    """A struct mirror whose numeric fields refuse what their C type cannot hold, naming the field:
    ctypes itself keeps the low bits of an integer that does not fit (2**64 + 8 becomes 8)."""

    def __setattr__(self, name, value):
        kind = _FIELD_KINDS.get(dict(type(self)._fields_).get(name))
        where = f"{type(self).__name__}.{name}"
        if kind == "float":
            value = _args.real(value, where)
        elif kind == "pointer":
            if value is not None and not isinstance(value, ctypes._SimpleCData):
                value = _args.integer(value, where, "size_t")
        elif kind is not None:
            value = _args.integer(value, where, kind)
        super().__setattr__(name, value)

    # The C function that fills the struct's defaults and its struct_size (each subclass names its
    # own); create() runs it, so every field starts at the header's documented default.
    _init_function = ""

    @classmethod
    def create(cls: Type[_Struct]) -> _Struct:
        value = cls()
        getattr(lib(), cls._init_function)(ctypes.byref(value), ctypes.sizeof(value))
        return value


class LayerConfig(_CheckedStructure):
    """moeblaze_layer_config_t. Construct with LayerConfig.create() (runs *_init)."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("dtype", ctypes.c_int32),
        ("d_model", ctypes.c_int64),
        ("d_ffn", ctypes.c_int64),
        ("num_experts", ctypes.c_int64),
        ("top_k", ctypes.c_int64),
        ("activation", ctypes.c_int32),
        ("checkpoint", ctypes.c_int32),
        ("score_function", ctypes.c_int32),
        ("renormalize", ctypes.c_int32),
        ("aux_loss_coeff", ctypes.c_float),
        ("z_loss_coeff", ctypes.c_float),
        ("deterministic", ctypes.c_int32),
        ("reserved0", ctypes.c_int32),
    ]

    _init_function = "moeblaze_layer_config_init"


class ForwardArgs(_CheckedStructure):
    """moeblaze_forward_args_t. Construct with ForwardArgs.create() (runs *_init)."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("num_tokens", ctypes.c_int64),
        ("x", c_void_p),
        ("w_router", c_void_p),
        ("w_gate", c_void_p),
        ("w_up", c_void_p),
        ("w_down", c_void_p),
        ("ids", c_void_p),
        ("g", c_void_p),
        ("y", c_void_p),
        ("logits_out", c_void_p),
        ("ids_out", c_void_p),
        ("g_out", c_void_p),
        ("expert_counts", c_void_p),
        ("losses", c_void_p),
        ("saved", c_void_p),
        ("saved_bytes", ctypes.c_size_t),
        ("workspace", c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
    ]

    _init_function = "moeblaze_forward_args_init"


class BackwardArgs(_CheckedStructure):
    """moeblaze_backward_args_t. Construct with BackwardArgs.create() (runs *_init)."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("num_tokens", ctypes.c_int64),
        ("dy", c_void_p),
        ("d_losses", c_void_p),
        ("x", c_void_p),
        ("w_router", c_void_p),
        ("w_gate", c_void_p),
        ("w_up", c_void_p),
        ("w_down", c_void_p),
        ("ids", c_void_p),
        ("g", c_void_p),
        ("saved", c_void_p),
        ("saved_bytes", ctypes.c_size_t),
        ("dx", c_void_p),
        ("dw_router", c_void_p),
        ("dw_gate", c_void_p),
        ("dw_up", c_void_p),
        ("dw_down", c_void_p),
        ("dg", c_void_p),
        ("d_logits", c_void_p),
        ("workspace", c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
    ]

    _init_function = "moeblaze_backward_args_init"


class EpConfig(_CheckedStructure):
    """moeblaze_ep_config_t. Construct with EpConfig.create() (runs *_init)."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("transport", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("world_size", ctypes.c_int32),
        ("communicator", c_void_p),
    ]

    _init_function = "moeblaze_ep_config_init"


class EpForwardArgs(_CheckedStructure):
    """moeblaze_ep_forward_args_t. Construct with EpForwardArgs.create() (runs *_init)."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("num_tokens", ctypes.c_int64),
        ("x", c_void_p),
        ("w_router", c_void_p),
        ("w_gate", c_void_p),
        ("w_up", c_void_p),
        ("w_down", c_void_p),
        ("y", c_void_p),
        ("logits_out", c_void_p),
        ("ids_out", c_void_p),
        ("g_out", c_void_p),
        ("expert_counts", c_void_p),
        ("losses", c_void_p),
        ("home_saved", c_void_p),
        ("home_saved_bytes", ctypes.c_size_t),
        ("expert_saved", c_void_p),
        ("expert_saved_bytes", ctypes.c_size_t),
        ("workspace", c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
    ]

    _init_function = "moeblaze_ep_forward_args_init"


class EpBackwardArgs(_CheckedStructure):
    """moeblaze_ep_backward_args_t. Construct with EpBackwardArgs.create() (runs *_init)."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("num_tokens", ctypes.c_int64),
        ("dy", c_void_p),
        ("d_losses", c_void_p),
        ("x", c_void_p),
        ("w_router", c_void_p),
        ("w_gate", c_void_p),
        ("w_up", c_void_p),
        ("w_down", c_void_p),
        ("home_saved", c_void_p),
        ("home_saved_bytes", ctypes.c_size_t),
        ("expert_saved", c_void_p),
        ("expert_saved_bytes", ctypes.c_size_t),
        ("dx", c_void_p),
        ("dw_router", c_void_p),
        ("dw_gate", c_void_p),
        ("dw_up", c_void_p),
        ("dw_down", c_void_p),
        ("dg", c_void_p),
        ("d_logits", c_void_p),
        ("workspace", c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
    ]

    _init_function = "moeblaze_ep_backward_args_init"


STRUCTS = {
    "moeblaze_layer_config_t": LayerConfig,
    "moeblaze_forward_args_t": ForwardArgs,
    "moeblaze_backward_args_t": BackwardArgs,
    "moeblaze_ep_config_t": EpConfig,
    "moeblaze_ep_forward_args_t": EpForwardArgs,
    "moeblaze_ep_backward_args_t": EpBackwardArgs,
}


class _ContextS(ctypes.Structure):
    pass


class _LayerS(ctypes.Structure):
    pass


class _EpGroupS(ctypes.Structure):
    pass


class _EpLayerS(ctypes.Structure):
    pass


context_t = ctypes.POINTER(_ContextS)
layer_t = ctypes.POINTER(_LayerS)
ep_group_t = ctypes.POINTER(_EpGroupS)
ep_layer_t = ctypes.POINTER(_EpLayerS)

# ------------------------------------------------------------------------------------------------
# Signatures
# ------------------------------------------------------------------------------------------------


class _STATUS:
    """Marks a function returning moeblaze_status_t: int32_t with the raising errcheck."""

_size_t_p = ctypes.POINTER(ctypes.c_size_t)

# name -> (restype, argtypes); _STATUS means moeblaze_status_t, checked by the raising errcheck.
SIGNATURES = {
    "moeblaze_get_version": (ctypes.c_int32, []),
    "moeblaze_get_abi_version": (ctypes.c_int32, []),
    "moeblaze_get_build_info": (ctypes.c_char_p, []),
    "moeblaze_status_name": (ctypes.c_char_p, [ctypes.c_int32]),
    "moeblaze_status_string": (ctypes.c_char_p, [ctypes.c_int32]),
    "moeblaze_last_error": (ctypes.c_char_p, []),
    "moeblaze_copy_last_error": (ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t]),
    "moeblaze_backend_available": (ctypes.c_int32, [ctypes.c_int32]),
    "moeblaze_context_create": (_STATUS, [ctypes.POINTER(context_t), ctypes.c_int32,
                                          ctypes.c_int32]),
    "moeblaze_context_destroy": (_STATUS, [context_t]),
    "moeblaze_context_get_info": (_STATUS, [context_t, c_int32_p, c_int32_p]),
    "moeblaze_context_set_num_threads": (_STATUS, [context_t, ctypes.c_int32]),
    "moeblaze_layer_config_init": (_STATUS, [ctypes.POINTER(LayerConfig), ctypes.c_size_t]),
    "moeblaze_layer_create": (_STATUS, [ctypes.POINTER(layer_t), context_t,
                                        ctypes.POINTER(LayerConfig)]),
    "moeblaze_layer_destroy": (_STATUS, [layer_t]),
    "moeblaze_layer_get_config": (_STATUS, [layer_t, ctypes.POINTER(LayerConfig)]),
    "moeblaze_layer_workspace_size": (_STATUS, [layer_t, ctypes.c_int32, ctypes.c_int64,
                                                _size_t_p]),
    "moeblaze_layer_workspace_size_with_flags": (_STATUS, [layer_t, ctypes.c_int32,
                                                           ctypes.c_int64, ctypes.c_uint32,
                                                           _size_t_p]),
    "moeblaze_layer_saved_size": (_STATUS, [layer_t, ctypes.c_int32, ctypes.c_int64, _size_t_p]),
    "moeblaze_router_forward": (_STATUS, [layer_t, ctypes.c_int64, c_void_p, c_void_p, c_void_p,
                                          c_void_p, c_void_p, c_void_p, ctypes.c_size_t,
                                          c_void_p]),
    "moeblaze_router_backward": (_STATUS, [layer_t, ctypes.c_int64, c_void_p, c_void_p, c_void_p,
                                           c_void_p, c_void_p, c_void_p, ctypes.c_size_t,
                                           c_void_p]),
    "moeblaze_routing_build": (_STATUS, [layer_t, ctypes.c_int64, c_void_p, c_void_p, c_void_p,
                                         c_void_p, c_void_p, ctypes.c_size_t, c_void_p]),
    "moeblaze_forward_args_init": (_STATUS, [ctypes.POINTER(ForwardArgs), ctypes.c_size_t]),
    "moeblaze_backward_args_init": (_STATUS, [ctypes.POINTER(BackwardArgs), ctypes.c_size_t]),
    "moeblaze_experts_forward": (_STATUS, [layer_t, ctypes.POINTER(ForwardArgs), c_void_p]),
    "moeblaze_experts_backward": (_STATUS, [layer_t, ctypes.POINTER(BackwardArgs), c_void_p]),
    "moeblaze_layer_forward": (_STATUS, [layer_t, ctypes.POINTER(ForwardArgs), c_void_p]),
    "moeblaze_layer_backward": (_STATUS, [layer_t, ctypes.POINTER(BackwardArgs), c_void_p]),
    # Expert parallelism
    "moeblaze_ep_local_group_create": (_STATUS, [ctypes.POINTER(ep_group_t), ctypes.c_int32]),
    "moeblaze_ep_local_group_destroy": (_STATUS, [ep_group_t]),
    "moeblaze_ep_config_init": (_STATUS, [ctypes.POINTER(EpConfig), ctypes.c_size_t]),
    "moeblaze_ep_layer_create": (_STATUS, [ctypes.POINTER(ep_layer_t), context_t,
                                           ctypes.POINTER(LayerConfig),
                                           ctypes.POINTER(EpConfig)]),
    "moeblaze_ep_layer_destroy": (_STATUS, [ep_layer_t]),
    "moeblaze_ep_layer_get_experts": (_STATUS, [ep_layer_t, ctypes.POINTER(ctypes.c_int64),
                                                ctypes.POINTER(ctypes.c_int64)]),
    "moeblaze_ep_layer_exchange_size": (_STATUS, [ep_layer_t, _size_t_p]),
    "moeblaze_ep_layer_workspace_size": (_STATUS, [ep_layer_t, ctypes.c_int32, ctypes.c_int64,
                                                   ctypes.c_int64, _size_t_p]),
    "moeblaze_ep_layer_workspace_size_with_flags": (_STATUS, [ep_layer_t, ctypes.c_int32,
                                                              ctypes.c_int64, ctypes.c_int64,
                                                              ctypes.c_uint32, _size_t_p]),
    "moeblaze_ep_layer_saved_size": (_STATUS, [ep_layer_t, ctypes.c_int32, ctypes.c_int64,
                                               ctypes.c_int64, _size_t_p]),
    "moeblaze_ep_forward_args_init": (_STATUS, [ctypes.POINTER(EpForwardArgs), ctypes.c_size_t]),
    "moeblaze_ep_backward_args_init": (_STATUS, [ctypes.POINTER(EpBackwardArgs),
                                                 ctypes.c_size_t]),
    "moeblaze_ep_forward_begin": (_STATUS, [ep_layer_t, ctypes.POINTER(EpForwardArgs), c_void_p,
                                            ctypes.c_size_t, ctypes.POINTER(ctypes.c_int64),
                                            c_void_p]),
    "moeblaze_ep_forward_finish": (_STATUS, [ep_layer_t, ctypes.POINTER(EpForwardArgs), c_void_p,
                                             ctypes.c_size_t, c_void_p]),
    "moeblaze_ep_backward": (_STATUS, [ep_layer_t, ctypes.POINTER(EpBackwardArgs), c_void_p,
                                       ctypes.c_size_t, c_void_p]),
}


def _make_errcheck(lib_handle):
    last_error = lib_handle.moeblaze_last_error

    def errcheck(status, func, arguments):
        if status != OK:
            # Read the thread-local message before any other moeblaze call can replace it.
            message = last_error().decode("utf-8", "replace")
            raise error_class(status)(status, message, func.__name__)
        return status

    return errcheck


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------

_PACKAGE_DIR = Path(__file__).resolve().parent
_LIB_NAMES = (f"libmoeblaze.so.{EXPECTED_ABI_VERSION}", "libmoeblaze.so")


def candidate_paths() -> list:
    """Where the loader looks, in order: $MOEBLAZE_LIBRARY (a file or a folder), the package folder
    (wheels ship the library there), the build trees of a source checkout (newest first), then the
    dynamic linker's search path."""
    candidates = []
    env = os.environ.get("MOEBLAZE_LIBRARY")
    if env:
        path = Path(env)
        if path.is_dir():
            candidates += [str(path / name) for name in _LIB_NAMES]
        else:
            candidates.append(env)
        return candidates  # an explicit choice is never silently replaced by another library
    candidates += [str(_PACKAGE_DIR / name) for name in _LIB_NAMES]
    # bindings/python/moeblaze/_lib.py -> the repository root is three levels up.
    repo_root = _PACKAGE_DIR.parent.parent.parent
    if (repo_root / "include" / "moeblaze.h").is_file():
        found = []
        for pattern in ("build*/src/libmoeblaze.so", "build*/libmoeblaze.so",
                        "build*/lib/libmoeblaze.so"):
            found += glob.glob(str(repo_root / pattern))
        found.sort(key=lambda p: os.path.getmtime(p), reverse=True)
        candidates += found
    candidates += list(_LIB_NAMES)  # LD_LIBRARY_PATH, ld.so.cache
    return candidates


_lib_instance = None
_lib_path = None
_load_lock = threading.Lock()


def _configure(handle) -> None:
    errcheck = _make_errcheck(handle)
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(handle, name)
        function.argtypes = argtypes
        if restype is _STATUS:
            function.restype = ctypes.c_int32
            function.errcheck = errcheck
        else:
            function.restype = restype


def load(path: str = None):
    """Loads (once) and returns the configured ctypes.CDLL. Raises OSError if no library is found
    and VersionMismatchError if the library's ABI differs from the one these bindings mirror."""
    global _lib_instance, _lib_path
    with _load_lock:
        if _lib_instance is not None and path is None:
            return _lib_instance
        errors = []
        for candidate in ([path] if path else candidate_paths()):
            if os.sep in candidate and not os.path.exists(candidate):
                errors.append(f"{candidate}: no such file")
                continue
            try:
                handle = ctypes.CDLL(candidate)
            except OSError as error:
                errors.append(f"{candidate}: {error}")
                continue
            handle.moeblaze_get_abi_version.restype = ctypes.c_int32
            handle.moeblaze_get_abi_version.argtypes = []
            abi = handle.moeblaze_get_abi_version()
            if abi != EXPECTED_ABI_VERSION:
                raise VersionMismatchError(
                    ERR_VERSION_MISMATCH,
                    f"{candidate} has ABI version {abi}, these bindings need "
                    f"{EXPECTED_ABI_VERSION}")
            _configure(handle)
            _lib_instance = handle
            _lib_path = os.path.realpath(candidate) if os.sep in candidate else candidate
            return handle
        raise OSError("libmoeblaze not found; set MOEBLAZE_LIBRARY to the library file. "
                      "Tried:\n  " + "\n  ".join(errors))


def lib():
    """The loaded library (loading it on first use)."""
    return _lib_instance if _lib_instance is not None else load()


def library_path() -> str:
    lib()
    return _lib_path


def last_error() -> str:
    return lib().moeblaze_last_error().decode("utf-8", "replace")
