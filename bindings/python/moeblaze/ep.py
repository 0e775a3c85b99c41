"""Expert parallelism (EP) with numpy arrays: the moeblaze_ep_* C API behind Python objects.

An EP layer spreads the `E` experts of one MoE layer over `world_size` ranks; rank `r` owns the
contiguous experts ``layer.experts = (begin, end)`` and feeds its own tokens. The results equal the
one-device layer on the *global batch* (the ranks' tokens concatenated in rank order); see
docs/design/expert-parallel.md, section 5, for which outputs are bitwise equal and which differ by
summation grouping only (``dx``, the ``dw_router`` shares, the loss shares).

This module is CPU/LOCAL-first: the ranks are threads of this process joined by a `LocalGroup`,
each with its own `EpLayer`, and every collective call (`forward`, `backward`) must be made by
every rank, in the same order::

    import moeblaze as mb
    from moeblaze import ep

    with ep.LocalGroup(2) as group:
        def rank_main(rank):
            layer = ep.EpLayer(mb.Context(num_threads=1), rank=rank, group=group,
                               d_model=16, d_ffn=32, num_experts=4, top_k=2)
            begin, end = layer.experts          # this rank passes w_gate[begin:end], ...
            out = layer.forward(x[rank], w_router, w_gate[begin:end], w_up[begin:end],
                                w_down[begin:end])
            grads = layer.backward(dy[rank])    # uses the step (and inputs) forward kept
            return out.y, grads
        results = ep.run_local(2, rank_main)

The NCCL transport (``transport="nccl"``, ``communicator`` = an ``ncclComm_t`` as an int address)
creates plans on a CUDA context, and the size queries work, but the numpy execute calls refuse
CUDA contexts: numpy arrays live in host memory, device arrays are out of scope here. Use
``moeblaze.distributed`` (PyTorch) or the raw ctypes calls of ``moeblaze._lib`` for devices.

Threads: ctypes.CDLL functions (which ``moeblaze._lib`` loads) release the GIL for the duration of
the foreign call (ctypes only keeps it for PyDLL functions), so ranks on Python threads really
run, and wait at the LOCAL group's rendezvous, concurrently. The library's error message is
thread-local and is read by the errcheck on the thread that made the call.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import numpy as np

from . import _args, _lib
from .core import (
    Context,
    Layer,
    _OwnedHandle,
    _name_of,
    _nbytes,
    _ptr,
    _storage_numpy_dtype,
    aligned_empty,
    aligned_zeros,
    default_context,
    make_config,
    needed,
)

TRANSPORTS = {"nccl": _lib.EP_TRANSPORT_NCCL, "local": _lib.EP_TRANSPORT_LOCAL}

_FORWARD_OUTPUTS = frozenset({"logits", "ids", "g", "expert_counts", "losses"})
_GRADIENTS = frozenset({"dx", "dw_router", "dw_gate", "dw_up", "dw_down", "dg", "d_logits"})


# ------------------------------------------------------------------------------------------------
# LocalGroup and run_local
# ------------------------------------------------------------------------------------------------


class LocalGroup(_OwnedHandle):
    """An in-process group of `world_size` ranks (moeblaze_ep_group_t) for ``transport="local"``.

    Each rank is one thread of this process that creates its own `EpLayer` on this group and makes
    the collective calls on its own thread (see `run_local`). `close()` (or leaving a ``with``
    block) destroys the handle; layers created on the group keep the group itself alive.

    A rank that waits more than 120 s for the others (a rank that did not make the same collective
    call) fails with `InternalError`, and the group is unusable from then on.
    """

    _destroy = "moeblaze_ep_local_group_destroy"

    def __init__(self, world_size: int):
        self._lib = _lib.lib()
        handle = _lib.ep_group_t()
        world_size = _args.integer(world_size, "world_size", "int32")
        self._lib.moeblaze_ep_local_group_create(ctypes.byref(handle), world_size)
        self._handle = handle
        self.world_size = world_size

    def __repr__(self):
        state = "closed" if self._handle is None else f"world_size={self.world_size}"
        return f"moeblaze.ep.LocalGroup({state})"


def run_local(world_size: int, fn: Callable[[int], object], *,
              timeout: Optional[float] = None) -> List[object]:
    """Runs ``fn(rank)`` for every rank on its own thread and returns the results in rank order.

    If any rank raises, the first exception raised (in time) is re-raised here once the other
    ranks have ended. Ranks left waiting in a collective call by a failed rank end with the LOCAL
    group's 120 s timeout; `timeout` (seconds, after the first failure) bounds how long this
    function waits for them before re-raising anyway (their threads are daemons and stay blocked
    in the library until its timeout).
    """
    world_size = _args.integer(world_size, "world_size", "int32")
    if world_size < 1:
        raise ValueError(f"world_size = {world_size} must be >= 1")
    results: List[object] = [None] * world_size
    errors: List[BaseException] = []
    lock = threading.Lock()
    failed = threading.Event()

    def main(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as error:  # noqa: B902  (re-raised on the caller's thread)
            with lock:
                errors.append(error)
            failed.set()

    threads = [threading.Thread(target=main, args=(rank,), name=f"moeblaze-ep-rank-{rank}",
                                daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    deadline = None
    for thread in threads:
        while thread.is_alive():
            if timeout is not None and failed.is_set():
                # After a failure the others may be stuck in a collective: wait at most `timeout`.
                if deadline is None:
                    deadline = time.monotonic() + _args.real(timeout, "timeout")
                thread.join(max(0.0, deadline - time.monotonic()))
                break
            thread.join(0.05)
    if errors:
        raise errors[0]
    return results


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------


@dataclass
class EpStep:
    """The state of one forward step that its backward needs: the host `exchange` buffer, the two
    saved buffers (HOME: this rank's tokens; EXPERT: the rows this rank's experts received) and the
    forward's inputs (by reference, as prepared for the library)."""

    num_tokens: int
    recv_rows: int
    exchange: np.ndarray      # uint8, host
    home_saved: np.ndarray    # uint8
    expert_saved: np.ndarray  # uint8
    x: np.ndarray
    w_router: np.ndarray
    w_gate: np.ndarray
    w_up: Optional[np.ndarray]
    w_down: np.ndarray


