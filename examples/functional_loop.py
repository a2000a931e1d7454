"""The pure functional API in a hand-written training loop, compiled with ``mf.compile_update``.

No ``torch.optim`` here: parameters are a dict pytree, gradients come from ``torch.func``, and
the optimizer is a ``GradientTransformation`` — ``state = tx.init(params)``, then
``updates, state = tx.update(grads, state, params)`` and ``params = mf.apply_updates(...)``.

The learning rates are 0-d tensors closed over by the transform and changed in place
(``lr.fill_(...)``), so the compiled update is traced once and never recompiles while the
schedule moves.

    python examples/functional_loop.py                            # 30 steps, inductor
    python examples/functional_loop.py --steps 3 --backend eager  # what the tests run

With inductor the first step compiles (about a minute on a CPU).
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch.func import functional_call, grad_and_value

try:
    import muon_fn as mf
except ImportError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import muon_fn as mf
from muon_fn.tools.train.data import Batcher, load_corpus
from muon_fn.tools.train.model import GPT, config_for


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--backend", default="inductor", help="torch.compile backend (eager: no codegen)"
    )
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    model = GPT(config_for("tiny", n_layer=2))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    # Labels: Muon for hidden matrices; AdamW for embeddings, the head and 1-D params.
    def label(name: str, p: torch.Tensor) -> str:
        return "muon" if p.ndim >= 2 and "emb" not in name and "lm_head" not in name else "adamw"

    labels = {k: label(k, v) for k, v in params.items()}
    muon_lr, adamw_lr = torch.tensor(0.02), torch.tensor(3e-3)  # 0-d tensors: schedulable
    tx = mf.partition(
        {
            "muon": mf.chain(
                mf.momentum(0.95, nesterov=True),
                mf.orthogonalize("polar_express", steps=5),
                mf.scale_by_shape("keller"),
                mf.add_decoupled_weight_decay(0.0),
                mf.scale_by_learning_rate(muon_lr),
            ),
            "adamw": mf.adamw(adamw_lr, betas=(0.9, 0.95), weight_decay=0.0),
        },
        labels,
    )  # the same optimizer as mf.hybrid(lr=muon_lr, adamw_lr=adamw_lr, labels=labels)
    tx = mf.compile_update(tx, backend=args.backend)
    state = tx.init(params)

    def loss_fn(p, x, y):
        _, loss = functional_call(model, p, (x, y))
        return loss

    grad_fn = grad_and_value(loss_fn)
    data = load_corpus(max_bytes=1_000_000)
    batches = Batcher(data.train, batch_size=8, seq_len=64, seed=0)
    t0 = time.perf_counter()
    for step in range(args.steps):
        scale = 0.5 * (1 + math.cos(math.pi * step / args.steps))  # cosine schedule
        muon_lr.fill_(0.02 * scale)
        adamw_lr.fill_(3e-3 * scale)
        x, y = batches.next()
        grads, loss = grad_fn(params, x, y)
        updates, state = tx.update(grads, state, params)
        params = mf.apply_updates(params, updates)
        print(f"step {step + 1:3d}  loss {loss.item():.4f}  ({time.perf_counter() - t0:.1f} s)")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(
        f"compiled graphs: {graphs} (one per update; the moving learning rates caused no recompile)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
