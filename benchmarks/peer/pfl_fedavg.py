"""pfl-research's side of ``benchmarks/peer_pfl.py``: FedAvg of the digits CNN in pfl 0.6.

Run with the pfl venv's Python (``benchmarks/peer/setup-pfl.sh``), on the data file the driver
writes (every client's partition, the test split and the initial weights, all fedsparse's), so
both simulators train the same model from the same weights on the same examples. Prints one
JSON line: each round's seconds (local training of every client, aggregation and the central
evaluation on the test split, as fedsparse's ``wall_seconds``) and each round's test accuracy.

Usage: .venv-pfl/bin/python benchmarks/peer/pfl_fedavg.py --data FILE.npz --rounds 5
           [--lr 0.25] [--batch-size 32] [--epochs 1]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from pfl.aggregate.simulate import SimulatedBackend
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.callback.central_evaluation import CentralEvaluationCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Weighted
from pfl.model.pytorch import PyTorchModel
from torch import nn


class DigitsCNN(nn.Module):
    """fedsparse's ``digits-cnn`` (``common/models/classifiers.py``), with pfl's two methods."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1),
            nn.Tanh(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.Tanh(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.Tanh(), nn.Linear(64, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
        self.eval() if eval else self.train()
        return nn.functional.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict:
        self.eval()
        logits = self(x)
        correct = int((logits.argmax(dim=1) == y).sum())
        return {"accuracy": Weighted(correct, len(y))}


class RoundClock(TrainingProcessCallback):
    """Each central iteration's seconds, from the end of the previous one."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._last = time.perf_counter()

    def on_train_begin(self, *, model):  # noqa: ANN001
        self._last = time.perf_counter()
        return super().on_train_begin(model=model)

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):  # noqa: ANN001
        now = time.perf_counter()
        self.seconds.append(now - self._last)
        self._last = now
        return False, aggregate_metrics.__class__()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.25)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(1)  # pfl's simulation runs one process here, one thread
    data = np.load(args.data)
    clients = int(data["clients"])
    users = {
        i: [torch.from_numpy(data[f"x{i}"]), torch.from_numpy(data[f"y{i}"])]
        for i in range(clients)
    }
    sampler = get_user_sampler("minimize_reuse", list(range(clients)))
    train = FederatedDataset.from_slices(users, sampler)
    test = Dataset(raw_data=[torch.from_numpy(data["x_test"]), torch.from_numpy(data["y_test"])])
    module = DigitsCNN()
    module.load_state_dict(
        {k[len("w:") :]: torch.from_numpy(data[k]) for k in data if k.startswith("w:")}
    )
    model = PyTorchModel(
        model=module,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
    )
    clock = RoundClock()
    evaluation = CentralEvaluationCallback(
        test, model_eval_params=NNEvalHyperParams(local_batch_size=1024)
    )
    accuracies: list[float] = []

    class Accuracy(TrainingProcessCallback):
        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):  # noqa: ANN001
            for name, value in aggregate_metrics:
                if str(name) == "Central val | accuracy":
                    accuracies.append(float(getattr(value, "overall_value", value)))
            return False, aggregate_metrics.__class__()

    backend = SimulatedBackend(training_data=train, val_data=None)
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=args.rounds,
            # pfl evaluates every user before and after its training in the iterations this
            # divides (iteration 0 always): fedsparse does not, so not after round 1
            evaluation_frequency=args.rounds + 1,
            train_cohort_size=clients,
            val_cohort_size=0,
        ),
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_num_epochs=args.epochs,
            local_learning_rate=args.lr,
            local_batch_size=args.batch_size,
        ),
        # no model_eval_params: pfl would evaluate every user before and after training
        callbacks=[evaluation, Accuracy(), clock],
    )
    print(
        json.dumps(
            {
                "round_seconds": clock.seconds,
                "accuracy": accuracies,
                "total_s": time.perf_counter() - started,
            }
        )
    )


if __name__ == "__main__":
    main()
