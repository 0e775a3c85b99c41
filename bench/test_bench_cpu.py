"""CPU smoke tests of the benchmark harness (no GPU needed; torch 1.13+).

    /usr/bin/python3 -m pytest -q bench/test_bench_cpu.py

The moeblaze checks use the CPU backend through bindings/python (library from $MOEBLAZE_LIBRARY or
a build*/ tree) and are skipped, with the reason, when the library cannot be loaded.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import baselines  # noqa: E402
import roofline  # noqa: E402
import run_bench  # noqa: E402

TINY = [
    {"name": "tiny_a", "T": 48, "d": 32, "h": 48, "E": 4, "k": 2},
    {"name": "tiny_b", "T": 37, "d": 16, "h": 40, "E": 8, "k": 3},
]


def random_problem(T, d, h, E, k, activation, dtype, seed):
    print(f"seed={seed} T={T} d={d} h={h} E={E} k={k} act={activation} dtype={dtype}")
    gen = torch.Generator().manual_seed(seed)
    route = torch.float64 if dtype == torch.float64 else torch.float32

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    logits = torch.randn(T, E, generator=gen)
    top, ids = torch.softmax(logits, -1).topk(k, -1)
    g = (top / top.sum(-1, keepdim=True)).to(route)
    gated = baselines.is_gated(activation)
    return {"x": randn(T, d), "ids": ids.to(torch.int32), "g": g,
            "w_gate": randn(E, h, d, scale=d ** -0.5),
            "w_up": randn(E, h, d, scale=d ** -0.5) if gated else None,
            "w_down": randn(E, d, h, scale=h ** -0.5), "dy": randn(T, d)}


def forward_backward(fn, p, **kw):
    leaves = [None if p[n] is None else p[n].detach().clone().requires_grad_(True)
              for n in ("x", "g", "w_gate", "w_up", "w_down")]
    x, g, wg, wu, wd = leaves
    y = fn(x, p["ids"], g, wg, wu, wd, **kw)
    wanted = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(y, wanted, p["dy"]))
    return [y.detach()] + [None if t is None else next(grads) for t in leaves]


def rel(a, b):
    if a is None and b is None:
        return 0.0
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def grouped_emulated(*args, **kw):
    return baselines.moe_grouped_mm(*args, grouped_mm=baselines.grouped_mm_emulated, **kw)


def moeblaze_torch():
    sys.path.insert(0, os.path.join(REPO, "bindings", "python"))
    try:
        import moeblaze
        import moeblaze.torch as mbt
        moeblaze.build_info()  # loads the library
        return mbt
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"moeblaze CPU library not loadable: {type(error).__name__}: {error}")


# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", baselines.ACTIVATIONS)
def test_baselines_match_dense_reference(activation):
    p = random_problem(29, 16, 24, 5, 2, activation, torch.float64, seed=11)
    ref = forward_backward(baselines.moe_dense_reference, p, activation=activation)
    for fn in (baselines.moe_loop, grouped_emulated):
        out = forward_backward(fn, p, activation=activation)
        for name, a, b in zip(("y",) + run_bench.GRAD_NAMES, out, ref):
            assert (a is None) == (b is None), name
            err = rel(a, b)
            assert err < 1e-12, f"{fn.__name__} {activation} {name}: {err}"


def test_comparison_can_fail():
    """A wrong routing must show up as a large error (the checks above are not vacuous)."""
    p = random_problem(29, 16, 24, 5, 2, "swiglu", torch.float64, seed=12)
    ref = forward_backward(baselines.moe_dense_reference, p, activation="swiglu")
    wrong = dict(p)
    wrong["ids"] = (p["ids"] + 1) % 5
    out = forward_backward(baselines.moe_loop, wrong, activation="swiglu")
    assert rel(out[0], ref[0]) > 0.1


def test_empty_experts_and_one_hot_routing():
    """Every token on expert 0 (others empty): the loop and the grouped dataflow still agree."""
    p = random_problem(20, 8, 16, 4, 1, "swiglu", torch.float64, seed=13)
    p["ids"] = torch.zeros_like(p["ids"])
    ref = forward_backward(baselines.moe_dense_reference, p, activation="swiglu")
    for fn in (baselines.moe_loop, grouped_emulated):
        out = forward_backward(fn, p, activation="swiglu")
        assert all(rel(a, b) < 1e-12 for a, b in zip(out, ref))
        assert float(out[3][1:].abs().max()) == 0.0  # no gradient for experts without tokens


@pytest.mark.parametrize("activation", ["swiglu", "silu", "geglu", "relu2"])
def test_moeblaze_cpu_matches_baselines(activation):
    mbt = moeblaze_torch()
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        p = random_problem(41, 16, 32, 6, 2, activation, dtype, seed=21)
        ref = forward_backward(baselines.moe_loop, p, activation=activation)
        results = {}
        for policy in run_bench.ALL_POLICIES:
            out = forward_backward(mbt.moe_experts, p, activation=activation, checkpoint=policy)
            for name, a, b in zip(("y",) + run_bench.GRAD_NAMES, out, ref):
                err = rel(a, b)
                assert err < tol, f"{dtype} {policy} {name}: {err}"
            results[policy] = out
        # the numerics contract: every policy gives bitwise the same results
        for policy in ("save_all", "recompute"):
            for a, b in zip(results[policy], results["save_preact"]):
                assert (a is None and b is None) or torch.equal(a, b), policy


def test_moeblaze_cpu_bf16_against_fp64():
    mbt = moeblaze_torch()
    p = random_problem(64, 32, 64, 4, 2, "swiglu", torch.bfloat16, seed=31)
    p64 = {n: (None if t is None or t.dtype == torch.int32 else t.double()) for n, t in p.items()}
    p64["ids"] = p["ids"]
    ref = forward_backward(baselines.moe_loop, p64, activation="swiglu")
    for fn, kw in ((mbt.moe_experts, {"checkpoint": "save_preact"}), (baselines.moe_loop, {}),
                   (grouped_emulated, {})):
        out = forward_backward(fn, p, activation="swiglu", **kw)
        for name, a, b in zip(("y",) + run_bench.GRAD_NAMES, out, ref):
            err = rel(a, b)
            assert err < 2e-2, f"{getattr(fn, '__name__', fn)} {name}: {err}"


def test_saved_tensor_recorder_excludes_inputs_and_dedups_views():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    key = run_bench.storage_key
    rec = run_bench.SavedTensorRecorder([key(w)[0], key(x)[0]])
    with rec.hooks():
        h = x @ w.t()          # saves x and w (inputs: excluded)
        z = torch.sigmoid(h)   # saves its output z
        y = (z * z[:, :4].repeat(1, 2)).sum()  # saves z (again) and a new [4,8] tensor
    assert rec.count >= 4
    assert rec.total() == 2 * 4 * 8 * 4  # z and the repeat, fp32, once each
    y.backward()
    assert w.grad is not None


def test_roofline_formulas():
    cfgs = {c["name"]: c for c in roofline.load_configs()}
    c = cfgs["conf1"]
    assert roofline.flops(c, "swiglu") == 18 * c["T"] * c["k"] * c["d"] * c["h"]
    assert roofline.flops(c, "silu") == 12 * c["T"] * c["k"] * c["d"] * c["h"]
    # the fused design's bytes worked by hand: Mixtral at T=16384 22.3 GB; Qwen3-30B-A3B at T=32768
    # 9.9 GB
    assert abs(roofline.fused_bytes(cfgs["mixtral"], "swiglu") / 1e9 - 22.3) < 0.05
    assert abs(roofline.fused_bytes(cfgs["qwen3-30b-a3b"], "swiglu") / 1e9 - 9.93) < 0.05
    assert roofline.strict_min_bytes(c, "swiglu") < roofline.fused_bytes(c, "swiglu")


def _run_harness(tmp_path, extra, env=None):
    cfg_path = tmp_path / "tiny.json"
    cfg_path.write_text(json.dumps({"configs": TINY}))
    out = tmp_path / "out"
    argv = [sys.executable, os.path.join(HERE, "run_bench.py"), "--device", "cpu",
            "--configs-file", str(cfg_path), "--quick", "--out", str(out),
            "--emulate-grouped-mm"] + extra
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=full_env)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0
    files = list(out.glob("*-cpu.json"))
    assert len(files) == 1
    return json.loads(files[0].read_text()), proc.stdout


def test_harness_smoke(tmp_path):
    doc, stdout = _run_harness(tmp_path, ["--acts", "swiglu,silu"])
    assert stdout.rindex("config/act") > stdout.rindex("wrote ")  # the summary table comes last
    for key in ("device", "commit", "command", "rows", "summary", "environment"):
        assert key in doc
    rows = doc["rows"]
    # grouped_mm, loop, sonicmoe and megablocks (both skipped on CPU), moeblaze x3
    assert len(rows) == len(TINY) * 2 * 7
    have_moeblaze = doc["environment"]["moeblaze"].startswith("bindings")
    for r in rows:
        assert set(r["rel_err"]) == {"y", "dx", "dw_gate", "dw_up", "dw_down", "dg"}
        if r["impl"] in ("sonicmoe", "megablocks"):  # CUDA-only peers: visible skips, reasons
            assert r["error"] is None and "CUDA" in r["skipped"], r
            assert r["policy"] == run_bench.PEER_POLICY, r
            continue
        if r["impl"] == "moeblaze" and not have_moeblaze:
            assert r["error"]
            continue
        assert r["error"] is None, r
        assert r["ms"] > 0 and r["tflops"] > 0
        assert r["saved_bytes"] > 0 and r["peak_bytes"] is None  # no peak on CPU
        assert r["clock_samples"] == 0 and r["sm_mhz"] is None and r["joules"] is None
        errs = r["rel_err"]
        assert (errs["dw_up"] is None) == (r["act"] == "silu")
        assert all(v < 3e-2 for v in errs.values() if v is not None), r
        assert r["err_ok"] is True and r["bitwise_repeat"] is True
    for r in rows:
        if r["impl"] == "moeblaze" and have_moeblaze:
            # The torch binding allocates an affine-in-T bound of the library's size
            # (moeblaze.torch._SavedSize): exact up to one 256-byte alignment pad per part.
            assert 0 <= r["saved_bytes"] - r["saved_bytes_library"] < 8 * 256, r
            assert "speedup_vs_grouped_mm" in r and "saved_ratio_vs_grouped_mm" in r
    if have_moeblaze:
        by = {(r["config"], r["act"], r["policy"]): r["saved_bytes"] for r in rows
              if r["impl"] == "moeblaze"}
        for c in TINY:
            for act in ("swiglu", "silu"):
                assert by[(c["name"], act, "recompute")] < by[(c["name"], act, "save_preact")] \
                    < by[(c["name"], act, "save_all")]


def test_interleaved_timing_alternates_the_rows_and_splits_their_repetitions():
    args = run_bench.parse_args(["--device", "cpu", "--interleave", "3"])
    calls = []

    def pending(impl, reps, fail=False):
        row = {"impl": impl, "flops": 1e9}

        def step():
            calls.append(impl)
            if fail and calls.count(impl) > 1:
                raise RuntimeError("step broke")
        return run_bench.PendingTiming(row, step, reps, est_ms=1000.0)  # no extra warm-up

    rows = [pending("a", 6), pending("b", 5), pending("c", 3, fail=True)]
    order = []
    run_bench.interleave_timing(rows, 3, args, order_log=order)
    # rounds: as planned, reversed, as planned (one block a row each); c's step raises in its
    # second round, which leaves c out of the third
    assert order == ["a", "b", "c", "b", "a", "a", "b"], order
    a, b, c = (p.row for p in rows)
    assert a["reps"] == 6 and len(a["ms_rounds"]) == 3 and a["timing_rounds"] == 3
    assert b["reps"] == 6  # ceil(5 / 3) = 2 a round
    assert a["ms"] > 0 and a["tflops"] > 0 and a["ms_min"] <= a["ms"] <= a["ms_p80"]
    assert a["clock_samples"] == 0 and a["sm_mhz"] is None  # CPU: nothing sampled
    assert "step broke" in c["error"] and "ms" not in c and "timing_rounds" not in c
    assert all(p.step is None for p in rows[:2])  # the implementations' state is let go


def test_harness_interleaved_rows(tmp_path):
    doc, _ = _run_harness(tmp_path, ["--acts", "silu", "--impls", "loop,grouped_mm",
                                     "--interleave", "3"])
    rows = doc["rows"]
    assert sorted((r["config"], r["impl"]) for r in rows) == \
        sorted((c["name"], impl) for c in TINY for impl in ("grouped_mm", "loop"))
    for r in rows:
        assert r["error"] is None, r
        assert r["timing_rounds"] == 3 and len(r["ms_rounds"]) == 3, r
        assert r["reps"] >= 3 and r["ms"] > 0 and r["err_ok"] is True
    assert "--interleave 3" in doc["command"]


def test_a_library_built_at_another_commit_is_flagged_and_not_published(tmp_path):
    info = "moeblaze 0.1.0 (git b18fd4923aea), ABI 0, backends: CPU"
    assert run_bench.commit_mismatch("b18fd4923aea80f62997d53c8cdfc15410e7d3fa", info) is None
    assert run_bench.commit_mismatch("b18fd49", info) is None  # $MOEBLAZE_COMMIT, short
    assert run_bench.commit_mismatch("b18fd4923aea80f6-dirty", info.replace(")", "-dirty)")) \
        is None
    message = run_bench.commit_mismatch("0b79da43057e0081926fef7ea9d3bac85fe8ae2c-dirty", info)
    assert "b18fd4923aea" in message and "MOEBLAZE_COMMIT" in message
    for commit, build in (("unknown", info), ("release 0.1", info), ("b18fd49", None),
                          ("0b79da4", "moeblaze 0.1.0 (git unknown), ABI 0")):
        assert run_bench.commit_mismatch(commit, build) is None, (commit, build)
    import make_report
    doc = {"device": "cpu", "commit": "0b79da4", "commit_mismatch": message,
           "environment": {"dtype": "bf16", "moeblaze_build_info": info}, "rows": []}
    assert "**Commit mismatch:**" in make_report.markdown(doc)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="not published"):
        make_report.publish(str(path), results_dir=str(tmp_path / "results"), doc_path=None,
                            make_plots=False)
    assert not (tmp_path / "results").exists()
    # tools/same_code.py's check that the library is a build of the run's commit but for its
    # revision: published, with the check in the report. A check of another commit or library
    # is not enough.
    good = {"library_revision": "b18fd4923aea", "same_code_as": "0b79da4",
            "compared": ["the SASS of 2 kernels"], "by": "tools/same_code.py"}
    for check in ({**good, "same_code_as": "1234567"}, {**good, "library_revision": "ffff"}):
        path.write_text(json.dumps({**doc, "build_check": check}))
        with pytest.raises(SystemExit, match="not published"):
            make_report.publish(str(path), results_dir=str(tmp_path / "results"), doc_path=None,
                                make_plots=False)
    checked = {**doc, "build_check": good}
    text = make_report.markdown(checked)
    assert "**Build check:**" in text and "**Commit mismatch:**" not in text
    path.write_text(json.dumps(checked))
    make_report.publish(str(path), results_dir=str(tmp_path / "results"), doc_path=None,
                        make_plots=False)
    assert (tmp_path / "results" / "latest.json").exists()


def test_committed_result_sets_name_the_build_they_measured():
    import make_report
    for name in ("latest.json", "layer.json", "megablocks.json"):
        with open(os.path.join(HERE, "results", name)) as f:
            doc = json.load(f)
        build = doc["environment"]["moeblaze_build_info"]
        if make_report.build_checked(doc):  # tools/same_code.py: the commit's code
            continue
        assert "commit_mismatch" not in doc, name
        assert run_bench.commit_mismatch(doc["commit"], build) is None, (name, doc["commit"], build)
        assert "(git " in build and not doc["commit"].endswith("-dirty"), (name, doc["commit"])


def test_harness_survives_a_crashing_configuration(tmp_path):
    doc, _ = _run_harness(tmp_path, ["--acts", "swiglu", "--isolate", "--impls", "loop,grouped_mm"],
                          env={"MOEBLAZE_BENCH_FAULT": "crash:tiny_a:loop"})
    rows = {(r["config"], r["impl"]): r for r in doc["rows"]}
    assert rows[("tiny_a", "grouped_mm")]["error"] is None  # ran before the crash
    assert "not measured" in rows[("tiny_a", "loop")]["error"]
    assert rows[("tiny_b", "loop")]["error"] is None  # the next configuration still ran
    assert rows[("tiny_b", "grouped_mm")]["error"] is None


def test_harness_records_a_raising_row(tmp_path):
    doc, _ = _run_harness(tmp_path, ["--acts", "silu", "--impls", "loop,grouped_mm"],
                          env={"MOEBLAZE_BENCH_FAULT": "raise:tiny_b:grouped_mm"})
    rows = {(r["config"], r["impl"]): r for r in doc["rows"]}
    assert "injected fault" in rows[("tiny_b", "grouped_mm")]["error"]
    assert rows[("tiny_b", "loop")]["error"] is None


def test_make_report_fills_markers(tmp_path):
    doc, _ = _run_harness(tmp_path, ["--acts", "swiglu", "--impls", "loop,grouped_mm"])
    import make_report
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    md = tmp_path / "perf.md"
    md.write_text(f"# x\n{make_report.RESULTS_BEGIN}\nold\n{make_report.RESULTS_END}\ntail\n")
    make_report.report(str(path), str(tmp_path), str(md))
    text = md.read_text()
    assert "old" not in text and "tail" in text and "| tiny_a | swiglu |" in text


def _report_rows():
    """Rows of two implementations besides moeblaze for one configuration: what make_report needs."""
    rows = []
    for impl, policy, ms in (("grouped_mm", "autograd", 4.0), ("sonicmoe", "autograd", 2.5),
                             ("moeblaze", "save_preact", 2.0), ("moeblaze", "save_all", 2.1),
                             ("moeblaze", "recompute", 2.4)):
        rows.append({"config": "c1", "act": "swiglu", "impl": impl, "policy": policy, "ms": ms,
                     "tflops": 100.0 / ms, "flops": 1e11, "saved_bytes": 1 << 20,
                     "peak_bytes": (4 << 20) if impl == "grouped_mm" else (2 << 20),
                     "rel_err": {"y": 1e-3, "dx": 2e-3}, "bitwise_repeat": True, "error": None})
    return rows


def test_make_report_gives_every_baseline_its_columns():
    import make_report
    doc = {"device": "cpu", "commit": "abc", "command": "x", "environment": {}, "rows": _report_rows()}
    table = make_report.speed_table(doc).splitlines()
    assert "| grouped_mm ms | sonicmoe ms | moeblaze ms | × vs grouped_mm | × vs sonicmoe |" in table[0]
    assert table[2].startswith("| c1 | swiglu | 4.000 | 2.500 | 2.000 | 2.00 | 1.25 |")
    assert table[0].count("|") == table[2].count("|")
    lines = make_report.target_lines(doc)
    assert "**2.00×** over grouped_mm" in lines[0] and "**1.25×** over sonicmoe" in lines[0]
    memory = make_report.memory_table(doc).splitlines()
    assert "peak MiB grouped_mm / sonicmoe" in memory[0] and "| 4 / 2 |" in memory[2]


def test_make_report_energy_table_compares_joules_and_names_the_power_reading():
    import make_report
    rows = _report_rows()
    doc = {"device": "cpu", "commit": "abc", "command": "x", "environment": {}, "rows": rows}
    assert make_report.energy_table(doc) == ""  # nothing sampled: no table, no caption
    assert "Clocks and energy" not in make_report.markdown(doc)
    for r, (mhz, watts) in zip(rows, ((1440, 690), (1500, 680), (1470, 700))):
        r.update(clock_samples=8, sm_mhz=mhz, power_w=watts, joules=watts * r["ms"] / 1e3,
                 power_field="power.draw.instant")
    table = make_report.energy_table(doc).splitlines()
    assert "| SM MHz grouped_mm / sonicmoe / moeblaze |" in table[0]
    assert table[0].endswith("| J moeblaze ÷ grouped_mm | J moeblaze ÷ sonicmoe |")
    # moeblaze 1.40 J against 2.76 and 1.70
    assert table[2] == ("| c1 | swiglu | 1440 / 1500 / 1470 | 690 / 680 / 700 "
                        "| 2.76 / 1.70 / 1.40 | 0.507 | 0.824 |")
    md = make_report.markdown(doc)
    assert "board power (`power.draw.instant`)" in md and "one-second average" not in md
    rows[1].pop("power_field")  # a set from before the instant reading: power.draw, with a caveat
    caption = make_report.energy_caption(doc)
    assert "(`power.draw` and `power.draw.instant`)" in caption and "one-second average" in caption
    rows[0]["clock_samples"] = 0  # an unsampled row reads as a dash, not as zero
    assert "| – / 1500 / 1470 |" in make_report.energy_table(doc)


def test_make_report_tells_a_consistent_lead_from_a_mixed_one():
    import make_report
    verdict = make_report.round_verdict
    assert verdict({"ms_rounds": [2.0, 2.1, 2.0]}, {"ms_rounds": [1.9, 2.0, 1.99]}) == "faster"
    assert verdict({"ms_rounds": [2.0, 2.1, 2.0]}, {"ms_rounds": [2.1, 2.2, 2.01]}) == "slower"
    # A lower median ratio is not a lead in every round.
    assert verdict({"ms_rounds": [2.0, 2.1, 2.0]}, {"ms_rounds": [1.5, 2.2, 1.9]}) == "mixed"
    assert verdict({"ms_rounds": [2.0]}, {"ms_rounds": [1.0]}) is None  # one round: no pairs
    assert verdict({"ms_rounds": [2.0, 2.0]}, {"ms_rounds": [1.0, 1.0, 1.0]}) is None
    assert verdict({}, {"ms_rounds": [1.0, 1.0]}) is None
    doc = {"device": "cpu", "commit": "abc", "command": "x", "environment": {}, "rows": _report_rows()}
    assert "paired timing round" not in make_report.target_lines(doc)[0]  # no rounds recorded
    for row in doc["rows"]:
        row["ms_rounds"] = {"grouped_mm": [4.0, 4.1], "sonicmoe": [2.5, 1.9]}.get(row["impl"],
                                                                                [2.0, 2.0])
    line = make_report.target_lines(doc)[0]
    assert "grouped_mm (slowest 2.00×, 1 configurations, target ≥ 1.3×; faster in every " \
           "paired timing round on 1 of 1)" in line
    assert "faster in every paired timing round on 0 of 1 (c1 mixed)" in line


def test_make_report_publish_writes_the_result_set(tmp_path):
    import make_report
    doc = {"device": "cpu", "commit": "abc", "rows": _report_rows(),
           "command": "python3 bench/run_bench.py --out /" + "root/out/bench --budget-s 200",
           "environment": {"moeblaze_library": "/" + "work/x/build/src/libmoeblaze.so.0"}}
    run = tmp_path / "2026-01-01-cpu.json"
    run.write_text(json.dumps(doc))
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    for name in make_report.PLOT_FILES.values():
        (results / name).write_bytes(b"png")
    perf = tmp_path / "docs" / "performance.md"
    perf.parent.mkdir()
    perf.write_text(f"# x\n{make_report.RESULTS_BEGIN}\nold\n{make_report.RESULTS_END}\n")
    make_report.publish(str(run), str(results), str(perf), make_plots=False)
    latest = json.loads((results / "latest.json").read_text())
    assert latest["command"] == 'python3 bench/run_bench.py --out "$OUT" --budget-s 200'
    assert latest["environment"]["moeblaze_library"] == "libmoeblaze.so.0"
    report = (results / "report.md").read_text()
    assert "![time.png](time.png)" in report and "**Accuracy**" in report
    block = perf.read_text()
    assert "![time.png](../bench/results/time.png)" in block and "old" not in block
    assert "**Accuracy**" not in block and "largest ‖out − ref‖ / ‖ref‖" in block


def _peer_rows(acts, mode):
    """One configuration's rows of grouped_mm, SonicMoE, MegaBlocks and moeblaze per activation."""
    rows = []
    for act in acts:
        for impl, policy, ms, peak in (("grouped_mm", "autograd", 4.0, 4),
                                       ("sonicmoe", "default", 3.0, 3),
                                       ("megablocks", "default", 2.5, 5),
                                       ("moeblaze", "save_preact", 2.0, 2)):
            rows.append({"config": "c1", "act": act, "impl": impl, "policy": policy, "ms": ms,
                         "peak_bytes": peak << 30, "mode": mode, "error": None})
    return rows


