#!/usr/bin/env python3
"""Times moeblaze tuning variants against each other, interleaved in one process, as the benchmark
times a row: an L2 flush before each repetition, forward + backward with dy, and no wait between
repetitions. Each variant is a set of MOEBLAZE_CUDA_* settings (src/cuda/tuning.hpp), read when
its context is created, so variants of one process differ only in those settings; their rounds
run in a shuffled order, which spreads the card's clock drift over all of them. The identical
configurations of one run differ by up to ~2 % (medians of 40 repetitions on an H200), so a
difference below that needs more rounds.

Usage (a GPU machine, from the repository root):
  MOEBLAZE_LIBRARY=build-device/src/libmoeblaze.so python3 tools/ab_tuning.py \\
      --configs qwen3-30b-a3b,sonicmoe-readme --acts swiglu,silu \\
      --variant pingpong=MOEBLAZE_CUDA_ROWS_FORM=pingpong \\
      --variant one_chunk=MOEBLAZE_CUDA_ROW_CHUNKS=1 [--rounds R --reps N] [--sonic]

Prints, per configuration and activation, each variant's median step time (with p20 and p80),
its speed against the default (the environment as given), whether every output and gradient has
the default's bits, and its peak memory over one step; --sonic adds SonicMoE (bench/peers.py) as a
reference row. --sustain S then runs each variant's steps back to back for S seconds (an L2 flush
before each) while nvidia-smi samples the card: its median SM clock, board power and joules a step
(power x time), which decide the speed at the power limit, where variants draw the same watts and
the one that needs fewer joules runs at the higher clock (the table's "x default by J": the
default's joules over the variant's). A table of every row comes last.
"""
import argparse
import os
import random
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "bench"))
import gpu_clocks  # noqa: E402  (standard library only: the self-test runs without torch)


