"""Benchmarks of muon_fn's optimizers, and their command line (``muon-fn bench``).

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
    "MEMORY_ROWS", "MODEL_ROWS", "memory_rows", "orthogonality", "orthogonalizer", "Ortho", "TORCH_ORTHO", "replay", "ROWS",
    "OPTIONAL_ROWS", "ELEMENTWISE_ROWS", "ROW_SPECS", "default_rows", "SSO_ROWS", "SSO_DEFAULT_ROWS",
    "SETS", "MatrixSet", "DEFAULT_SIZES", "meta_params", "set_size", "step_gemm_flops", "matmul_rate",
]
