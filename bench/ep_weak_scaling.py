#!/usr/bin/env python3
"""Expert-parallel weak scaling: moeblaze's ExpertParallelMoE against a PyTorch EP baseline.

    python3 bench/ep_weak_scaling.py --out DIR [--worlds 1,2,4,8] [--skew] [--reps 20]

For every world size W (default 1, 2, 4, 8, capped at the visible GPU count) it launches W worker
processes (rank r on cuda:r, NCCL; or --device cpu with gloo) and keeps the work per rank fixed:
T_r tokens and E_r experts per rank, E = E_r * W experts, top-k of them (defaults from
docs/design/expert-parallel.md section 8: T_r = 16384, E_r = 8, k = 4, d = 4096, h = 1408, bf16,
SwiGLU). Routing cases: "balanced" (Gaussian logits from random x and w_router) and, with --skew,
"zipf" (a router bias log p_e with p_e ~ 1/(e+1)^s, hot experts on the first ranks unless
--zipf-shuffle).

Implementations (--impls): "moeblaze" (moeblaze.distributed.ExpertParallelMoE), "grouped_mm"
(bench/ep_baseline.py: all_to_all_single dispatch, sort, torch._grouped_mm, reverse exchange,
weighted combine), "loop" (the same with a per-expert loop). The first baseline listed is the
reference: before timing, every worker runs one fwd+bwd of each implementation on the same inputs
and weights and compares y, dx, dw_router and dw_gate/up/down with the reference's (relative
Frobenius error over all ranks); a row over the tolerance is flagged and the exit status is 1,
so a wrong computation is never timed silently.

Per (W, routing, implementation) row (see bench/README.md, "Expert parallelism: weak scaling"):
fwd+bwd median time (CUDA events after warm-up; wall clock on the CPU) of the slowest rank per
repetition, efficiency t(1)/t(W), exchange vs compute time (every exchange is bracketed with
events inside the worker), the host wait of the forward's one count-table copy, bytes exchanged
per rank and the achieved all-to-all bandwidth, received-row imbalance, TFLOP/s per rank, peak
memory. Results: DIR/<date>-<device>-ep-weak-scaling.json ({"device","commit","command","rows"});
a markdown table is printed last.

NVLink multicast stays off: this file exports NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 before torch is imported, and in every worker's environment.
"""

import os

# Before torch or NCCL initialise, in the launcher and (the same file) in every worker.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
os.environ.update(MULTICAST_OFF)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PYTHON_PACKAGE = os.path.join(REPO, "bindings", "python")
for _path in (HERE, PYTHON_PACKAGE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp64": torch.float64}
# Relative Frobenius error against the reference implementation (as run_bench.py).
ERR_TOLERANCE = {"bf16": 3e-2, "fp16": 1e-2, "fp32": 1e-4, "fp64": 1e-10}
IMPLS = ("moeblaze", "grouped_mm", "loop", "grouped_mm_emulated")
BASELINE_IMPLS = ("grouped_mm", "loop", "grouped_mm_emulated")
COMPARED = ("y", "dx", "dw_router", "dw_gate", "dw_up", "dw_down")
FAULT_ENV = "MOEBLAZE_EP_BENCH_FAULT"  # tests: "scale_y:<impl>" makes that impl's y wrong


def log(msg):
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="1,2,4,8",
                   help="world sizes (capped at the visible GPU count on CUDA)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--tokens-per-rank", type=int, default=16384)
    p.add_argument("--experts-per-rank", type=int, default=8)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--d-ffn", type=int, default=1408)
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="bf16 (default on CUDA) or fp32 (default on the CPU)")
    p.add_argument("--activation", default="swiglu")
    p.add_argument("--checkpoint", default="save_preact",
                   choices=("save_preact", "save_all", "recompute"), help="moeblaze's policy")
    p.add_argument("--renormalize", action="store_true", help="renormalise the top-k weights")
    p.add_argument("--skew", action="store_true", help="also run the Zipf-skewed routing")
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of --skew")
    p.add_argument("--zipf-shuffle", action="store_true",
                   help="spread the popular experts over ranks at random (default: hot first)")
    p.add_argument("--impls", default=None,
                   help=f"comma-separated among {','.join(IMPLS)}; default moeblaze,grouped_mm "
                        f"(moeblaze,loop where torch has no grouped_mm or on the CPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-check", action="store_true",
                   help="skip the comparison with the reference implementation")
    p.add_argument("--threads-per-rank", type=int, default=1, help="CPU threads per worker")
    p.add_argument("--launch-timeout-s", type=float, default=600.0,
                   help="kill the workers of one world size after this long")
    p.add_argument("--collective-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    import baselines
    baselines.is_gated(args.activation)  # raises on unknown names
    if args.impls is None:
        fast = args.device == "cuda" and baselines.grouped_mm_available()
        args.impls = "moeblaze," + ("grouped_mm" if fast else "loop")
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    for impl in args.impls:
        if impl not in IMPLS:
            p.error(f"unknown impl {impl!r}; expected among {IMPLS}")
    if len(set(args.impls)) != len(args.impls):
        p.error("--impls lists an implementation twice")
    args.worlds = sorted({int(w) for w in args.worlds.split(",") if w.strip()})
    if not args.worlds or args.worlds[0] < 1:
        p.error("--worlds needs positive world sizes")
    if args.device == "cuda":
        visible = torch.cuda.device_count()
        dropped = [w for w in args.worlds if w > visible]
        if dropped:
            log(f"note: {visible} GPU(s) visible; skipping world sizes {dropped}")
        args.worlds = [w for w in args.worlds if w <= visible]
        if not args.worlds:
            p.error("no world size fits the visible GPUs")
    args.routings = ["balanced"] + (["zipf"] if args.skew else [])
    return args


def reference_impl(impls):
    """The first baseline listed: every other implementation is compared with it."""
    for impl in impls:
        if impl in BASELINE_IMPLS:
            return impl
    return None


# ------------------------------------------------------------------------------------------------
# Worker: inputs
# ------------------------------------------------------------------------------------------------


def _generator(device, *key):
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32("/".join(str(k) for k in key).encode()))
    return gen


