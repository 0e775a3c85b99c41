"""The numpy API (CPU backend): the same objects as the top-level package, under an explicit name.

    import moeblaze.numpy as mbn
    layer = mbn.Layer(d_model=64, d_ffn=128, num_experts=8, top_k=2)
"""

from .core import (  # noqa: F401
    Context,
    Layer,
    aligned_empty,
    bfloat16_bits_to_float,
    default_context,
    float_to_bfloat16_bits,
)