def test_make_report_publish_as_layer_and_megablocks(tmp_path):
    import make_report
    results = tmp_path / "bench" / "results"
    perf = tmp_path / "docs" / "performance.md"
    perf.parent.mkdir(parents=True)
    perf.write_text(f"# x\n{make_report.LAYER_BEGIN}\nold layer\n{make_report.LAYER_END}\n"
                    f"{make_report.MEGABLOCKS_BEGIN}\nold mb\n{make_report.MEGABLOCKS_END}\ntail\n")
    command = "python3 bench/run_bench.py --out /" + "root/out/x --mode layer"
    layer = tmp_path / "layer-run.json"
    layer.write_text(json.dumps({"command": command, "rows": _peer_rows(["swiglu"], "layer")}))
    make_report.publish(str(layer), str(results), str(perf), make_plots=False, as_="layer")
    assert not (results / "latest.json").exists()
    published = json.loads((results / "layer.json").read_text())
    assert published["command"].endswith('--out "$OUT" --mode layer')
    text = perf.read_text()
    assert "old layer" not in text and "old mb" in text and text.endswith("tail\n")
    row = "| c1 | 4.00 | 3.00 | 2.50 | 2.00 | 2.00 | 1.50 | 1.25 | 2.00 / 4.00 / 3.00 / 5.00 |"
    assert row in text
    mb = tmp_path / "mb-run.json"
    mb.write_text(json.dumps({"command": "x", "rows": _peer_rows(["swiglu", "silu"], "experts")}))
    make_report.publish(str(mb), str(results), str(perf), make_plots=False, as_="megablocks")
    text = perf.read_text()
    assert "old mb" not in text and (results / "megablocks.json").exists()
    assert ("| config | SwiGLU: MegaBlocks / moeblaze ms | × | SiLU: MegaBlocks / moeblaze ms | × |"
            in text)
    assert "| c1 | 2.50 / 2.00 | 1.25 | 2.50 / 2.00 | 1.25 | 2.00 / 5.00 |" in text
    with pytest.raises(SystemExit):
        make_report.publish(str(mb), str(results), str(perf), make_plots=False, as_="nonsense")
    assert set(make_report.ACT_NAMES) == set(baselines.ACTIVATIONS)  # every activation has a name


