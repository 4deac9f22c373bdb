"""GPU kernels (Triton) with plain-torch fallbacks, so CPU runs use the same entry points."""
