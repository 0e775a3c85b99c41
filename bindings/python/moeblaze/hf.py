"""Hugging Face transformers models on moeblaze: `replace_moe_blocks(model)`.

transformers (5.x) builds every sparse MoE block from a router module (``block.gate``: logits ->
top-k ids and weights) and an experts module (``block.experts``: 3-D ``gate_up_proj`` and
``down_proj`` weights, ``forward(hidden_states, top_k_index, top_k_weights)``), the experts class
declaring its weight layout through ``transformers.integrations.use_experts_implementation``.
`replace_moe_blocks` swaps each block's experts module for a `MoeblazeExperts` whose forward and
backward are moeblaze's experts operators, and leaves everything else of the block as it was:

- routing is the model's own router, untouched: its dtype, ``norm_topk_prob``, scaling, grouping,
  jitter, shared experts and the router logits that ``output_router_logits=True`` collects for the
  load-balancing loss (recorded from the router module) are exactly the original's;
- the weights are shared: ``down_proj`` (and a non-gated ``up_proj``) is the same Parameter
  object; a fused ``gate_up_proj`` [E, 2h, d] is split once into moeblaze's ``w_gate`` and
  ``w_up`` [E, h, d] (the fused parameter is dropped, so memory does not grow), and a transposed
  layout ([E, in, out]) is converted once; nothing is copied per step;
- ``state_dict()`` and ``load_state_dict()`` keep the original keys and layout (hooks fuse and split
  on the way), so checkpoints and ``save_pretrained`` stay compatible with the unswapped model.

Call it after loading the model and before creating the optimizer, wrapping with FSDP/DDP or
compiling (the experts' parameters change). A block is swapped when its experts compute
``y = sum_j w_j * down(act(gate(x)) * up(x))`` (or ``down(act(up(x)))`` without a gate) with an
activation moeblaze has and no biases; `swap_blocker(experts)` says why one is not. The families
this covers, and those it does not, are listed in bindings/python/README.md.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch

from . import _lib
from .torch import moe_experts, routing_dtype

__all__ = ["MoeblazeExperts", "replace_moe_blocks", "swap_blocker", "experts_modules"]

# ------------------------------------------------------------------------------------------------
# Recognising transformers' experts modules
# ------------------------------------------------------------------------------------------------

# Attributes transformers' use_experts_implementation sets on every experts module it decorates.
_LAYOUT_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


def _is_experts_module(module: torch.nn.Module) -> bool:
    return (all(hasattr(module, flag) for flag in _LAYOUT_FLAGS) and hasattr(module, "down_proj")
            and hasattr(module, "num_experts"))


def experts_modules(model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every transformers experts module in `model`."""
    for name, module in model.named_modules():
        if _is_experts_module(module) and not isinstance(module, MoeblazeExperts):
            yield name, module


# Class (or function) names of activations known to be exactly one of moeblaze's: torch.nn's and
# torch.nn.functional's, and transformers' ACT2FN classes ("gelu", "silu", "swish", "relu",
# "relu2"). A known name must also pass the numeric probe (nn.GELU(approximate="tanh") does not).
_KNOWN_ACTIVATIONS = {
    "SiLU": "silu", "SiLUActivation": "silu", "silu": "silu", "swish": "silu",
    "GELU": "gelu", "GELUActivation": "gelu", "gelu": "gelu",
    "ReLU": "relu", "relu": "relu",
    "ReLUSquaredActivation": "relu2",
}


def _activation_probe() -> torch.Tensor:
    """Points on which an activation must equal moeblaze's: a fine grid over [-8, 8], values just
    below, at and above the clamp points of clamped or capped variants (ReLU6 at 6, transformers'
    ClippedGELU at -10 and 10, ...), and magnitudes up to 1e12, so that a clamp or soft cap
    anywhere below ~1e9 shows."""
    limits = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 15.0, 16.0,
                           20.0, 25.0, 30.0, 32.0, 50.0, 64.0, 100.0, 128.0, 256.0, 1000.0],
                          dtype=torch.float64)
    near = torch.cat([limits * (1 - 1e-3), limits, limits * (1 + 1e-3)])
    large = torch.logspace(0, 12, 49, dtype=torch.float64)
    positive = torch.cat([near, large])
    return torch.cat([torch.linspace(-8.0, 8.0, 129, dtype=torch.float64), positive, -positive])