def test_run_bench_publishes_a_layer_run_as_the_layer_results():
    assert run_bench.publish_target({"rows": _peer_rows(["swiglu"], "layer")}) == "layer"
    assert run_bench.publish_target({"rows": _peer_rows(["swiglu"], "experts")}) == "latest"
    assert run_bench.publish_target({"rows": []}) == "latest"


def test_clock_samples_parse_and_summarise():
    import gpu_clocks
    lines = ["1440, 3201, 691.70, 700.00, 59, 0x0000000000000004",
             "1485, 3201, 650.10, 700.00, 60, 0x0000000000000000",
             "1245, 3201, 698.00, 700.00, 58, 0x0000000000000024",
             "[N/A], 3201, 80.2, 700.00, 36, 0x0000000000000001",
             "garbage line"]
    samples = [gpu_clocks.parse_sample(line) for line in lines]
    assert samples[-1] is None and samples[3]["sm_mhz"] is None
    assert samples[0]["reasons"] == 0x4 and samples[2]["reasons"] == 0x24
    sampler = gpu_clocks.ClockSampler()
    sampler.samples = [s for s in samples if s]
    summary = sampler.summary()
    assert summary["samples"] == 4
    assert summary["sm_mhz"] == {"min": 1245.0, "median": 1440.0, "max": 1485.0}
    assert summary["reason_share"]["software power cap"] == 0.5
    assert summary["reason_share"]["software thermal slowdown"] == 0.25
    assert summary["reason_share"]["idle"] == 0.25
    text = gpu_clocks.describe(summary)
    assert "SM 1440 MHz (1245-1485)" in text and "software power cap 50 %" in text
    assert gpu_clocks.reason_names(0) == "none"
    assert gpu_clocks.reason_names(0x84) == "software power cap, hardware power brake"
    assert gpu_clocks.reason_names(0x1000) == "0x1000"
    assert "no clock samples (nvidia-smi not found)" == gpu_clocks.describe(
        {"samples": 0, "error": "nvidia-smi not found"})


