"""Newton–Schulz orthogonalization: the math once, each device's execution in its own module.

- :mod:`.schedules`: each method's coefficients, how a schedule extends to ``steps`` iterations,
  its preconditioner and form, and what it costs in GEMM FLOPs;
- :mod:`.iteration`: the iteration as formulas (``step``, ``poly``, ``iterate``, the Gram form,
  the AOL rescale, normalization), asking the :class:`~.products.Products` it is given for every
  product;
- :mod:`.products`: the products the iteration asks for, computed plainly;
- :mod:`.cpu`: the CPU's execution (block-split symmetric products, AMX's rule, one matrix at a
  time from 384 rows, aligned slots, reused scratch, the bf16 probe);
- :mod:`.batched`: the GPUs' execution (stacked batches, half-block symmetric GEMMs);
- :mod:`.execution`: the device's products (``for_device``) and the iteration run through them
  (``newton_schulz``, ``orthogonalize_matrices``; ``gram_matrix``, ``iterate``, ``iterate_gram``
  with the device's products by default), the default dtype per device, batched orthogonalization
  through the device's products, and the operator ``torch.ops.muon_fn.orthogonalize_batch``.

Imports point down only: the math (schedules, iteration, products) imports no execution module;
the execution side (cpu, batched, execution) picks the products (``tests/test_layering.py``).
Which execution runs on a device is its policy (:mod:`muon_fn.core.execution`). The names below are
this package's public face, importable as ``muon_fn.core.newton_schulz.<name>``.
"""

from .batched import BatchedProducts, half_blocks
from .cpu import (AMX_SPLIT_MIN_RATIO, CPU_HAS_BF16_GEMM, LOOP_MIN_DIM, SLOT_ALIGNMENT, SYMMETRIC_MIN_BLOCK,
                  CPUProducts, aligned_slots, clear_scratch, cpu_has_bf16_gemm)
from .execution import (default_compute_dtype, for_device, gram_matrix, iterate, iterate_gram, msign_batch,
                        newton_schulz, orthogonalize_batch, orthogonalize_matrices, polar_express,
                        zeropower_via_newtonschulz5)
from .iteration import aol_scale, inverse_norm, poly, run_schedule, step, wide_shape
from .products import Buffers, Products
from .schedules import (AOL9_COEFFICIENTS, AOL_COEFFICIENTS, COMPUTE_DTYPES, CUBIC_COEFFICIENTS, DEFAULT_METHOD,
                        FORMS, GRAM_RESTARTS, KELLER_COEFFICIENTS, METHODS, POLAR_EXPRESS_COEFFICIENTS,
                        POLAR_EXPRESS_SAFETY, PRECONDITIONERS, TORCH_NS_STEPS, YOU_COEFFICIENTS, Coefficients,
                        Method, Schedule, check_dtype, coefficient_rows, coefficient_schedule, default_steps,
                        degree_terms, gemm_flops, gram_products, norm_scale, validate_coefficients)

__all__ = [
    "AMX_SPLIT_MIN_RATIO", "AOL9_COEFFICIENTS", "AOL_COEFFICIENTS", "BatchedProducts", "Buffers", "COMPUTE_DTYPES",
    "CPUProducts", "CPU_HAS_BF16_GEMM", "CUBIC_COEFFICIENTS", "Coefficients", "DEFAULT_METHOD", "FORMS",
    "GRAM_RESTARTS", "KELLER_COEFFICIENTS", "LOOP_MIN_DIM", "METHODS", "Method", "POLAR_EXPRESS_COEFFICIENTS",
    "POLAR_EXPRESS_SAFETY", "PRECONDITIONERS", "Products", "SLOT_ALIGNMENT", "SYMMETRIC_MIN_BLOCK", "Schedule",
    "TORCH_NS_STEPS", "YOU_COEFFICIENTS", "aligned_slots", "aol_scale", "check_dtype", "clear_scratch",
    "coefficient_rows", "coefficient_schedule", "cpu_has_bf16_gemm", "default_compute_dtype", "default_steps",
    "degree_terms",
    "for_device", "gemm_flops", "gram_matrix", "gram_products", "half_blocks", "inverse_norm", "iterate",
    "iterate_gram", "msign_batch", "newton_schulz", "norm_scale", "orthogonalize_batch", "orthogonalize_matrices",
    "poly", "polar_express", "run_schedule", "step", "validate_coefficients", "wide_shape",
    "zeropower_via_newtonschulz5",
]
