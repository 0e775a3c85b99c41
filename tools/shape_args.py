#!/usr/bin/env python3
"""The shape arguments of tests/cuda/profile_kernels.py for a benchmark configuration, read from
bench/configs.json, so that profiling commands name shapes instead of repeating their sizes.

Usage:
  tools/shape_args.py conf4                 -> --T 32768 --d 2048 --h 8192 --E 16 --k 4
  tools/shape_args.py --lines conf3:swiglu mixtral:silu:--policy=save_all
      -> one "conf3 swiglu|--T ... --act swiglu" line per NAME:ACT[:EXTRA], EXTRA's '=' and ','
         turned into spaces, its values appended to the label (a "label|arguments" list for
         scripts that profile several shapes in a loop)
  tools/shape_args.py --self-test
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "..", "bench", "configs.json")


def load_configs(path=CONFIGS):
    with open(path) as f:
        return {c["name"]: c for c in json.load(f)["configs"]}


def shape(name, configs=None):
    """(T, d, h, E, k) of a benchmark configuration."""
    configs = load_configs() if configs is None else configs
    if name not in configs:
        raise SystemExit(f"shape_args: unknown configuration {name!r} "
                         f"(bench/configs.json has {', '.join(sorted(configs))})")
    c = configs[name]
    return c["T"], c["d"], c["h"], c["E"], c["k"]


def args_for(name, configs=None):
    T, d, h, E, k = shape(name, configs)
    return f"--T {T} --d {d} --h {h} --E {E} --k {k}"


def line_for(spec, configs=None):
    """NAME:ACT[:EXTRA] -> 'NAME ACT[ EXTRA words]|ARGS --act ACT[ EXTRA]'."""
    parts = spec.split(":", 2)
    if len(parts) < 2:
        raise SystemExit(f"shape_args: {spec!r} is not NAME:ACT[:EXTRA]")
    name, act = parts[0], parts[1]
    extra = parts[2].replace("=", " ").replace(",", " ") if len(parts) == 3 else ""
    # The label names every EXTRA value (not the option names), so two lines never share one.
    values = [w for w in extra.split() if not w.startswith("-")]
    label = " ".join([name, act] + values)
    return f"{label}|{args_for(name, configs)} --act {act}" + (f" {extra}" if extra else "")


def self_test():
    configs = load_configs()
    assert args_for("conf4", configs) == "--T 32768 --d 2048 --h 8192 --E 16 --k 4"
    assert args_for("mixtral", configs) == "--T 16384 --d 4096 --h 14336 --E 8 --k 2"
    assert shape("conf7", configs) == (8192, 2048, 8192, 8, 4)
    assert line_for("conf3:silu", configs) == \
        "conf3 silu|--T 65536 --d 1024 --h 4096 --E 16 --k 4 --act silu"
    assert line_for("conf3:swiglu:--policy=save_all", configs) == \
        "conf3 swiglu save_all|--T 65536 --d 1024 --h 4096 --E 16 --k 4 --act swiglu --policy save_all"
    assert line_for("conf3:swiglu:--routing=blocked,--policy=save_all", configs).split("|")[0] == \
        "conf3 swiglu blocked save_all"
    try:
        args_for("conf99", configs)
    except SystemExit as e:
        assert "unknown configuration 'conf99'" in str(e)
    else:
        raise AssertionError("an unknown configuration must fail")
    print("shape_args self-test: ok")
    return 0


def main(argv):
    if argv == ["--self-test"]:
        return self_test()
    if argv[:1] == ["--lines"]:
        configs = load_configs()
        print("\n".join(line_for(spec, configs) for spec in argv[1:]))
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        sys.exit(__doc__)
    print(args_for(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
