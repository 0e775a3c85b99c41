"""moeblaze.distributed (expert parallelism over torch.distributed) against the one-process layer.

For world sizes 1, 2 and 4 this launches that many worker processes on the CPU (gloo backend,
rendezvous through a file). Every worker builds the same global weights and global batch from the
case's seed, keeps its slice of the tokens and of the experts, runs forward and backward of
ExpertParallelMoE twice (the two runs must agree bitwise), and saves its outputs and gradients. The
parent concatenates them and compares them with moeblaze.torch.moe_layer on the whole batch with
the whole weights: y, the losses, the expert counts, dx, dw_router, and dw_gate / dw_up / dw_down
of every expert. A second launch of the largest world must reproduce the first bitwise.

Run as a script with `worker` as the first argument, this file is the worker.

On a multi-GPU machine, MOEBLAZE_TEST_DIST_BACKEND=nccl runs the same checks over NCCL with rank r
on cuda:r (float64 cases skipped: the CUDA backend has no float64), for the world sizes listed in
MOEBLAZE_TEST_DIST_WORLDS (default "2,4,8", capped by the GPU count). Keep NVLink multicast off
there: this file sets NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 for its workers.
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
BACKEND = os.environ.get("MOEBLAZE_TEST_DIST_BACKEND", "gloo")
if BACKEND == "nccl":
    WORLD_SIZES = tuple(int(w) for w in os.environ.get("MOEBLAZE_TEST_DIST_WORLDS",
                                                       "2,4,8").split(","))
else:
    WORLD_SIZES = (1, 2, 4)
LAUNCH_TIMEOUT_S = 90
DEFAULT_SEED = 20260611

# The d_losses the objective puts on (aux, z), not 1 so that their plumbing is tested.
LOSS_WEIGHTS = (0.75, 1.25)

# Each case: shape, options and how the global batch is split over the ranks ("even", "uneven":
# remainders on the first ranks, "empty_last": the last rank of a multi-rank world has no token).
CASES = {
    "f64_swiglu_k2": dict(dtype="float64", activation="swiglu", E=8, k=2, d=16, h=8, T=24,
                          score_function="softmax_topk", renormalize=False, aux=0.01, z=0.001,
                          checkpoint="save_preact", weights_on="expert", split="even"),
    "f32_swiglu_k2": dict(dtype="float32", activation="swiglu", E=8, k=2, d=16, h=8, T=24,
                          score_function="softmax_topk", renormalize=False, aux=0.01, z=0.001,
                          checkpoint="save_preact", weights_on="expert", split="uneven"),
    "f64_gelu_k3_sigmoid": dict(dtype="float64", activation="gelu", E=6, k=3, d=12, h=10, T=19,
                                score_function="sigmoid", renormalize=True, aux=0.02, z=0.003,
                                checkpoint="recompute", weights_on="home", split="empty_last"),
    "f32_geglu_k1_topk_softmax": dict(dtype="float32", activation="geglu", E=4, k=1, d=8, h=12,
                                      T=21, score_function="topk_softmax", renormalize=False,
                                      aux=0.05, z=0.0, checkpoint="save_all", weights_on="home",
                                      split="uneven"),
    "f64_relu2_k2_renorm": dict(dtype="float64", activation="relu2", E=5, k=2, d=8, h=6, T=16,
                                score_function="softmax_topk", renormalize=True, aux=0.0, z=0.01,
                                checkpoint="save_preact", weights_on="expert", split="even"),
    # bfloat16 moves as float16 bits over gloo; the expert rank rounds its rows once more than
    # the one-process layer does (see the design note), hence the looser tolerance.
    "bf16_swiglu_k2": dict(dtype="bfloat16", activation="swiglu", E=4, k=2, d=16, h=8, T=12,
                           score_function="softmax_topk", renormalize=False, aux=0.01, z=0.001,
                           checkpoint="save_preact", weights_on="expert", split="even"),
    # No token anywhere: every exchange is empty, every expert gradient zero.
    "f64_empty_batch": dict(dtype="float64", activation="reglu", E=4, k=2, d=8, h=4, T=0,
                            score_function="softmax_topk", renormalize=False, aux=0.01, z=0.01,
                            checkpoint="save_preact", weights_on="expert", split="even"),
    # x and w_router on coarse binary grids: every logit is exact whatever the summation order,
    # so the router sees bitwise the same logits as the one-process layer, and what the design
    # promises becomes checkable bitwise (docs/design/expert-parallel.md, "Determinism").
    "f32_grid_bitwise": dict(dtype="float32", activation="swiglu", E=8, k=2, d=16, h=8, T=28,
                             score_function="softmax_topk", renormalize=True, aux=0.0, z=0.0,
                             checkpoint="save_preact", weights_on="expert", split="uneven",
                             grid=True),
    "f64_grid_bitwise": dict(dtype="float64", activation="silu", E=4, k=3, d=8, h=16, T=20,
                             score_function="sigmoid", renormalize=False, aux=0.0, z=0.0,
                             checkpoint="save_all", weights_on="expert", split="even",
                             grid=True),
}
# With exact logits, the expert rank runs per routed row exactly the arithmetic of the one-process
# layer, and each expert's rows arrive in global token order: these must then be bitwise equal.
BITWISE_KEYS = ("y", "dw_gate", "dw_up", "dw_down")
GATED = {"swiglu", "geglu", "reglu"}
TOLERANCES = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 3e-2}


def token_splits(T, world, split):
    if split == "empty_last" and world > 1:
        return token_splits(T, world - 1, "uneven") + [0]
    base, extra = divmod(T, world)
    if split == "even" and extra:
        raise ValueError("an even split needs world | T")
    return [base + (1 if r < extra else 0) for r in range(world)]


def global_problem(case, seed):
    """The same global weights, batch and output gradient on every process."""
    dtype = getattr(torch, case["dtype"])
    gen = torch.Generator().manual_seed(seed)
    E, d, h, T = case["E"], case["d"], case["h"], case["T"]

    def uniform(*shape, bound):
        return ((torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound).to(dtype)

    if case.get("grid"):
        # |x . w_router| <= d * 2 * 1 in steps of 1/128: exact in float32 for d <= 2^15.
        w_router = (torch.randint(-16, 17, (E, d), generator=gen) / 16.0).to(dtype)
    else:
        w_router = uniform(E, d, bound=1.0)  # large enough that the router is far from uniform
    w_gate = uniform(E, h, d, bound=d ** -0.5)
    w_up = uniform(E, h, d, bound=d ** -0.5) if case["activation"] in GATED else None
    w_down = uniform(E, d, h, bound=h ** -0.5)
    if case.get("grid"):
        x = (torch.randint(-16, 17, (T, d), generator=gen) / 8.0).to(dtype)
    else:
        x = torch.randn(T, d, generator=gen, dtype=torch.float64).to(dtype)
    dy = torch.randn(T, d, generator=gen, dtype=torch.float64).to(dtype)
    return x, dy, (w_router, w_gate, w_up, w_down)


# ------------------------------------------------------------------------------------------------
# Worker
# ------------------------------------------------------------------------------------------------


def device_for(rank):
    return torch.device(f"cuda:{rank}") if BACKEND == "nccl" else torch.device("cpu")


def runs_here(case):
    return not (BACKEND == "nccl" and case["dtype"] == "float64")


def _run_case(case, seed, rank, world):
    from moeblaze.distributed import ExpertParallelMoE

    device = device_for(rank)
    x_all, dy_all, weights = global_problem(case, seed)
    x_all, dy_all = x_all.to(device), dy_all.to(device)
    weights = [None if w is None else w.to(device) for w in weights]
    splits = token_splits(case["T"], world, case["split"])
    begin = sum(splits[:rank])
    x = x_all[begin:begin + splits[rank]].clone().requires_grad_(True)
    dy = dy_all[begin:begin + splits[rank]]
    layer = ExpertParallelMoE(case["d"], case["h"], case["E"], case["k"],
                              activation=case["activation"], checkpoint=case["checkpoint"],
                              score_function=case["score_function"],
                              renormalize=case["renormalize"], aux_loss_coeff=case["aux"],
                              z_loss_coeff=case["z"], weights_on=case["weights_on"],
                              dtype=x.dtype, device=device)
    layer.load_global_weights(*weights)
    results = []
    for _ in range(2):
        x.grad = None
        layer.zero_grad(set_to_none=True)
        y, aux, z = layer(x)
        loss = (y * dy).sum() + LOSS_WEIGHTS[0] * aux + LOSS_WEIGHTS[1] * z
        loss.backward()
        layer.allreduce_replicated_grads()
        result = {
            "y": y.detach().clone(), "aux": aux.detach().clone(), "z": z.detach().clone(),
            "dx": x.grad.clone(), "dw_router": layer.w_router.grad.clone(),
            "dw_gate": layer.w_gate.grad.clone(), "dw_down": layer.w_down.grad.clone(),
            "dw_up": None if layer.w_up is None else layer.w_up.grad.clone(),
            "counts": torch.tensor(layer.last_expert_counts, device=device),
            "experts": (layer.expert_begin, layer.expert_end),
        }
        results.append(result)
    first, second = results
    for name, value in first.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, second[name]), f"{name} differs between two runs"
    with torch.no_grad():  # inference: nothing saved, same output
        y_inference, _, _ = layer(x.detach().view(1, -1, case["d"]))
    assert torch.equal(y_inference.view(-1, case["d"]), first["y"]), "inference y differs"
    return {name: value.cpu() if isinstance(value, torch.Tensor) else value
            for name, value in first.items()}


def _check_router_sync(rank, world):
    """Ranks seeded differently still end with rank 0's router weight after construction."""
    import torch.distributed as dist
    from moeblaze.distributed import ExpertParallelMoE

    device = device_for(rank)
    d, E = 8, 2 * world
    torch.manual_seed(1000 + rank)
    layer = ExpertParallelMoE(d, 4, E, 1, dtype=torch.float32, device=device)
    torch.manual_seed(1000)
    bound = 1.0 / d ** 0.5
    rank0_draw = torch.empty(E, d, dtype=torch.float32, device=device).uniform_(-bound, bound)
    assert torch.equal(layer.w_router.detach(), rank0_draw), "w_router is not rank 0's"
    if world > 1:  # while each rank's experts are its own draw
        gathered = [torch.empty_like(layer.w_gate) for _ in range(world)]
        dist.all_gather(gathered, layer.w_gate.detach().contiguous())
        assert not torch.equal(gathered[0], gathered[1]), "experts should be drawn per rank"


