"""The RS paper's claims re-run by our engine, beside its numbers (``fedsparse reproduce``).

One command runs every part below (resumable: a finished run is reused, not rerun) and writes
``report.md``, CSVs and plots into one folder (``docs/reproduction``). The RS paper:
*Improving Differentially Private SGD via Randomly Sparsified Gradients*, arXiv:2112.00845.

- **noise** (Fig. 1c): the norm of the DP noise a sparsified step adds over the dense one's, at
  the paper's d = 5.5e5, measured through ``SparseDPEngine`` against ``sqrt(1 - r)``.
- **central** (Table 2, Fig. 4): centralized DP-SGD, best vs best. Every arm (final rate r*,
  0 = the baseline) is tuned on a validation split (``eval_split="validation"``, one fixed
  train/test split for every run), then runs at its own best on the test split with paired
  seeds; "RS" is the rate among r* > 0 of highest validation accuracy, as the paper searches
  r* per row. ``untuned``: each r* also runs at the baseline's best (Fig. 4's protocol:
  RS plugged into the no-sparsification hyperparameters).
- **federated**: the same comparison on the federated app (``run_tuned_sweep``, in-process).
- **ablations** (Fig. 3): clipped SGD without noise and noisy SGD without clipping
  (Algorithms 3 and 2) against r*; the paper: RS only slows them down.
- **scaling** (App. H): a (C, momentum) grid; the paper: the best C of every momentum, and
  the best momentum of every C, lie on the diagonal C / (1 - mu) = C* / (1 - mu*).

Verdicts are rules written down before the runs (``comparison.gain_verdict``, the report's
``sections``), not judgement calls. Where our data or models differ from the paper's, the
report says so: the paper's Table 2 has no MNIST row; its nearest rows are FMNIST's small
models (DP-CNN/S, 26K parameters; H-CNN/S, 33K), which is what ours (digits-cnn, dpcnn-mnist)
are compared with.

Modules: ``plan`` (the parts, the studies, the paper's numbers), ``run`` (running the parts;
``central_runs``: one centralized run each, reused when finished; ``noise``: Fig. 1c),
``comparison`` (best-vs-best results, statistics and verdicts) and ``report`` (``report.md``,
CSVs and plots, written with ``sections`` and ``figures``).
"""

from fedsparse.lab.research.reproduction.central_runs import run_specs
from fedsparse.lab.research.reproduction.comparison import (
    ArmResult,
    Comparison,
    Convergence,
    LengthProfile,
    gain_verdict,
    still_rising,
)
from fedsparse.lab.research.reproduction.noise import measure_noise_ratio
from fedsparse.lab.research.reproduction.plan import (
    EQUIVALENCE_MARGIN,
    PAPER_MODEL,
    PAPER_NOISE_DIM,
    PAPER_TABLE2,
    PARTS,
    RISING_TOLERANCE,
    CentralSpec,
    CentralStudy,
    FederatedStudy,
    Log,
    ReproductionPlan,
)
from fedsparse.lab.research.reproduction.run import (
    Reproduction,
    run_central_study,
    run_federated_study,
    run_reproduction,
)

__all__ = [
    "EQUIVALENCE_MARGIN",
    "PAPER_MODEL",
    "PAPER_NOISE_DIM",
    "PAPER_TABLE2",
    "PARTS",
    "RISING_TOLERANCE",
    "ArmResult",
    "CentralSpec",
    "CentralStudy",
    "Comparison",
    "Convergence",
    "FederatedStudy",
    "LengthProfile",
    "Log",
    "Reproduction",
    "ReproductionPlan",
    "gain_verdict",
    "measure_noise_ratio",
    "run_central_study",
    "run_federated_study",
    "run_reproduction",
    "run_specs",
    "still_rising",
]
