"""Train a small MoE layer with moeblaze's numpy API on the CPU: learn a random teacher MoE.

    PYTHONPATH=bindings/python python3 examples/python/numpy_training.py [--steps 150]

The student has the teacher's shape but its own random weights; plain SGD on the mean squared error
between the two layers' outputs, with every gradient (router included) from layer.backward().
Exits non-zero if the loss did not fall, so CI can run it as a test.
"""

import argparse
import sys

import numpy as np

import moeblaze

D_MODEL, D_FFN, NUM_EXPERTS, TOP_K, TOKENS = 16, 32, 4, 2, 256


def init_weights(rng, scale):
    """nn.Linear-style U(-1/sqrt(fan_in), 1/sqrt(fan_in)) bounds, times `scale`."""
    def uniform(shape, fan_in):
        bound = scale / np.sqrt(fan_in)
        return rng.uniform(-bound, bound, size=shape).astype(np.float32)
    return {
        "w_router": uniform((NUM_EXPERTS, D_MODEL), D_MODEL),
        "w_gate": uniform((NUM_EXPERTS, D_FFN, D_MODEL), D_MODEL),
        "w_up": uniform((NUM_EXPERTS, D_FFN, D_MODEL), D_MODEL),
        "w_down": uniform((NUM_EXPERTS, D_MODEL, D_FFN), D_FFN),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(f"moeblaze {moeblaze.build_info()}")
    rng = np.random.default_rng(args.seed)
    layer = moeblaze.Layer(d_model=D_MODEL, d_ffn=D_FFN, num_experts=NUM_EXPERTS, top_k=TOP_K,
                           activation="swiglu", dtype="float32", aux_loss_coeff=0.01)
    teacher = init_weights(rng, scale=3.0)
    student = init_weights(rng, scale=1.0)
    x = rng.standard_normal((TOKENS, D_MODEL)).astype(np.float32)
    target = layer.forward(x, **teacher, training=False).y

    losses = []
    for step in range(args.steps):
        out = layer.forward(x, **student)
        error = out.y - target
        mse = float(np.mean(error ** 2))
        losses.append(mse)
        dy = (2.0 / error.size) * error
        grads = layer.backward(out, dy, x, **student)  # d_losses NULL: aux loss added as returned
        for name, grad in (("w_router", grads.dw_router), ("w_gate", grads.dw_gate),
                           ("w_up", grads.dw_up), ("w_down", grads.dw_down)):
            student[name] -= args.lr * grad
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  mse {mse:.6f}  aux {out.aux_loss:.5f}  "
                  f"tokens per expert {out.expert_counts.tolist()}")

    ratio = losses[-1] / losses[0]
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f} ({ratio:.3f} of the initial loss)")
    if not ratio < 0.5:
        print("FAILED: the loss did not fall below half of its initial value", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