def make_problem(spec, routing, rank, world, device):
    """This rank's tokens and output gradient, the replicated router weight, and this rank's
    experts. Rank r's tokens and expert e's weights depend only on (seed, r) and (seed, e), so a
    rank's share of the work is the same at every world size."""
    from ep_baseline import expert_ranges

    dtype = DTYPES[spec["dtype"]]
    seed = spec["seed"]
    T, d, h = spec["tokens_per_rank"], spec["d_model"], spec["d_ffn"]
    E = spec["experts_per_rank"] * world
    begin, end = expert_ranges(E, world)[rank]
    import baselines
    gated = baselines.is_gated(spec["activation"])

    def randn(*shape, key, scale=1.0):
        t = torch.randn(*shape, generator=_generator(device, seed, *key), device=device,
                        dtype=torch.float32)
        return t * scale

    x = randn(T, d, key=("x", rank))
    dy = randn(T, d, key=("dy", rank))
    # Logits x . w_router^T ~ N(0, 1): every expert equally likely in expectation.
    w_router = randn(E, d, key=("router",), scale=d ** -0.5)
    if routing == "zipf":
        popularity = torch.arange(E, dtype=torch.float64)
        if spec["zipf_shuffle"]:
            popularity = popularity[torch.randperm(E, generator=_generator("cpu", seed, "perm"))]
        # A constant input feature times a per-expert weight is a router bias log p_e (softmax is
        # shift invariant), p_e proportional to 1 / (popularity_e + 1)^s.
        x[:, 0] = 1.0
        w_router[:, 0] = (-spec["zipf_s"] * torch.log1p(popularity)).to(device=device,
                                                                       dtype=torch.float32)
    w_gate = torch.stack([randn(h, d, key=("gate", e), scale=d ** -0.5)
                          for e in range(begin, end)])
    w_up = torch.stack([randn(h, d, key=("up", e), scale=d ** -0.5)
                        for e in range(begin, end)]) if gated else None
    w_down = torch.stack([randn(d, h, key=("down", e), scale=h ** -0.5)
                          for e in range(begin, end)])

    def cast(t):
        return None if t is None else t.to(dtype).contiguous()

    return {"x": cast(x), "dy": cast(dy), "w_router": cast(w_router), "w_gate": cast(w_gate),
            "w_up": cast(w_up), "w_down": cast(w_down), "E": E, "experts": (begin, end)}


# ------------------------------------------------------------------------------------------------
# Worker: exchange instrumentation
# ------------------------------------------------------------------------------------------------


