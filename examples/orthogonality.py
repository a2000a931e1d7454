"""How close each orthogonalization method gets to msign(G) = UVᵀ: the table in docs/algorithms.md.

For a Gaussian G (seed 0) of each shape, prints the singular values of the output O (min, max)
and the RMS distance of the singular values from 1 (= ‖O − UVᵀ‖_F/√m), per method, steps and
iteration dtype. Metrics are computed in float64.

    python examples/orthogonality.py                    # 256×1024 and 1024×256; designed steps, 5 and 8
    python examples/orthogonality.py --shape 768x3072   # gpt2-small's MLP shape (slower)
"""

import argparse
import sys
from pathlib import Path

import torch

try:
    import muon_fn as mf
except ImportError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import muon_fn as mf

from muon_fn.core.newton_schulz import (  # every built-in method and its designed step count
    METHODS,
    default_steps,
)


def measure(
    G: torch.Tensor, method: str, steps: int, dtype: torch.dtype
) -> tuple[float, float, float]:
    Q = mf.newton_schulz(G, method, steps, dtype=dtype).double()
    s = torch.linalg.svdvals(Q)
    return s.min().item(), s.max().item(), (s - 1).pow(2).mean().sqrt().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shape", action="append", help="MxN (repeatable); default 256x1024 and 1024x256"
    )
    ap.add_argument("--steps", type=int, nargs="+", default=[5, 8])
    args = ap.parse_args(argv)
    shapes = [
        tuple(int(v) for v in s.lower().split("x"))
        for s in (args.shape or ["256x1024", "1024x256"])
    ]
    print(
        f"{'shape':<10} {'method':<14} {'steps':>5} {'dtype':<9} {'σ_min':>7} {'σ_max':>7} {'RMS(σ−1)':>9}"
    )
    for shape in shapes:
        G = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        for method in METHODS:
            for steps in sorted({default_steps(method), *args.steps}):
                for dtype in (torch.float32, torch.bfloat16):
                    if method == "gram" and dtype == torch.bfloat16:
                        continue  # Gram Newton–Schulz rejects bf16 (it loses orthogonality there)
                    lo, hi, rms = measure(G, method, steps, dtype)
                    name = str(dtype).replace("torch.", "")
                    print(
                        f"{'x'.join(map(str, shape)):<10} {method:<14} {steps:>5} {name:<9} {lo:7.4f} {hi:7.4f} {rms:9.4f}"  # noqa: E501
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
