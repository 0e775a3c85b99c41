"""Train an MoE layer in JAX (moeblaze.jax.moe_layer) to imitate a random teacher MoE layer.

    export MOEBLAZE_LIBRARY=$PWD/build/src/libmoeblaze.so PYTHONPATH=$PWD/bindings/python
    python3 examples/jax/train_moe.py [--steps 150] [--dtype float32|bfloat16|float16]

The whole training step (the layer's forward and backward as XLA FFI custom calls, the losses, the
optimizer update) is one jax.jit program; it runs on JAX's default device (a GPU needs a CUDA build
of moeblaze). Uses optax's Adam when optax is installed, plain SGD otherwise. Exits non-zero if the
loss did not fall below half of its initial value.
"""

import argparse
import sys

import jax
import jax.numpy as jnp

from moeblaze.jax import moe_layer

try:
    import optax
except ImportError:  # plain SGD below
    optax = None

CONFIG = dict(top_k=2, activation="swiglu", aux_loss_coeff=0.01, z_loss_coeff=0.001)


def init_params(key, d_model, d_ffn, num_experts, dtype, scale=1.0):
    """nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), times `scale`."""
    shapes = {"w_router": ((num_experts, d_model), d_model),
              "w_gate": ((num_experts, d_ffn, d_model), d_model),
              "w_up": ((num_experts, d_ffn, d_model), d_model),
              "w_down": ((num_experts, d_model, d_ffn), d_ffn)}
    keys = jax.random.split(key, len(shapes))
    return {name: (scale * jax.random.uniform(k, shape, jnp.float32, -1, 1) / fan_in ** 0.5)
            .astype(dtype) for k, (name, (shape, fan_in)) in zip(keys, shapes.items())}


def apply(params, x):
    return moe_layer(x, params["w_router"], params["w_gate"], params["w_up"], params["w_down"],
                     return_expert_counts=True, **CONFIG)


def loss_fn(params, x, target):
    y, aux_loss, z_loss, counts = apply(params, x)
    mse = jnp.mean((y.astype(jnp.float32) - target.astype(jnp.float32)) ** 2)
    return mse + aux_loss + z_loss, (mse, aux_loss, z_loss, counts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: 0.02 for Adam, 1.0 for SGD)")
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    d_model, d_ffn, num_experts = 16, 32, 4
    teacher_key, student_key, data_key = jax.random.split(jax.random.PRNGKey(0), 3)
    teacher = init_params(teacher_key, d_model, d_ffn, num_experts, dtype, scale=3.0)
    params = init_params(student_key, d_model, d_ffn, num_experts, dtype)
    x = jax.random.normal(data_key, (8, 32, d_model), jnp.float32).astype(dtype)  # [batch, seq, d]
    target = apply(teacher, x)[0]

    if optax is not None:
        optimizer = optax.adam(args.lr or 0.02)
        print(f"optax {optax.__version__}: Adam, lr {args.lr or 0.02}")
    else:
        lr = args.lr or 1.0
        optimizer = None
        print(f"optax not installed: plain SGD, lr {lr}")
    opt_state = optimizer.init(params) if optimizer else None

    @jax.jit
    def train_step(params, opt_state, x, target):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, target)
        if optimizer is not None:
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        else:
            params = jax.tree_util.tree_map(lambda p, g: (p - lr * g).astype(p.dtype), params,
                                            grads)
        return params, opt_state, loss, aux

    losses = []
    for step in range(args.steps):
        params, opt_state, loss, (mse, aux_loss, z_loss, counts) = train_step(
            params, opt_state, x, target)
        losses.append(float(mse))
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  mse {losses[-1]:.6f}  aux {float(aux_loss):.5f}  "
                  f"z {float(z_loss):.5f}  tokens per expert {counts.tolist()}")
    ratio = losses[-1] / losses[0]
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f} ({ratio:.3f} of the initial loss) on "
          f"{jax.devices()[0].platform}")
    if not ratio < 0.5:
        print("FAILED: the loss did not fall below half of its initial value", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
