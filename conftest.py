"""Suite-wide JAX settings: applies to tests/ and to the doctests in jmp_lite/.

Strict dtype promotion turns every silent bf16 -> f32 upcast into an error, the
single best check for a mixed-precision library (pyproject.toml also makes
warnings errors).
"""

import jax

jax.config.update("jax_numpy_dtype_promotion", "strict")
