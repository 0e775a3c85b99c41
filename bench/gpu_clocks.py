"""What the GPU ran at: SM clock, power and the driver's clock-event reasons, sampled by nvidia-smi,
and the sustained dense bf16 matmul rate of the card as found.

Why this exists: an H200 held at its 700 W power limit runs its SMs well below the 1,980 MHz boost
clock (a median near 1,440 MHz under moeblaze's conf3 step, and an 8192^3 bf16 matmul loop
sustains ~660 TFLOP/s at ~1,470 MHz). A single step timed after an idle pause runs at
boost clock and is ~15 % faster than the same step back to back. So a TFLOP/s figure means little
without the clock it ran at, and the fair ceiling for a long run is the sustained dense rate on the
same card in the same process, not a burst figure.

Used by bench/run_bench.py (the run's header) and tests/cuda/profile_kernels.py (--clocks). Pure
Python plus torch; every function degrades to an explanation when there is no GPU or no nvidia-smi.
"""

import functools
import os
import shutil
import subprocess
import time

# Board power, the first of these that nvidia-smi answers for the GPU: the instantaneous reading
# (drivers 530 and newer), else power.draw, which on Ampere and newer cards is a one-second
# average (NVML's nvmlDeviceGetPowerUsage) that blurs a row's short rounds into its neighbours'.
POWER_FIELDS = ("power.draw.instant", "power.draw")


def fields(power="power.draw"):
    """The columns a sample has, in order, with `power` as its power column."""
    return ("clocks.sm", "clocks.mem", power, "enforced.power.limit", "temperature.gpu",
            "clocks_event_reasons.active")

# NVML clock-event reason bits (nvmlClocksEventReason*): why the clock is below its maximum.
REASON_BITS = {0x1: "idle", 0x2: "application clocks setting", 0x4: "software power cap",
               0x8: "hardware slowdown", 0x10: "sync boost", 0x20: "software thermal slowdown",
               0x40: "hardware thermal slowdown", 0x80: "hardware power brake",
               0x100: "display clock setting"}


def reason_names(mask):
    """'software power cap' etc. for an NVML reason bit mask ('none' for 0)."""
    names = [name for bit, name in REASON_BITS.items() if mask & bit]
    unknown = mask & ~sum(REASON_BITS)
    if unknown:
        names.append(f"0x{unknown:x}")
    return ", ".join(names) if names else "none"


