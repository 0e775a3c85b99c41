"""moeblaze: one Mixture-of-Experts layer, forward and backward, with minimal activation memory.

Python bindings of libmoeblaze (ctypes). Layers:

- ``moeblaze.Context`` / ``moeblaze.Layer``: handles plus a numpy API on the CPU backend
  (``layer.forward``, ``layer.backward``, ``layer.router_forward``, ``layer.routing_build``, ...).
- ``moeblaze.torch``: ``moe_layer``, ``moe_experts`` (registered ``moeblaze::*`` operators with
  autograd) and ``MoE`` (nn.Module), CPU and CUDA; ``moeblaze.hf`` swaps Hugging Face MoE blocks,
  ``moeblaze.distributed`` runs expert parallelism over ``torch.distributed``.
- ``moeblaze.jax``: ``moe_layer``, ``moe_experts`` as XLA FFI calls (jit, grad), CPU and CUDA.
- ``moeblaze.ep``: expert parallelism on numpy arrays (CPU backend).
- ``moeblaze.dlpack``: layer forward/backward on any DLPack tensors (numpy, torch, CuPy, JAX), with
  caller-provided outputs and buffers, on CPU or CUDA.
- ``moeblaze._lib``: the raw ctypes declarations (structs, signatures, error mapping).
- ``moeblaze_swig`` (build tree only): the 1:1 SWIG module.

The shared library is found through $MOEBLAZE_LIBRARY, the package folder, or a build tree of the
source checkout; its ABI version is checked on first use.
"""

from . import _lib
from . import ep  # noqa: F401  (moeblaze.ep: expert parallelism, numpy)
from ._lib import (  # noqa: F401  (re-exported)
    CudaError,
    InsufficientWorkspaceError,
    InternalError,
    InvalidArgumentError,
    InvalidHandleError,
    MoeblazeError,
    MoeblazeRuntimeError,
    NonFiniteError,
    NotSupportedError,
    OutOfMemoryError,
    VersionMismatchError,
)
from .core import (  # noqa: F401
    Context,
    ExpertsForwardResult,
    ExpertsGradients,
    Layer,
    LayerForwardResult,
    LayerGradients,
    RouterResult,
    RoutingIndices,
    aligned_empty,
    backend_available,
    bfloat16_bits_to_float,
    build_info,
    default_context,
    float_to_bfloat16_bits,
    get_abi_version,
    get_version,
    make_config,
    status_name,
    status_string,
)

__version__ = "0.1.0"
ABI_VERSION = _lib.EXPECTED_ABI_VERSION


def library_path() -> str:
    """The path of the loaded libmoeblaze."""
    return _lib.library_path()
