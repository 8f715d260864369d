"""``lab/experiments/export.py``: a run's model as a state_dict that ``build_model`` loads back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fedsparse.common.config import FederatedConfig
from fedsparse.common.layout import ParamLayout
from fedsparse.common.models.classifiers import build_model
from fedsparse.lab.experiments.export import export_model, load_exported, save_trained
from fedsparse.server.checkpoint import Checkpoint


def flat(model: torch.nn.Module) -> torch.Tensor:
    return ParamLayout.from_module(model).flatten_module(model)


def federated_run(
    tmp_path: Path,
    *,
    model: str = "digits-cnn",
    weights_of: str = "",
    config: dict[str, Any] | None = None,
) -> Path:
    """A run folder whose checkpoint.pt holds the weights of build_model(seed=7) (and the
    run config ``config``, if given)."""
    cfg = (
        FederatedConfig()
        if model == "digits-cnn"
        else FederatedConfig(dataset="mnist-5k", model=model)
    )
    trained = build_model(weights_of or cfg.model_name, seed=7)
    layout = ParamLayout.from_module(trained)
    run = tmp_path / "run"
    run.mkdir()
    Checkpoint(
        round=3,
        weights=layout.flatten_module(trained),
        names=list(layout.names),
        shapes=[tuple(s) for s in layout.shapes],
        config=config or cfg.to_run_config(),
    ).save(run / "checkpoint.pt")
    return run


def test_a_federated_run_exports_its_global_model(tmp_path: Path) -> None:
    run = federated_run(tmp_path)
    exported = export_model(run, tmp_path / "model.pt")
    assert (exported["model"], exported["round"], exported["num_classes"]) == ("digits-cnn", 3, 10)
    model = load_exported(tmp_path / "model.pt")
    assert torch.equal(flat(model), flat(build_model("digits-cnn", seed=7)))
    assert not torch.equal(flat(model), flat(build_model("digits-cnn", seed=0)))
    # Plain torch: the file is a dict of tensors and names, readable without fedsparse's code.
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    fresh = build_model(saved["model"], num_classes=saved["num_classes"])
    fresh.load_state_dict(saved["state_dict"])
    assert torch.equal(flat(fresh), flat(model))


def test_a_run_recorded_before_a_refusal_still_exports(tmp_path: Path) -> None:
    """int2 with error feedback ran until it was refused (common/config_values.py): its
    checkpoints still export, by their model key."""
    config = {**FederatedConfig().to_run_config(), "value-dtype": "int2", "error-feedback": True}
    config["dp-norm-bound"] = "off"
    with pytest.raises(ValueError, match="value-dtype='int2'"):
        FederatedConfig.from_run_config(config)
    exported = export_model(federated_run(tmp_path, config=config), tmp_path / "model.pt")
    assert (exported["model"], exported["round"]) == ("digits-cnn", 3)
    model = load_exported(tmp_path / "model.pt")
    assert torch.equal(flat(model), flat(build_model("digits-cnn", seed=7)))


def test_the_whole_state_dict_travels_so_loading_is_strict(tmp_path: Path) -> None:
    # The H-CNN: its scattering filters are fixed buffers, rebuilt by the model itself.
    run = federated_run(tmp_path, model="mnist-hcnn")
    export_model(run, tmp_path / "hcnn.pt")
    saved = torch.load(tmp_path / "hcnn.pt", weights_only=True)
    assert set(saved["state_dict"]) == set(build_model("mnist-hcnn").state_dict())
    model = load_exported(tmp_path / "hcnn.pt")
    assert torch.equal(flat(model), flat(build_model("mnist-hcnn", seed=7)))


def test_a_train_run_exports_the_model_it_saved(tmp_path: Path) -> None:
    trained = build_model("digits-cnn", seed=9)
    save_trained(trained, "digits-cnn", tmp_path / "train")
    export_model(tmp_path / "train", tmp_path / "out" / "model.pt")
    assert torch.equal(flat(load_exported(tmp_path / "out" / "model.pt")), flat(trained))


def test_what_cannot_be_exported_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no checkpoint.pt .* or model.pt"):
        export_model(tmp_path, tmp_path / "model.pt")
    run = federated_run(tmp_path, weights_of="dpcnn-mnist")  # the config says digits-cnn
    with pytest.raises(ValueError, match="do not fit model='digits-cnn'"):
        export_model(run, tmp_path / "model.pt")
    with pytest.raises(ValueError, match="is a folder"):
        export_model(run, tmp_path)
    assert not list(tmp_path.glob(".*.tmp"))


def test_train_saves_its_model_and_the_cli_exports_it(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fedsparse.lab.cli import app

    run = tmp_path / "train"
    result = CliRunner().invoke(app, ["train", "--out", str(run), "--epochs", "1"])
    assert result.exit_code == 0, result.output
    assert (run / "model.pt").is_file()
    out = tmp_path / "exported.pt"
    result = CliRunner().invoke(app, ["export", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    model = load_exported(out)
    saved = torch.load(run / "model.pt", weights_only=True)
    assert torch.equal(flat(model), ParamLayout.from_module(model).flatten(saved["state_dict"]))
    assert not torch.equal(flat(model), flat(build_model("digits-cnn", seed=0)))
    result = CliRunner().invoke(app, ["export", str(tmp_path), "--out", str(out)])
    assert result.exit_code == 2
    assert "no checkpoint.pt" in " ".join(result.output.replace("│", " ").split())


def test_a_file_naming_a_user_model_builds_it_only_if_listed(tmp_path: Path) -> None:
    # A model file from someone else must not choose code to import and call.
    trained = build_model("digits-cnn", seed=9)
    save_trained(trained, "digits-cnn", tmp_path)
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    torch.save({**saved, "model": "os:system"}, tmp_path / "hostile.pt")
    with pytest.raises(ValueError, match="model='os:system' is a user's model"):
        load_exported(tmp_path / "hostile.pt")