class ExchangeMeter:
    """Brackets every exchange call with CUDA events on the current stream (an all_to_all_single
    makes the current stream wait for it, so the bracket is the exchange's time on the critical
    path, waiting for slower peers included) or with the wall clock on the CPU (gloo is
    synchronous), and counts the bytes this rank sends and receives, to itself and to others.
    One instance per worker; begin_step() starts a new fwd+bwd."""

    def __init__(self, rank, device):
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.begin_step()

    def begin_step(self):
        self.intervals = []    # CUDA: (start, end) events
        self.cpu_s = 0.0
        self.calls = 0
        self.host_waits = []   # seconds the host blocked in the forward's count-table copy
        self.bytes = {"sent_remote": 0, "recv_remote": 0, "sent_self": 0}

    def wrap(self, exchange):
        def timed(rows, send_splits, recv_splits, group):
            row_bytes = rows.element_size() * math.prod(rows.shape[1:])
            self.calls += 1
            for peer, (sent, received) in enumerate(zip(send_splits, recv_splits)):
                if peer == self.rank:
                    self.bytes["sent_self"] += sent * row_bytes
                else:
                    self.bytes["sent_remote"] += sent * row_bytes
                    self.bytes["recv_remote"] += received * row_bytes
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                out = exchange(rows, send_splits, recv_splits, group)
                end.record()
                self.intervals.append((start, end))
            else:
                t0 = time.perf_counter()
                out = exchange(rows, send_splits, recv_splits, group)
                self.cpu_s += time.perf_counter() - t0
            return out
        return timed

    def exchange_ms(self):
        """This step's exchange time (CUDA: call after the stream is synchronised)."""
        if self.cuda:
            return sum(s.elapsed_time(e) for s, e in self.intervals)
        return self.cpu_s * 1e3


# ------------------------------------------------------------------------------------------------
# Worker: implementations
# ------------------------------------------------------------------------------------------------


def _fault_scale(impl):
    fault = os.environ.get(FAULT_ENV, "")
    return 1.5 if fault == f"scale_y:{impl}" else None


class MoeblazeImpl:
    def __init__(self, spec, problem, meter, device):
        import moeblaze.distributed as mbd
        from moeblaze.distributed import ExpertParallelMoE

        self._hook(mbd, meter)
        E, d, h = problem["E"], spec["d_model"], spec["d_ffn"]
        dtype = DTYPES[spec["dtype"]]
        self.layer = ExpertParallelMoE(d, h, E, spec["top_k"], activation=spec["activation"],
                                       checkpoint=spec["checkpoint"],
                                       score_function="softmax_topk",
                                       renormalize=spec["renormalize"], dtype=dtype,
                                       device=device)
        if (self.layer.expert_begin, self.layer.expert_end) != tuple(problem["experts"]):
            raise RuntimeError("moeblaze and the benchmark place the experts differently")
        with torch.no_grad():
            for name in ("w_router", "w_gate", "w_up", "w_down"):
                param = getattr(self.layer, name)
                if param is not None:
                    param.copy_(problem[name])
        self.x = problem["x"].detach().clone().requires_grad_(True)
        self.leaves = [self.x, self.layer.w_router, self.layer.w_gate, self.layer.w_up,
                       self.layer.w_down]
        self.scale = _fault_scale("moeblaze")

    @staticmethod
    def _hook(mbd, meter):
        """Times moeblaze.distributed's exchanges and its one host copy without changing them
        (module attributes looked up at call time). Installed once per process."""
        if getattr(mbd, "_ep_bench_hooked", False):
            mbd._ep_bench_meter = meter
            return
        if not hasattr(mbd, "_exchange") or not hasattr(mbd, "ExchangePlan"):
            raise RuntimeError("moeblaze.distributed has no _exchange/ExchangePlan to time; "
                               "update bench/ep_weak_scaling.py")
        mbd._ep_bench_meter = meter
        exchange = mbd._exchange

        def timed_exchange(rows, send_splits, recv_splits, group):
            return mbd._ep_bench_meter.wrap(exchange)(rows, send_splits, recv_splits, group)

        init = mbd.ExchangePlan.__init__

        def timed_init(plan, *a, **kw):
            t0 = time.perf_counter()
            init(plan, *a, **kw)  # the table's device-to-host copy
            mbd._ep_bench_meter.host_waits.append(time.perf_counter() - t0)

        mbd._exchange = timed_exchange
        mbd.ExchangePlan.__init__ = timed_init
        mbd._ep_bench_hooked = True

    def forward(self):
        y, _, _ = self.layer(self.x)
        plan = self.layer.last_plan
        facts = {"send_rows": sum(plan.send_splits), "recv_rows": sum(plan.recv_splits),
                 "global_counts": list(plan.global_counts)}
        return (y * self.scale if self.scale else y), facts


