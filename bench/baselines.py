"""PyTorch baselines for one MoE expert layer, forward + backward through plain autograd.

Both compute exactly moeblaze's experts layer (see include/moeblaze.h):

    for each routed pair (t, j), e = ids[t, j]:
        a = x_t . w_gate[e]^T        b = x_t . w_up[e]^T (gated activations only)
        u = act(a, b)                y2 = u . w_down[e]^T
    y_t = sum_j g[t, j] * y2_(t, j)

Shapes: x [T,d], ids [T,k] int32, g [T,k] fp32, w_gate/w_up [E,h,d], w_down [E,d,h].

* ``moe_loop``: one expert at a time (the "for-loop" dataflow of torchtitan / HF Mixtral): sort the
  routed pairs by expert, one host sync for the per-expert counts, per-expert matmuls, weighted
  index_add into an fp32 ``y``. Run on fp32/fp64 inputs it is also the harness's reference.
* ``moe_grouped_mm``: the sort -> gathered copy ``x[perm]`` -> ``torch._grouped_mm`` per projection
  -> activation -> weighted scatter_add dataflow (torchtitan's ``MoE.forward`` without padding),
  with no host synchronisation (offsets stay on the device).

``moe_layer`` adds the router in front of either: logits = x . w_router^T, top-k of the logits, a
softmax over the k chosen (moeblaze's ``score_function="topk_softmax"``, SonicMoE's router), and
the switch load-balancing loss ``E * sum_e P_e * f_e`` (P_e the mean router probability of expert
e, f_e its share of the routed pairs).

All are written for this project; none imports moeblaze. PyTorch autograd computes their
backward. Works with torch 1.13 (CPU, Debian) and 2.x (CUDA).

Nothing here comes from bindings/python/tests/reference.py, on purpose: that is the package tests'
oracle (per-token Python loops straight from the header's math, plus the router and its losses),
over 10x slower than ``moe_loop`` even on the CPU at T=2048 and hopeless at benchmark sizes (one
small matmul per routed pair), while the baselines are timing subjects that must stay vectorised.
The two share only the activation table below.
"""

import torch
import torch.nn.functional as F

from roofline import GATED  # the gated activations: one list for every file of bench/

ACTIVATIONS = ("swiglu", "geglu", "reglu", "silu", "gelu", "relu", "relu2")


def is_gated(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
    return activation in GATED


def apply_activation(activation, a, b=None):
    """u = act(a, b) in the input dtype (GELU is the exact erf form; relu'(0) = 0)."""
    if activation == "swiglu":
        return F.silu(a) * b
    if activation == "geglu":
        return F.gelu(a) * b
    if activation == "reglu":
        return F.relu(a) * b
    if activation == "silu":
        return F.silu(a)
    if activation == "gelu":
        return F.gelu(a)
    if activation == "relu":
        return F.relu(a)
    if activation == "relu2":
        return torch.square(F.relu(a))
    raise ValueError(f"unknown activation {activation!r}")


def _accumulation_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_shapes(x, ids, g, w_gate, w_up, w_down, activation):
    T, d = x.shape
    E, h, d2 = w_gate.shape
    if d2 != d or tuple(w_down.shape) != (E, d, h):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, w_gate {tuple(w_gate.shape)}, "
                         f"w_down {tuple(w_down.shape)}")
    if ids.shape != g.shape or ids.shape[0] != T:
        raise ValueError(f"ids {tuple(ids.shape)} and g {tuple(g.shape)} must both be [T,k]")
    if is_gated(activation):
        if w_up is None or tuple(w_up.shape) != (E, h, d):
            raise ValueError("gated activations need w_up [E,h,d]")


def sort_by_expert(ids):
    """Routed pairs grouped by expert, stable (ascending token id inside each expert).

    Returns (perm [N] int64: flat pair index t*k+j in expert order, token [N] int64: its token id).
    """
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    perm = torch.sort(flat, stable=True).indices
    return perm, torch.div(perm, k, rounding_mode="floor")


def expert_counts(ids, num_experts):
    """[E] int32 tokens per expert, computed on the device without a host sync."""
    flat = ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))


def moe_loop(x, ids, g, w_gate, w_up, w_down, activation="swiglu"):
    """Per-expert loop. y [T,d] in x.dtype; combine accumulated in fp32 (fp64 for fp64 inputs)."""
    _check_shapes(x, ids, g, w_gate, w_up, w_down, activation)
    gated = is_gated(activation)
    T, d = x.shape
    E = w_gate.shape[0]
    acc = _accumulation_dtype(x.dtype)

    perm, token = sort_by_expert(ids)
    counts = expert_counts(ids, E).tolist()  # the loop's one host sync
    g_sorted = g.reshape(-1).index_select(0, perm)

    # unbind (backward = one stack) rather than w[e] per expert (backward = E full-size buffers)
    gate_rows = w_gate.unbind(0)
    up_rows = w_up.unbind(0) if gated else None
    down_rows = w_down.unbind(0)

    y = torch.zeros((T, d), dtype=acc, device=x.device)
    start = 0
    for e in range(E):
        n = counts[e]
        if n == 0:
            continue
        tok_e = token[start:start + n]
        g_e = g_sorted[start:start + n]
        start += n
        x_e = x.index_select(0, tok_e)                                  # [n, d]
        a = x_e @ gate_rows[e].t()                                      # [n, h]
        b = x_e @ up_rows[e].t() if gated else None                     # [n, h]
        u = apply_activation(activation, a, b)                          # [n, h]
        y2 = u @ down_rows[e].t()                                       # [n, d]
        y.index_add_(0, tok_e, y2.to(acc) * g_e.to(acc)[:, None])
    return y.to(x.dtype)