def _activation_of(act_fn, gated: bool) -> Optional[str]:
    """moeblaze's name for `act_fn`, or None when it is not exactly one of moeblaze's.

    The activation is probed numerically (`_activation_probe`: wide, with large magnitudes and
    the usual clamp points) and must equal a moeblaze activation everywhere there; when its class
    or function name is a known one (`_KNOWN_ACTIVATIONS`), the probe must give that activation.
    So an equivalent module of another name matches, and a clamped or capped variant (ReLU6,
    ClippedGELU, a soft cap) does not."""
    probe = _activation_probe()
    try:
        with torch.no_grad():
            out = act_fn(probe.clone())
    except Exception:  # an activation that cannot run on a CPU float64 vector
        return None
    if not isinstance(out, torch.Tensor) or out.shape != probe.shape:
        return None
    candidates = {
        "silu": torch.nn.functional.silu(probe),
        "gelu": torch.nn.functional.gelu(probe),  # exact (erf) form
        "relu": torch.relu(probe),
        "relu2": torch.relu(probe).square(),
    }
    known = _KNOWN_ACTIVATIONS.get(getattr(act_fn, "__name__", None) or type(act_fn).__name__)
    for name, expected in candidates.items():
        if known is not None and name != known:
            continue
        if torch.allclose(out.to(torch.float64), expected, rtol=1e-6, atol=1e-9):
            if gated:
                return {"silu": "swiglu", "gelu": "geglu", "relu": "reglu"}.get(name)
            return name
    return None


def _default_gate(module: torch.nn.Module) -> bool:
    """True when the module gates with transformers' default act(gate) * up."""
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is None:
        return True
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # a transformers without it has no overridable gate either
        return True
    return apply_gate is _default_apply_gate