class BaselineImpl:
    MODES = {"grouped_mm": "grouped_mm", "loop": "loop",
             "grouped_mm_emulated": "grouped_mm_emulated"}

    def __init__(self, impl, spec, problem, meter, device):
        import ep_baseline

        self.impl = impl
        self.spec = spec
        self.E = problem["E"]
        self.meter = meter
        self.exchange = meter.wrap(ep_baseline.exchange_rows)
        self.run = ep_baseline.ep_moe_baseline
        self.leaves = [None if problem[n] is None else
                       problem[n].detach().clone().requires_grad_(True)
                       for n in ("x", "w_router", "w_gate", "w_up", "w_down")]
        self.scale = _fault_scale(impl)

    def forward(self):
        x, wr, wg, wu, wd = self.leaves
        y, info = self.run(x, wr, wg, wu, wd, num_experts=self.E, top_k=self.spec["top_k"],
                           activation=self.spec["activation"],
                           renormalize=self.spec["renormalize"],
                           expert_mode=self.MODES[self.impl], exchange=self.exchange,
                           host_clock=time.perf_counter)
        self.meter.host_waits.append(info.host_wait_s)
        facts = {"send_rows": sum(info.send_splits), "recv_rows": sum(info.recv_splits),
                 "global_counts": list(info.global_counts)}
        return (y * self.scale if self.scale else y), facts


def make_impl(impl, spec, problem, meter, device):
    if impl == "moeblaze":
        return MoeblazeImpl(spec, problem, meter, device)
    return BaselineImpl(impl, spec, problem, meter, device)


def fwd_bwd(impl, dy, meter):
    """One fwd+bwd: (y, grads in COMPARED[1:] order, facts)."""
    meter.begin_step()
    y, facts = impl.forward()
    wanted = [t for t in impl.leaves if t is not None]
    grads = iter(torch.autograd.grad(y, wanted, dy, allow_unused=True))
    out = []
    for leaf in impl.leaves:
        grad = None if leaf is None else next(grads)
        out.append(torch.zeros_like(leaf) if leaf is not None and grad is None else grad)
    return y.detach(), out, facts


def _squared_errors(outputs, reference):
    """{name: [sum (a-b)^2, sum b^2]} in float64 (summed over ranks by the parent)."""
    result = {}
    for name, a, b in zip(COMPARED, outputs, reference):
        if a is None or b is None:
            result[name] = None if (a is None and b is None) else [math.nan, 1.0]
            continue
        a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
        result[name] = [float(((a64 - b64) ** 2).sum()), float((b64 ** 2).sum())]
    return result


def measure(impl, problem, spec, meter, device):
    """Warm-up, then `reps` timed fwd+bwd; per-repetition times and exchange times."""
    import torch.distributed as dist

    cuda = device.type == "cuda"
    dy = problem["dy"]
    for _ in range(spec["warmup"]):
        out = fwd_bwd(impl, dy, meter)
        del out
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    dist.barrier()
    step_ms, exchange_ms, host_wait_ms = [], [], []
    facts, bytes_per_step, calls = None, None, None
    pending = []
    for _ in range(spec["reps"]):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        y, grads, facts = fwd_bwd(impl, dy, meter)
        if cuda:
            end.record()
            pending.append((start, end, list(meter.intervals)))
        else:
            step_ms.append((time.perf_counter() - t0) * 1e3)
            exchange_ms.append(meter.exchange_ms())
        host_wait_ms.extend(w * 1e3 for w in meter.host_waits if w is not None)
        bytes_per_step, calls = dict(meter.bytes), meter.calls
        del y, grads
    peak = None
    if cuda:
        torch.cuda.synchronize(device)
        for start, end, intervals in pending:
            step_ms.append(start.elapsed_time(end))
            exchange_ms.append(sum(s.elapsed_time(e) for s, e in intervals))
        peak = torch.cuda.max_memory_allocated(device) - base
    return {"step_ms": step_ms, "exchange_ms": exchange_ms, "host_wait_ms": host_wait_ms,
            "bytes": bytes_per_step, "exchange_calls": calls, "send_rows": facts["send_rows"],
            "recv_rows": facts["recv_rows"], "global_counts": facts["global_counts"],
            "peak_bytes": peak}


