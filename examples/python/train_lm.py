"""Train a small MoE decoder language model on the Python standard library's sources, with
moeblaze's MoE layer and, side by side, the same model with a plain-PyTorch MoE layer.

    PYTHONPATH=bindings/python python3 examples/python/train_lm.py --device cuda --out runs/h200
    PYTHONPATH=bindings/python python3 examples/python/train_lm.py --preset tiny --out lm-tiny

The text is every ``*.py`` file of this interpreter's standard library (no download), read as bytes
(a byte-level vocabulary of 256); one file in 20 is held out for validation. The model is a pre-norm
decoder (causal attention, an MoE feed-forward layer in every block, tied embeddings) in two MoE
shapes: ``fine`` (fine-grained, 64 experts, top-8, renormalised weights) and ``mixtral`` (8 wide
experts, top-2). Each shape is trained once per MoE implementation, from the same initial weights
on the same batches:

- ``moeblaze``: ``moeblaze.torch.moe_layer`` (router, experts, load-balancing loss in the library);
- ``grouped_mm``: the same router and loss in PyTorch, the experts as sort -> gathered copy ->
  ``torch._grouped_mm`` -> activation -> weighted ``scatter_add`` (bench/baselines.py); on a CPU,
  where grouped_mm has no kernel, a per-expert loop (``loop``) of the same math.

CUDA runs use bf16 autocast (fp32 master weights, AdamW). Written to --out: ``results.json`` (the
configuration, every loss, tokens/s and peak memory per run), ``summary.md`` and ``loss.png`` (loss
curves and the speed and memory bars; needs matplotlib). Each run is a child process, so peak
memory (CUDA: torch's allocator peak; CPU: the process's peak RSS) is the run's own. Exits non-zero
if a run's loss did not fall or is not finite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import resource
import subprocess
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F

REPO = pathlib.Path(__file__).resolve().parents[2]

# d_model, layers, heads, sequence, batch, steps; each MoE shape's experts, top-k, d_ffn
PRESETS = {
    # CI: a few seconds per run on two CPU cores
    "tiny": dict(d_model=32, layers=1, heads=2, seq=32, batch=4, steps=12, lr=5e-3, warmup=2,
                 eval_every=6, eval_batches=1,
                 shapes={"fine": dict(experts=64, top_k=8, d_ffn=8),
                         "mixtral": dict(experts=8, top_k=2, d_ffn=64)}),
    # a workstation CPU: minutes
    "cpu": dict(d_model=128, layers=4, heads=4, seq=128, batch=16, steps=300, lr=2e-3, warmup=30,
                eval_every=50, eval_batches=4,
                shapes={"fine": dict(experts=64, top_k=8, d_ffn=64),
                        "mixtral": dict(experts=8, top_k=2, d_ffn=384)}),
    # one GPU: 8 blocks of d = 1024, 32k tokens a step, 0.84 B (fine) or 0.74 B (mixtral)
    # parameters; a few minutes for all four runs on an H200
    "cuda": dict(d_model=1024, layers=8, heads=16, seq=1024, batch=32, steps=400, lr=1e-3,
                 warmup=40, eval_every=80, eval_batches=8,
                 shapes={"fine": dict(experts=64, top_k=8, d_ffn=512),
                         "mixtral": dict(experts=8, top_k=2, d_ffn=3584)}),
}
AUX_LOSS_COEFF = 0.01


# ------------------------------------------------------------------------------------------------
# Data: the standard library's sources as bytes
# ------------------------------------------------------------------------------------------------


def load_corpus():
    """(train, validation) uint8 tensors of the stdlib's *.py files; every 20th file validates."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if p.is_file())
    if not files:
        raise SystemExit(f"no *.py files under {root}")
    train, val = bytearray(), bytearray()
    for i, path in enumerate(files):
        (val if i % 20 == 19 else train).extend(path.read_bytes() + b"\n")
    return (torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8),
            root, len(files))


