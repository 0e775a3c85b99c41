"""Plain PyTorch reference of the moeblaze layer: per-token loops, straight from the header's math.

Autograd through this module gives the reference gradients (top-k selection is piecewise constant:
ids are taken from the forward and do not carry gradient, exactly as in the library).

Kept apart from bench/baselines.py (vectorised PyTorch MoE layers that the benchmark times and, in
fp32/fp64, uses as its reference): this oracle stays as plain as the math, and the package tests
run from the installed package layout, where bench/ does not exist."""

import math

import torch
import torch.nn.functional as F

GATED = {"swiglu", "geglu", "reglu"}


def activation(name, a, b):
    if name == "swiglu":
        return F.silu(a) * b
    if name == "geglu":
        return F.gelu(a) * b
    if name == "reglu":
        return F.relu(a) * b
    if name == "silu":
        return F.silu(a)
    if name == "gelu":
        return F.gelu(a)
    if name == "relu":
        return F.relu(a)
    if name == "relu2":
        return F.relu(a) ** 2
    raise ValueError(name)


def experts(x, ids, g, w_gate, w_up, w_down, act="swiglu"):
    """y[t] = sum_j g[t,j] * w_down[e] @ act(w_gate[e] @ x[t], w_up[e] @ x[t]), e = ids[t,j]."""
    T, k = ids.shape
    rows = []
    for t in range(T):
        acc = torch.zeros_like(x[t])
        for j in range(k):
            e = int(ids[t, j])
            a = w_gate[e] @ x[t]
            b = w_up[e] @ x[t] if act in GATED else None
            acc = acc + g[t, j].to(x.dtype) * (w_down[e] @ activation(act, a, b))
        rows.append(acc)
    return torch.stack(rows) if rows else torch.zeros_like(x)


def route(logits, top_k, score_function="softmax_topk", renormalize=False):
    """ids (descending score, ties to the lower id), g (differentiable in logits), scores."""
    T, E = logits.shape
    if score_function == "softmax_topk":
        scores = torch.softmax(logits, dim=-1)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits)
    elif score_function == "topk_softmax":
        scores = logits
    else:
        raise ValueError(score_function)
    # Stable descending order: sort by (-score, id). Selection carries no gradient.
    plain = scores.detach().tolist()
    ids = torch.stack([
        torch.tensor(sorted(range(E), key=lambda e: (-plain[t][e], e))[:top_k])
        for t in range(T)]) if T else torch.zeros((0, top_k), dtype=torch.long)
    picked = torch.gather(scores, 1, ids)
    if score_function == "topk_softmax":
        g = torch.softmax(picked, dim=-1)
    else:
        g = picked
        if renormalize:
            g = g / g.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), g


def router_losses(logits, ids, score_function, aux_loss_coeff, z_loss_coeff):
    T, E = logits.shape
    k = ids.shape[1]
    if score_function == "sigmoid":
        s = torch.sigmoid(logits)
        probs = s / s.sum(dim=-1, keepdim=True)
    else:
        probs = torch.softmax(logits, dim=-1)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E).to(logits.dtype)
    f = counts / (T * k)
    P = probs.mean(dim=0)
    aux = aux_loss_coeff * E * (f * P).sum()
    z = z_loss_coeff * (torch.logsumexp(logits, dim=-1) ** 2).mean()
    return aux, z


def layer(x, w_router, w_gate, w_up, w_down, top_k, act="swiglu", score_function="softmax_topk",
          renormalize=False, aux_loss_coeff=0.0, z_loss_coeff=0.0):
    """Whole-layer reference: returns y, aux, z, ids, g."""
    route_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    logits = x.to(route_dtype) @ w_router.to(route_dtype).t()
    ids, g = route(logits, top_k, score_function, renormalize)
    y = experts(x, ids, g, w_gate, w_up, w_down, act)
    aux, z = router_losses(logits, ids, score_function, aux_loss_coeff, z_loss_coeff)
    return y, aux, z, ids, g


def random_weights(E, d, h, act, dtype=torch.float64, generator=None, scale=1.0):
    def u(*shape, fan_in):
        bound = scale / math.sqrt(fan_in)
        return (torch.rand(*shape, generator=generator, dtype=torch.float64) * 2 - 1).mul(
            bound).to(dtype)
    w_router = u(E, d, fan_in=d)
    w_gate = u(E, h, d, fan_in=d)
    w_up = u(E, h, d, fan_in=d) if act in GATED else None
    w_down = u(E, d, h, fan_in=h)
    return w_router, w_gate, w_up, w_down


def random_routing(T, E, k, dtype=torch.float64, generator=None):
    ids = torch.stack([torch.randperm(E, generator=generator)[:k] for _ in range(T)]).to(
        torch.int32) if T else torch.zeros((0, k), dtype=torch.int32)
    g = torch.rand(T, k, generator=generator, dtype=torch.float64).to(dtype)
    return ids, g