def test_row_clocks_give_the_energy_of_a_step():
    import gpu_clocks
    sampler = gpu_clocks.ClockSampler()
    sampler.samples = [gpu_clocks.parse_sample(line) for line in
                       ("1500, 3201, 690.0, 700.00, 59, 0x4", "1560, 3201, 700.0, 700.00, 60, 0x4",
                        "1485, 3201, 692.0, 700.00, 60, 0x4")]
    fields = gpu_clocks.row_clocks(sampler.summary(), 14.5)
    assert fields["clock_samples"] == 3
    assert fields["sm_mhz"] == 1500.0 and fields["power_w"] == 692.0
    assert abs(fields["joules"] - 692.0 * 14.5e-3) < 1e-12
    assert fields["clock_reasons"] == {"software power cap": 1.0}
    for nothing in (None, {"samples": 0, "error": "nvidia-smi not found"}):
        assert gpu_clocks.row_clocks(nothing, 14.5) == {
            "clock_samples": 0, "sm_mhz": None, "power_w": None, "joules": None,
            "power_field": None, "clock_reasons": None}
    assert fields["power_field"] is None  # samples that do not say which reading they are
    # run_bench.clock_summary condenses samples from several sampled blocks in a new sampler: the
    # reading comes with the samples.
    merged = gpu_clocks.ClockSampler()
    merged.samples = [dict(s, power_field="power.draw.instant") for s in sampler.samples]
    assert gpu_clocks.row_clocks(merged.summary(), 14.5)["power_field"] == "power.draw.instant"


