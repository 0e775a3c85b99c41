"""Peer libraries as benchmark subjects: SonicMoE (Dao-AILab/sonic-moe) and MegaBlocks
(databricks/megablocks, its dropless MoE "dMoE").

Nothing of a peer's code lives in this repository: the benchmark imports the peer when it is
installed and reports a visible "skipped" row with the import error otherwise. How to make SonicMoE
and MegaBlocks importable on a machine without a registry is in bench/README.md.

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

MegaBlocks (dMoE, ``mlp_impl="grouped"``: its gather / scatter Triton kernels and the grouped GEMMs
of the ``grouped_gemm`` extension, bf16 only; its block-sparse ``"sparse"`` path refuses Triton
>= 3.2):

* experts: ``ParallelDroplessMLP.forward_once(x, expert_weights=g, top_experts=ids)``, the dMoE's
  expert computation with the routing given, no router and no load-balancing loss. Per routed pair
  (t, j) with e = ids[t, j]: ``u = act(x_t w1_e^T) * (x_t v1_e^T)`` (GLU) or ``act(x_t w1_e^T)``,
  then ``y_t = sum_j g[t, j] * (u w2_e)``: moeblaze's formula with ``w1 = w_gate``, ``v1 = w_up``
  and ``w2 = w_down^T``, each stored as one ``[E*h, d]`` matrix (to_megablocks_weights). The
  combine scales each expert row by its weight in fp32, stores it in bf16 and sums the k rows of a
  token; ``dg`` comes back rounded to bf16.
* layer: ``megablocks.layers.dmoe.dMoE`` holding the same weights: softmax over all E logits, top-k,
  the k probabilities divided by their sum (``moe_normalize_expert_weights=1``: the same weights as
  a softmax over the k chosen logits), and its load-balancing loss with weight 1, which is the
  switch loss ``E * sum_e f_e * P_e`` of the other layer rows.
"""

import importlib
import importlib.metadata
import importlib.util
import os

import torch
import torch.nn.functional as F

from roofline import GATED

# moeblaze activation name -> SonicMoE ActivationType member name
SONICMOE_ACTIVATIONS = {"swiglu": "SWIGLU", "geglu": "GEGLU", "reglu": "REGLU", "silu": "SILU",
                        "gelu": "GELU", "relu": "RELU", "relu2": "RELU_SQ"}

_cache = {}


def _import_peer(name, modules):
    """(module `name`, None) once it and `modules` import, else (None, reason); never raises."""
    if name not in _cache:
        try:
            module = importlib.import_module(name)
            for extra in modules:
                importlib.import_module(extra)
            _cache[name] = (module, None)
        except Exception as error:  # noqa: BLE001 (reported as the row's skip reason)
            _cache[name] = (None, f"{name} not importable: {type(error).__name__}: {error}")
    return _cache[name]


# Package distributions of the peers and what they import as; a peer run from a source tree has no
# distribution metadata, so the environment variable below names its commit instead.
PEER_DISTRIBUTIONS = {"sonic-moe": "sonicmoe", "quack-kernels": "quack",
                      "nvidia-cutlass-dsl": "cutlass", "megablocks": "megablocks",
                      "grouped_gemm": "grouped_gemm", "stanford-stk": "stk"}
PEERS_NOTE_ENV = "MOEBLAZE_BENCH_PEERS"


def peer_versions():
    """What the results JSON records of the peers, without importing them (SonicMoE's import
    compiles): each distribution's version, "source tree" for a package found without one, and
    $MOEBLAZE_BENCH_PEERS (free text, e.g. the commits of source trees) as "described"."""
    found = {}
    for dist, module in PEER_DISTRIBUTIONS.items():
        try:
            found[dist] = importlib.metadata.version(dist)
            continue
        except importlib.metadata.PackageNotFoundError:
            pass
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            found[dist] = "source tree (no package metadata)"
    note = os.environ.get(PEERS_NOTE_ENV, "").strip()
    if note:
        found["described"] = note
    return found


def sonicmoe():
    """(module, None) or (None, reason): never raises."""
    return _import_peer("sonicmoe", ("sonicmoe.functional", "sonicmoe.enums"))


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


# The glu-ness SonicMoE's cached dX kernel is for ("last") and the other one's entries ("stash").
_sonicmoe_dx = {"last": None, "stash": {True: {}, False: {}}}


def _is_dx_entry(key):
    return (isinstance(key, tuple) and key[:1] == ("dx",)) or (
        isinstance(key, str) and key.startswith("dx-"))