@dataclass
class EpForwardResult:
    y: np.ndarray                        # [T,d] storage dtype
    recv_rows: int                       # rows this rank's experts received
    logits: Optional[np.ndarray] = None  # [T,E] routing dtype
    ids: Optional[np.ndarray] = None     # [T,k] int32, global expert ids
    g: Optional[np.ndarray] = None       # [T,k] routing dtype
    expert_counts: Optional[np.ndarray] = None  # [E] int32: GLOBAL tokens per expert
    losses: Optional[np.ndarray] = None  # [2] routing dtype: this rank's shares {aux, z}
    step: Optional[EpStep] = None        # None for inference (training=False)


@dataclass
class EpGradients:
    dx: Optional[np.ndarray] = None         # [T,d], includes the router's path
    dw_router: Optional[np.ndarray] = None  # [E,d]: this rank's share (sum over ranks)
    dw_gate: Optional[np.ndarray] = None    # [E_r,h,d]: complete, of this rank's experts
    dw_up: Optional[np.ndarray] = None      # [E_r,h,d] (gated activations)
    dw_down: Optional[np.ndarray] = None    # [E_r,d,h]
    dg: Optional[np.ndarray] = None         # [T,k] routing dtype
    d_logits: Optional[np.ndarray] = None   # [T,E] routing dtype


# ------------------------------------------------------------------------------------------------
# EpLayer
# ------------------------------------------------------------------------------------------------


def _communicator_pointer(communicator) -> int:
    if isinstance(communicator, ctypes.c_void_p):
        communicator = communicator.value
    if isinstance(communicator, bool) or not isinstance(communicator, (int, np.integer)):
        raise TypeError("communicator: the NCCL transport takes an ncclComm_t as an int address "
                        f"(or ctypes.c_void_p), got {type(communicator).__name__}")
    return _args.integer(communicator, "communicator", "size_t")