def visible_gpu():
    """nvidia-smi's --id for the GPU that CUDA calls device 0 in this process: the first entry of
    CUDA_VISIBLE_DEVICES (an index or a UUID, both of which --id takes), else 0."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return first or "0"


@functools.lru_cache(maxsize=None)
def power_field(gpu):
    """The first of POWER_FIELDS that nvidia-smi reads as a number for `gpu` (asked once per
    process), or None without nvidia-smi. An unknown field fails the query; an unsupported one
    reads [N/A]."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    for field in POWER_FIELDS:
        try:
            out = subprocess.run([exe, f"--id={gpu}", f"--query-gpu={field}",
                                  "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        try:
            if out.returncode == 0:
                float(out.stdout.strip().splitlines()[0])
                return field
        except (ValueError, IndexError):
            pass
    return POWER_FIELDS[-1]


class ClockSampler:
    """Samples fields(power_field(gpu)) every interval_ms while the `with` block runs (the
    process's CUDA device 0, or `gpu`: an nvidia-smi index or UUID).

    After the block, .samples holds one dict per sample and .summary() condenses them. With no
    nvidia-smi the block still runs and .error says why there are no samples."""

    def __init__(self, interval_ms=100, gpu=None):
        self.interval_ms = interval_ms
        self.gpu = visible_gpu() if gpu is None else gpu
        self.samples, self.error, self._proc = [], None, None
        self.power_field = None  # the power column nvidia-smi was asked for (POWER_FIELDS)

    def __enter__(self):
        exe = shutil.which("nvidia-smi")
        if exe is None:
            self.error = "nvidia-smi not found"
            return self
        self.power_field = power_field(self.gpu) or POWER_FIELDS[-1]
        try:
            self._proc = subprocess.Popen(
                [exe, f"--id={self.gpu}", f"--query-gpu={','.join(fields(self.power_field))}",
                 "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError as error:
            self.error = f"nvidia-smi failed to start: {error}"
        return self

    def __exit__(self, *exc):
        if self._proc is None:
            return False
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.samples = [s for s in (parse_sample(line) for line in out.splitlines()) if s]
        for sample in self.samples:  # samples gathered over several blocks keep their reading
            sample["power_field"] = self.power_field
        if not self.samples:
            self.error = "nvidia-smi gave no readable samples"
        return False

    def summary(self):
        """Medians, ranges and the share of samples with each clock-event reason."""
        if not self.samples:
            return {"samples": 0, "error": self.error}
        field = self.power_field or next(
            (s["power_field"] for s in self.samples if s.get("power_field")), None)
        out = {"samples": len(self.samples), "interval_ms": self.interval_ms, "power_field": field}
        for key in ("sm_mhz", "mem_mhz", "power_w", "power_limit_w", "temperature_c"):
            values = sorted(s[key] for s in self.samples if s[key] is not None)
            if values:
                out[key] = {"min": values[0], "median": values[len(values) // 2],
                            "max": values[-1]}
        shares = {}
        for s in self.samples:
            for bit, name in REASON_BITS.items():
                if s["reasons"] is not None and s["reasons"] & bit:
                    shares[name] = shares.get(name, 0) + 1
        out["reason_share"] = {name: round(n / len(self.samples), 3)
                               for name, n in sorted(shares.items(), key=lambda kv: -kv[1])}
        return out


def row_clocks(summary, ms):
    """A timed row's clock fields from its sampler's summary(): the median SM clock and board power
    while its repetitions ran, and the energy of one repetition estimated as median power x median
    time (joules). Under the power limit two implementations draw the same watts, so the one that
    needs fewer joules a step runs its SMs faster: this is the figure that decides speed there.
    None where nothing was sampled (no GPU, no nvidia-smi, or a row shorter than the interval).
    clock_reasons: the share of those samples with each of the driver's clock-event reasons (why
    the SM clock was below its maximum: the power cap, a hardware slowdown, ...)."""
    def median(key):
        return (summary.get(key) or {}).get("median")

    count = (summary or {}).get("samples", 0)
    mhz, watts = (median("sm_mhz"), median("power_w")) if count else (None, None)
    joules = watts * ms / 1e3 if watts is not None and ms is not None else None
    return {"clock_samples": count, "sm_mhz": mhz, "power_w": watts, "joules": joules,
            "power_field": summary.get("power_field") if count else None,
            "clock_reasons": summary.get("reason_share") if count else None}


def parse_sample(line):
    """One nvidia-smi CSV line -> dict, or None for a malformed line ('[N/A]' fields: None)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(fields()):
        return None

    def number(text):
        try:
            return float(text)
        except ValueError:
            return None

    try:
        reasons = int(parts[5], 16)
    except ValueError:
        reasons = None
    return {"sm_mhz": number(parts[0]), "mem_mhz": number(parts[1]), "power_w": number(parts[2]),
            "power_limit_w": number(parts[3]), "temperature_c": number(parts[4]),
            "reasons": reasons}


def describe(summary):
    """One line for logs, e.g.
    'SM 1440 MHz (1245-1485), 692 W of 700 W, 59 C; software power cap 100 % (81 samples)'."""
    if not summary or not summary.get("samples"):
        return f"no clock samples ({(summary or {}).get('error', 'not sampled')})"

    def med(key, unit, spec=".0f"):
        v = summary.get(key)
        return f"{format(v['median'], spec)} {unit}" if v else "?"

    sm = summary.get("sm_mhz")
    sm_range = f" ({sm['min']:.0f}-{sm['max']:.0f})" if sm else ""
    reasons = format_reasons(summary.get("reason_share")) or "no reasons"
    return (f"SM {med('sm_mhz', 'MHz')}{sm_range}, {med('power_w', 'W')} of "
            f"{med('power_limit_w', 'W')}, {med('temperature_c', 'C')}; {reasons} "
            f"({summary['samples']} samples)")


def format_reasons(shares, separator="; "):
    """'software power cap 90 %; ...' for a {reason: share of samples} map ('' for none)."""
    return separator.join(f"{name} {share * 100:.0f} %" for name, share in (shares or {}).items())


def back_to_back(fn, seconds, batch=10, interval_ms=100):
    """Runs fn() back to back for about `seconds` (batches of `batch` calls, synchronised between
    batches so the host loop tracks the device) while sampling the clocks. Returns (ms per call
    by CUDA events, calls, clock summary)."""
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 0
    with ClockSampler(interval_ms=interval_ms) as sampler:
        t0 = time.perf_counter()
        start.record()
        while time.perf_counter() - t0 < seconds:
            for _ in range(batch):
                fn()
            calls += batch
            torch.cuda.synchronize()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / calls, calls, sampler.summary()


def sustained_matmul(seconds=6.0, n=8192, dtype=None):
    """The dense rate the card sustains back to back: n x n x n matmuls for `seconds`, after a
    short warm-up, with the clocks sampled meanwhile. Returns a dict for a results header."""
    import torch

    if not torch.cuda.is_available():
        return {"error": "no CUDA device"}
    dtype = dtype or torch.bfloat16
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    c = torch.empty(n, n, device="cuda", dtype=dtype)
    for _ in range(5):
        torch.matmul(a, b, out=c)
    ms, count, clocks = back_to_back(lambda: torch.matmul(a, b, out=c), seconds)
    del a, b, c
    return {"shape": f"{n}x{n}x{n}", "dtype": str(dtype).replace("torch.", ""),
            "seconds": round(seconds, 1), "matmuls": count, "ms_each": ms,
            "tflops": 2.0 * n ** 3 / ms / 1e9, "clocks": clocks}