def separate_sonicmoe_dx_kernels(activation):
    """SonicMoE caches its compiled dX GEMM and tensor maps (``_up_projection_backward.
    compile_cache`` in ``sonicmoe/functional/backward.py``) under keys without the activation's
    glu-ness (``is_glu`` there is the enums function, not the bool), so in one process a non-gated
    layer after a gated one of the same shape (or the reverse) would run the other's kernel and
    tile configuration. Whenever the glu-ness changes, the entries of the other glu-ness are put
    aside and this one's put back: each activation runs the kernel SonicMoE compiles for it, and
    each compiles once a process (in the benchmark's warm-up)."""
    gated = activation in GATED
    last = _sonicmoe_dx["last"]
    if last == gated:
        return
    _sonicmoe_dx["last"] = gated
    try:
        backward = importlib.import_module("sonicmoe.functional.backward")
    except Exception:  # noqa: BLE001 (no SonicMoE: nothing cached)
        return
    cache = getattr(getattr(backward, "_up_projection_backward", None), "compile_cache", None)
    if not isinstance(cache, dict):
        return
    current = {key: cache.pop(key) for key in list(cache) if _is_dx_entry(key)}
    if last is not None:  # entries from before the first call: glu-ness unknown, dropped
        _sonicmoe_dx["stash"][last] = current
    cache.update(_sonicmoe_dx["stash"][gated])
    _sonicmoe_dx["stash"][gated] = {}


def token_order_indices(num_tokens, top_k, device):
    """token_indices [T*k] int32 for routed pairs in (t, j) order: ascending, as SonicMoE asks."""
    return torch.arange(num_tokens, device=device, dtype=torch.int32).repeat_interleave(top_k)


def sonicmoe_experts(x, g, w1, w_down, ids, token_indices, activation):
    """y [T, d] = SonicMoE's experts layer with the routing given (g [T, k] fp32, ids [T, k])."""
    functional = importlib.import_module("sonicmoe.functional")
    separate_sonicmoe_dx_kernels(activation)
    E = w_down.shape[0]
    stream = torch.cuda.current_stream().cuda_stream
    y, _ = functional.moe_general_routing_inputs(
        x, g.reshape(-1), token_indices, ids.reshape(-1), w1.permute(1, 2, 0), None,
        w_down.permute(1, 2, 0), None, E, stream, _activation_type(activation))
    return y


def sonicmoe_layer(d, h, E, k, activation, w_router, w_gate, w_up, w_down):
    """A sonicmoe.MoE holding the given weights (copied into its own layout once)."""
    module = importlib.import_module("sonicmoe")
    separate_sonicmoe_dx_kernels(activation)
    layer = module.MoE(num_experts=E, num_experts_per_tok=k, hidden_size=d, intermediate_size=h,
                       activation_function=_activation_type(activation), add_bias=False,
                       std=0.02).to(device=w_gate.device, dtype=w_gate.dtype)
    with torch.no_grad():
        layer.router.weight.copy_(w_router)
        layer.c_fc.weight.copy_(fuse_up_projection(w_gate, w_up))
        layer.c_proj.weight.copy_(w_down)
    return layer


# ------------------------------------------------------------------------------------------------
# MegaBlocks
# ------------------------------------------------------------------------------------------------


def _relu2(x):
    return torch.square(F.relu(x))


# moeblaze activation -> (MegaBlocks mlp_type, the activation_fn it applies to x w1^T). GELU is the
# exact erf form, as in bench/baselines.py (MegaBlocks' own default is the tanh approximation).
MEGABLOCKS_ACTIVATIONS = {"swiglu": ("glu", F.silu), "geglu": ("glu", F.gelu),
                          "reglu": ("glu", F.relu), "silu": ("mlp", F.silu),
                          "gelu": ("mlp", F.gelu), "relu": ("mlp", F.relu),
                          "relu2": ("mlp", _relu2)}


def megablocks():
    """(module, None) or (None, reason): never raises. megablocks imports without grouped_gemm (a
    warning), but its grouped path cannot run without it."""
    return _import_peer("megablocks", ("megablocks.layers.arguments", "megablocks.layers.dmoe",
                                       "megablocks.layers.moe", "grouped_gemm"))


def megablocks_unsupported(activation, dtype, device):
    """Why MegaBlocks cannot run this row, or None."""
    if device != "cuda":
        return "MegaBlocks runs on CUDA only"
    if dtype != torch.bfloat16:
        return f"MegaBlocks' grouped GEMMs (grouped_gemm) take bf16 only, not {dtype}"
    if activation not in MEGABLOCKS_ACTIVATIONS:
        return f"no MegaBlocks activation_fn for {activation!r}"
    _, reason = megablocks()
    return reason