def run_routing(spec, routing, rank, world, device, meter):
    problem = make_problem(spec, routing, rank, world, device)
    ref_name = reference_impl(spec["impls"])
    cases = {}
    reference = None
    order = ([ref_name] if ref_name else []) + [i for i in spec["impls"] if i != ref_name]
    for name in order:
        case = {"routing": routing, "impl": name, "error": None, "squared_errors": None,
                "routing_mismatch": None}
        impl = make_impl(name, spec, problem, meter, device)
        if spec["check"] and ref_name is not None:
            y, grads, facts = fwd_bwd(impl, problem["dy"], meter)
            outputs = [y] + grads
            if name == ref_name:
                reference = (outputs, facts["global_counts"])
            else:
                case["squared_errors"] = _squared_errors(outputs, reference[0])
                case["routing_mismatch"] = sum(
                    abs(a - b) for a, b in zip(facts["global_counts"], reference[1])) // 2
            del y, grads, outputs
        case.update(measure(impl, problem, spec, meter, device))
        cases[name] = case
        del impl
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return [cases[name] for name in spec["impls"]]


def worker_main(argv):
    spec_path, rank, world, init_file, out_path = argv[0], int(argv[1]), int(argv[2]), argv[3], \
        argv[4]
    os.environ.update(MULTICAST_OFF)
    import torch.distributed as dist

    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads_per_rank"])
    if spec["device"] == "cuda":
        device = torch.device(f"cuda:{rank}")
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=spec["collective_timeout_s"]))
    meter = ExchangeMeter(rank, device)
    result = {"rank": rank, "world": world, "cases": [],
              "multicast_env": {key: os.environ.get(key) for key in MULTICAST_OFF}}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    for routing in spec["routings"]:
        result["cases"].extend(run_routing(spec, routing, rank, world, device, meter))
    with open(out_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".tmp", out_path)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: the results are written and the group is closed,
    # and torch's gloo threads can abort that teardown ("terminate called without an active
    # exception", SIGABRT), failing a rank that has finished its work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------


def worker_env(args):
    env = dict(os.environ)
    env.update(MULTICAST_OFF)
    paths = [HERE, PYTHON_PACKAGE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if args.device == "cpu":
        threads = str(args.threads_per_rank)
        env.update(MOEBLAZE_NUM_THREADS=threads, OMP_NUM_THREADS=threads)
    return env


def launch(world, spec, args):
    """Runs `world` workers; returns (per-rank results or None, error text or None)."""
    with tempfile.TemporaryDirectory(prefix="moeblaze-ep-bench-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        init_file = os.path.join(tmp, "rendezvous")
        env = worker_env(args)
        workers = []
        for rank in range(world):
            log_file = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            out_path = os.path.join(tmp, f"rank{rank}.json")
            process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "_worker", spec_path, str(rank),
                 str(world), init_file, out_path], env=env, stdout=log_file,
                stderr=subprocess.STDOUT)
            workers.append((process, log_file, out_path))
        deadline = time.monotonic() + args.launch_timeout_s
        failures = []
        while not failures:  # poll all: a failed rank leaves its peers waiting in a collective
            codes = [process.poll() for process, _, _ in workers]
            failures = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if all(code == 0 for code in codes):
                break
            if not failures and time.monotonic() > deadline:
                failures = [(codes.index(None), f"timeout after {args.launch_timeout_s:.0f} s")]
            time.sleep(0.05)
        if failures:
            for process, _, _ in workers:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        texts = []
        for rank, (process, log_file, _) in enumerate(workers):
            log_file.seek(0)
            text = log_file.read()
            log_file.close()
            if failures and (rank == failures[0][0] or process.returncode not in (0, -9)):
                texts.append(f"rank {rank} exit {process.returncode}:\n{text[-3000:]}")
        if failures:
            rank, code = failures[0]
            return None, f"world {world}: rank {rank} exit {code}\n" + "\n".join(texts)
        results = []
        for _, _, out_path in workers:
            with open(out_path) as f:
                results.append(json.load(f))
        return results, None