def _fake_nvidia_smi(tmp_path, monkeypatch, answers):
    """An nvidia-smi on PATH that answers a one-field --query-gpu with answers[field] (exit 0), and
    any other field as the real one answers an unknown field (exit 2)."""
    import gpu_clocks
    script = tmp_path / "nvidia-smi"
    cases = "".join(f'  *"--query-gpu={field} "*) echo "{text}"; exit 0;;\n'
                    for field, text in answers.items())
    script.write_text('#!/bin/sh\ncase "$*" in\n' + cases +
                      '  *) echo "Field is not a valid field to query." >&2; exit 2;;\nesac\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ.get('PATH', '')}")
    gpu_clocks.power_field.cache_clear()


def test_power_field_takes_the_instant_reading_where_nvidia_smi_has_one(tmp_path, monkeypatch):
    import gpu_clocks
    _fake_nvidia_smi(tmp_path, monkeypatch, {"power.draw.instant": "512.34", "power.draw": "600"})
    assert gpu_clocks.power_field("0") == "power.draw.instant"
    # An older driver: the field is unknown, the query fails.
    _fake_nvidia_smi(tmp_path, monkeypatch, {"power.draw": "600.00"})
    assert gpu_clocks.power_field("0") == "power.draw"
    # Known but not supported on this card.
    _fake_nvidia_smi(tmp_path, monkeypatch, {"power.draw.instant": "[N/A]", "power.draw": "600"})
    assert gpu_clocks.power_field("0") == "power.draw"
    # A sampler asks for the reading power_field found, and its rows say which one it was.
    script = tmp_path / "nvidia-smi"
    script.write_text('#!/bin/sh\ncase "$*" in\n'
                      '  *"-lms"*) echo "1500, 3201, 612.5, 700.00, 60, 0x4"; '
                      'echo "1485, 3201, 640.0, 700.00, 61, 0x4"; exec sleep 30;;\n'
                      '  *"--query-gpu=power.draw.instant "*) echo "512.34"; exit 0;;\n'
                      '  *) exit 2;;\nesac\n')
    gpu_clocks.power_field.cache_clear()
    import time
    with gpu_clocks.ClockSampler(interval_ms=50) as sampler:
        time.sleep(0.5)
    summary = sampler.summary()
    assert sampler.power_field == "power.draw.instant" and summary["samples"] == 2
    assert summary["power_field"] == "power.draw.instant"
    assert summary["power_w"]["max"] == 640.0
    assert gpu_clocks.fields("power.draw.instant")[2] == "power.draw.instant"
    assert len(gpu_clocks.fields("power.draw.instant")) == len(gpu_clocks.fields())
    gpu_clocks.power_field.cache_clear()


def test_clock_sampler_follows_cuda_visible_devices(monkeypatch):
    import gpu_clocks
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_clocks.ClockSampler().gpu == "0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert gpu_clocks.ClockSampler().gpu == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8a1b2c3d-0000-1111-2222-333344445555")
    assert gpu_clocks.ClockSampler().gpu.startswith("GPU-8a1b")
    assert gpu_clocks.ClockSampler(gpu=2).gpu == 2


def test_clock_lines_in_summary_and_report(tmp_path):
    doc, _ = _run_harness(tmp_path, ["--acts", "swiglu", "--impls", "loop,grouped_mm"])
    clocks = {"samples": 2, "sm_mhz": {"min": 1400.0, "median": 1440.0, "max": 1480.0},
              "power_w": {"min": 690.0, "median": 692.0, "max": 698.0},
              "power_limit_w": {"min": 700.0, "median": 700.0, "max": 700.0},
              "reason_share": {"software power cap": 1.0}}
    doc["environment"]["dense_reference"] = {"shape": "8192x8192x8192", "dtype": "bfloat16",
                                             "seconds": 6.0, "tflops": 660.0, "clocks": clocks}
    doc["environment"]["clocks_during_run"] = clocks
    doc["rows"].append({"config": "tiny_a", "act": "swiglu", "impl": "moeblaze",
                        "policy": "save_preact", "tflops": 550.0})
    lines = run_bench.clock_lines(doc)
    assert lines[0].startswith("sustained dense bfloat16 matmul 8192x8192x8192: 660 TFLOP/s")
    assert lines[1] == "moeblaze swiglu TFLOP/s as a share of it: tiny_a/swiglu 83 %"
    assert "software power cap 100 %" in lines[2]
    import make_report
    md = make_report.markdown(doc)
    assert "**660 TFLOP/s**" in md and "Clocks during the rows: SM 1440 MHz" in md
    header = next(line for line in md.splitlines() if line.startswith("| config | act |"))
    row = next(line for line in md.splitlines() if line.startswith("| tiny_a | swiglu |"))
    assert "| moeblaze % of sustained 660 |" in header
    assert header.count("|") == row.count("|")
    assert "| 83 |" in row  # 550 of the sustained 660


def test_clock_sampler_without_nvidia_smi(monkeypatch):
    import gpu_clocks
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    with gpu_clocks.ClockSampler() as sampler:
        pass
    assert sampler.summary() == {"samples": 0, "error": "nvidia-smi not found"}
    assert "nvidia-smi not found" in gpu_clocks.describe(sampler.summary())


def test_back_to_back_counts_calls_and_times_them(monkeypatch):
    # The loop of gpu_clocks.back_to_back without a GPU: CUDA events replaced by host clocks.
    import time as _time
    import gpu_clocks

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = _time.perf_counter()

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    calls = []
    ms, count, clocks = gpu_clocks.back_to_back(lambda: (calls.append(1), _time.sleep(0.002)),
                                                0.05, batch=4)
    assert count == len(calls) and count % 4 == 0 and count >= 4
    assert 1.5 < ms < 50
    assert clocks == {"samples": 0, "error": "nvidia-smi not found"}


def test_dense_reference_defaults():
    assert run_bench.parse_args(["--device", "cpu"]).dense_reference_s == 6.0
    assert run_bench.parse_args(["--device", "cpu", "--quick"]).dense_reference_s == 2.0
    assert run_bench.parse_args(["--device", "cpu", "--quick",
                                 "--dense-reference-s", "0"]).dense_reference_s == 0.0


