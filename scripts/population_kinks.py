"""Where the population runner, Opacus and the func engine part on one client round (docs/gpu).

For 1 or 2 local epochs, with and without momentum, dense (final-rate 0), on CUDA and on the
CPU under ``exact_cudnn``: the three clients of ``tests/client/test_population.py`` (the
second padded to 600 examples: 19 steps an epoch) trained by ``client_round`` on Opacus, on
the func engine and by ``population_round``; prints each update's largest difference from
Opacus's relative to its largest value, and the three mean losses. Run from the checkout's
root (it imports the tests' helpers): ``python scripts/population_kinks.py``.
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")

from fedsparse.client.population import population_round  # noqa: E402
from fedsparse.common.models.classifiers import build_model  # noqa: E402
from fedsparse.common.wire.payload import decode_update  # noqa: E402
from tests.client.round_helpers import cfg  # noqa: E402
from tests.client.test_population import FIXED, _alone, _calls  # noqa: E402
from tests.common.dp.engine_helpers import exact_cudnn  # noqa: E402


def values(result) -> torch.Tensor:
    return decode_update(result.reply.update).values


def main() -> None:
    devices = ["cuda", "cpu"] if torch.cuda.is_available() else ["cpu"]
    for epochs, momentum in [(1, 0.0), (1, 0.9), (2, 0.0), (2, 0.9)]:
        for device in devices:
            out = {}
            for engine in ["opacus", "func"]:
                settings = {**FIXED, "final_rate": 0.0, "momentum": momentum}
                run = cfg(**settings, local_epochs=epochs, device=device, engine=engine)
                calls = _calls(run, nominal=[None, 600, None])
                with exact_cudnn():
                    out[engine] = [_alone(c) for c in calls]
                    if engine == "opacus":
                        model = build_model(run.model_name, seed=run.seed)
                        out["pop"] = population_round(calls, model=model)
            for i in range(3):
                ref = values(out["opacus"][i])
                scale = float(ref.abs().max())
                func = float((values(out["func"][i]) - ref).abs().max()) / scale
                pop = float((values(out["pop"][i]) - ref).abs().max()) / scale
                losses = "/".join(
                    f"{out[k][i].reply.train_loss:.6f}" for k in ("opacus", "func", "pop")
                )
                print(
                    f"epochs={epochs} momentum={momentum} device={device} client={i} "
                    f"func-vs-opacus={func:.1e} pop-vs-opacus={pop:.1e} loss o/f/p={losses}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