def died_by_signal(error):
    """Whether launch()'s error says the first failed rank was killed by a signal other than the
    launcher's own kill (-9): "world W: rank R exit -N"."""
    words = error.split("\n", 1)[0].split()
    try:
        code = int(words[-1])
    except ValueError:
        return False  # a timeout
    return code < 0 and code != -9


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def useful_flops(spec):
    gated = spec["activation"] in ("swiglu", "geglu", "reglu")
    return 6 * spec["tokens_per_rank"] * spec["top_k"] * spec["d_model"] * spec["d_ffn"] * (
        3 if gated else 2)


def aggregate(world, per_rank, spec, args):
    """Rows of one world size from every rank's cases."""
    rows = []
    tol = ERR_TOLERANCE[spec["dtype"]]
    ref_name = reference_impl(spec["impls"])
    for index, first in enumerate(per_rank[0]["cases"]):
        cases = [r["cases"][index] for r in per_rank]
        assert all(c["impl"] == first["impl"] and c["routing"] == first["routing"]
                   for c in cases)
        reps = min(len(c["step_ms"]) for c in cases)
        slowest = [max(c["step_ms"][i] for c in cases) for i in range(reps)]
        ms = median(slowest)
        exch = [median(c["exchange_ms"]) for c in cases]
        compute = [median([s - e for s, e in zip(c["step_ms"], c["exchange_ms"])])
                   for c in cases]
        waits = [median(c["host_wait_ms"]) for c in cases]
        sent = [c["bytes"]["sent_remote"] for c in cases]
        recv_rows = [c["recv_rows"] for c in cases]
        bandwidth = [b / (e * 1e-3) / 1e9 if e and b else None for b, e in zip(sent, exch)]
        mean_rows = sum(recv_rows) / len(recv_rows)
        row = {
            "world": world, "routing": first["routing"], "impl": first["impl"],
            "T_r": spec["tokens_per_rank"], "E_r": spec["experts_per_rank"],
            "E": spec["experts_per_rank"] * world, "k": spec["top_k"], "d": spec["d_model"],
            "h": spec["d_ffn"], "dtype": spec["dtype"], "activation": spec["activation"],
            "checkpoint": spec["checkpoint"] if first["impl"] == "moeblaze" else "autograd",
            "reps": reps, "ms": ms, "ms_min": min(slowest) if slowest else None,
            "ms_max": max(slowest) if slowest else None,
            "rank_ms": [median(c["step_ms"]) for c in cases],
            "efficiency": None,
            "exchange_ms": max(exch) if exch else None,
            "compute_ms": max(compute) if compute else None,
            "rank_exchange_ms": exch,
            "exchange_fraction": (max(exch) / ms) if ms else None,
            "host_wait_ms": max((w for w in waits if w is not None), default=None),
            "exchange_calls": first["exchange_calls"],
            "bytes_sent_remote_per_rank": sum(sent) / len(sent),
            "bytes_sent_remote_max": max(sent),
            "bytes_recv_remote_per_rank": sum(c["bytes"]["recv_remote"] for c in cases) /
            len(cases),
            "bytes_self_per_rank": sum(c["bytes"]["sent_self"] for c in cases) / len(cases),
            "a2a_GBps": median(bandwidth),
            "a2a_GBps_min": min((b for b in bandwidth if b is not None), default=None),
            "recv_rows": recv_rows,
            "imbalance": max(recv_rows) / mean_rows if mean_rows else None,
            "global_counts": first["global_counts"],
            "tflops_per_rank": useful_flops(spec) / (ms * 1e-3) / 1e12 if ms else None,
            "peak_bytes": max((c["peak_bytes"] for c in cases if c["peak_bytes"] is not None),
                              default=None),
            "reference": ref_name if first["impl"] != ref_name else None,
            "rel_err": None, "max_rel_err": None, "err_ok": None, "routing_mismatch": None,
            "multicast_off": all(r["multicast_env"] == MULTICAST_OFF for r in per_rank),
            "seed": spec["seed"], "error": None,
        }
        if first["squared_errors"] is not None:
            rel = {}
            for name in COMPARED:
                parts = [c["squared_errors"][name] for c in cases]
                if all(p is None for p in parts):
                    rel[name] = None
                    continue
                num = sum(p[0] for p in parts if p is not None)
                den = sum(p[1] for p in parts if p is not None)
                # a share that exists on one side only is an error (NaN never passes)
                if any(p is None for p in parts) or not math.isfinite(num):
                    rel[name] = math.nan
                else:
                    rel[name] = math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else
                                                                      math.inf)
            row["rel_err"] = rel
            finite = [v for v in rel.values() if v is not None]
            row["max_rel_err"] = max(finite) if finite else None
            row["err_ok"] = all(math.isfinite(v) and v <= tol for v in finite)
            row["routing_mismatch"] = first["routing_mismatch"]
        rows.append(row)
    return rows


