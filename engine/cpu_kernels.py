"""The kernels this project puts in place of MLX's and mlx-lm's own when the ranks compute
on MLX's CPU device: grouped-query attention (engine/cpu_attention.py) and SwiGLU
(engine/cpu_activation.py). Every process that runs the model as a rank does calls
`install()` first: server.py, the machine probe, the benches and the tests' logits probe."""

from __future__ import annotations

from engine import cpu_activation, cpu_attention


def install() -> bool:
    """Both kernels in place on the CPU backend; False (nothing installed) elsewhere."""
    if not cpu_attention.install():
        return False
    return cpu_activation.install()
