"""Expert parallelism over torch.distributed: experts spread over ranks, tokens travel to them.

`ExpertParallelMoE` is the multi-rank twin of `moeblaze.torch.MoE`. Every rank holds the router
weight (replicated) and only its own contiguous slice of the experts; each rank feeds its own
tokens. One forward:

1. route locally: logits = x . w_router^T, then moeblaze's router (ids, g; ties to the lower id);
2. exchange the per-expert counts (one all_to_all_single of E+1 integers per rank pair) and copy
   them to the host: the only host synchronisation, inherent to point-to-point exchanges whose
   sizes the host must know (see docs/design/expert-parallel.md);
3. send each routed row to the rank owning its expert, packed in moeblaze's expert-grouped order
   (expert, then token): no padding to a capacity, no dropped tokens;
4. run the local experts on the received rows with `moeblaze.torch.moe_experts`: the received rows
   are a token batch of their own with k = 1, ids remapped to local experts;
5. send the results back and combine each token's k rows in slot order j = 0..k-1.

Backward mirrors it with the forward's split sizes (no count exchange, no host sync): the row
gradients travel back to the expert ranks, the expert backward produces the weight gradients of
the local experts over the rows of every rank, and the input-row gradients travel home.

Gradient convention: the gradients are those of the sum over ranks of each rank's objective (what
`loss.backward()` on every rank computes together). The experts' weights get their complete
gradient from the exchange. The router weight is replicated: each rank holds the share of its own
tokens; `allreduce_replicated_grads()` sums the shares in rank order (deterministic; DDP would
average instead). The returned aux and z losses are this rank's shares of the global-batch losses:
their sum over ranks equals the single-device layer's losses on the concatenated batch.

Every rank must call forward and backward the same number of times, as for any collective.
Works with the gloo backend (CPU tensors) and NCCL (CUDA tensors). Uses only APIs present in torch
1.13 through 2.x.
"""

from __future__ import annotations

import ctypes
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from . import _args, _lib
from .torch import (MoE, _init_moe_module, _reset_moe_parameters, get_layer, moe_experts,
                    routing_dtype)

_ALIGNMENT = 16
_WEIGHTS_ON = ("expert", "home")

__all__ = [
    "ExpertParallelMoE",
    "expert_parallel_moe",
    "expert_ranges",
    "allreduce_replicated_grads",
]


# ------------------------------------------------------------------------------------------------
# Expert placement
# ------------------------------------------------------------------------------------------------


def expert_ranges(num_experts: int, world_size: int) -> List[Tuple[int, int]]:
    """[begin, end) of the experts each rank owns: contiguous, the first E % W ranks one more."""
    if world_size < 1 or num_experts < world_size:
        raise ValueError(f"expert parallelism needs 1 <= world_size <= num_experts, got "
                         f"world_size={world_size}, num_experts={num_experts}")
    base, extra = divmod(num_experts, world_size)
    ranges, begin = [], 0
    for rank in range(world_size):
        end = begin + base + (1 if rank < extra else 0)
        ranges.append((begin, end))
        begin = end
    return ranges


def _group_info(group) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("moeblaze.distributed needs torch.distributed.init_process_group() "
                           "first")
    return dist.get_rank(group), dist.get_world_size(group)


# ------------------------------------------------------------------------------------------------
# Tensor plumbing (the library needs contiguous, 16-byte aligned buffers)
# ------------------------------------------------------------------------------------------------


