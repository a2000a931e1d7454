"""Benchmarks of muon_fn's optimizers, and their command line (``muon-fn bench``).

A tool: it reads the library through its public API only, what it times inside Newton–Schulz
(schedules, FLOPs, the device's products and policy) through :mod:`muon_fn.orthogonalization`.

- The Muon step (:func:`benchmark_muon_optimizers`, ``muon-fn bench``): paired step times of
  muon_fn's compiled default, its eager form, torch.optim.Muon, fused AdamW and GEMM replays;
  each row's first (compiling) step, persistent state and peak step memory; orthogonality
  quality on real gradients. ``--elementwise``: TritonMuon and TritonMuonW against torch's fused
  Adam, AdamW and SGD.
- Memory (:func:`benchmark_memory`, ``muon-fn bench --memory``): each row's state and the peak of
  one step, every row in a fresh process (CPU: the resident set; CUDA: allocated bytes), against
  torch.optim.Muon, and the hybrid against torch.optim.Muon + AdamW on the same split.
- SSO (:func:`benchmark_sso`, ``muon-fn bench sso``): SpectralSphereOptimizer against Muon.
- FSDP (:func:`benchmark_fsdp`, ``muon-fn bench fsdp``): owner-computes against replicate on
  gloo ranks, and torch.optim.Muon against MuonOptimizer on the same FSDP2 DTensors.

The sets (:data:`SETS`: tiny, gpt2-small, and the LLM-size llama3-1b, llama3-8b, deepseek-moe
for GPUs) and the GEMM bound of a step (:func:`step_gemm_flops` over :func:`matmul_rate`).

Shared pieces: the parameter sets and their real gradients (:func:`real_gradients`), paired
rounds and :func:`paired_ratio`, device synchronization, thread counts, state and peak bytes.

**Parameter sets.** ``tiny``: 4 layers at d = 256 (24 matrices, 3.1 M parameters);
``gpt2-small``: 12 layers at d = 768 (72 matrices, 84.9 M); each layer q, k, v, o (d×d), fc
(4d×d), proj (d×4d). The gradients are real: one forward/backward pass of a byte-level
transformer built from these matrices on Python's standard library sources (the Llama sets with
RMSNorm, grouped-query attention and SwiGLU; ``deepseek-moe`` with a routed top-6 MoE), of stable
rank 1–4, unlike Gaussian noise.

**Rows.** ``muon_fn`` is ``MuonOptimizer(params, lr)`` with the defaults; ``muon_fn[like_torch]``
runs torch's math (quintic ×5 in bf16, EMA momentum, ``adjust_lr_fn="original"``) through
muon_fn; ``torch.optim.Muon`` (``weight_decay=0``, ``adjust_lr_fn="original"``) is the reference
of ``/torch``; ``replay[...]`` runs exactly the GEMMs of a schedule, batched as the step batches,
on inputs prepared outside the clock (``torch_quintic5``: one matrix at a time in bf16, as
torch). ``muon-fn bench --help`` lists every row. On a CPU without bf16 instructions the default
rows leave out the bf16 ones (emulated there), except torch.optim.Muon on the tiny set.

**Columns.** The first step (``1st step``; ``c``: it compiled), ms per step over the paired rounds
(min, median, max), ``bound ms`` (the row's GEMM FLOPs, ``muon_fn.orthogonalization.gemm_flops``, at
the rate of one representative GEMM timed in the same run; muon_fn's blocked symmetric products
can come in under it on the CPU) and ``/bound``, ``/torch`` and ``/own`` (medians of the per-round
ratios to torch.optim.Muon and to the row's own replay), ``state MiB``, and ``peak MiB`` (what one
more step allocates above what existed before it: on CUDA ``torch.cuda.max_memory_allocated``, on
the CPU torch's allocator events in ``torch.profiler``, without BLAS packing buffers).

**Quality.** On the gradients of layer 0 and the last layer and on Gaussian 768×3072 and
3072×768 matrices, the worst ratio per matrix kind of the RMS deviation of singular values from 1
to torch's 5-step quintic (``ratio_to_torch``) and to the quintic in the row's dtype
(``ratio_to_quintic_same_dtype``); ``signed_ratio_to_torch`` uses u_iᵀ O v_i, so it also catches
a flipped direction.
"""

from ._cli import main
from ._fsdp import benchmark_fsdp, format_fsdp_result
from ._memory import peak_step_bytes, resident_step_bytes, state_bytes
from ._memory_table import benchmark_memory, format_memory_table
from ._muon import benchmark_muon_optimizers, compile_check, format_table
from ._bound import matmul_rate, step_gemm_flops
from ._problem import (DEFAULT_SIZES, MATRIX_NAMES, MODEL_SIZES, SETS, MatrixSet, matrix_shapes, meta_params,
                       real_gradients, set_size)
from ._quality import TORCH_ORTHO, Ortho, orthogonality, orthogonalizer
from ._replay import replay
from ._rows import ELEMENTWISE_ROWS, MEMORY_ROWS, MODEL_ROWS, OPTIONAL_ROWS, ROW_SPECS, ROWS, default_rows, memory_rows
from ._sso import SSO_DEFAULT_ROWS, SSO_ROWS, benchmark_sso, format_sso_table
from .._device import synchronize
from ._timing import check_device, default_threads, paired_ratio, paired_rounds, parse_threads

__all__ = [
    "main", "benchmark_muon_optimizers", "compile_check", "format_table", "benchmark_sso", "format_sso_table",
    "benchmark_fsdp", "format_fsdp_result", "real_gradients", "matrix_shapes", "MODEL_SIZES", "MATRIX_NAMES",
    "paired_ratio", "paired_rounds", "check_device", "synchronize", "default_threads", "parse_threads",
    "state_bytes", "peak_step_bytes", "resident_step_bytes", "benchmark_memory", "format_memory_table",
    "MEMORY_ROWS", "MODEL_ROWS", "memory_rows", "orthogonality", "orthogonalizer", "Ortho", "TORCH_ORTHO",
    "replay", "ROWS",
    "OPTIONAL_ROWS", "ELEMENTWISE_ROWS", "ROW_SPECS", "default_rows", "SSO_ROWS", "SSO_DEFAULT_ROWS",
    "SETS", "MatrixSet", "DEFAULT_SIZES", "meta_params", "set_size", "step_gemm_flops", "matmul_rate",
]
