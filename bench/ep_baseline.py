"""PyTorch baseline for one expert-parallel MoE layer, forward + backward through plain autograd.

The usual EP dataflow (torchtitan's expert-parallel MoE without padding or capacity), written for
this project; it does not import moeblaze. On each of the W ranks of `group`, with this rank's
tokens x [T,d], the replicated router weight w_router [E,d] and this rank's E_r contiguous experts
(w_gate/w_up [E_r,h,d], w_down [E_r,d,h]; the same placement as moeblaze.distributed):

1. route: logits = x . w_router^T (float32; float64 for float64 x), softmax over the E experts,
   top-k (optionally renormalised): ids [T,k], g [T,k];
2. counts: per-expert counts [E] go to every rank (one all_to_all_single); the [W, E] table is
   copied to the host once (the split sizes of the exchanges): the one host synchronisation;
3. sort the routed pairs by expert (stable: by token inside an expert) and gather the rows: [N,d];
4. dispatch: all_to_all_single of the rows to the ranks owning their experts;
5. the received rows arrive grouped by source rank, then by local expert: a stable sort by local
   expert groups them per expert;
6. experts: torch._grouped_mm (F.grouped_mm) per projection when available, otherwise a loop over
   the local experts (the per-expert counts are on the host already: no further sync);
7. un-sort, return the rows with the reverse all_to_all_single;
8. weighted combine on the home rank: y_t = sum_j g[t,j] * y2_(t,j), accumulated in float32
   (index_add; the returned y2 rows stay alive for the backward's dg, as in the usual dataflow).

Backward is autograd's: the exchanges' backward is the transposed exchange with the same splits.
`exchange` is pluggable (a function with the signature of `exchange_rows`) so that a benchmark can
time each exchange and count its bytes. Works with torch 1.13 (gloo, CPU) and 2.x (NCCL, CUDA).
"""

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import baselines

__all__ = ["exchange_rows", "expert_ranges", "route", "ep_moe_baseline", "BaselineInfo"]


def expert_ranges(num_experts: int, world_size: int) -> List[Tuple[int, int]]:
    """[begin, end) per rank: contiguous, the first E % W ranks one more (moeblaze's placement)."""
    if world_size < 1 or num_experts < world_size:
        raise ValueError(f"need 1 <= world_size <= num_experts, got {world_size}, {num_experts}")
    base, extra = divmod(num_experts, world_size)
    ranges, begin = [], 0
    for rank in range(world_size):
        end = begin + base + (1 if rank < extra else 0)
        ranges.append((begin, end))
        begin = end
    return ranges


def _wire(t: torch.Tensor) -> torch.Tensor:
    # gloo has no bfloat16; an exchange only moves bytes, so move those bits as float16.
    return t.view(torch.float16) if t.dtype == torch.bfloat16 else t