def worker_main(argv):
    rank, world, init_file, out_dir, seed = int(argv[0]), int(argv[1]), argv[2], argv[3], \
        int(argv[4])
    sys.path.insert(0, str(_PACKAGE_ROOT))
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    if BACKEND == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(BACKEND, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    _check_router_sync(rank, world)
    out = {}
    for name, case in CASES.items():
        if runs_here(case):
            out[name] = _run_case(case, seed, rank, world)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: the results are written and the group is closed,
    # and torch's gloo threads can abort that teardown ("terminate called without an active
    # exception", SIGABRT), failing a rank that has finished its work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------------------------------------
# Parent
# ------------------------------------------------------------------------------------------------


def launch(world, seed):
    """Runs `world` worker processes; returns the per-rank results."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is unavailable")
    if BACKEND == "nccl":
        if not torch.distributed.is_nccl_available() or torch.cuda.device_count() < world:
            pytest.skip(f"NCCL with {world} GPUs is unavailable")
    elif not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is unavailable")
    with tempfile.TemporaryDirectory(prefix="moeblaze-dist-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(_PACKAGE_ROOT)] + (
            [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env.update(MOEBLAZE_NUM_THREADS="1", OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0",
                   TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
        workers = []
        for rank in range(world):
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            process = subprocess.Popen(
                [sys.executable, __file__, "worker", str(rank), str(world), init_file, tmp,
                 str(seed)], env=env, stdout=log, stderr=subprocess.STDOUT)
            workers.append((process, log))
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        failures = []
        for rank, (process, log) in enumerate(workers):
            try:
                code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                code = "timeout"
            if code != 0:
                log.seek(0)
                failures.append(f"rank {rank} of {world}: exit {code}\n{log.read()[-4000:]}")
            log.close()
        if failures:
            for process, _ in workers:  # a failed rank leaves its peers waiting in a collective
                if process.poll() is None:
                    process.kill()
                    process.wait()
            pytest.fail("\n".join(failures))
        return [torch.load(os.path.join(tmp, f"rank{rank}.pt")) for rank in range(world)]


def reference(case, seed):
    """moeblaze's one-process layer on the whole batch with the whole weights."""
    from moeblaze import torch as mbt

    device = device_for(0)
    x, dy, weights = global_problem(case, seed)
    x, dy = x.to(device).requires_grad_(True), dy.to(device)
    leaves = [None if w is None else w.to(device).requires_grad_(True) for w in weights]
    w_router, w_gate, w_up, w_down = leaves
    y, losses, counts, _, _ = mbt.moe_layer(
        x, w_router, w_gate, w_up, w_down, top_k=case["k"], activation=case["activation"],
        checkpoint=case["checkpoint"], score_function=case["score_function"],
        renormalize=case["renormalize"], aux_loss_coeff=case["aux"], z_loss_coeff=case["z"])
    loss = (y * dy).sum() + LOSS_WEIGHTS[0] * losses[0] + LOSS_WEIGHTS[1] * losses[1]
    loss.backward()
    result = {
        "y": y.detach(), "aux": losses[0].detach(), "z": losses[1].detach(), "dx": x.grad,
        "dw_router": w_router.grad, "dw_gate": w_gate.grad, "dw_down": w_down.grad,
        "dw_up": None if w_up is None else w_up.grad, "counts": counts.long(),
    }
    return {name: None if value is None else value.cpu() for name, value in result.items()}


def gather(per_rank, name):
    """The global view of one case's results from every rank's share."""
    shares = [r[name] for r in per_rank]
    if shares[0] is None:
        return None
    if name in ("aux", "z"):
        return sum(shares[1:], shares[0].clone())
    if name in ("dw_router", "counts"):
        for other in shares[1:]:  # replicated: bitwise the same everywhere
            assert torch.equal(other, shares[0]), f"{name} differs between ranks"
        return shares[0]
    return torch.cat(shares)  # tokens (y, dx) and experts (dw_*) are both in rank order


@pytest.fixture(scope="module")
def seed():
    value = int(os.environ.get("MOEBLAZE_TEST_SEED", DEFAULT_SEED))
    print(f"[test_distributed] seed = {value}")
    return value


@pytest.fixture(scope="module")
def references(seed):
    return {name: reference(case, seed) for name, case in CASES.items() if runs_here(case)}


_launches = {}


def launched(world, seed):
    if world not in _launches:
        _launches[world] = launch(world, seed)
    return _launches[world]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_matches_single_process_layer(world, seed, references):
    from moeblaze.distributed import expert_ranges

    results = launched(world, seed)
    for name, case in CASES.items():
        if not runs_here(case):
            continue
        per_rank = [r[name] for r in results]
        assert [r["experts"] for r in per_rank] == expert_ranges(case["E"], world), name
        expected = references[name]
        assert torch.equal(gather(per_rank, "counts"), expected["counts"]), name
        tol = TOLERANCES[case["dtype"]]
        for key in ("y", "aux", "z", "dx", "dw_router", "dw_gate", "dw_up", "dw_down"):
            mine, theirs = gather(per_rank, key), expected[key]
            if theirs is None:
                assert mine is None, f"{name}: {key}"
                continue
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, f"{name}: {key}"
            if case.get("grid") and key in BITWISE_KEYS:
                assert torch.equal(mine, theirs), (
                    f"{name} ({world} ranks): {key} is not bitwise equal: max |diff| = "
                    f"{float((mine - theirs).abs().max())}")
            scale = max(1.0, float(theirs.abs().max())) if theirs.numel() else 1.0
            torch.testing.assert_close(mine, theirs, rtol=tol, atol=tol * scale,
                                       msg=lambda m, n=name, k=key, w=world:
                                       f"{n} ({w} ranks): {k}: {m}")


def test_expert_placement_is_contiguous():
    from moeblaze.distributed import expert_ranges

    assert expert_ranges(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert expert_ranges(6, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert expert_ranges(5, 1) == [(0, 5)]
    with pytest.raises(ValueError):
        expert_ranges(2, 4)


def test_repeated_launch_is_bitwise_identical(seed):
    world = max(WORLD_SIZES)
    first = launched(world, seed)
    second = launch(world, seed)
    for rank, (a, b) in enumerate(zip(first, second)):
        assert a.keys() == b.keys()
        for name in a:
            for key, value in a[name].items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, b[name][key]), f"{name} rank {rank}: {key}"


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    worker_main(sys.argv[2:])