def test_sonicmoe_weight_layout_round_trip():
    """SonicMoE's fused w1 puts gate row i at 2i and up row i at 2i+1, and computes
    u = up * silu(gate): the fused layout must give moeblaze's SwiGLU, and the split must invert
    the fusion (it is how the harness maps SonicMoE's dw1 back for the accuracy check)."""
    import peers
    p = random_problem(9, 8, 6, 3, 2, "swiglu", torch.float64, seed=41)
    w1 = peers.fuse_up_projection(p["w_gate"], p["w_up"])
    assert tuple(w1.shape) == (3, 12, 8)
    z = torch.einsum("td,ehd->teh", p["x"], w1)  # every expert on every token
    u_fused = z[..., 1::2] * torch.nn.functional.silu(z[..., 0::2])
    a = torch.einsum("td,ehd->teh", p["x"], p["w_gate"])
    b = torch.einsum("td,ehd->teh", p["x"], p["w_up"])
    assert torch.allclose(u_fused, baselines.apply_activation("swiglu", a, b), rtol=1e-13, atol=0)
    gate, up = peers.split_up_projection(w1, gated=True)
    assert torch.equal(gate, p["w_gate"]) and torch.equal(up, p["w_up"])
    assert peers.split_up_projection(p["w_gate"], gated=False) == (p["w_gate"], None)
    tok = peers.token_order_indices(3, 2, "cpu")
    assert tok.tolist() == [0, 0, 1, 1, 2, 2] and tok.dtype == torch.int32


def test_sonicmoe_dx_kernels_are_kept_apart_by_glu_ness(monkeypatch):
    """SonicMoE keys its cached dX kernel without the activation's glu-ness; the adapter keeps a
    gated and a non-gated layer's dX entries apart (and leaves every other entry alone)."""
    import types
    import peers

    def _up_projection_backward():
        pass

    cache = _up_projection_backward.compile_cache = {}
    fake = types.ModuleType("sonicmoe.functional.backward")
    fake._up_projection_backward = _up_projection_backward
    monkeypatch.setitem(sys.modules, "sonicmoe.functional.backward", fake)
    monkeypatch.setattr(peers, "_sonicmoe_dx", {"last": None, "stash": {True: {}, False: {}}})
    dx_key, dw1_key = ("dx", 8, 64, 32, "is_glu", "bf16"), ("dw1", 8, 64, 32, True, "bf16")

    def compile_dx(kernel):  # what SonicMoE does on a miss
        cache.setdefault(dx_key, kernel)
        cache.setdefault("dx-tensormap", kernel + " maps")
        return cache[dx_key]

    cache.update({dx_key: "stale", "dx-tensormap": "stale maps", dw1_key: "dw1 kernel"})
    peers.separate_sonicmoe_dx_kernels("swiglu")  # entries of unknown glu-ness: dropped
    assert compile_dx("gated dx") == "gated dx"
    peers.separate_sonicmoe_dx_kernels("geglu")  # gated again: the same kernel
    assert compile_dx("never compiled") == "gated dx"
    peers.separate_sonicmoe_dx_kernels("silu")  # non-gated: its own kernel
    assert compile_dx("plain dx") == "plain dx" and cache["dx-tensormap"] == "plain dx maps"
    peers.separate_sonicmoe_dx_kernels("swiglu")  # back: the gated one, not recompiled
    assert compile_dx("never compiled") == "gated dx" and cache["dx-tensormap"] == "gated dx maps"
    peers.separate_sonicmoe_dx_kernels("relu2")  # non-gated: the plain one, not recompiled
    assert compile_dx("never compiled") == "plain dx"
    assert cache[dw1_key] == "dw1 kernel"


def test_sonicmoe_rows_skip_with_a_reason_on_cpu():
    import peers
    reason = peers.sonicmoe_unsupported("swiglu", torch.bfloat16, "cpu")
    assert reason and "CUDA" in reason
    assert "activation" in peers.sonicmoe_unsupported("swish", torch.bfloat16, "cuda")


def test_layer_reference_over_chunks_equals_one_pass():
    """The layer-mode reference runs over token chunks with the batch's expert fractions: its
    output, switch loss and every gradient must equal one pass over the whole batch."""
    T, d, h, E, k = 23, 8, 12, 5, 2
    gen = torch.Generator().manual_seed(51)
    print("seed=51")

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)

    x, wr, wg, wu, wd = randn(T, d), randn(E, d), randn(E, h, d), randn(E, h, d), randn(E, d, h)
    dy = torch.randn(T, d, generator=gen, dtype=torch.float64)
    y, aux = baselines.moe_layer(x, wr, wg, wu, wd, k, "swiglu")
    whole = torch.autograd.grad([y, aux], [x, wr, wg, wu, wd], [dy, torch.ones_like(aux)])
    with torch.no_grad():
        fractions = baselines.expert_fractions(torch.topk(x @ wr.t(), k, dim=-1).indices, E,
                                               torch.float64)
    parts, auxes, grads = [], [], [torch.zeros_like(t) for t in (wr, wg, wu, wd)]
    dx = torch.zeros_like(x)
    for s in range(0, T, 7):
        xc = x[s:s + 7].detach().requires_grad_(True)
        yc, ac = baselines.moe_layer(xc, wr, wg, wu, wd, k, "swiglu", fractions=fractions,
                                     num_tokens=T)
        g = torch.autograd.grad([yc, ac], [xc, wr, wg, wu, wd], [dy[s:s + 7], torch.ones_like(ac)])
        dx[s:s + 7] = g[0]
        for acc, part in zip(grads, g[1:]):
            acc += part
        parts.append(yc.detach())
        auxes.append(float(ac))
    assert torch.allclose(torch.cat(parts), y.detach(), rtol=0, atol=1e-12)
    assert abs(sum(auxes) - float(aux)) < 1e-12
    for got, want in zip([dx] + grads, whole):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    assert float(whole[1].abs().max()) > 0  # the router gets a gradient (the test can fail)


def test_harness_layer_mode(tmp_path):
    doc, stdout = _run_harness(tmp_path, ["--acts", "swiglu", "--mode", "layer",
                                          "--dtype", "fp64"])
    rows = doc["rows"]
    have_moeblaze = doc["environment"]["moeblaze"].startswith("bindings")
    impls = {r["impl"] for r in rows}
    assert impls == {"grouped_mm", "sonicmoe", "megablocks", "moeblaze"}  # no loop here
    for r in rows:
        assert r["mode"] == "layer"
        assert set(r["rel_err"]) == {"y", "dx", "dw_router", "dw_gate", "dw_up", "dw_down"}
        if r["impl"] in ("sonicmoe", "megablocks"):
            assert "CUDA" in r["skipped"], r
            continue
        if r["impl"] == "moeblaze" and not have_moeblaze:
            continue
        assert r["error"] is None, r
        # fp64: the same routing as the reference, so the errors are rounding only
        assert max(v for v in r["rel_err"].values() if v is not None) < 1e-12, r


def test_harness_parallel_warmup_measures_every_configuration(tmp_path):
    doc, _ = _run_harness(tmp_path, ["--acts", "silu", "--impls", "loop,grouped_mm",
                                     "--parallel-warmup", "on"])
    rows = doc["rows"]
    assert {(r["config"], r["impl"]) for r in rows} == {
        (c["name"], i) for c in TINY for i in ("loop", "grouped_mm")}
    assert all(r["error"] is None and r["ms"] > 0 for r in rows), rows
    assert not list((tmp_path / "out").glob(".bench-*"))  # lock and state files cleaned up


# ------------------------------------------------------------------------------------------------
# MegaBlocks: layout conversion, its math in the converted layout, the adapter end to end over a
# stand-in package (pure torch, written from MegaBlocks' documented dataflow; no MegaBlocks code)
# ------------------------------------------------------------------------------------------------


