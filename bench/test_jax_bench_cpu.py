"""CPU smoke tests of the JAX benchmark (bench/jax_bench.py); no GPU needed.

    python3 -m pytest -q bench/test_jax_bench_cpu.py

Needs jax and the moeblaze JAX binding (libmoeblaze_xla; $MOEBLAZE_LIBRARY and
$MOEBLAZE_XLA_LIBRARY as CTest's bench_jax_cpu_smoke sets them).
"""

import argparse
import json
import os
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bindings", "python"))

import jax_bench  # noqa: E402

TINY = {"name": "tiny", "T": 29, "d": 16, "h": 24, "E": 5, "k": 2}


def dense_experts(x, ids, g, w_gate, w_up, w_down, activation):
    """Per-token gather of each routed expert's weights: no sorting, no ragged_dot."""
    a = jnp.einsum("td,tjhd->tjh", x, w_gate[ids])
    b = jnp.einsum("td,tjhd->tjh", x, w_up[ids]) if w_up is not None else None
    y2 = jnp.einsum("tjh,tjdh->tjd", jax_bench.activation_fn(activation, a, b), w_down[ids])
    return jnp.einsum("tj,tjd->td", g, y2)


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_ragged_dot_baseline_matches_dense_reference(activation):
    seed = 7
    print(f"seed = {seed}")
    p = jax_bench.make_problem(TINY, activation, "float64", seed, jax.devices("cpu")[0])
    wg, wu, wd = jax_bench.transposed(p)
    y = jax_bench.ragged_dot_experts(p["x"], p["ids"], p["g"], wg, wu, wd, activation)
    ref = dense_experts(p["x"], p["ids"], p["g"].astype(jnp.float64), p["w_gate"], p["w_up"],
                        p["w_down"], activation)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-12, atol=1e-12)
    # Every token's k rows went through the dataflow: the experts' row counts add up to T*k.
    assert int(np.bincount(np.asarray(p["ids"]).ravel(), minlength=TINY["E"]).sum()) == 58


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_loop_reference_matches_dense_reference_with_gradients(activation):
    seed = 11
    print(f"seed = {seed}")
    p = jax_bench.make_problem(TINY, activation, "float64", seed, jax.devices("cpu")[0])
    rng = np.random.default_rng(seed)
    # Expert 0 gets no rows (its scan step is all padding); each token's two experts are distinct.
    ids = jnp.asarray(np.stack([np.sort(rng.choice(np.arange(1, TINY["E"]), 2, replace=False))
                                for _ in range(TINY["T"])]).astype(np.asarray(p["ids"]).dtype))
    gated = activation in jax_bench.GATED
    dy = jnp.asarray(rng.standard_normal((TINY["T"], TINY["d"])))
    args = (p["x"], p["g"].astype(jnp.float64), p["w_gate"], p["w_up"], p["w_down"], ids, dy)
    ref = jax_bench.reference_outputs("moeblaze", args, activation)

    def dense(x, g, wg, wu, wd):
        return dense_experts(x, ids, g, wg, wu, wd, activation)

    primals = args[:5] if gated else args[:3] + args[4:5]
    y, pullback = jax.vjp((lambda x, g, wg, wu, wd: dense(x, g, wg, wu, wd)) if gated
                          else (lambda x, g, wg, wd: dense(x, g, wg, None, wd)), *primals)
    names = ("dx", "dg", "dw_gate", "dw_up", "dw_down") if gated else ("dx", "dg", "dw_gate",
                                                                         "dw_down")
    expected = dict(zip(names, pullback(dy)), y=y)
    assert set(ref) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(np.asarray(ref[name]), np.asarray(value), rtol=1e-10,
                                   atol=1e-10, err_msg=name)
    assert float(jnp.abs(ref["dw_gate"][0]).max()) == 0.0  # the expert without rows


def case_args(**overrides):
    args = argparse.Namespace(dtype="float32", checkpoint="save_preact", device="cpu", seed=3,
                              reps=2, warmup=1, check=True, tolerance=1e-4)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_case_measures_and_checks_both_implementations():
    rows = {impl: jax_bench.run_case(TINY, "swiglu", impl, case_args())
            for impl in ("moeblaze", "ragged_dot")}
    for impl, row in rows.items():
        assert row["ok"], row
        assert row["ms"] > 0 and row["reps"] == 2 and row["xla_temp_bytes"] > 0
        assert set(row["rel_err"]) == {"y", "dx", "dg", "dw_gate", "dw_up", "dw_down"}
        assert row["peak_bytes"] is None  # the CPU backend keeps no memory statistics
    assert max(rows["moeblaze"]["rel_err"].values()) < 1e-5


def test_a_result_beyond_the_tolerance_fails():
    # moeblaze in float32 differs from the float32 ragged_dot reference by rounding only; a zero
    # tolerance must flag it.
    row = jax_bench.run_case(TINY, "silu", "moeblaze", case_args(tolerance=0.0))
    assert 0 < max(row["rel_err"].values()) < 1e-5
    assert not row["ok"]


def test_an_unchecked_case_records_no_error():
    # Without the reference there is no error to report: a recorded 0 would read as exact.
    row = jax_bench.run_case(TINY, "swiglu", "moeblaze", case_args(check=False))
    assert row["ok"] and "rel_err" not in row
    assert row["finite"] == {name: True for name in ("y", "dx", "dg", "dw_gate", "dw_up",
                                                     "dw_down")}
    assert "| not checked | yes |" in jax_bench.table([row])


def test_driver_end_to_end(tmp_path, capsys):
    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps({"configs": [TINY]}))
    status = jax_bench.main(["--configs-file", str(configs), "--acts", "swiglu", "--quick",
                             "--dtype", "float32", "--tolerance", "1e-4", "--device", "cpu",
                             "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert status == 0, printed
    (written,) = (tmp_path / "out").iterdir()
    assert written.name.endswith("-cpu-jax.json")
    result = json.loads(written.read_text())
    assert [(r["impl"], r["ok"]) for r in result["rows"]] == [("moeblaze", True),
                                                              ("ragged_dot", True)]
    assert result["environment"]["moeblaze_platforms"][0] == "cpu"
    assert "| tiny | swiglu | moeblaze |" in printed
    assert "speed-up over ragged_dot" in printed