def grouped_mm_available():
    """True when this torch has a grouped GEMM (torch >= 2.8 on CUDA sm80+)."""
    return _grouped_mm_op() is not None


def _grouped_mm_op():
    fn = getattr(F, "grouped_mm", None)
    if fn is None:
        fn = getattr(torch, "_grouped_mm", None)
    return fn


def _torch_grouped_mm(a, b, offs):
    return _grouped_mm_op()(a, b, offs=offs)


def grouped_mm_emulated(a, b, offs):
    """Reference semantics of grouped_mm (2D x 3D): rows offs[i-1]:offs[i] of a times b[i].

    For tests on torches without grouped_mm; it syncs with the host, so never time it.
    """
    ends = offs.tolist()
    outs, start = [], 0
    for i, end in enumerate(ends):
        outs.append(a[start:end] @ b[i])
        start = end
    return torch.cat(outs, 0)


def moe_grouped_mm(x, ids, g, w_gate, w_up, w_down, activation="swiglu", grouped_mm=None):
    """Sort -> gathered copy -> grouped GEMMs -> activation -> weighted scatter_add.

    `grouped_mm` overrides the GEMM (tests pass grouped_mm_emulated on CPU); by default
    F.grouped_mm / torch._grouped_mm, which needs bf16 CUDA tensors.
    """
    _check_shapes(x, ids, g, w_gate, w_up, w_down, activation)
    if grouped_mm is None:
        if not grouped_mm_available():
            raise NotImplementedError("this torch has no torch._grouped_mm")
        grouped_mm = _torch_grouped_mm
    gated = is_gated(activation)
    T, d = x.shape
    E = w_gate.shape[0]

    perm, token = sort_by_expert(ids)
    offs = torch.cumsum(expert_counts(ids, E), 0, dtype=torch.int32)   # [E] group ends
    g_sorted = g.reshape(-1).index_select(0, perm)                      # [N]
    x_sorted = x.index_select(0, token)                                 # [N, d] gathered copy

    a = grouped_mm(x_sorted, w_gate.transpose(-2, -1), offs)            # [N, h]
    b = grouped_mm(x_sorted, w_up.transpose(-2, -1), offs) if gated else None
    u = apply_activation(activation, a, b)                              # [N, h]
    y2 = grouped_mm(u, w_down.transpose(-2, -1), offs)                  # [N, d]

    # torchtitan: weight in fp32, round to the storage dtype, scatter_add into y
    acc = _accumulation_dtype(x.dtype)
    routed = (y2.to(acc) * g_sorted.to(acc)[:, None]).to(x.dtype)
    y = torch.zeros_like(x)
    return y.scatter_add(0, token[:, None].expand(-1, d), routed)


def moe_dense_reference(x, ids, g, w_gate, w_up, w_down, activation="swiglu"):
    """Every expert on every token, masked by a dense [T,E] gate matrix: independent of the
    sort/index logic above, for tests on tiny shapes only (E times the work)."""
    _check_shapes(x, ids, g, w_gate, w_up, w_down, activation)
    gated = is_gated(activation)
    T = x.shape[0]
    E = w_gate.shape[0]
    dense_g = torch.zeros((T, E), dtype=g.dtype, device=g.device)
    dense_g = dense_g.scatter(1, ids.long(), g)
    a = torch.einsum("td,ehd->teh", x, w_gate)
    b = torch.einsum("td,ehd->teh", x, w_up) if gated else None
    u = apply_activation(activation, a, b)
    y2 = torch.einsum("teh,edh->ted", u, w_down)
    return torch.einsum("ted,te->td", y2, dense_g.to(y2.dtype))


def route_topk_softmax(logits, top_k):
    """ids [T,k] int32 (top-k of the logits), g [T,k] = softmax over the chosen logits in the
    accumulation dtype."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    g = torch.softmax(top.to(_accumulation_dtype(logits.dtype)), dim=-1)
    return ids.to(torch.int32), g


def expert_fractions(ids, num_experts, dtype=torch.float32):
    """f_e [E]: the share of routed pairs that went to expert e (no gradient)."""
    return expert_counts(ids, num_experts).to(dtype) / ids.numel()


def moe_layer(x, w_router, w_gate, w_up, w_down, top_k, activation="swiglu", experts=None,
              fractions=None, num_tokens=None):
    """Router + experts. Returns (y [T,d], switch loss).

    `experts` is moe_loop (default) or moe_grouped_mm (or a partial of it). For a reference run
    over chunks of tokens pass the whole batch's `fractions` (expert_fractions) and `num_tokens`:
    the chunks' losses then sum to the whole batch's, and so do their gradients."""
    experts = experts or moe_loop
    E = w_router.shape[0]
    logits = x @ w_router.t()
    ids, g = route_topk_softmax(logits, top_k)
    y = experts(x, ids, g.to(torch.float64 if x.dtype == torch.float64 else torch.float32),
                w_gate, w_up, w_down, activation)
    probs = torch.softmax(logits.to(_accumulation_dtype(logits.dtype)), dim=-1)
    if fractions is None:
        fractions = expert_fractions(ids, E, probs.dtype)
    T = num_tokens or x.shape[0]
    aux = E * (probs.sum(0) / T * fractions.to(probs.dtype)).sum()
    return y, aux


def moe_layer_grouped_mm(x, w_router, w_gate, w_up, w_down, top_k, activation="swiglu",
                         grouped_mm=None):
    """moe_layer over the grouped_mm dataflow (no host synchronisation on CUDA)."""
    def experts(*args):
        return moe_grouped_mm(*args, grouped_mm=grouped_mm)
    return moe_layer(x, w_router, w_gate, w_up, w_down, top_k, activation, experts=experts)