def batch_at(data, step, batch, seq, seed, device):
    """A deterministic batch (the same for every implementation): inputs and next-byte targets."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
    rows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()
    return rows[:, :-1].to(device, non_blocking=True), rows[:, 1:].to(device, non_blocking=True)


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------


def _baselines():
    sys.path.insert(0, str(REPO / "bench"))
    import baselines  # bench/baselines.py: the benchmark's PyTorch MoE layers
    return baselines


class MoEFeedForward(torch.nn.Module):
    """Router + SwiGLU experts, softmax top-k routing, load-balancing loss; `impl` computes it."""

    def __init__(self, d_model, d_ffn, experts, top_k, impl, renormalize):
        super().__init__()
        self.top_k, self.impl, self.renormalize = top_k, impl, renormalize
        self.w_router = torch.nn.Parameter(torch.empty(experts, d_model))
        self.w_gate = torch.nn.Parameter(torch.empty(experts, d_ffn, d_model))
        self.w_up = torch.nn.Parameter(torch.empty(experts, d_ffn, d_model))
        self.w_down = torch.nn.Parameter(torch.empty(experts, d_model, d_ffn))
        with torch.no_grad():
            for w, fan_in in ((self.w_router, d_model), (self.w_gate, d_model),
                              (self.w_up, d_model), (self.w_down, d_ffn)):
                w.uniform_(-fan_in ** -0.5, fan_in ** -0.5)
        if impl != "moeblaze":
            self.baselines = _baselines()

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.impl == "moeblaze":
            from moeblaze.torch import moe_layer
            y, losses, _, _, _ = moe_layer(x, self.w_router, self.w_gate, self.w_up, self.w_down,
                                           top_k=self.top_k, renormalize=self.renormalize,
                                           aux_loss_coeff=AUX_LOSS_COEFF)
            return y.reshape(shape), losses[0]
        return self._torch_layer(x).reshape(shape), self.aux_loss

    def _torch_layer(self, x):
        """moeblaze's layer in PyTorch: fp32 router, softmax, top-k, the same aux loss; the
        experts in the autocast dtype, as moeblaze runs them."""
        E = self.w_router.shape[0]
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):
            # moeblaze: the router's inputs in the storage dtype, its logits in fp32
            logits = x.to(dtype).float() @ self.w_router.to(dtype).float().t()
            probs = torch.softmax(logits, dim=-1)
            g, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.renormalize:
                g = g / g.sum(-1, keepdim=True)
            counts = torch.zeros(E, device=x.device).scatter_add_(
                0, ids.reshape(-1), torch.ones(ids.numel(), device=x.device))
            fraction = counts / ids.numel()
            self.aux_loss = AUX_LOSS_COEFF * E * (fraction * probs.mean(0)).sum()
            x, w_gate, w_up, w_down = (t.to(dtype) for t in (x, self.w_gate, self.w_up,
                                                             self.w_down))
            if self.impl == "grouped_mm":
                return self.baselines.moe_grouped_mm(x, ids.int(), g, w_gate, w_up, w_down)
            return self.baselines.moe_loop(x, ids.int(), g, w_gate, w_up, w_down)


class Block(torch.nn.Module):
    def __init__(self, d_model, heads, moe):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.RMSNorm(d_model)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = torch.nn.Linear(d_model, d_model, bias=False)
        self.norm2 = torch.nn.RMSNorm(d_model)
        self.moe = moe

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, D // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(B, S, D))
        y, aux = self.moe(self.norm2(x))
        return x + y, aux


class MoELanguageModel(torch.nn.Module):
    def __init__(self, cfg, shape, impl):
        super().__init__()
        d = cfg["d_model"]
        self.embed = torch.nn.Embedding(256, d)
        self.pos = torch.nn.Parameter(torch.zeros(cfg["seq"], d))
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        torch.nn.init.normal_(self.pos, std=0.02)
        self.blocks = torch.nn.ModuleList(
            Block(d, cfg["heads"], MoEFeedForward(d, shape["d_ffn"], shape["experts"],
                                                  shape["top_k"], impl,
                                                  renormalize=shape["top_k"] > 1))
            for _ in range(cfg["layers"]))
        self.norm = torch.nn.RMSNorm(d)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[:tokens.shape[1]]
        aux_total = 0.0
        for block in self.blocks:
            x, aux = block(x)
            aux_total = aux_total + aux
        logits = self.norm(x) @ self.embed.weight.t()
        return logits, aux_total


# ------------------------------------------------------------------------------------------------
# One run (a child process)
# ------------------------------------------------------------------------------------------------


class Progress:
    """tqdm when it is installed, else a line every tenth of the run."""

    def __init__(self, total, label):
        self.total, self.label, self.step = total, label, 0
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=label, unit="step", file=sys.stdout,
                            dynamic_ncols=True, mininterval=0.5)
        except ImportError:
            self.bar = None

    def update(self, **info):
        self.step += 1
        text = " ".join(f"{k} {v}" for k, v in info.items())
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif self.step % max(1, self.total // 10) == 0 or self.step == self.total:
            print(f"{self.label}: step {self.step}/{self.total} {text}", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def run_one(cfg, shape_name, impl, device, seed):
    torch.manual_seed(seed)
    shape = cfg["shapes"][shape_name]
    train, val, _, _ = load_corpus()
    model = MoELanguageModel(cfg, shape, impl).to(device)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95),
                                  weight_decay=0.1)
    steps, warmup = cfg["steps"], cfg["warmup"]
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(
            1.0, s / steps))))
    cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else \
        torch.autocast("cpu", enabled=False)
    step_fn = model if not cfg.get("compile") else torch.compile(model)
    tokens_per_step = cfg["batch"] * cfg["seq"]

    def loss_of(tokens, targets):
        with autocast:
            logits, aux = step_fn(tokens)
            lm = F.cross_entropy(logits.float().reshape(-1, 256), targets.reshape(-1))
        return lm, aux

    def evaluate():
        model.eval()
        total = 0.0
        with torch.no_grad():
            for i in range(cfg["eval_batches"]):
                tokens, targets = batch_at(val, i, cfg["batch"], cfg["seq"], seed + 1, device)
                total += float(loss_of(tokens, targets)[0])
        model.train()
        return total / cfg["eval_batches"]

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    train_losses, val_losses = [], []
    timed_tokens, eval_seconds = 0, 0.0
    timing_from = min(5, steps // 4)  # the first steps warm up allocators, plans and kernels
    progress = Progress(steps, f"{shape_name}/{impl}")
    for step in range(steps):
        if step == timing_from:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
        tokens, targets = batch_at(train, step, cfg["batch"], cfg["seq"], seed, device)
        lm, aux = loss_of(tokens, targets)
        optimizer.zero_grad(set_to_none=True)
        (lm + aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        train_losses.append(float(lm.detach()))  # one host sync a step, as a logged loop has
        if step >= timing_from:
            timed_tokens += tokens_per_step
        if (step + 1) % cfg["eval_every"] == 0 or step + 1 == steps:
            if cuda:
                torch.cuda.synchronize()
            eval_start = time.perf_counter()
            val_losses.append((step + 1, evaluate()))
            if step >= timing_from:  # evaluation is not training throughput
                eval_seconds += time.perf_counter() - eval_start
        progress.update(loss=f"{train_losses[-1]:.3f}", aux=f"{float(aux.detach()):.4f}")
    if cuda:
        torch.cuda.synchronize()
    timed_seconds = time.perf_counter() - start - eval_seconds
    progress.close()
    peak = torch.cuda.max_memory_allocated() if cuda else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(shape=shape_name, impl=impl, parameters=params, train_loss=train_losses,
                val_loss=val_losses, tokens_per_step=tokens_per_step,
                tokens_per_second=timed_tokens / timed_seconds if timed_seconds > 0 else None,
                peak_memory_bytes=peak,
                peak_memory_kind="torch.cuda.max_memory_allocated" if cuda else "peak RSS")


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------


def default_impls(device):
    return ["moeblaze", "grouped_mm" if device == "cuda" else "loop"]


def plot(results, out_dir, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss.png")
        return None
    shapes = sorted({r["shape"] for r in results})
    fig, axes = plt.subplots(1, len(shapes) + 1, figsize=(6 * (len(shapes) + 1), 4.5))
    colors = {"moeblaze": "tab:red", "grouped_mm": "tab:blue", "loop": "tab:blue"}
    for ax, shape in zip(axes, shapes):
        for r in (r for r in results if r["shape"] == shape):
            losses = torch.tensor(r["train_loss"])
            window = max(1, len(losses) // 50)
            smooth = losses.unfold(0, window, 1).mean(1) if window > 1 else losses
            ours = r["impl"] == "moeblaze"  # wide and pale under the baseline's thin line
            ax.plot(range(window, len(losses) + 1), smooth.tolist(), color=colors[r["impl"]],
                    label=f"{r['impl']} train", linewidth=3.0 if ours else 1.2,
                    alpha=0.45 if ours else 1.0)
            steps, vals = zip(*r["val_loss"])
            ax.plot(steps, vals, "o" if ours else "x", linestyle="--", color=colors[r["impl"]],
                    label=f"{r['impl']} validation", markersize=8 if ours else 6)
        ax.set_title(f"{shape}: {describe_shape(results, shape)}")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats / byte)")
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[-1]
    labels = [f"{r['shape']}\n{r['impl']}" for r in results]
    speed = [(r["tokens_per_second"] or 0) / 1e3 for r in results]
    memory = [r["peak_memory_bytes"] / 2 ** 30 for r in results]
    positions = range(len(results))
    bars = ax.bar([p - 0.2 for p in positions], speed, 0.4,
                  color=[colors[r["impl"]] for r in results], label="k tokens/s")
    ax.bar_label(bars, fmt="%.3g", fontsize=8)
    twin = ax.twinx()
    membars = twin.bar([p + 0.2 for p in positions], memory, 0.4, color="gray", alpha=0.6,
                       label="peak GiB")
    twin.bar_label(membars, fmt="%.3g", fontsize=8)
    ax.set_xticks(list(positions), labels, fontsize=8)
    ax.set_ylabel("thousand tokens / s (bars left)")
    twin.set_ylabel(f"peak memory GiB (grey; {results[0]['peak_memory_kind']})")
    ax.set_title("speed and peak memory")
    fig.suptitle(title)
    fig.tight_layout()
    path = out_dir / "loss.png"
    fig.savefig(path, dpi=110)
    return path


def describe_shape(results, shape):
    cfg = results[0]["config"]["shapes"][shape]
    return f"E={cfg['experts']}, k={cfg['top_k']}, d_ffn={cfg['d_ffn']}"


def summary_table(results):
    lines = ["| shape | MoE layer | parameters | final train loss | final validation loss | "
             "tokens/s | peak memory |", "|---|---|---|---|---|---|---|"]
    for r in results:
        tail = r["train_loss"][-max(1, len(r["train_loss"]) // 20):]
        lines.append(f"| {r['shape']} | {r['impl']} | {r['parameters'] / 1e6:.1f} M | "
                     f"{sum(tail) / len(tail):.4f} | {r['val_loss'][-1][1]:.4f} | "
                     f"{(r['tokens_per_second'] or 0):,.0f} | "
                     f"{r['peak_memory_bytes'] / 2 ** 30:.2f} GiB |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model and run size (default: cuda on a GPU, else cpu)")
    parser.add_argument("--shapes", default="fine,mixtral", help="MoE shapes to train")
    parser.add_argument("--impls", default=None,
                        help="MoE layers to compare (default: moeblaze plus grouped_mm on CUDA, "
                             "loop on a CPU)")
    parser.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="train_lm_out", help="folder for the results")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    preset = args.preset or ("cuda" if device == "cuda" else "cpu")
    cfg = dict(PRESETS[preset])
    if args.steps is not None:
        cfg["steps"] = args.steps
        cfg["eval_every"] = max(1, min(cfg["eval_every"], args.steps // 3))
    cfg["compile"] = args.compile
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    if args.worker:  # child process: one (shape, impl) run, result as JSON
        shape, impl, result_path = args.worker.split(":", 2)
        result = run_one(cfg, shape, impl, torch.device(device), args.seed)
        pathlib.Path(result_path).write_text(json.dumps(result))
        return 0

    shapes = [s for s in args.shapes.split(",") if s]
    impls = args.impls.split(",") if args.impls else default_impls(device)
    for shape in shapes:
        if shape not in cfg["shapes"]:
            parser.error(f"--shapes: unknown {shape!r}; expected {sorted(cfg['shapes'])}")
    for impl in impls:
        if impl not in ("moeblaze", "grouped_mm", "loop"):
            parser.error(f"--impls: unknown {impl!r}; expected moeblaze, grouped_mm or loop")
    _, _, root, files = load_corpus()
    print(f"corpus: {files} files of {root}; preset {preset} on {device}: d_model "
          f"{cfg['d_model']}, {cfg['layers']} layers, {cfg['batch']}x{cfg['seq']} tokens a step, "
          f"{cfg['steps']} steps; seed {args.seed}", flush=True)

    results = []
    for shape in shapes:
        for impl in impls:
            result_path = out_dir / f"run-{shape}-{impl}.json"
            command = [sys.executable, os.path.abspath(__file__), "--device", device, "--preset",
                       preset, "--seed", str(args.seed), "--out", str(out_dir),
                       "--worker", f"{shape}:{impl}:{result_path}"]
            if args.steps is not None:
                command += ["--steps", str(args.steps)]
            if args.compile:
                command.append("--compile")
            subprocess.run(command, check=True)
            result = json.loads(result_path.read_text())
            result_path.unlink()
            result["config"] = {k: v for k, v in cfg.items()}
            results.append(result)
            print(f"{shape}/{impl}: loss {result['train_loss'][0]:.4f} -> "
                  f"{result['train_loss'][-1]:.4f}, validation {result['val_loss'][-1][1]:.4f}, "
                  f"{(result['tokens_per_second'] or 0):,.0f} tokens/s, peak "
                  f"{result['peak_memory_bytes'] / 2 ** 30:.2f} GiB", flush=True)

    environment = dict(torch=torch.__version__, python=sys.version.split()[0], device=device,
                       gpu=torch.cuda.get_device_name() if device == "cuda" else None,
                       corpus=f"{files} *.py files of {root}")
    try:
        import moeblaze
        environment["moeblaze"] = moeblaze.build_info()
    except Exception as error:  # the comparison still reports the other implementation
        environment["moeblaze"] = f"unavailable: {error}"
    (out_dir / "results.json").write_text(json.dumps(dict(environment=environment, preset=preset,
                                                          runs=results), indent=1))
    title = (f"byte-level LM on the Python stdlib: {cfg['layers']} x d={cfg['d_model']}, "
             f"{cfg['batch']}x{cfg['seq']} tokens/step, {device}"
             + (f" ({environment['gpu']})" if environment["gpu"] else ""))
    png = plot(results, out_dir, title)
    table = summary_table(results)
    (out_dir / "summary.md").write_text(f"{title}\n\n{table}\n")
    print(table)
    if png:
        print(f"wrote {png}")

    failed = []
    for r in results:
        losses = r["train_loss"]
        if not all(math.isfinite(v) for v in losses) or not losses[-1] < losses[0]:
            failed.append(f"{r['shape']}/{r['impl']}")
    for shape in shapes:  # same initial weights and batch: the first losses agree
        firsts = [r["train_loss"][0] for r in results if r["shape"] == shape]
        if max(firsts) - min(firsts) > 1e-2:
            failed.append(f"{shape}: first losses differ ({firsts})")
    if failed:
        print("FAILED: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