def megablocks_dataflow(x, ids, g, w1, v1, w2, activation_fn, num_experts):
    """MegaBlocks' grouped dMoE experts (ParallelDroplessMLP.forward_once) in plain torch: the
    routed pairs sorted stably by expert, rows gathered as x[pair // k], per expert
    act(x w1_e^T) [* x v1_e^T] then @ w2_e with w1/v1/w2 viewed [E, h, d], each result scaled by its
    pair's weight and written to slot pair of a [T*k, d] buffer, summed over the k slots."""
    T, k = ids.shape
    d = x.shape[1]
    experts = ids.reshape(-1).long()
    order = torch.sort(experts, stable=True).indices
    rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
    counts = torch.bincount(experts, minlength=num_experts).tolist()
    w1e = w1.view(num_experts, -1, d)
    v1e = None if v1 is None else v1.view(num_experts, -1, d)
    w2e = w2.view(num_experts, -1, d)
    outs, start = [], 0
    for e, n in enumerate(counts):
        xe = rows[start:start + n]
        u = activation_fn(xe @ w1e[e].t())
        if v1e is not None:
            u = u * (xe @ v1e[e].t())
        outs.append(u @ w2e[e])
        start += n
    weights = g.reshape(-1).index_select(0, order).to(x.dtype)
    slots = torch.zeros(T * k, d, dtype=x.dtype).index_copy(0, order, torch.cat(outs) *
                                                            weights[:, None])
    return slots.view(T, k, d).sum(dim=1), torch.tensor(counts)


def test_megablocks_weight_layout_round_trip():
    import peers
    for activation in ("swiglu", "silu"):
        p = random_problem(9, 8, 6, 3, 2, activation, torch.float64, seed=61)
        w1, v1, w2 = peers.to_megablocks_weights(p["w_gate"], p["w_up"], p["w_down"])
        assert tuple(w1.shape) == tuple(w2.shape) == (3 * 6, 8)
        assert (v1 is None) == (activation == "silu")
        assert torch.equal(w1[6:12], p["w_gate"][1])  # expert 1's rows at 1*h .. 2*h-1
        assert torch.equal(w2[6:12], p["w_down"][1].t())
        gate, up, down = peers.from_megablocks_weights(w1, v1, w2, 3)
        assert torch.equal(gate, p["w_gate"]) and torch.equal(down, p["w_down"])
        assert (up is None and p["w_up"] is None) or torch.equal(up, p["w_up"])


@pytest.mark.parametrize("activation", baselines.ACTIVATIONS)
def test_megablocks_layout_computes_moeblaze_math(activation):
    """MegaBlocks' dataflow on the converted weights gives moeblaze's y and, mapped back, every
    gradient (fp64): the layout, the activation table and the gradient mapping are right."""
    import peers
    p = random_problem(29, 16, 24, 5, 3, activation, torch.float64, seed=62)
    ref = forward_backward(baselines.moe_dense_reference, p, activation=activation)
    mlp_type, activation_fn = peers.MEGABLOCKS_ACTIVATIONS[activation]
    assert (mlp_type == "glu") == baselines.is_gated(activation)
    w1, v1, w2 = [None if w is None else w.requires_grad_(True)
                  for w in peers.to_megablocks_weights(p["w_gate"], p["w_up"], p["w_down"])]
    x = p["x"].clone().requires_grad_(True)
    g = p["g"].clone().requires_grad_(True)
    y, counts = megablocks_dataflow(x, p["ids"], g, w1, v1, w2, activation_fn, 5)
    assert int(counts.sum()) == 29 * 3
    leaves = [t for t in (x, g, w1, v1, w2) if t is not None]
    grads = dict(zip(("x", "g", "w1", "v1", "w2") if v1 is not None else ("x", "g", "w1", "w2"),
                     torch.autograd.grad(y, leaves, p["dy"])))
    dw_gate, dw_up, dw_down = peers.from_megablocks_weights(grads["w1"], grads.get("v1"),
                                                            grads["w2"], 5)
    out = [y.detach(), grads["x"], grads["g"], dw_gate, dw_up, dw_down]
    for name, a, b in zip(("y",) + run_bench.GRAD_NAMES, out, ref):
        assert (a is None) == (b is None), name
        assert rel(a, b) < 1e-12, f"{activation} {name}: {rel(a, b)}"


def test_megablocks_rows_skip_with_a_reason_on_cpu():
    import peers
    assert "CUDA" in peers.megablocks_unsupported("swiglu", torch.bfloat16, "cpu")
    assert "bf16" in peers.megablocks_unsupported("swiglu", torch.float16, "cuda")
    assert "activation" in peers.megablocks_unsupported("swish", torch.bfloat16, "cuda")


def _fake_megablocks(dtype):
    """Modules named like MegaBlocks' with the API surface the adapter uses (Arguments,
    ParallelDroplessMLP.forward_once, dMoE, the load-balancing loss list), computing
    megablocks_dataflow in `dtype` (the real package holds bf16 parameters)."""
    import dataclasses
    import types

    @dataclasses.dataclass
    class Arguments:
        hidden_size: int = 1024
        ffn_hidden_size: int = 4096
        num_layers: int = 1
        bias: bool = True
        return_bias: bool = True
        activation_fn: object = None
        moe_num_experts: int = 1
        moe_top_k: int = 1
        moe_normalize_expert_weights: object = None
        moe_loss_weight: float = 0.1
        mlp_type: str = "mlp"
        mlp_impl: str = "sparse"
        fp16: bool = True
        bf16: bool = False
        device: object = None
        init_method: object = None
        output_layer_init_method: object = None

    class Mlp(torch.nn.Module):
        def __init__(self, args):
            super().__init__()
            shape = (args.moe_num_experts * args.ffn_hidden_size, args.hidden_size)
            self.w1 = torch.nn.Parameter(torch.empty(shape, dtype=dtype))
            self.w2 = torch.nn.Parameter(torch.empty(shape, dtype=dtype))
            if args.mlp_type == "glu":
                self.v1 = torch.nn.Parameter(torch.empty(shape, dtype=dtype))

    class ParallelDroplessMLP(torch.nn.Module):
        def __init__(self, args):
            super().__init__()
            assert args.mlp_impl == "grouped" and not args.bias and args.bf16 and not args.fp16
            self.args = args
            self.mlp = Mlp(args)

        def forward_once(self, x, expert_weights, top_experts):
            mlp = self.mlp
            return megablocks_dataflow(x, top_experts, expert_weights, mlp.w1,
                                       getattr(mlp, "v1", None), mlp.w2, self.args.activation_fn,
                                       self.args.moe_num_experts)

    losses = []

    class Router(torch.nn.Module):
        def __init__(self, args):
            super().__init__()
            self.layer = torch.nn.Linear(args.hidden_size, args.moe_num_experts, bias=False,
                                         dtype=dtype)

    class DMoE(torch.nn.Module):
        def __init__(self, args):
            super().__init__()
            self.router = Router(args)
            self.experts = ParallelDroplessMLP(args)

        def forward(self, x):
            args = self.experts.args
            scores = self.router.layer(x).softmax(dim=-1)
            weights, experts = torch.topk(scores, args.moe_top_k, dim=-1)
            weights = weights / torch.norm(weights, p=args.moe_normalize_expert_weights, dim=-1,
                                           keepdim=True)
            y, counts = self.experts.forward_once(x, weights, experts)
            losses.append((counts, scores))
            return y

    def batched_load_balancing_loss(args):
        (counts, scores), = losses
        scale = args.moe_num_experts * args.moe_loss_weight / (
            args.num_layers * scores.shape[0] * args.moe_top_k)
        return scale * torch.dot(counts.to(scores.dtype), scores.mean(dim=0))

    modules = {name: types.ModuleType(name) for name in (
        "megablocks", "megablocks.layers", "megablocks.layers.arguments",
        "megablocks.layers.dmoe", "megablocks.layers.moe", "grouped_gemm")}
    modules["megablocks.layers.arguments"].Arguments = Arguments
    modules["megablocks.layers.dmoe"].ParallelDroplessMLP = ParallelDroplessMLP
    modules["megablocks.layers.dmoe"].dMoE = DMoE
    modules["megablocks.layers.moe"].clear_load_balancing_loss = losses.clear
    modules["megablocks.layers.moe"].batched_load_balancing_loss = batched_load_balancing_loss
    return modules