def exchange_rows(rows: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                  group) -> torch.Tensor:
    """all_to_all_single over the first dimension: send_splits[q] rows to rank q, recv_splits[q]
    rows from rank q, concatenated by source rank."""
    rows = rows.contiguous()
    out = torch.empty((sum(recv_splits),) + tuple(rows.shape[1:]), dtype=rows.dtype,
                      device=rows.device)
    dist.all_to_all_single(_wire(out), _wire(rows), output_split_sizes=list(recv_splits),
                           input_split_sizes=list(send_splits), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group, exchange):
        ctx.send_splits, ctx.recv_splits, ctx.group, ctx.exchange = (send_splits, recv_splits,
                                                                      group, exchange)
        return exchange(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return (ctx.exchange(grad, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None,
                None)


def route(x: torch.Tensor, w_router: torch.Tensor, top_k: int, renormalize: bool):
    """softmax over the experts, then top-k: (logits [T,E], ids [T,k] int64, g [T,k])."""
    route_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    logits = torch.matmul(x.to(route_dtype), w_router.to(route_dtype).t())
    probs = torch.softmax(logits, dim=-1)
    g, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        g = g / g.sum(dim=-1, keepdim=True)
    return logits, ids, g


class BaselineInfo:
    """Host-side facts of one forward: split sizes and the global per-expert counts."""

    def __init__(self, send_splits, recv_splits, local_counts, global_counts, host_wait_s):
        self.send_splits = send_splits
        self.recv_splits = recv_splits
        self.local_counts = local_counts      # rows per local expert received from all ranks
        self.global_counts = global_counts    # [E] over all ranks
        self.host_wait_s = host_wait_s


def _grouped_mm_or_none(mode: str):
    if mode == "loop":
        return None
    if mode == "grouped_mm_emulated":
        return baselines.grouped_mm_emulated
    if mode == "grouped_mm":
        if not baselines.grouped_mm_available():
            raise NotImplementedError(f"torch {torch.__version__} has no grouped_mm")
        return baselines._torch_grouped_mm
    raise ValueError(f"unknown expert mode {mode!r}")


def _experts(rows, local_ids_host, offs, w_gate, w_up, w_down, activation, mode):
    """The local experts on rows grouped by expert; local_ids_host[e] rows for expert e."""
    gated = baselines.is_gated(activation)
    grouped = _grouped_mm_or_none(mode)
    if grouped is not None:
        a = grouped(rows, w_gate.transpose(-2, -1), offs)
        b = grouped(rows, w_up.transpose(-2, -1), offs) if gated else None
        u = baselines.apply_activation(activation, a, b)
        return grouped(u, w_down.transpose(-2, -1), offs)
    outs, start = [], 0
    gate_rows = w_gate.unbind(0)
    up_rows = w_up.unbind(0) if gated else None
    down_rows = w_down.unbind(0)
    for e, n in enumerate(local_ids_host):
        if n == 0:
            continue
        r = rows[start:start + n]
        start += n
        a = r @ gate_rows[e].t()
        b = r @ up_rows[e].t() if gated else None
        outs.append(baselines.apply_activation(activation, a, b) @ down_rows[e].t())
    if not outs:
        return rows.new_zeros((0, w_down.shape[1]))
    return torch.cat(outs, 0)


def ep_moe_baseline(x: torch.Tensor, w_router: torch.Tensor, w_gate: torch.Tensor,
                    w_up: Optional[torch.Tensor], w_down: torch.Tensor, *, num_experts: int,
                    top_k: int, activation: str = "swiglu", renormalize: bool = False,
                    expert_mode: str = "loop", group=None,
                    exchange: Callable = exchange_rows,
                    host_clock: Callable = None) -> Tuple[torch.Tensor, BaselineInfo]:
    """One EP MoE layer (forward; autograd gives the backward). Returns (y [T,d], info).

    expert_mode: "grouped_mm" (torch._grouped_mm / F.grouped_mm; CUDA bf16), "loop" (per local
    expert), or "grouped_mm_emulated" (tests only: a host-synchronising stand-in)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ranges = expert_ranges(num_experts, world)
    begin, end = ranges[rank]
    T, d = x.shape
    k = int(top_k)
    E = int(num_experts)
    device = x.device

    # 1. route
    _, ids, g = route(x, w_router, k, renormalize)

    # 2. counts to every rank, one host copy of the [W, E] table
    flat = ids.reshape(-1)
    counts = torch.zeros(E, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    table = exchange(counts.repeat(world), [E] * world, [E] * world, group).view(world, E)
    t0 = host_clock() if host_clock else None
    host = table.cpu().tolist()  # the one host synchronisation
    host_wait_s = host_clock() - t0 if host_clock else None
    own = host[rank]
    send_splits = [sum(own[b:e]) for b, e in ranges]
    recv_by_source = [row[begin:end] for row in host]            # [W][E_r]
    recv_splits = [sum(row) for row in recv_by_source]
    local_counts = [sum(row[e] for row in recv_by_source) for e in range(end - begin)]
    global_counts = [sum(row[e] for row in host) for e in range(E)]

    # 3. sort by expert (stable), gather rows
    perm = torch.sort(flat, stable=True).indices                  # [N] pair index t*k+j
    token = torch.div(perm, k, rounding_mode="floor")
    send_rows = x.index_select(0, token)                          # [N, d]
    g_sorted = g.reshape(-1).index_select(0, perm)                # [N]

    # 4. dispatch
    recv = _AllToAll.apply(send_rows, send_splits, recv_splits, group, exchange)   # [R, d]

    # 5. group the received rows by local expert (they arrive by source, then expert)
    R = sum(recv_splits)
    local_experts = end - begin
    repeats = table[:, begin:end].reshape(-1)                     # device copy: no H2D
    expert_of_row = torch.repeat_interleave(
        torch.arange(local_experts, device=device).repeat(world), repeats, output_size=R)
    by_expert = torch.sort(expert_of_row, stable=True).indices
    unsort = torch.empty_like(by_expert)
    unsort[by_expert] = torch.arange(R, device=device)
    rows = recv.index_select(0, by_expert)
    offs = torch.cumsum(table[:, begin:end].sum(0), 0).to(torch.int32)

    # 6. experts
    y2 = _experts(rows, local_counts, offs, w_gate, w_up, w_down, activation, expert_mode)

    # 7. un-sort, send back
    back = _AllToAll.apply(y2.index_select(0, unsort), recv_splits, send_splits, group, exchange)

    # 8. weighted combine at home in float32
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    weighted = back.to(acc) * g_sorted.to(acc)[:, None]
    y = torch.zeros((T, d), dtype=acc, device=device).index_add(0, token, weighted)
    return y.to(x.dtype), BaselineInfo(send_splits, recv_splits, local_counts, global_counts,
                                       host_wait_s)