def swap_blocker(experts: torch.nn.Module) -> Optional[str]:
    """Why `experts` (a transformers experts module) cannot run on moeblaze, or None if it can."""
    if not _is_experts_module(experts):
        return ("not an experts module of transformers' use_experts_implementation convention "
                "(3-D gate_up_proj/up_proj and down_proj with layout flags)")
    reasons = []
    if experts.has_bias:
        reasons.append("expert biases (moeblaze's experts have none)")
    if getattr(experts, "has_post_expert_norm", False):
        reasons.append("a norm after each expert")
    if experts.has_gate and not _default_gate(experts):
        reasons.append(f"its own gating function ({type(experts).__name__}._apply_gate, e.g. a "
                       "clamped or scaled SwiGLU)")
    elif experts.has_gate and not getattr(experts, "is_concatenated", True):
        reasons.append("interleaved gate/up rows (the default gate splits concatenated halves)")
    if getattr(experts, "_is_expert_parallel", False):
        reasons.append("transformers' own expert parallelism (sharded experts, sentinel ids)")
    act_fn = getattr(experts, "act_fn", None)
    if act_fn is None:
        if experts.has_gate and _default_gate(experts):
            reasons.append("no act_fn")
    elif _activation_of(act_fn, experts.has_gate) is None:
        kind = "gated " if experts.has_gate else ""
        reasons.append(f"a {kind}activation moeblaze does not have ({type(act_fn).__name__}; "
                       "moeblaze has SiLU, exact GELU and ReLU, gated or not, and ReLU^2)")
    weights = ("gate_up_proj",) if experts.has_gate else ("up_proj",)
    for name in weights + ("down_proj",):
        weight = getattr(experts, name, None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            reasons.append(f"{name} is not a 3-D [num_experts, ...] tensor")
    return "; ".join(reasons) if reasons else None


# ------------------------------------------------------------------------------------------------
# The moeblaze experts module
# ------------------------------------------------------------------------------------------------


def _expert_ids(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """transformers' (int64) expert ids as moeblaze's int32 ids, without wrapping: ids wider than
    int32 are first clamped to [-1, num_experts], which keeps every invalid id invalid (outside
    0..num_experts-1), so moe_experts refuses it as out of range (the CPU backend raises; the CUDA
    backend drops such pairs, see moe_experts) instead of seeing id + 2^32 as a valid id. No host
    synchronisation, nothing data-dependent for torch.compile."""
    dtype = top_k_index.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"top_k_index: expected integer expert ids, got dtype {dtype}")
    info = torch.iinfo(dtype)
    if info.min < -(1 << 31) or info.max >= (1 << 31):
        top_k_index = top_k_index.clamp(-1, num_experts)
    return top_k_index.to(torch.int32)


class MoeblazeExperts(torch.nn.Module):
    """A drop-in for a transformers experts module, computed by moeblaze's experts operators.

    forward(hidden_states [T, d], top_k_index [T, k], top_k_weights [T, k]) -> [T, d], the
    original's signature. Parameters: ``w_gate``, ``w_up`` [E, h, d] (gated; ``w_up`` is None
    otherwise) and ``down_proj`` [E, d, h], moeblaze's layout. ``state_dict`` keys and layouts are
    the original module's (``gate_up_proj`` or ``up_proj``, ``down_proj``)."""

    def __init__(self, w_gate: torch.nn.Parameter, w_up: Optional[torch.nn.Parameter],
                 down_proj: torch.nn.Parameter, activation: str, *, gated: bool,
                 is_transposed: bool = False, checkpoint: str = "save_preact",
                 consume_saved: bool = True):
        super().__init__()
        self.num_experts, self.intermediate_dim, self.hidden_dim = w_gate.shape
        self.activation = activation
        self.gated = gated
        self.is_transposed = is_transposed
        self.checkpoint = checkpoint
        self.consume_saved = consume_saved
        self.w_gate = w_gate
        if gated:
            self.w_up = w_up
        else:
            self.register_parameter("w_up", None)
        self.down_proj = down_proj
        self.register_state_dict_post_hook(MoeblazeExperts._to_original_layout)
        self.register_load_state_dict_pre_hook(MoeblazeExperts._from_original_layout)

    @classmethod
    def from_transformers(cls, experts: torch.nn.Module, *, checkpoint: str = "save_preact",
                          consume_saved: bool = True) -> "MoeblazeExperts":
        """Takes over `experts`' weights: ``down_proj`` (and a non-gated ``up_proj``) itself when
        its layout is moeblaze's, the gate and up halves of ``gate_up_proj`` split (and a
        transposed layout transposed) once."""
        blocker = swap_blocker(experts)
        if blocker is not None:
            raise ValueError(f"{type(experts).__name__} cannot run on moeblaze: {blocker}")
        gated = bool(experts.has_gate)
        transposed = bool(experts.is_transposed)
        activation = _activation_of(experts.act_fn, gated)

        def standard(weight):  # [E, out, in]
            return weight.transpose(-2, -1) if transposed else weight

        def parameter(values, like):  # copies only where the layout differs from moeblaze's
            return torch.nn.Parameter(values.detach().contiguous(),
                                      requires_grad=like.requires_grad)

        with torch.no_grad():
            if gated:
                fused = standard(experts.gate_up_proj)
                h = fused.shape[1] // 2
                gate, up = fused[:, :h], fused[:, h:]  # act(gate) * up of chunk(2)
                w_gate = parameter(gate, experts.gate_up_proj)
                w_up = parameter(up, experts.gate_up_proj)
            else:
                up_proj = experts.up_proj
                w_gate = up_proj if not transposed and up_proj.is_contiguous() else \
                    parameter(standard(up_proj), up_proj)
                w_up = None
            down = experts.down_proj
            down_proj = down if not transposed and down.is_contiguous() else \
                parameter(standard(down), down)
        return cls(w_gate, w_up, down_proj, activation, gated=gated, is_transposed=transposed,
                   checkpoint=checkpoint, consume_saved=consume_saved)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        ids = _expert_ids(top_k_index, self.num_experts)
        g = top_k_weights.to(routing_dtype(hidden_states.dtype))
        return moe_experts(hidden_states, ids, g, self.w_gate, self.w_up, self.down_proj,
                           activation=self.activation, checkpoint=self.checkpoint,
                           consume_saved=self.consume_saved)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, activation={self.activation!r}, "
                f"checkpoint={self.checkpoint!r}")

    # -- the original layout in state dicts -------------------------------------------------------

    def _original_up(self) -> Tuple[str, torch.Tensor]:
        """(key, value) of the original fused up weight, from w_gate and w_up."""
        if not self.gated:
            weight = self.w_gate
            return "up_proj", weight.transpose(-2, -1) if self.is_transposed else weight
        fused = torch.cat([self.w_gate, self.w_up], dim=1)
        return "gate_up_proj", fused.transpose(-2, -1) if self.is_transposed else fused

    @staticmethod
    def _to_original_layout(module, state_dict, prefix, local_metadata):
        for name in ("w_gate", "w_up"):
            state_dict.pop(prefix + name, None)
        # Contiguous copies where the layouts differ: safetensors (save_pretrained) needs them.
        # The original order: the up (or fused gate/up) weight, then down_proj.
        key, value = module._original_up()
        down = state_dict.pop(prefix + "down_proj")
        state_dict[prefix + key] = value.detach().contiguous()
        state_dict[prefix + "down_proj"] = down.transpose(-2, -1).contiguous() \
            if module.is_transposed else down

    @staticmethod
    def _from_original_layout(module, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + ("gate_up_proj" if module.gated else "up_proj")
        if key in state_dict:
            value = state_dict.pop(key)
            if module.is_transposed:
                value = value.transpose(-2, -1)
            if module.gated:
                h = value.shape[1] // 2
                state_dict[prefix + "w_gate"] = value[:, :h]
                state_dict[prefix + "w_up"] = value[:, h:]
            else:
                state_dict[prefix + "w_gate"] = value
        down = prefix + "down_proj"
        if module.is_transposed and down in state_dict:
            state_dict[down] = state_dict[down].transpose(-2, -1)


# ------------------------------------------------------------------------------------------------
# Swapping
# ------------------------------------------------------------------------------------------------


def replace_moe_blocks(model: torch.nn.Module, *, checkpoint: str = "save_preact",
                       consume_saved: bool = True, strict: bool = True) -> int:
    """Runs the experts of every sparse MoE block of `model` on moeblaze; returns how many.

    Each block keeps its router and everything around the experts (see the module docstring);
    its experts module becomes a `MoeblazeExperts` sharing the original weights. `checkpoint`
    and `consume_saved` are moeblaze's options (moeblaze.torch.moe_experts). With `strict=True`
    (the default) an experts module that cannot run on moeblaze raises ValueError naming it and
    the reason, before anything is changed; with `strict=False` such blocks are left as they are.
    """
    if str(checkpoint).lower() not in _lib.CHECKPOINTS:
        raise ValueError(f"checkpoint: unknown {checkpoint!r}; expected one of "
                         f"{sorted(_lib.CHECKPOINTS)}")
    found: List[Tuple[str, torch.nn.Module]] = list(experts_modules(model))
    swappable = []
    for name, experts in found:
        blocker = swap_blocker(experts)
        if blocker is None:
            swappable.append((name, experts))
        elif strict:
            raise ValueError(f"{name} ({type(experts).__name__}) cannot run on moeblaze: "
                             f"{blocker}; pass strict=False to leave such blocks as they are")
    modules = dict(model.named_modules())
    for name, experts in swappable:
        parent_name, _, attribute = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        setattr(parent, attribute, MoeblazeExperts.from_transformers(
            experts, checkpoint=str(checkpoint).lower(), consume_saved=consume_saved))
    return len(swappable)
