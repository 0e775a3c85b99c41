"""CPU smoke tests of the expert-parallel weak-scaling benchmark (gloo, no GPU; torch 1.13+).

    MOEBLAZE_LIBRARY=build/src/libmoeblaze.so /usr/bin/python3 -m pytest -q \
        bench/test_ep_weak_scaling_cpu.py

Runs bench/ep_weak_scaling.py end to end at world sizes 1 and 2 on tiny shapes and checks the JSON
and that moeblaze's ExpertParallelMoE agrees with the PyTorch EP baselines (so the benchmark cannot
time a wrong computation silently), that a wrong result is flagged, and that the baseline equals
the one-process loop baseline. The moeblaze runs are skipped, with the reason, when the library
cannot be loaded.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import baselines  # noqa: E402
import ep_baseline  # noqa: E402
import ep_weak_scaling  # noqa: E402

SEED = 20261129
TINY = ["--tokens-per-rank", "40", "--experts-per-rank", "3", "--top-k", "2", "--d-model", "16",
        "--d-ffn", "12", "--warmup", "1", "--reps", "2", "--seed", str(SEED)]
ROW_KEYS = ("world", "routing", "impl", "T_r", "E_r", "E", "k", "d", "h", "dtype", "ms",
            "efficiency", "exchange_ms", "compute_ms", "host_wait_ms",
            "bytes_sent_remote_per_rank", "bytes_recv_remote_per_rank", "a2a_GBps", "imbalance",
            "recv_rows", "tflops_per_rank", "peak_bytes", "rel_err", "max_rel_err", "err_ok",
            "routing_mismatch", "multicast_off", "error")


def require_moeblaze():
    sys.path.insert(0, os.path.join(REPO, "bindings", "python"))
    try:
        import moeblaze
        moeblaze.build_info()  # loads the library
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"moeblaze CPU library not loadable: {type(error).__name__}: {error}")


def run_benchmark(tmp_path, extra, fault=None):
    print(f"seed = {SEED}")
    out = tmp_path / "out"
    argv = [sys.executable, os.path.join(HERE, "ep_weak_scaling.py"), "--device", "cpu",
            "--out", str(out)] + TINY + extra
    env = dict(os.environ)
    env["MOEBLAZE_COMMIT"] = "smoke-test"
    env.pop(ep_weak_scaling.FAULT_ENV, None)
    if fault:
        env[ep_weak_scaling.FAULT_ENV] = fault
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)
    print(proc.stdout[-6000:], proc.stderr[-4000:])
    files = list(out.glob("*-cpu-ep-weak-scaling.json"))
    assert len(files) == 1, files
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-cpu-ep-weak-scaling\.json", files[0].name)
    return proc, json.loads(files[0].read_text())


def test_weak_scaling_smoke_w1_w2(tmp_path):
    require_moeblaze()
    proc, doc = run_benchmark(tmp_path, ["--worlds", "1,2", "--skew",
                                         "--impls", "moeblaze,loop,grouped_mm_emulated"])
    assert proc.returncode == 0
    for key in ("device", "commit", "command", "rows", "environment", "spec", "method"):
        assert key in doc, key
    assert doc["device"] == "cpu" and doc["commit"] == "smoke-test"
    assert "ep_weak_scaling.py" in doc["command"]
    assert doc["environment"]["NCCL_NVLS_ENABLE"] == "0"
    assert doc["environment"]["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert doc["spec"]["reference"] == "loop"
    # the markdown table comes last
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("rows with errors or over the tolerance: 0")
    assert proc.stdout.rindex("| W | routing | impl |") > proc.stdout.rindex("wrote ")

    rows = doc["rows"]
    assert len(rows) == 2 * 2 * 3  # worlds x routings x impls
    by = {(r["world"], r["routing"], r["impl"]): r for r in rows}
    for r in rows:
        for key in ROW_KEYS:
            assert key in r, key
        assert r["error"] is None, r["error"]
        assert r["multicast_off"] is True
        assert r["E"] == 3 * r["world"] and r["T_r"] == 40
        assert r["ms"] > 0 and r["compute_ms"] > 0 and r["exchange_ms"] >= 0
        assert r["ms_min"] <= r["ms"] <= r["ms_max"]
        assert len(r["recv_rows"]) == r["world"] and r["imbalance"] >= 1.0
        # every routed pair lands somewhere: received rows over ranks = W * T_r * k
        assert sum(r["recv_rows"]) == r["world"] * 40 * 2
        assert sum(r["global_counts"]) == r["world"] * 40 * 2
        # bytes are conserved: what ranks send to others, others receive
        assert r["bytes_sent_remote_per_rank"] == r["bytes_recv_remote_per_rank"]
        if r["world"] == 1:
            assert r["efficiency"] == 1.0
            assert r["bytes_sent_remote_per_rank"] == 0 and r["a2a_GBps"] is None
        else:
            assert r["efficiency"] > 0
            assert r["bytes_sent_remote_per_rank"] > 0 and r["a2a_GBps"] > 0
        if r["impl"] == "loop":  # the reference
            assert r["rel_err"] is None and r["reference"] is None
            continue
        assert r["reference"] == "loop"
        assert set(r["rel_err"]) == set(ep_weak_scaling.COMPARED)
        assert r["err_ok"] is True, r["rel_err"]
        assert r["routing_mismatch"] == 0
        for name, err in r["rel_err"].items():
            assert err is not None and err < 1e-5, (r["world"], r["routing"], r["impl"], name)
    for world in (1, 2):  # all implementations see the same routing
        for routing in ("balanced", "zipf"):
            counts = {by[(world, routing, i)]["global_counts"].__str__()
                      for i in ("moeblaze", "loop", "grouped_mm_emulated")}
            assert len(counts) == 1
    # the skewed routing is skewed: hot experts on rank 0
    assert by[(2, "zipf", "loop")]["imbalance"] > by[(2, "balanced", "loop")]["imbalance"]
    zipf = by[(2, "zipf", "loop")]["global_counts"]
    assert zipf[0] > zipf[-1]


def test_bf16_w2_matches_baseline(tmp_path):
    require_moeblaze()
    proc, doc = run_benchmark(tmp_path, ["--worlds", "2", "--dtype", "bf16",
                                         "--impls", "loop,moeblaze"])
    assert proc.returncode == 0
    rows = {r["impl"]: r for r in doc["rows"]}
    mb = rows["moeblaze"]
    assert mb["dtype"] == "bf16" and mb["err_ok"] is True
    assert 0 < mb["max_rel_err"] < 3e-2  # bf16: rounding differs, but not by much
    assert rows["loop"]["efficiency"] is None  # no W = 1 in this run


def test_a_wrong_result_is_flagged(tmp_path):
    """The comparison can fail: a scaled y in moeblaze's row is reported and the run exits 1."""
    require_moeblaze()
    proc, doc = run_benchmark(tmp_path, ["--worlds", "1", "--impls", "loop,moeblaze"],
                              fault="scale_y:moeblaze")
    assert proc.returncode == 1
    rows = {r["impl"]: r for r in doc["rows"]}
    assert rows["moeblaze"]["err_ok"] is False
    assert rows["moeblaze"]["rel_err"]["y"] > 0.4
    assert rows["moeblaze"]["rel_err"]["dx"] > 0.4  # y's scale reaches every gradient
    assert rows["loop"]["err_ok"] is None  # the reference is not compared with itself
    assert "**FAIL**" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith(
        "rows with errors or over the tolerance: 1")