def parse_variant(spec):
    """'name=VAR=VALUE[;VAR=VALUE...]' -> (name, {VAR: VALUE}); raises ValueError otherwise."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"variant {spec!r}: expected name=VAR=VALUE[;VAR=VALUE...]")
    settings = {}
    for item in rest.split(";"):
        var, sep, value = item.partition("=")
        if not sep or not var.startswith("MOEBLAZE_"):
            raise ValueError(f"variant {spec!r}: {item!r} is not MOEBLAZE_...=VALUE")
        settings[var] = value
    return name, settings


def self_test():
    assert parse_variant("pp=MOEBLAZE_CUDA_ROWS_FORM=pingpong") == (
        "pp", {"MOEBLAZE_CUDA_ROWS_FORM": "pingpong"})
    assert parse_variant("x=MOEBLAZE_CUDA_ROW_CHUNKS=1;MOEBLAZE_CUDA_BAND_MTILES=4") == (
        "x", {"MOEBLAZE_CUDA_ROW_CHUNKS": "1", "MOEBLAZE_CUDA_BAND_MTILES": "4"})
    for bad in ("pp", "pp=", "=MOEBLAZE_CUDA_SM90=0", "pp=ROWS_FORM=pingpong", "pp=MOEBLAZE_X"):
        try:
            parse_variant(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")
    assert energy_cells({"sm_mhz": 1500.0, "power_w": 692.4, "joules": 10.0126}) == [
        "1500", "692", "10.013"]
    assert energy_cells(None) == ["-", "-", "-"]
    assert energy_cells({"sm_mhz": None, "power_w": None, "joules": None}) == ["-", "-", "-"]
    assert joules_speed({"joules": 12.0}, {"joules": 11.5}) == "1.0435"
    assert joules_speed({"joules": 12.0}, None) == "-"
    assert joules_speed(None, {"joules": 11.5}) == "-"
    assert joules_speed({"joules": 12.0}, {"joules": None}) == "-"
    assert describe_energy(None) == ""
    assert describe_energy({"sm_mhz": 1980.0, "power_w": 350.0, "joules": 1.5}) == (
        "  sustained: 1980 MHz, 350 W, 1.500 J a step")
    assert describe_energy({"sm_mhz": 1440.0, "power_w": 700.0, "joules": 10.0, "clock_reasons": {
        "software power cap": 0.9, "hardware slowdown": 0.25}}) == (
        "  sustained: 1440 MHz, 700 W, 10.000 J a step (clock-event reasons: software power cap "
        "90 %, hardware slowdown 25 %)")
    print("ab_tuning self-test: ok")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="qwen3-30b-a3b",
                   help="names from bench/configs.json, or all")
    p.add_argument("--acts", default="swiglu")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=VAR=VALUE[;...]")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--reps", type=int, default=5, help="repetitions of a variant in a round")
    p.add_argument("--sonic", action="store_true", help="SonicMoE as a reference row")
    p.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                   help="also each variant's SM clock, power and joules a step over this many "
                        "seconds of back-to-back steps")
    p.add_argument("--self-test", action="store_true")
    a = p.parse_args()
    if a.self_test:
        self_test()
        return
    variants = [("default", {})] + [parse_variant(spec) for spec in a.variant]
    # SonicMoE's CUTLASS DSL parses the command line whenever it compiles a kernel.
    del sys.argv[1:]
    sys.path.insert(0, os.path.join(REPO, "bindings", "python"))
    import torch
    import run_bench
    import moeblaze.torch as mbt

    args = run_bench.parse_args(["--device", "cuda"])
    args.device = "cuda"
    # "all" or names from configs.json; an unknown name stops here, before anything is timed.
    configs = run_bench.load_configs(run_bench.parse_args(["--configs", a.configs]))
    flush = torch.empty(run_bench.L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def use(run):
        """Makes a variant's context and plans current; returns its step."""
        step, contexts, layers = run
        if contexts is not None:
            mbt._contexts.clear()
            mbt._contexts.update(contexts)
            mbt._layers.clear()
            mbt._layers.update(layers)
        return step

    def time_reps(step, reps):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            flush.zero_()
            starts[i].record()
            step()
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]

    table = []
    for cfg in configs:
        config = cfg["name"]
        for act in a.acts.split(","):
            inputs = run_bench.make_inputs(cfg, act, args)
            print(f"== {config} {act} (seed {inputs['seed']})", flush=True)
            runs, outputs, peaks = {}, {}, {}
            for name, settings in variants:
                before = {var: os.environ.get(var) for var in settings}
                os.environ.update(settings)
                mbt.clear_caches()  # the variant's own context, made with its settings
                impl = run_bench.make_impl("moeblaze", "save_preact", act, args, cfg)
                native = impl.prepare(inputs)

                def step(impl=impl, native=native):
                    return run_bench.fwd_bwd(impl.fn, native, impl.leaves(native))

                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                y, grads = step()
                torch.cuda.synchronize()
                peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
                outputs[name] = [y] + grads
                runs[name] = (step, dict(mbt._contexts), dict(mbt._layers))
                for var, value in before.items():
                    if value is None:
                        os.environ.pop(var, None)
                    else:
                        os.environ[var] = value
            if a.sonic:
                impl = run_bench.make_impl("sonicmoe", "save_preact", act, args, cfg)
                if impl.skip:
                    print(f"sonicmoe skipped: {impl.skip}")
                else:
                    native = impl.prepare(inputs)

                    def sonic_step(impl=impl, native=native):
                        return run_bench.fwd_bwd(impl.fn, native, impl.leaves(native))

                    sonic_step()  # compiles SonicMoE's kernels for this shape (minutes)
                    runs["sonicmoe"] = (sonic_step, None, None)
            reference = outputs["default"]
            same = {name: all((o is None and r is None) or torch.equal(o, r)
                              for o, r in zip(outs, reference))
                    for name, outs in outputs.items()}
            del outputs, reference
            times = {name: [] for name in runs}
            order = list(runs)
            for _ in range(a.rounds):
                random.shuffle(order)
                for name in order:
                    times[name] += time_reps(use(runs[name]), a.reps)
            energy = {}
            for name in (order if a.sustain > 0 else ()):  # the last round's shuffled order
                step = use(runs[name])
                step_ms, _, clocks = gpu_clocks.back_to_back(
                    lambda step=step: (flush.zero_(), step()), a.sustain, batch=5, interval_ms=50)
                energy[name] = gpu_clocks.row_clocks(clocks, step_ms)
            default_ms = statistics.median(times["default"])
            for name in runs:
                ts = sorted(times[name])
                ms = statistics.median(ts)
                row = (config, act, name, ms, ts[len(ts) // 5], ts[4 * len(ts) // 5],
                       default_ms / ms, same.get(name, "-"), peaks.get(name), energy.get(name))
                table.append(row)
                print("%-9s %8.3f ms (p20 %.3f, p80 %.3f)  x%.4f  same bits: %s  peak %s MiB%s"
                      % (name, ms, row[4], row[5], row[6], row[7],
                         "-" if row[8] is None else "%.0f" % row[8], describe_energy(row[9])),
                      flush=True)
            del runs
            torch.cuda.empty_cache()
    sustained = a.sustain > 0
    print("\n| config | act | variant | ms | x default | same bits | peak MiB |"
          + (" MHz | W | J a step | x default by J |" if sustained else ""))
    print("|---|---|---|---:|---:|---|---:|" + ("---:|---:|---:|---:|" if sustained else ""))
    default_clocks = {(row[0], row[1]): row[9] for row in table if row[2] == "default"}
    for config, act, name, ms, _, _, speed, bits, peak, clocks in table:
        cells = [config, act, name, f"{ms:.3f}", f"{speed:.4f}", str(bits),
                 "-" if peak is None else format(peak, ".0f")]
        if sustained:
            cells += energy_cells(clocks)
            cells.append(joules_speed(default_clocks.get((config, act)), clocks))
        print("| " + " | ".join(cells) + " |")


def energy_cells(clocks):
    """A row's sustained SM clock, power and joules a step as table cells ('-' where unsampled)."""
    clocks = clocks or {}
    return [("-" if clocks.get(key) is None else format(clocks[key], spec))
            for key, spec in (("sm_mhz", ".0f"), ("power_w", ".0f"), ("joules", ".3f"))]


def joules_speed(default_clocks, clocks):
    """The default's joules a step over the variant's: its speed at the power limit, where both
    draw the same watts (steadier than the medians of short rounds there); '-' where unsampled."""
    base = (default_clocks or {}).get("joules")
    mine = (clocks or {}).get("joules")
    return "-" if not base or not mine else f"{base / mine:.4f}"


def describe_energy(clocks):
    """The sustained figures of a variant's line ('' without --sustain)."""
    if clocks is None:
        return ""
    mhz, watts, joules = energy_cells(clocks)
    reasons = gpu_clocks.format_reasons(clocks.get("clock_reasons"), ", ")
    return (f"  sustained: {mhz} MHz, {watts} W, {joules} J a step"
            + (f" (clock-event reasons: {reasons})" if reasons else ""))


if __name__ == "__main__":
    main()