class EpLayer(_OwnedHandle):
    """This rank's expert-parallel plan of one MoE layer (moeblaze_ep_layer_t).

    `config_kwargs` describe the GLOBAL layer, as for `moeblaze.Layer` (``num_experts`` = E of all
    ranks). ``transport="local"`` takes a `LocalGroup` as `group` (or `communicator`);
    ``transport="nccl"`` takes an ``ncclComm_t`` int address as `communicator` (CUDA context,
    library built with MOEBLAZE_NCCL). `world_size` defaults to the group's size. Creation is not
    collective; the library validates the placement and raises with its message (``rank`` outside
    0..world_size-1, ``world_size`` outside 1..num_experts, a group of another size, ...).
    """

    _destroy = "moeblaze_ep_layer_destroy"

    # The numpy input handling is the one of the one-device Layer (same dtype rules: bfloat16 takes
    # bit patterns or floats, which are rounded; copies only to fix dtype, contiguity, alignment).
    _input = Layer._input
    _storage_input = Layer._storage_input

    def __init__(self, context: Optional[Context] = None, *, rank: int,
                 world_size: Optional[int] = None, transport="local",
                 group: Optional[LocalGroup] = None, communicator=None, **config_kwargs):
        self.context = context if context is not None else default_context()
        self._lib = _lib.lib()
        self._handle = None
        transport_code = _lib.lookup(TRANSPORTS, transport, "transport")
        ep_config = _lib.EpConfig.create()
        ep_config.transport = transport_code
        ep_config.rank = _args.integer(rank, "rank", "int32")
        if transport_code == _lib.EP_TRANSPORT_LOCAL:
            if group is None and isinstance(communicator, LocalGroup):
                group, communicator = communicator, None
            if group is None or communicator is not None:
                raise TypeError("transport='local' takes a moeblaze.ep.LocalGroup as `group`")
            if not isinstance(group, LocalGroup):
                raise TypeError(f"group: expected a moeblaze.ep.LocalGroup, got "
                                f"{type(group).__name__}")
            ep_config.communicator = ctypes.cast(group.handle, ctypes.c_void_p).value
            ep_config.world_size = _args.integer(
                world_size if world_size is not None else group.world_size, "world_size", "int32")
        else:
            if group is not None:
                raise TypeError(f"group is for transport='local'; transport={transport!r} takes "
                                "`communicator`")
            if communicator is None:
                raise TypeError("transport='nccl' needs `communicator`: an ncclComm_t address")
            if world_size is None:
                raise TypeError("transport='nccl' needs `world_size` (the communicator's size)")
            ep_config.communicator = _communicator_pointer(communicator)
            ep_config.world_size = _args.integer(world_size, "world_size", "int32")
        self.group = group  # kept so the Python object outlives the layer, as the C handle does
        self.transport = _name_of(TRANSPORTS, transport_code)
        self.rank = int(ep_config.rank)
        self.world_size = int(ep_config.world_size)

        config = make_config(**config_kwargs)
        handle = _lib.ep_layer_t()
        self._lib.moeblaze_ep_layer_create(ctypes.byref(handle), self.context.handle,
                                           ctypes.byref(config), ctypes.byref(ep_config))
        self._handle = handle
        self.config = config  # validated by the create call (there is no ep get_config)
        self.d_model = int(config.d_model)
        self.d_ffn = int(config.d_ffn)
        self.num_experts = int(config.num_experts)
        self.top_k = int(config.top_k)
        self.dtype = _name_of(_lib.DTYPES, config.dtype)
        self.activation = _name_of(_lib.ACTIVATIONS, config.activation)
        self.gated = self.activation in _lib.GATED_ACTIVATIONS
        self.storage_dtype = _storage_numpy_dtype(config.dtype)
        self.routing_dtype = np.dtype(np.float64 if config.dtype == _lib.DTYPE_F64
                                      else np.float32)
        begin, end = ctypes.c_int64(), ctypes.c_int64()
        self._lib.moeblaze_ep_layer_get_experts(handle, ctypes.byref(begin), ctypes.byref(end))
        self.experts = (int(begin.value), int(end.value))
        self.num_local_experts = self.experts[1] - self.experts[0]
        size = ctypes.c_size_t()
        self._lib.moeblaze_ep_layer_exchange_size(handle, ctypes.byref(size))
        self.exchange_size = int(size.value)
        self._last_step: Optional[EpStep] = None
        # A never-begun exchange: what backward passes when no forward step exists, so that the
        # library itself reports the call order (no rendezvous happens before that check).
        self._unbegun_exchange = aligned_zeros(self.exchange_size, np.uint8)

    # -- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        self._last_step = None
        super().close()

    def __repr__(self):
        return (f"moeblaze.ep.EpLayer(rank={self.rank}, world_size={self.world_size}, "
                f"transport={self.transport!r}, experts={self.experts}, "
                f"d_model={self.d_model}, d_ffn={self.d_ffn}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, activation={self.activation!r}, dtype={self.dtype!r})")

    @property
    def local_experts(self) -> slice:
        """``slice(begin, end)``: ``w_gate_global[layer.local_experts]`` is this rank's share."""
        return slice(*self.experts)

    # -- sizes ------------------------------------------------------------------------------------

    def workspace_size(self, pass_code: int, num_tokens: int, recv_rows: int = 0,
                       flags: int = 0) -> int:
        """Bytes of the workspace of `pass_code` (``_lib.EP_PASS_*``) for a backward made with the
        ``_lib.BACKWARD_*`` `flags` (``BACKWARD_CONSUME_SAVED`` may need less on a GPU; the forward
        passes ignore them)."""
        size = ctypes.c_size_t()
        self._lib.moeblaze_ep_layer_workspace_size_with_flags(
            self.handle, _args.integer(pass_code, "pass_code", "int32"),
            _args.integer(num_tokens, "num_tokens"), _args.integer(recv_rows, "recv_rows"),
            _args.integer(flags, "flags", "uint32"), ctypes.byref(size))
        return size.value

    def saved_size(self, part: int, num_tokens: int, recv_rows: int = 0) -> int:
        """Bytes of the saved buffer `part` (``_lib.EP_SAVED_HOME`` or ``_lib.EP_SAVED_EXPERT``)."""
        size = ctypes.c_size_t()
        self._lib.moeblaze_ep_layer_saved_size(self.handle, _args.integer(part, "part", "int32"),
                                               _args.integer(num_tokens, "num_tokens"),
                                               _args.integer(recv_rows, "recv_rows"),
                                               ctypes.byref(size))
        return size.value

    # -- numpy plumbing ---------------------------------------------------------------------------

    def _require_host(self):
        if self.context.backend != _lib.BACKEND_CPU:
            raise ValueError(
                "moeblaze.ep runs its numpy API on CPU contexts only: numpy arrays are host "
                "memory and device arrays are out of scope for this module. For CUDA/NCCL use "
                "moeblaze.distributed (PyTorch) or the raw moeblaze._lib ctypes calls")

    def _workspace(self, pass_code: int, num_tokens: int, recv_rows: int):
        size = self.workspace_size(pass_code, num_tokens, recv_rows)
        return aligned_empty(size, np.uint8) if size else None

    def _num_tokens(self, x, pass_code: int, name: str = "x") -> int:
        """T of `x` [T, d_model], checked by the library (a size query of `pass_code`) before
        anything is copied or allocated, as in moeblaze.Layer."""
        x = np.asarray(x)
        if x.ndim != 2:
            raise ValueError(f"{name}: expected a 2-D [T, d_model] array, got shape "
                             f"{list(x.shape)}")
        T = int(x.shape[0])
        self.workspace_size(pass_code, T)
        return T

    def _weights(self, w_gate, w_up, w_down):
        E_r, h, d = self.num_local_experts, self.d_ffn, self.d_model
        w_gate = self._storage_input(w_gate, "w_gate", (E_r, h, d))
        if self.gated:
            if w_up is None:
                raise ValueError(f"w_up is required for the gated activation {self.activation!r}")
            w_up = self._storage_input(w_up, "w_up", (E_r, h, d))
        else:
            w_up = None
        w_down = self._storage_input(w_down, "w_down", (E_r, d, h))
        return w_gate, w_up, w_down

    # -- forward ----------------------------------------------------------------------------------

    def forward(self, x, w_router, w_gate, w_up, w_down, *, training: bool = True,
                need=("losses",)) -> EpForwardResult:
        """Collective forward of this rank's tokens: begin, allocate, finish.

        x [T,d] (this rank's tokens; T may be 0); w_router [E,d] (replicated); w_gate, w_up
        [E_r,h,d] and w_down [E_r,d,h]: this rank's experts only (``layer.local_experts``).
        `need` names the optional outputs: "logits", "ids", "g", "expert_counts" (global),
        "losses" (this rank's shares). With `training=True` the step (saved buffers, exchange and
        inputs) is kept for `backward` and returned as ``result.step``.

        forward_begin routes the tokens, exchanges the per-expert counts (the one host
        synchronisation of EP) and returns ``recv_rows``; the EXPERT saved buffer and the finish
        workspace are then allocated for exactly that many rows.
        """
        self._require_host()
        need = needed(need, _FORWARD_OUTPUTS, "outputs")
        T = self._num_tokens(x, _lib.EP_PASS_FORWARD_BEGIN)
        E, k, d = self.num_experts, self.top_k, self.d_model
        # Every Python-side check happens before begin: a rank failing later would leave the other
        # ranks waiting in a collective call.
        x = self._storage_input(x, "x", (T, d))
        w_router = self._storage_input(w_router, "w_router", (E, d))
        w_gate, w_up, w_down = self._weights(w_gate, w_up, w_down)

        exchange = aligned_zeros(self.exchange_size, np.uint8)
        home_saved = aligned_empty(self.saved_size(_lib.EP_SAVED_HOME, T), np.uint8)
        workspace = self._workspace(_lib.EP_PASS_FORWARD_BEGIN, T, 0)
        args = _lib.EpForwardArgs.create()
        args.num_tokens = T
        args.x, args.w_router = _ptr(x), _ptr(w_router)
        args.w_gate, args.w_up, args.w_down = _ptr(w_gate), _ptr(w_up), _ptr(w_down)
        args.home_saved, args.home_saved_bytes = _ptr(home_saved), _nbytes(home_saved)
        args.workspace, args.workspace_bytes = _ptr(workspace), _nbytes(workspace)
        recv_rows = ctypes.c_int64()
        self._lib.moeblaze_ep_forward_begin(self.handle, ctypes.byref(args), _ptr(exchange),
                                            _nbytes(exchange), ctypes.byref(recv_rows), None)
        R = int(recv_rows.value)

        # Finish always needs the EXPERT buffer; for inference it is dropped afterwards.
        expert_saved = aligned_empty(self.saved_size(_lib.EP_SAVED_EXPERT, T, R), np.uint8)
        workspace = self._workspace(_lib.EP_PASS_FORWARD_FINISH, T, R)
        result = EpForwardResult(
            y=aligned_empty((T, d), self.storage_dtype), recv_rows=R,
            logits=aligned_empty((T, E), self.routing_dtype) if "logits" in need else None,
            ids=aligned_empty((T, k), np.int32) if "ids" in need else None,
            g=aligned_empty((T, k), self.routing_dtype) if "g" in need else None,
            expert_counts=aligned_empty((E,), np.int32) if "expert_counts" in need else None,
            losses=aligned_empty((2,), self.routing_dtype) if "losses" in need else None)
        args.y, args.logits_out = _ptr(result.y), _ptr(result.logits)
        args.ids_out, args.g_out = _ptr(result.ids), _ptr(result.g)
        args.expert_counts, args.losses = _ptr(result.expert_counts), _ptr(result.losses)
        args.expert_saved, args.expert_saved_bytes = _ptr(expert_saved), _nbytes(expert_saved)
        args.workspace, args.workspace_bytes = _ptr(workspace), _nbytes(workspace)
        self._lib.moeblaze_ep_forward_finish(self.handle, ctypes.byref(args), _ptr(exchange),
                                             _nbytes(exchange), None)
        if training:
            result.step = EpStep(num_tokens=T, recv_rows=R, exchange=exchange,
                                 home_saved=home_saved, expert_saved=expert_saved, x=x,
                                 w_router=w_router, w_gate=w_gate, w_up=w_up, w_down=w_down)
            self._last_step = result.step  # an inference forward keeps the last training step
        return result

    # -- backward ---------------------------------------------------------------------------------

    def backward(self, dy, *, step: Optional[EpStep] = None, x=None, w_router=None, w_gate=None,
                 w_up=None, w_down=None, d_losses=None,
                 need=("dx", "dw_router", "dw_gate", "dw_up", "dw_down"),
                 grads_out: Optional[EpGradients] = None, accumulate: bool = False
                 ) -> EpGradients:
        """Collective backward of a forward step (default: this layer's last training forward).

        dy [T,d]. The forward's inputs are reused unless given again (x, w_router, this rank's
        w_gate/w_up/w_down). `need` names the gradients: "dx", "dw_router" (this rank's share:
        sum it over ranks), "dw_gate", "dw_up", "dw_down" (complete, of this rank's experts),
        "dg", "d_logits". `d_losses` [2] (default {1, 1}) weights this rank's loss shares. With
        `accumulate=True` the weight gradients are added into `grads_out`'s arrays. A step may be
        back-propagated more than once.
        """
        self._require_host()
        if isinstance(step, EpForwardResult):
            step = step.step
        if step is None:
            step = self._last_step
        need = needed(need, _GRADIENTS)
        T = self._num_tokens(dy, _lib.EP_PASS_BACKWARD, "dy")
        E, k, d = self.num_experts, self.top_k, self.d_model
        E_r, h = self.num_local_experts, self.d_ffn
        dy = self._storage_input(dy, "dy", (T, d))
        if d_losses is not None:
            d_losses = self._input(d_losses, "d_losses", (2,), self.routing_dtype)
        if step is None:
            # No forward step: let the library report it (a never-begun exchange is refused
            # before any buffer check or rendezvous).
            args = _lib.EpBackwardArgs.create()
            args.num_tokens = T
            args.dy = _ptr(dy)
            self._lib.moeblaze_ep_backward(self.handle, ctypes.byref(args),
                                           _ptr(self._unbegun_exchange),
                                           _nbytes(self._unbegun_exchange), None)
            raise AssertionError("moeblaze_ep_backward accepted an exchange that was never begun")
        x = step.x if x is None else self._storage_input(x, "x", (T, d))
        w_router = step.w_router if w_router is None else \
            self._storage_input(w_router, "w_router", (E, d))
        if w_gate is not None or w_up is not None or w_down is not None:
            w_gate, w_up, w_down = self._weights(
                step.w_gate if w_gate is None else w_gate,
                step.w_up if w_up is None else w_up,
                step.w_down if w_down is None else w_down)
        else:
            w_gate, w_up, w_down = step.w_gate, step.w_up, step.w_down

        shapes = {"dx": ((T, d), self.storage_dtype), "dw_router": ((E, d), self.storage_dtype),
                  "dw_gate": ((E_r, h, d), self.storage_dtype),
                  "dw_up": ((E_r, h, d), self.storage_dtype),
                  "dw_down": ((E_r, d, h), self.storage_dtype),
                  "dg": ((T, k), self.routing_dtype), "d_logits": ((T, E), self.routing_dtype)}
        if grads_out is None:
            if accumulate:
                raise ValueError("accumulate=True adds into existing arrays: pass grads_out")
            grads = EpGradients(**{name: aligned_empty(*shapes[name]) for name in need
                                   if name != "dw_up" or self.gated})
        else:  # written in place: must already be exactly right
            grads = grads_out
            for name, (shape, dtype) in shapes.items():
                array = getattr(grads, name)
                if array is not None and (array.shape != tuple(shape) or array.dtype != dtype
                                          or not array.flags.c_contiguous
                                          or not array.flags.writeable
                                          or array.ctypes.data % 16):
                    raise ValueError(f"grads_out.{name}: need a writeable, 16-byte aligned, "
                                     f"C-contiguous {dtype} array of shape {list(shape)}")
            if not self.gated:
                grads.dw_up = None

        workspace = self._workspace(_lib.EP_PASS_BACKWARD, T, step.recv_rows)
        args = _lib.EpBackwardArgs.create()
        args.flags = _lib.BACKWARD_ACCUMULATE_WGRAD if accumulate else 0
        args.num_tokens = T
        args.dy, args.d_losses = _ptr(dy), _ptr(d_losses)
        args.x, args.w_router = _ptr(x), _ptr(w_router)
        args.w_gate, args.w_up, args.w_down = _ptr(w_gate), _ptr(w_up), _ptr(w_down)
        args.home_saved, args.home_saved_bytes = _ptr(step.home_saved), _nbytes(step.home_saved)
        args.expert_saved = _ptr(step.expert_saved)
        args.expert_saved_bytes = _nbytes(step.expert_saved)
        args.dx, args.dw_router = _ptr(grads.dx), _ptr(grads.dw_router)
        args.dw_gate, args.dw_up, args.dw_down = _ptr(grads.dw_gate), _ptr(grads.dw_up), \
            _ptr(grads.dw_down)
        args.dg, args.d_logits = _ptr(grads.dg), _ptr(grads.d_logits)
        args.workspace, args.workspace_bytes = _ptr(workspace), _nbytes(workspace)
        self._lib.moeblaze_ep_backward(self.handle, ctypes.byref(args), _ptr(step.exchange),
                                       _nbytes(step.exchange), None)
        return grads


__all__ = ["EpForwardResult", "EpGradients", "EpLayer", "EpStep", "LocalGroup",
           "TRANSPORTS", "run_local"]