def _ready(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.contiguous()
    if tensor.data_ptr() % _ALIGNMENT:
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _bytes(device: torch.device, size: int) -> torch.Tensor:
    return torch.empty(max(int(size), 1), dtype=torch.uint8, device=device)


def _stream_of(device: torch.device):
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


class _OnDevice:
    """Makes a CUDA tensor's device current for the duration of a library call."""

    def __init__(self, device: torch.device):
        self.guard = torch.cuda.device(device) if device.type == "cuda" else None

    def __enter__(self):
        if self.guard is not None:
            self.guard.__enter__()

    def __exit__(self, *exc):
        if self.guard is not None:
            self.guard.__exit__(*exc)


# ------------------------------------------------------------------------------------------------
# Autograd pieces
# ------------------------------------------------------------------------------------------------


def _wire_view(rows: torch.Tensor) -> torch.Tensor:
    # An exchange only moves bytes; gloo has no bfloat16, so move those bits as float16 (on every
    # backend, so that the choice never depends on how the group was created).
    return rows.view(torch.float16) if rows.dtype == torch.bfloat16 else rows


def _exchange(rows: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
              group) -> torch.Tensor:
    """all_to_all_single of the rows of `rows`: send_splits[r] rows go to rank r (in order),
    recv_splits[r] rows come from rank r, concatenated by source rank."""
    rows = rows.contiguous()
    out = torch.empty((sum(recv_splits),) + tuple(rows.shape[1:]), dtype=rows.dtype,
                      device=rows.device)
    dist.all_to_all_single(_wire_view(out), _wire_view(rows),
                           output_split_sizes=list(recv_splits),
                           input_split_sizes=list(send_splits), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """The exchange of one or more row-aligned tensors (rows and their g), in a fixed order. The
    backward is the transposed exchange with the same split sizes, so the backward pass needs
    neither a count exchange nor a host synchronisation. Exchanging the tensors of one step in
    one Function keeps the order of collectives the same on every rank without relying on the
    autograd engine's scheduling of independent nodes."""

    @staticmethod
    def forward(ctx, send_splits, recv_splits, group, *tensors):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        return tuple(_exchange(t, send_splits, recv_splits, group) for t in tensors)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        return (None, None, None) + tuple(
            _exchange(grad, ctx.recv_splits, ctx.send_splits, ctx.group) for grad in grads)


class _Dispatch(torch.autograd.Function):
    """send[i] = x[order[i] // k]: the routed rows in send order. Backward sums each token's k row
    gradients in slot order j = 0..k-1 (gathers only: deterministic without atomics, unlike
    index_select's index_add backward on CUDA), in at least float32, rounded once."""

    @staticmethod
    def forward(ctx, x, order, inverse, top_k):
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        ctx.num_tokens = x.shape[0]
        return x.index_select(0, torch.div(order, top_k, rounding_mode="floor"))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_send):
        (inverse,) = ctx.saved_tensors
        k = ctx.top_k
        per_slot = grad_send.index_select(0, inverse).view(ctx.num_tokens, k, grad_send.shape[1])
        acc_dtype = routing_dtype(grad_send.dtype)
        dx = per_slot[:, 0].to(acc_dtype)
        for j in range(1, k):
            dx = dx + per_slot[:, j].to(acc_dtype)
        return dx.to(grad_send.dtype), None, None, None


class _Permute(torch.autograd.Function):
    """out = rows[index]; `index` is a permutation and `inverse` its inverse, so the backward is a
    gather as well (exact and deterministic)."""

    @staticmethod
    def forward(ctx, rows, index, inverse):
        ctx.save_for_backward(inverse)
        return rows.index_select(0, index)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        (inverse,) = ctx.saved_tensors
        return grad_out.index_select(0, inverse), None, None


class _Router(torch.autograd.Function):
    """moeblaze's router on this rank's logits: (ids, g) with the library's exact score function,
    top-k (ties to the lower expert id) and renormalisation; backward is moeblaze_router_backward
    (J^T dg). The load-balancing and z losses are not computed here: they need global statistics
    and are formed in torch math by the caller (`_router_losses`)."""

    @staticmethod
    def forward(ctx, logits, layer):
        T = logits.shape[0]
        k = int(layer.top_k)
        device = logits.device
        logits = _ready(logits)
        ids = torch.empty((T, k), dtype=torch.int32, device=device)
        g = torch.empty((T, k), dtype=logits.dtype, device=device)
        workspace_size = layer.workspace_size(_lib.PASS_ROUTER_FORWARD, T)
        workspace = _bytes(device, workspace_size)
        with _OnDevice(device):
            layer._lib.moeblaze_router_forward(layer.handle, T, logits.data_ptr(), ids.data_ptr(),
                                               g.data_ptr(), None, None, workspace.data_ptr(),
                                               workspace_size, _stream_of(device))
        ctx.mark_non_differentiable(ids)
        ctx.layer = layer
        ctx.save_for_backward(logits, ids)
        return ids, g

    @staticmethod
    @once_differentiable
    def backward(ctx, _grad_ids, grad_g):
        logits, ids = ctx.saved_tensors
        layer = ctx.layer
        T = logits.shape[0]
        device = logits.device
        grad_g = _ready(grad_g.to(logits.dtype))
        d_logits = torch.empty_like(logits)
        workspace_size = layer.workspace_size(_lib.PASS_ROUTER_BACKWARD, T)
        workspace = _bytes(device, workspace_size)
        with _OnDevice(device):
            layer._lib.moeblaze_router_backward(layer.handle, T, logits.data_ptr(),
                                                ids.data_ptr(), grad_g.data_ptr(), None,
                                                d_logits.data_ptr(), workspace.data_ptr(),
                                                workspace_size, _stream_of(device))
        return d_logits, None


def _float32_coefficient(value: float) -> float:
    # The library stores the coefficients as float; use the same value in float64 math.
    return ctypes.c_float(float(value)).value


def _router_losses(logits: torch.Tensor, global_counts: torch.Tensor, global_tokens: int,
                   num_experts: int, top_k: int, score_function: str, aux_loss_coeff: float,
                   z_loss_coeff: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's shares of the global-batch router losses (the library's definitions):

        aux = c_aux * E * sum_e (C_e / (T_g * k)) * (sum_t q[t, e] / T_g)
        z   = c_z * sum_t logsumexp(logits_t)^2 / T_g

    with C_e the global per-expert counts (piecewise constant: no gradient) and T_g the global
    token count. Both are linear in the per-token sums, so the shares (the same formulas with the
    sums over this rank's tokens) add up over ranks to the single-device losses, and each share's
    gradient with respect to this rank's logits is exact."""
    zero = logits.new_zeros(())
    aux = zero
    z = zero
    if global_tokens == 0:
        return aux, z
    if aux_loss_coeff != 0.0:
        if score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            balance = scores / scores.sum(dim=1, keepdim=True)
        else:
            balance = torch.softmax(logits, dim=1)
        fraction = global_counts.to(logits.dtype) / float(global_tokens * top_k)
        mean_share = balance.sum(dim=0) / float(global_tokens)
        aux = _float32_coefficient(aux_loss_coeff) * float(num_experts) * (fraction *
                                                                           mean_share).sum()
    if z_loss_coeff != 0.0:
        lse = torch.logsumexp(logits, dim=1)
        z = _float32_coefficient(z_loss_coeff) * (lse * lse).sum() / float(global_tokens)
    return aux, z


# ------------------------------------------------------------------------------------------------
# The layer, functional form
# ------------------------------------------------------------------------------------------------


class ExchangePlan:
    """The sizes of one forward's exchanges, known on the host after the one synchronisation.

    send_splits[r]: rows this rank sends to rank r; recv_splits[r]: rows it receives from rank r;
    recv_expert_counts[r][e]: of those, the rows for local expert e (rows arrive grouped by expert);
    global_counts[e]: tokens routed to expert e over all ranks; global_tokens: T over all ranks.
    `table` [W, E+1] int64 stays on the device: what the device needs is computed from it there,
    so that no host-to-device copy (a synchronisation for pageable memory) is needed either."""

    def __init__(self, table: torch.Tensor, rank: int, ranges: List[Tuple[int, int]]):
        num_experts = ranges[-1][1]
        begin, end = ranges[rank]
        self.table = table
        host = table.cpu().tolist()  # the forward's one device-to-host copy
        own = host[rank][:num_experts]
        self.send_splits = [sum(own[b:e]) for b, e in ranges]
        self.recv_expert_counts = [row[begin:end] for row in host]
        self.recv_splits = [sum(counts) for counts in self.recv_expert_counts]
        self.global_counts = [sum(row[e] for row in host) for e in range(num_experts)]
        self.global_tokens = sum(row[num_experts] for row in host)
        self.expert_begin, self.expert_end = begin, end

    def global_counts_on_device(self) -> torch.Tensor:
        return self.table[:, :-1].sum(dim=0)

    def received_local_ids(self) -> torch.Tensor:
        """[R, 1] int32: the local expert of each received row (sources in rank order, each
        source's rows grouped by expert)."""
        local = self.expert_end - self.expert_begin
        repeats = self.table[:, self.expert_begin:self.expert_end].reshape(-1)
        experts = torch.arange(local, dtype=torch.int32, device=self.table.device)
        ids = torch.repeat_interleave(experts.repeat(self.table.shape[0]), repeats,
                                      output_size=sum(self.recv_splits))
        return ids.view(-1, 1)


def _plan_exchange(ids: torch.Tensor, num_tokens: int, num_experts: int, rank: int,
                   ranges: List[Tuple[int, int]], group) -> ExchangePlan:
    """Every rank sends every rank its per-expert counts and its token count (one all-to-all of
    E+1 integers per pair of ranks); the received table is copied to the host once."""
    world = len(ranges)
    flat = ids.reshape(-1).long()
    # Integer scatter-add: exact in any order; torch.bincount would synchronise on CUDA.
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    row = torch.cat([counts, counts.new_full((1,), num_tokens)])
    table = _exchange(row.repeat(world), [num_experts + 1] * world, [num_experts + 1] * world,
                      group)
    return ExchangePlan(table.view(world, num_experts + 1), rank, ranges)


def _send_order(ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The order in which routed pairs p = t*k + j are sent: by expert, then by p (= by token,
    since a token's k experts are distinct). Experts are contiguous over ranks, so this is also by
    destination rank, and it is moeblaze's expert-grouped row order (expert_token_indices). The
    sort keys are unique, so any sort algorithm gives this one order."""
    flat = ids.reshape(-1).long()
    num_pairs = flat.numel()
    pair = torch.arange(num_pairs, device=flat.device)
    order = torch.argsort(flat * max(num_pairs, 1) + pair)
    inverse = torch.empty_like(order)
    inverse[order] = pair  # a permutation: no two writes to one place
    return order, inverse


def expert_parallel_moe(x: torch.Tensor, w_router: torch.Tensor, w_gate: torch.Tensor,
                        w_up: Optional[torch.Tensor], w_down: torch.Tensor, *, num_experts: int,
                        top_k: int, activation: str = "swiglu", checkpoint: str = "save_preact",
                        score_function: str = "softmax_topk", renormalize: bool = False,
                        aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                        weights_on: str = "expert", group=None, consume_saved: bool = True):
    """One expert-parallel MoE layer over `group` (default: the world).

    x [T,d] this rank's tokens; w_router [E,d] (the same on every rank); w_gate/w_up [E_r,h,d] and
    w_down [E_r,d,h] the E_r experts this rank owns (`expert_ranges(E, world)[rank]`).

    `weights_on`: "expert" (default) sends g with the rows and lets the expert rank's moeblaze call
    apply it, so dg is computed there exactly as on one device (<v, u>) and the home rank keeps no
    activation for backward; "home" runs the experts with g = 1 and weights on the home rank
    (dg = <dy_t, y2_(t,j)>, which keeps the returned y2 rows alive for backward).

    Returns (y [T,d], aux_share, z_share, plan); see the module docstring for the loss shares."""
    if weights_on not in _WEIGHTS_ON:
        raise ValueError(f"weights_on must be one of {_WEIGHTS_ON}, got {weights_on!r}")
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, d_model], got shape {list(x.shape)}")
    rank, world = _group_info(group)
    ranges = expert_ranges(num_experts, world)
    begin, end = ranges[rank]
    T, d = x.shape
    k = _args.integer(top_k, "top_k")
    E = _args.integer(num_experts, "num_experts")
    renormalize = _args.flag(renormalize, "renormalize")
    consume_saved = _args.flag(consume_saved, "consume_saved")
    h = w_gate.shape[1]
    if tuple(w_router.shape) != (E, d):
        raise ValueError(f"w_router: expected shape {[E, d]}, got {list(w_router.shape)}")
    if w_gate.shape[0] != end - begin or w_down.shape[0] != end - begin:
        raise ValueError(f"rank {rank} owns experts [{begin}, {end}): w_gate and w_down need "
                         f"{end - begin} experts, got {w_gate.shape[0]} and {w_down.shape[0]}")
    route_dtype = routing_dtype(x.dtype)
    device = x.device

    # 1. Route locally (the router plan has no loss terms: they need global statistics).
    router_layer = get_layer(device, d_model=d, d_ffn=h, num_experts=E, top_k=k,
                             activation=activation.lower(), dtype=_storage_name(x.dtype),
                             checkpoint=checkpoint.lower(), score_function=score_function.lower(),
                             renormalize=renormalize)
    logits = torch.matmul(x.to(route_dtype), w_router.to(route_dtype).t())
    ids, g = _Router.apply(logits, router_layer)

    # 2. Sizes of every exchange: the one host synchronisation.
    plan = _plan_exchange(ids, T, E, rank, ranges, group)
    aux, z = _router_losses(logits, plan.global_counts_on_device(),
                            plan.global_tokens, E, k, score_function.lower(), aux_loss_coeff,
                            z_loss_coeff)

    # 3. Rows to the experts' ranks, grouped by expert (hence by rank), tokens ascending.
    order, inverse = _send_order(ids)
    send_rows = _Dispatch.apply(x, order, inverse, k)
    if weights_on == "expert":
        send_g = _Permute.apply(g.reshape(-1, 1), order, inverse)
        recv_rows, recv_g = _AllToAll.apply(plan.send_splits, plan.recv_splits, group, send_rows,
                                            send_g)
    else:
        (recv_rows,) = _AllToAll.apply(plan.send_splits, plan.recv_splits, group, send_rows)
        recv_g = torch.ones((recv_rows.shape[0], 1), dtype=route_dtype, device=device)
    local_ids = plan.received_local_ids()

    # 4. The local experts on the received rows: a batch of R tokens with k = 1.
    recv_out = moe_experts(recv_rows, local_ids, recv_g, w_gate, w_up, w_down,
                           activation=activation, checkpoint=checkpoint,
                           consume_saved=consume_saved)

    # 5. Results home, back in pair order (t, j), combined in slot order j = 0..k-1.
    (back,) = _AllToAll.apply(plan.recv_splits, plan.send_splits, group, recv_out)
    per_slot = _Permute.apply(back, inverse, order).view(T, k, d)
    acc_dtype = route_dtype
    if weights_on == "expert":
        y = per_slot[:, 0].to(acc_dtype)
        for j in range(1, k):
            y = y + per_slot[:, j].to(acc_dtype)
    else:
        y = g[:, 0:1] * per_slot[:, 0].to(acc_dtype)
        for j in range(1, k):
            y = y + g[:, j:j + 1] * per_slot[:, j].to(acc_dtype)
    return y.to(x.dtype), aux, z, plan


def _storage_name(dtype: torch.dtype) -> str:
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
             torch.float64: "float64"}
    if dtype not in names:
        raise TypeError(f"moeblaze: unsupported dtype {dtype}")
    return names[dtype]


# ------------------------------------------------------------------------------------------------
# Replicated parameters
# ------------------------------------------------------------------------------------------------


def allreduce_replicated_grads(parameters, group=None) -> None:
    """Sums the gradients of replicated parameters over the ranks of `group`, in rank order, so
    every rank ends with bitwise the same sum (an all_gather, then a fixed-order sum: unlike a
    ring all_reduce, the order does not depend on the algorithm the backend picks)."""
    _, world = _group_info(group)
    for parameter in parameters:
        if parameter is None or parameter.grad is None:
            continue
        grad = parameter.grad.contiguous()
        shares = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather([_wire_view(share) for share in shares], _wire_view(grad),
                        group=group)
        total = shares[0].clone()
        for share in shares[1:]:
            total += share
        parameter.grad.copy_(total)


# ------------------------------------------------------------------------------------------------
# Module
# ------------------------------------------------------------------------------------------------


class ExpertParallelMoE(torch.nn.Module):
    """A token-choice MoE layer whose experts are spread contiguously over the ranks of
    `process_group` (default: the world). Parameters: `w_router` [E,d] (replicated), and this
    rank's experts `w_gate`/`w_up` [E_r,h,d], `w_down` [E_r,d,h]; `expert_begin`, `expert_end` give
    their global ids.

    forward(x [..., d_model]) -> (y [..., d_model], aux_share, z_share): see the module docstring
    for the loss shares and for the router gradient (`allreduce_replicated_grads()`)."""

    def __init__(self, d_model: int, d_ffn: int, num_experts: int, top_k: int = 1, *,
                 activation: str = "swiglu", checkpoint: str = "save_preact",
                 score_function: str = "softmax_topk", renormalize: bool = False,
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                 weights_on: str = "expert", process_group=None, dtype=None, device=None,
                 consume_saved: bool = True):
        super().__init__()
        self.consume_saved = _args.flag(consume_saved, "consume_saved")  # see moe_experts()
        if weights_on not in _WEIGHTS_ON:
            raise ValueError(f"weights_on must be one of {_WEIGHTS_ON}, got {weights_on!r}")
        self.process_group = process_group
        self.rank, self.world_size = _group_info(process_group)
        self.expert_begin, self.expert_end = expert_ranges(num_experts, self.world_size)[self.rank]
        _init_moe_module(self, d_model, d_ffn, num_experts, top_k,
                         self.expert_end - self.expert_begin, activation, checkpoint,
                         score_function, renormalize, aux_loss_coeff, z_loss_coeff, dtype, device)
        self.weights_on = weights_on
        self.last_plan = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As moeblaze.torch.MoE: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), each rank drawing its own
        experts; the router weight is then made the same everywhere (a collective: every rank
        of the group constructs the layer, as with DDP)."""
        _reset_moe_parameters(self)
        self.sync_replicated_parameters()

    @torch.no_grad()
    def sync_replicated_parameters(self) -> None:
        """Copies the router weight of the group's first rank to every rank (an all_gather, which
        needs no mapping from group rank to global rank, unlike broadcast)."""
        if self.world_size == 1:
            return
        weight = self.w_router.data.contiguous()
        copies = [torch.empty_like(weight) for _ in range(self.world_size)]
        dist.all_gather([_wire_view(c) for c in copies],
                        _wire_view(weight), group=self.process_group)
        self.w_router.data.copy_(copies[0])

    @torch.no_grad()
    def load_global_weights(self, w_router: torch.Tensor, w_gate: torch.Tensor,
                            w_up: Optional[torch.Tensor], w_down: torch.Tensor) -> None:
        """Copies the router and this rank's slice of full [E, ...] expert weights."""
        b, e = self.expert_begin, self.expert_end
        self.w_router.copy_(w_router)
        self.w_gate.copy_(w_gate[b:e])
        if self.w_up is not None:
            self.w_up.copy_(w_up[b:e])
        self.w_down.copy_(w_down[b:e])

    @classmethod
    def from_moe(cls, moe, process_group=None, weights_on: str = "expert"):
        """The expert-parallel twin of a `moeblaze.torch.MoE` holding the full weights."""
        layer = cls(moe.d_model, moe.d_ffn, moe.num_experts, moe.top_k, activation=moe.activation,
                    checkpoint=moe.checkpoint, score_function=moe.score_function,
                    renormalize=moe.renormalize, aux_loss_coeff=moe.aux_loss_coeff,
                    z_loss_coeff=moe.z_loss_coeff, weights_on=weights_on,
                    process_group=process_group, dtype=moe.w_router.dtype,
                    device=moe.w_router.device)
        layer.load_global_weights(moe.w_router, moe.w_gate, moe.w_up, moe.w_down)
        return layer

    def replicated_parameters(self):
        return [self.w_router]

    def allreduce_replicated_grads(self) -> None:
        """Sums the router weight's gradient over the ranks (call after backward, before the
        optimizer step; skip it when DDP or another wrapper already reduces w_router)."""
        allreduce_replicated_grads(self.replicated_parameters(), self.process_group)

    def forward(self, x: torch.Tensor):
        shape = x.shape
        y, aux, z, plan = expert_parallel_moe(
            x.reshape(-1, self.d_model), self.w_router, self.w_gate, self.w_up, self.w_down,
            num_experts=self.num_experts, top_k=self.top_k, activation=self.activation,
            checkpoint=self.checkpoint, score_function=self.score_function,
            renormalize=self.renormalize, aux_loss_coeff=self.aux_loss_coeff,
            z_loss_coeff=self.z_loss_coeff, weights_on=self.weights_on,
            group=self.process_group, consume_saved=self.consume_saved)
        self.last_plan = plan
        self.last_expert_counts = plan.global_counts
        return y.reshape(shape), aux, z

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ffn={self.d_ffn}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, activation={self.activation!r}, "
                f"experts=[{self.expert_begin}, {self.expert_end}) of rank {self.rank}/"
                f"{self.world_size}, weights_on={self.weights_on!r}")


# moeblaze.torch.MoE(..., process_group=pg) builds this class (the torch module cannot import this
# one, which builds on it).
MoE.expert_parallel_class = ExpertParallelMoE
