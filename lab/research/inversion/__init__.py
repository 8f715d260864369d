"""Gradient inversion against RS-sparsified (DP-)SGD updates: RS paper Sec. 5, Thm 5.1, Fig. 5.

Two attacks on one client's update, and the experiment that puts them side by side with the
paper's claim that random sparsification (RS) raises the reconstruction error.

* ``invert_gradients``: Inverting Gradients (IG, Geiping et al. 2020). The attacker holds the
  model at the round's weights, the victim's observed gradient (``-update / lr``), the round's
  public mask and the victim's label (known, as IG's reference code ``inversefed`` takes it;
  ``infer_label`` is the iDLG alternative, reported as a diagnostic). It optimizes a dummy
  image with Adam (signed gradients, step decay at 3/8, 5/8, 7/8 of the iterations, pixels
  boxed to ``[0, 1]``) on ``1 - cos(grad(dummy)[S], observed[S]) + tv_weight * TV(dummy)``,
  where ``S`` is the mask's support: off-mask coordinates of an RS update carry neither data
  nor noise, so the attack reads only ``observed[S]``. With restarts it keeps the one with
  the lowest final objective.
* ``linear_attack``: the closed-form attack of Thm 5.1 (Zhu & Blaschko 2021, Eq. 15): least
  squares on ``m * K x = m * (g + xi)``. Given the mask, its error is
  ``sigma^2 tr((K_m^T K_m)^-1)`` in expectation (``linear_attack_expected_error``; for a scalar
  ``x``, ``sigma^2 / ||m * k||^2``, the paper's Eq. 110), bounded below over masks by Eq. 17,
  ``sigma^2 / ((1 - r) ||k||^2)`` (``theorem51_lower_bound``). The paper's ``1 - r`` is the
  expected kept fraction; our masks keep exactly ``keep = d - floor(r d)`` coordinates, so the
  bound uses ``keep / d``, which equals ``1 - r`` when ``r d`` is an integer.

The victim's update comes from the repository's mechanism itself (``victim_update``): one
step of ``SparseDPOptimizer`` (per-sample gradient -> mask -> clip at C -> sum -> noise
``m * N(0, (sigma C)^2)`` -> scale) on a batch of one, then the SGD update, as a client sends.

A reference cell, the null (``NULL_LABEL``), runs the same attack on ``m * xi`` alone (the
DP mechanism's limit sigma -> infinity: the victim's own noise draw, no data): a cell leaks
only where its MSE is below the null's at the same r. The design is paired: per image, one
mask seed for every r and one noise draw for every setting (``AttackStream``).

Reconstruction error is measured in the data's pixel scale, ``[0, 1]`` (digits' 0..16 ink
levels divided by 16), as ``MSE = mean((x_hat - x)^2)`` over the 64 pixels and
``PSNR = 10 log10(1 / MSE)`` dB.

Entry points: ``python -m fedsparse.lab.research.inversion --out docs/reconstruction`` and
``fedsparse reconstruct --out DIR`` run the grid r x {non-private, the paper's fixed noise
N(0, 1e-3), DP at each epsilon} on digits test images and write ``results.csv``,
``mse_vs_rate.png``, ``examples.png`` and ``report.md``.

Modules: ``attack`` (the two attacks and the victim), ``grid`` (the experiment: settings,
seed streams, tuning, ``run``), ``report`` (summaries, verdicts, plots, ``report.md``) and
``__main__`` (the ``-m`` entry point).

References:
    J. Geiping, H. Bauermeister, H. Droege, M. Moeller. "Inverting Gradients - How easy is it
    to break privacy in federated learning?". NeurIPS 2020. arXiv:2003.14053.
    B. Zhao, K. R. Mopuri, H. Bilen. "iDLG: Improved Deep Leakage from Gradients". 2020.
    arXiv:2001.02610.
    J. Zhu, M. Blaschko. "R-GAP: Recursive Gradient Attack on Privacy". ICLR 2021.
    arXiv:2010.07733.
    J. Zhu, M. Blaschko. "Improving Differentially Private SGD via Randomly Sparsified
    Gradients". TMLR 2023. arXiv:2112.00845 (Sec. 5, Thm 5.1, App. D, Fig. 5).
"""

from fedsparse.lab.research.inversion.attack import (
    InversionConfig,
    PixelScale,
    PrivacySetting,
    Reconstruction,
    flat_gradient,
    infer_label,
    invert_gradients,
    linear_attack,
    linear_attack_expected_error,
    reconstruction_error,
    theorem51_lower_bound,
    total_variation,
    victim_update,
)
from fedsparse.lab.research.inversion.grid import (
    NULL_LABEL,
    AttackRow,
    AttackStream,
    ExperimentConfig,
    Results,
    attack_one,
    privacy_settings,
    run,
    single_step_epsilon,
    tune_tv_weight,
)
from fedsparse.lab.research.inversion.report import (
    CellSummary,
    LinearCheck,
    plot_examples,
    plot_mse,
    summarize,
    theorem51_check,
    verdict,
    write_csv,
    write_outputs,
    write_report,
)

__all__ = [
    "NULL_LABEL",
    "AttackRow",
    "AttackStream",
    "CellSummary",
    "ExperimentConfig",
    "InversionConfig",
    "LinearCheck",
    "PixelScale",
    "PrivacySetting",
    "Reconstruction",
    "Results",
    "attack_one",
    "flat_gradient",
    "infer_label",
    "invert_gradients",
    "linear_attack",
    "linear_attack_expected_error",
    "plot_examples",
    "plot_mse",
    "privacy_settings",
    "reconstruction_error",
    "run",
    "single_step_epsilon",
    "summarize",
    "theorem51_check",
    "theorem51_lower_bound",
    "total_variation",
    "tune_tv_weight",
    "verdict",
    "victim_update",
    "write_csv",
    "write_outputs",
    "write_report",
]