def test_failed_worker_is_reported(tmp_path):
    """A world that cannot start (top-k larger than E is refused up front; an unknown impl by the
    parser) fails loudly rather than producing rows."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, "ep_weak_scaling.py"), "--device",
                           "cpu", "--impls", "nope", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "unknown impl" in proc.stderr


def test_only_a_rank_killed_by_a_signal_gets_a_second_launch():
    assert ep_weak_scaling.died_by_signal("world 2: rank 1 exit -6\nrank 1 exit -6:\nterminate")
    assert not ep_weak_scaling.died_by_signal("world 2: rank 1 exit 1\nTraceback")
    assert not ep_weak_scaling.died_by_signal("world 2: rank 0 exit -9\n")  # the launcher's kill
    assert not ep_weak_scaling.died_by_signal("world 2: rank 0 exit timeout after 600 s\n")


def test_baseline_equals_one_process_loop(tmp_path):
    """ep_baseline at world size 1 (gloo, in this process) against baselines.moe_loop with the same
    routing: the EP baseline is right independently of moeblaze."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(SEED)
    T, d, h, E, k = 37, 16, 24, 5, 2
    x = torch.randn(T, d, generator=gen, dtype=torch.float64)
    w_router = torch.randn(E, d, generator=gen, dtype=torch.float64)
    w_gate = torch.randn(E, h, d, generator=gen, dtype=torch.float64) * d ** -0.5
    w_up = torch.randn(E, h, d, generator=gen, dtype=torch.float64) * d ** -0.5
    w_down = torch.randn(E, d, h, generator=gen, dtype=torch.float64) * h ** -0.5
    dy = torch.randn(T, d, generator=gen, dtype=torch.float64)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0,
                            world_size=1)
    try:
        for mode in ("loop", "grouped_mm_emulated"):
            leaves = [t.clone().requires_grad_(True) for t in (x, w_router, w_gate, w_up,
                                                               w_down)]
            y, info = ep_baseline.ep_moe_baseline(*leaves, num_experts=E, top_k=k,
                                                  activation="swiglu", renormalize=True,
                                                  expert_mode=mode)
            grads = torch.autograd.grad(y, leaves, dy)

            ref_leaves = [t.clone().requires_grad_(True) for t in (x, w_router, w_gate, w_up,
                                                                   w_down)]
            _, ids, g = ep_baseline.route(ref_leaves[0], ref_leaves[1], k, True)
            y_ref = baselines.moe_loop(ref_leaves[0], ids.to(torch.int32), g, *ref_leaves[2:],
                                       activation="swiglu")
            ref_grads = torch.autograd.grad(y_ref, ref_leaves, dy)
            assert torch.allclose(y, y_ref, rtol=1e-12, atol=1e-12), mode
            for name, a, b in zip(("dx", "dw_router", "dw_gate", "dw_up", "dw_down"), grads,
                                  ref_grads):
                assert torch.allclose(a, b, rtol=1e-11, atol=1e-11), (mode, name)
            assert sum(info.global_counts) == T * k and info.send_splits == [T * k]
    finally:
        dist.destroy_process_group()