@pytest.mark.parametrize("mode,activation", [("experts", "swiglu"), ("experts", "relu2"),
                                             ("layer", "swiglu"), ("layer", "gelu")])
def test_megablocks_adapter_end_to_end_on_a_stand_in(monkeypatch, mode, activation):
    """The harness's megablocks row (weights into the peer's layout in prepare, its parameters as
    leaves, gradients mapped back) over the stand-in package, fp64 on the CPU: every output and
    gradient equals the reference. The real package's import, device and dtype checks are what
    this replaces."""
    import peers
    for name, module in _fake_megablocks(torch.float64).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(peers, "_cache", {})
    monkeypatch.setattr(peers, "megablocks_unsupported",
                        lambda act, dtype, device: peers.megablocks()[1])
    args = run_bench.parse_args(["--device", "cpu", "--dtype", "fp64", "--quick", "--mode", mode])
    cfg = {"name": "tiny_mb", "T": 33, "d": 16, "h": 24, "E": 5, "k": 2}
    inputs = run_bench.make_inputs(cfg, activation, args)
    ref, _ = run_bench.reference(cfg, activation, inputs, args)
    row = run_bench.run_row(cfg, activation, "megablocks", run_bench.PEER_POLICY, inputs, ref,
                            args, row_budget_s=0.05)
    assert row["error"] is None and not row.get("skipped"), row
    errs = row["rel_err"]
    assert set(errs) == set(run_bench.err_names(args))
    assert (errs["dw_up"] is None) == (not baselines.is_gated(activation))
    assert all(v < 1e-12 for v in errs.values() if v is not None), errs
    assert row["err_ok"] is True and row["ms"] > 0 and row["saved_bytes"] > 0


def test_megablocks_rows_in_summary_and_report():
    """A megablocks row gets its own columns in the printed summary and in make_report's tables."""
    import make_report
    rows = _report_rows()
    rows.insert(2, dict(rows[0], impl="megablocks", policy=run_bench.PEER_POLICY, ms=5.0,
                        peak_bytes=8 << 20))
    doc = {"device": "cpu", "commit": "abc", "command": "x", "environment": {}, "rows": rows}
    doc["summary"] = run_bench.annotate(rows)
    assert doc["summary"]["swiglu"]["geomean_speedup_vs_megablocks"] == 2.5
    table = run_bench.summary_table(doc).splitlines()
    assert "mgblk ms" in table[0] and "x_mgblk" in table[0]
    assert "    5.00 " in table[1] and " 2.50 " in table[1] and "/0.01 " in table[1]
    assert "vs megablocks 2.50" in table[2]
    speed = make_report.speed_table(doc).splitlines()
    assert "| megablocks ms |" in speed[0] and "| × vs megablocks |" in speed[0]
    assert speed[0].count("|") == speed[2].count("|")
    assert "**2.50×** over megablocks" in make_report.target_lines(doc)[0]


def _merge_doc(command, groups, build="moeblaze 0.1.0 (git abc)"):
    """A results JSON of (config, act) groups: {(cfg, act): {impl: ms or None (skipped)}}."""
    rows = []
    for (cfg, act), impls in groups.items():
        for impl, ms in impls.items():
            policy = "save_preact" if impl == "moeblaze" else run_bench.policy_of(impl)
            rows.append({"config": cfg, "act": act, "impl": impl, "policy": policy, "ms": ms,
                         "saved_bytes": None, "peak_bytes": None,
                         "error": None if ms else "skipped: time budget exhausted"})
    return {"device": "NVIDIA H200", "commit": "abc", "command": command,
            "date_utc": "2026-01-01T00:00:00+00:00",
            "environment": {"dtype": "bf16", "moeblaze_build_info": build},
            "method": {"timing": "median"}, "summary": {}, "rows": rows}


def test_merge_takes_each_group_whole_from_the_last_run_that_measured_it(tmp_path):
    first = _merge_doc("run one", {("a", "swiglu"): {"grouped_mm": 2.0, "moeblaze": 1.0},
                                   ("a", "silu"): {"grouped_mm": None, "moeblaze": None},
                                   ("b", "swiglu"): {"grouped_mm": 4.0, "moeblaze": 2.0}})
    second = _merge_doc("run two", {("a", "silu"): {"grouped_mm": 3.0, "moeblaze": 1.5},
                                    ("b", "swiglu"): {"grouped_mm": None, "moeblaze": None}})
    paths = []
    for name, doc in (("one.json", first), ("two.json", second)):
        (tmp_path / name).write_text(json.dumps(doc))
        paths.append(str(tmp_path / name))
    merged = json.loads(open(run_bench.merge_results(paths, str(tmp_path / "out"))).read())
    ms = {(r["config"], r["act"], r["impl"]): r["ms"] for r in merged["rows"]}
    assert ms == {("a", "swiglu", "grouped_mm"): 2.0, ("a", "swiglu", "moeblaze"): 1.0,
                  ("a", "silu", "grouped_mm"): 3.0, ("a", "silu", "moeblaze"): 1.5,
                  # the second run skipped b/swiglu: the first run's measured group stays
                  ("b", "swiglu", "grouped_mm"): 4.0, ("b", "swiglu", "moeblaze"): 2.0}
    speedups = {(r["config"], r["act"]): r.get("speedup_vs_grouped_mm")
                for r in merged["rows"] if r["impl"] == "moeblaze"}
    assert speedups == {("a", "swiglu"): 2.0, ("a", "silu"): 2.0, ("b", "swiglu"): 2.0}
    assert [run["command"] for run in merged["runs"]] == ["run one", "run two"]
    import make_report
    lines = make_report.command_lines(merged)
    assert any("`run one`" in line for line in lines) and any("`run two`" in line
                                                               for line in lines)


def test_merge_refuses_runs_of_two_builds(tmp_path):
    a = _merge_doc("one", {("a", "swiglu"): {"moeblaze": 1.0}}, build="moeblaze (git abc)")
    b = _merge_doc("two", {("a", "silu"): {"moeblaze": 1.0}}, build="moeblaze (git def)")
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    with pytest.raises(SystemExit, match="moeblaze_build_info"):
        run_bench.merge_results([str(tmp_path / "a.json"), str(tmp_path / "b.json")],
                                str(tmp_path / "out"))


def test_peer_versions_name_what_is_installed_and_the_described_commits(monkeypatch):
    import peers
    monkeypatch.setenv(peers.PEERS_NOTE_ENV, "sonic-moe 8565e84, quack 3d0ab3e")
    found = peers.peer_versions()
    assert found["described"] == "sonic-moe 8565e84, quack 3d0ab3e"
    assert set(found) <= set(peers.PEER_DISTRIBUTIONS) | {"described"}
    monkeypatch.delenv(peers.PEERS_NOTE_ENV)
    assert "described" not in peers.peer_versions()
    import make_report
    doc = {"environment": {"peers": {"nvidia-cutlass-dsl": "4.2.1", "described": "x 1"}}}
    assert make_report.peer_lines(doc) == ["Peers: nvidia-cutlass-dsl 4.2.1; described x 1."]
    assert make_report.peer_lines({"environment": {}}) == []