def error_rows(world, spec, message):
    return [{"world": world, "routing": routing, "impl": impl, "T_r": spec["tokens_per_rank"],
             "E_r": spec["experts_per_rank"], "E": spec["experts_per_rank"] * world,
             "k": spec["top_k"], "d": spec["d_model"], "h": spec["d_ffn"],
             "dtype": spec["dtype"], "ms": None, "efficiency": None, "err_ok": None,
             "seed": spec["seed"], "error": message}
            for routing in spec["routings"] for impl in spec["impls"]]


def add_efficiency(rows):
    base = {(r["routing"], r["impl"]): r["ms"] for r in rows if r["world"] == 1 and r["ms"]}
    for r in rows:
        t1 = base.get((r["routing"], r["impl"]))
        r["efficiency"] = t1 / r["ms"] if t1 and r.get("ms") else None


def markdown_table(doc):
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    lines = [f"EP weak scaling on {doc['device']} ({doc['commit']}): T_r={doc['spec']['T_r']}, "
             f"E_r={doc['spec']['E_r']}, k={doc['spec']['k']}, d={doc['spec']['d']}, "
             f"h={doc['spec']['h']}, {doc['spec']['dtype']}, {doc['spec']['activation']}",
             "",
             "| W | routing | impl | ms | eff | exch ms | compute ms | host wait ms | "
             "MiB sent/rank | a2a GB/s | imbalance | TF/s/rank | peak GiB | max rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        if r.get("error"):
            lines.append(f"| {r['world']} | {r['routing']} | {r['impl']} | error: "
                         f"{r['error'].splitlines()[0][:80]} |" + " |" * 10)
            continue
        err = fmt(r.get("max_rel_err"), ".1e")
        if r.get("err_ok") is False:
            err += " **FAIL**"
        lines.append(
            f"| {r['world']} | {r['routing']} | {r['impl']} | {fmt(r['ms'], '.2f')} | "
            f"{fmt(r['efficiency'], '.2f')} | {fmt(r['exchange_ms'], '.2f')} | "
            f"{fmt(r['compute_ms'], '.2f')} | {fmt(r['host_wait_ms'], '.2f')} | "
            f"{fmt(r['bytes_sent_remote_per_rank'] / 2 ** 20, '.1f')} | "
            f"{fmt(r['a2a_GBps'], '.1f')} | {fmt(r['imbalance'], '.2f')} | "
            f"{fmt(r['tflops_per_rank'], '.0f')} | "
            f"{fmt(None if r['peak_bytes'] is None else r['peak_bytes'] / 2 ** 30, '.2f')} | "
            f"{err} |")
    bad = [r for r in doc["rows"] if r.get("err_ok") is False or r.get("error")]
    lines.append("")
    lines.append(f"rows with errors or over the tolerance: {len(bad)}")
    return "\n".join(lines)


def environment(args):
    import baselines

    env = {"torch": torch.__version__, "python": sys.version.split()[0],
           "grouped_mm_available": baselines.grouped_mm_available(),
           "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")}
    if args.device == "cuda":
        env["cuda"] = torch.version.cuda
        env["gpus_visible"] = torch.cuda.device_count()
        try:
            env["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 (facts only)
            pass
    try:
        import moeblaze
        env["moeblaze_build_info"] = moeblaze.build_info()
        env["moeblaze_library"] = moeblaze.library_path()
    except Exception as error:  # noqa: BLE001
        env["moeblaze_build_info"] = f"unavailable: {type(error).__name__}: {error}"
    return env


def main(argv=None):
    import run_bench  # git_commit, device_slug, finite_or_none

    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    spec = {"device": args.device, "dtype": args.dtype, "seed": args.seed,
            "tokens_per_rank": args.tokens_per_rank, "experts_per_rank": args.experts_per_rank,
            "top_k": args.top_k, "d_model": args.d_model, "d_ffn": args.d_ffn,
            "activation": args.activation, "checkpoint": args.checkpoint,
            "renormalize": args.renormalize, "zipf_s": args.zipf_s,
            "zipf_shuffle": args.zipf_shuffle, "routings": args.routings, "impls": args.impls,
            "warmup": args.warmup, "reps": args.reps, "check": not args.no_check,
            "threads_per_rank": args.threads_per_rank,
            "collective_timeout_s": args.collective_timeout_s}
    for world in args.worlds:
        if args.top_k > args.experts_per_rank * world:
            raise SystemExit(f"top-k {args.top_k} > E = {args.experts_per_rank * world} "
                             f"at W = {world}")
    date = datetime.datetime.now(datetime.timezone.utc)
    path = os.path.join(args.out, f"{date.strftime('%Y-%m-%d')}-{run_bench.device_slug(device)}"
                                  f"-ep-weak-scaling.json")
    header = {
        "device": device, "commit": run_bench.git_commit(),
        "command": " ".join(["python3", os.path.relpath(os.path.abspath(__file__))] +
                            (sys.argv[1:] if argv is None else list(argv))),
        "date_utc": date.isoformat(timespec="seconds"),
        "environment": environment(args),
        "spec": {"T_r": args.tokens_per_rank, "E_r": args.experts_per_rank, "k": args.top_k,
                 "d": args.d_model, "h": args.d_ffn, "dtype": args.dtype,
                 "activation": args.activation, "checkpoint": args.checkpoint,
                 "renormalize": args.renormalize, "score_function": "softmax_topk",
                 "routings": args.routings, "zipf_s": args.zipf_s,
                 "zipf_shuffle": args.zipf_shuffle, "impls": args.impls,
                 "reference": reference_impl(args.impls), "worlds": args.worlds,
                 "warmup": args.warmup, "reps": args.reps, "seed": args.seed,
                 "err_tolerance": ERR_TOLERANCE[args.dtype]},
        "method": {
            "ms": "median over repetitions of the slowest rank's fwd+bwd "
                  + ("(CUDA events on each rank's stream)" if args.device == "cuda"
                     else "(wall clock, gloo on the CPU)"),
            "exchange_ms": "per rank, sum of the bracketed exchange calls of one fwd+bwd "
                           "(count table, dispatch, return, both directions; waiting for peers "
                           "included), median over repetitions; max over ranks",
            "compute_ms": "per rank median of (step - exchange); max over ranks",
            "host_wait_ms": "host time blocked in the forward's count-table copy, max over "
                            "ranks of the per-rank median",
            "a2a_GBps": "bytes a rank sends to other ranks per fwd+bwd / its exchange time; "
                        "median over ranks",
            "imbalance": "max over ranks of received routed rows / mean",
            "tflops_per_rank": "18*T_r*k*d*h (gated) or 12*T_r*k*d*h / ms",
            "rel_err": "relative Frobenius error vs the reference implementation, all ranks",
        },
    }
    log(f"EP weak scaling: worlds {args.worlds} on {device} ({args.device}), impls {args.impls}, "
        f"routings {args.routings}; results -> {path}")
    log(f"moeblaze: {header['environment'].get('moeblaze_build_info')}")
    rows = []

    def save():
        doc = dict(header)
        doc["rows"] = run_bench.finite_or_none(rows)
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1, allow_nan=False, default=str)
        os.replace(path + ".tmp", path)
        return doc

    for world in args.worlds:
        t0 = time.monotonic()
        per_rank, error = launch(world, spec, args)
        if error and died_by_signal(error):
            # A rank killed by a signal (gloo has aborted a CPU rank under heavy load) gets one more
            # launch on the same inputs; a fault of the library would repeat, and is reported.
            log(f"W={world}: {error.splitlines()[0]}; launching the world once more")
            per_rank, error = launch(world, spec, args)
        if error:
            log(f"W={world}: FAILED after {time.monotonic() - t0:.0f} s\n{error}")
            rows.extend(error_rows(world, spec, error))
        else:
            new = aggregate(world, per_rank, spec, args)
            rows.extend(new)
            log(f"W={world}: done in {time.monotonic() - t0:.0f} s: " + ", ".join(
                f"{r['routing']}/{r['impl']} {r['ms']:.2f} ms" for r in new))
        add_efficiency(rows)
        doc = save()
    log(f"wrote {path}")
    log("")
    log(markdown_table(doc))
    bad = [r for r in rows if r.get("error") or r.get("err_ok") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker_main(sys.argv[2:])
    else:
        sys.exit(main())
