"""Train moeblaze.torch.MoE (an nn.Module) to imitate a random teacher MoE, with torch.optim.SGD.

    PYTHONPATH=bindings/python python3 examples/python/torch_training.py [--device cuda]

CPU tensors run on moeblaze's CPU backend, CUDA tensors on its CUDA backend (torch's current
stream, torch's caching allocator for the saved buffer and workspace). Exits non-zero if the loss
did not fall.
"""

import argparse
import sys

import torch

from moeblaze.torch import MoE


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    config = dict(d_model=16, d_ffn=32, num_experts=4, top_k=2, activation="swiglu",
                  aux_loss_coeff=0.01, z_loss_coeff=0.001, device=args.device, dtype=dtype)
    teacher = MoE(**config)
    with torch.no_grad():
        for p in teacher.parameters():
            p.mul_(3.0)  # a teacher with larger weights than the student's initialisation
    student = MoE(**config)
    optimizer = torch.optim.SGD(student.parameters(), lr=args.lr)
    x = torch.randn(256, 16, device=args.device, dtype=dtype)
    with torch.no_grad():
        target, _, _ = teacher(x)

    losses = []
    for step in range(args.steps):
        y, aux_loss, z_loss = student(x)
        mse = torch.nn.functional.mse_loss(y.float(), target.float())
        loss = mse + aux_loss + z_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(mse.detach()))
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  mse {losses[-1]:.6f}  aux {float(aux_loss.detach()):.5f}  "
                  f"z {float(z_loss.detach()):.5f}  tokens per expert "
                  f"{student.last_expert_counts.tolist()}")
    ratio = losses[-1] / losses[0]
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f} ({ratio:.3f} of the initial loss)")
    if not ratio < 0.5:
        print("FAILED: the loss did not fall below half of its initial value", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
