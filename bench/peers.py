"""Peer libraries as benchmark subjects: SonicMoE (Dao-AILab/sonic-moe).

Nothing of a peer's code lives in this repository: the benchmark imports the peer when it is
installed and reports a visible "skipped" row with the import error otherwise. How to make SonicMoE
importable on a machine without a registry is in bench/README.md.

Each peer runs the same problem as the other implementations (run_bench.py: moeblaze's experts
layer with the routing given, or the whole layer with its router), on its own weight layout, which
the adapter builds once, outside the timed and measured region, from the canonical weights:

* experts: ``sonicmoe.functional.moe_general_routing_inputs`` with the routed pairs in token order
  (``token_indices`` ascending, as it requires), the routing weights ``g`` flattened, and its fused
  up-projection ``w1 [E, 2h, d]`` with the gate rows at even and the up rows at odd positions
  (``u = up * silu(gate)``, moeblaze's SwiGLU); non-gated activations use ``w1 = w_gate``.
  Its ``dw1`` is split back into ``dw_gate``/``dw_up`` for the accuracy check.
* layer: ``sonicmoe.MoE`` (router GEMM, fused softmax top-k, experts, its switch aux loss), whose
  routing is top-k of the logits then a softmax over the k chosen (moeblaze's
  ``score_function="topk_softmax"``).
"""

import importlib

import torch

# moeblaze activation name -> SonicMoE ActivationType member name
SONICMOE_ACTIVATIONS = {"swiglu": "SWIGLU", "geglu": "GEGLU", "reglu": "REGLU", "silu": "SILU",
                        "gelu": "GELU", "relu": "RELU", "relu2": "RELU_SQ"}

_cache = {}


def sonicmoe():
    """(module, None) or (None, reason): never raises."""
    if "sonicmoe" not in _cache:
        try:
            module = importlib.import_module("sonicmoe")
            importlib.import_module("sonicmoe.functional")
            importlib.import_module("sonicmoe.enums")
            _cache["sonicmoe"] = (module, None)
        except Exception as error:  # noqa: BLE001 (reported as the row's skip reason)
            _cache["sonicmoe"] = (None, f"sonicmoe not importable: {type(error).__name__}: "
                                        f"{error}")
    return _cache["sonicmoe"]


def sonicmoe_unsupported(activation, dtype, device):
    """Why SonicMoE cannot run this row, or None."""
    if device != "cuda":
        return "SonicMoE runs on CUDA (Hopper) only"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"SonicMoE's kernels take bf16/fp16, not {dtype}"
    if activation not in SONICMOE_ACTIVATIONS:
        return f"SonicMoE has no {activation!r} activation"
    _, reason = sonicmoe()
    return reason


def _activation_type(activation):
    enums = importlib.import_module("sonicmoe.enums")
    return getattr(enums.ActivationType, SONICMOE_ACTIVATIONS[activation])


def fuse_up_projection(w_gate, w_up):
    """SonicMoE's w1 [E, 2h, d]: gate row i at 2i, up row i at 2i+1 (w_up None: w_gate itself)."""
    if w_up is None:
        return w_gate.detach().clone()
    E, h, d = w_gate.shape
    return torch.stack([w_gate.detach(), w_up.detach()], dim=2).reshape(E, 2 * h, d)


def split_up_projection(dw1, gated):
    """Inverse of fuse_up_projection for gradients: (dw_gate, dw_up or None)."""
    if dw1 is None:
        return None, None
    if not gated:
        return dw1, None
    return dw1[:, 0::2], dw1[:, 1::2]


def token_order_indices(num_tokens, top_k, device):
    """token_indices [T*k] int32 for routed pairs in (t, j) order: ascending, as SonicMoE asks."""
    return torch.arange(num_tokens, device=device, dtype=torch.int32).repeat_interleave(top_k)


def sonicmoe_experts(x, g, w1, w_down, ids, token_indices, activation):
    """y [T, d] = SonicMoE's experts layer with the routing given (g [T, k] fp32, ids [T, k])."""
    functional = importlib.import_module("sonicmoe.functional")
    E = w_down.shape[0]
    stream = torch.cuda.current_stream().cuda_stream
    y, _ = functional.moe_general_routing_inputs(
        x, g.reshape(-1), token_indices, ids.reshape(-1), w1.permute(1, 2, 0), None,
        w_down.permute(1, 2, 0), None, E, stream, _activation_type(activation))
    return y


def sonicmoe_layer(d, h, E, k, activation, w_router, w_gate, w_up, w_down):
    """A sonicmoe.MoE holding the given weights (copied into its own layout once)."""
    module = importlib.import_module("sonicmoe")
    layer = module.MoE(num_experts=E, num_experts_per_tok=k, hidden_size=d, intermediate_size=h,
                       activation_function=_activation_type(activation), add_bias=False,
                       std=0.02).to(device=w_gate.device, dtype=w_gate.dtype)
    with torch.no_grad():
        layer.router.weight.copy_(w_router)
        layer.c_fc.weight.copy_(fuse_up_projection(w_gate, w_up))
        layer.c_proj.weight.copy_(w_down)
    return layer