def to_megablocks_weights(w_gate, w_up, w_down):
    """MegaBlocks' dMoE parameters from the canonical weights: (w1, v1 or None, w2), each
    [E*h, d]: w1 = w_gate and v1 = w_up with expert e's rows at e*h..e*h+h-1, w2 = w_down^T."""
    E, h, d = w_gate.shape
    w1 = w_gate.detach().reshape(E * h, d).clone()
    v1 = None if w_up is None else w_up.detach().reshape(E * h, d).clone()
    w2 = w_down.detach().transpose(1, 2).reshape(E * h, d).clone()
    return w1, v1, w2


def from_megablocks_weights(w1, v1, w2, num_experts):
    """Inverse of to_megablocks_weights, also for their gradients: (w_gate, w_up or None, w_down)
    with w_gate/w_up [E, h, d] and w_down [E, d, h] (views)."""
    def experts(w):
        return None if w is None else w.reshape(num_experts, -1, w.shape[-1])
    down = experts(w2)
    return experts(w1), experts(v1), None if down is None else down.transpose(1, 2)


def megablocks_arguments(d, h, E, k, activation, device):
    """The dMoE's Arguments: grouped GEMMs, bf16, no bias, no expert parallelism; the top-k
    probabilities renormalised to sum 1; load-balancing loss weight 1."""
    arguments = importlib.import_module("megablocks.layers.arguments")
    mlp_type, activation_fn = MEGABLOCKS_ACTIVATIONS[activation]
    return arguments.Arguments(
        hidden_size=d, ffn_hidden_size=h, moe_num_experts=E, moe_top_k=k, mlp_type=mlp_type,
        mlp_impl="grouped", activation_fn=activation_fn, bias=False, return_bias=False,
        fp16=False, bf16=True, device=device, moe_normalize_expert_weights=1,
        moe_loss_weight=1.0, num_layers=1, init_method=_no_init, output_layer_init_method=_no_init)


def _no_init(_weight):
    """The weights are copied in after construction: no random initialisation needed."""


def _load_megablocks_weights(mlp, w_gate, w_up, w_down):
    w1, v1, w2 = to_megablocks_weights(w_gate, w_up, w_down)
    with torch.no_grad():
        mlp.w1.copy_(w1)
        mlp.w2.copy_(w2)
        if v1 is not None:
            mlp.v1.copy_(v1)


def megablocks_parameters(mlp, gated):
    """The expert parameters of a MegaBlocks mlp in moeblaze's order: (w1, v1 or None, w2)."""
    return mlp.w1, (mlp.v1 if gated else None), mlp.w2


def megablocks_experts_module(d, h, E, k, activation, w_gate, w_up, w_down):
    """A ParallelDroplessMLP (the dMoE's experts) holding the given weights in its layout."""
    dmoe = importlib.import_module("megablocks.layers.dmoe")
    experts = dmoe.ParallelDroplessMLP(megablocks_arguments(d, h, E, k, activation,
                                                            w_gate.device))
    _load_megablocks_weights(experts.mlp, w_gate, w_up, w_down)
    return experts


def megablocks_experts(experts, x, ids, g):
    """y [T, d]: the dMoE's expert computation with the routing given (ids [T, k], g [T, k])."""
    y, _tokens_per_expert = experts.forward_once(x, g, ids)
    return y


def megablocks_layer(d, h, E, k, activation, w_router, w_gate, w_up, w_down):
    """A megablocks dMoE (router + experts) holding the given weights."""
    dmoe = importlib.import_module("megablocks.layers.dmoe")
    layer = dmoe.dMoE(megablocks_arguments(d, h, E, k, activation, w_gate.device))
    with torch.no_grad():
        layer.router.layer.weight.copy_(w_router)
    _load_megablocks_weights(layer.experts.mlp, w_gate, w_up, w_down)
    return layer


def megablocks_layer_forward(layer, x):
    """(y, load-balancing loss) of a dMoE in training mode: the loss is collected from
    MegaBlocks' module-level list, which is emptied before and after."""
    moe = importlib.import_module("megablocks.layers.moe")
    moe.clear_load_balancing_loss()
    try:
        y = layer(x)
        aux = moe.batched_load_balancing_loss(layer.experts.args)
    finally:
        moe.clear_load_balancing_loss()
    return y, aux
