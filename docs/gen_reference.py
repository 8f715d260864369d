"""Writes the reference pages for every configuration key from the code's own metadata.

- ``docs/reference/run-config.md``: ``FederatedConfig``'s fields
  (``common/config.py``), the keys of ``[tool.flwr.app.config]``; type and default
  from the dataclass, the accepted names from the config's own table of named fields
  (``common/config_keys.py``), the meaning from the field's comments in the source (inline,
  else the comment directly above it), else from ``MEANINGS`` below.
- ``docs/reference/node-policy.md`` and ``node-data.md``: ``NodePolicy`` and ``NodeData``'s
  fields (``client/node_policy.py``, ``client/node_data.py``), the meaning from the key table
  in each module's docstring.

``python docs/gen_reference.py`` rewrites the pages; ``--check`` exits 1 when a committed page
differs from what the code gives (``tests/test_docs.py`` runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import re
import sys
import tokenize
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from fedsparse.client import node_data, node_policy
from fedsparse.common import config, config_keys
from fedsparse.common.models.classifiers import MODEL_NAMES

OUT = Path(__file__).resolve().parent / "reference"

#: Where a run-config section starts (the key it starts at) and its title.
SECTIONS: dict[str, str] = {
    "num-rounds": "Federation",
    "local-epochs": "Local optimisation",
    "engine": "Local performance",
    "mechanism": "Privacy (sample level)",
    "dp-level": "User-level DP (DP-FedAvg)",
    "final-rate": "Sparsification",
    "method": "Methods",
    "codec": "Transport",
    "dataset": "Data and model",
    "weighting": "The server against its clients",
    "save-updates": "Records and resume",
}

#: Meanings of the run-config keys whose field has no comment in ``common/config.py``, or
#: whose comment describes its section rather than the key. The one place such text lives.
MEANINGS: dict[str, str] = {
    "num-rounds": "Federated rounds. Under a target epsilon, sigma is calibrated for this "
    "horizon, so it changes every round's noise.",
    "clients-per-round": "Clients sampled per round; 0: every connected client (under "
    "dp-level=user, >= 1: the expected users per round).",
    "min-clients": "Clients that must be connected before a round starts; `simulate --clients` "
    "and `deploy --nodes` below it are refused before anything starts.",
    "round-timeout": "Seconds the server waits for a round's replies; a node that heartbeats "
    "but never answers counts as missing after it.",
    "local-epochs": "Local epochs of DP-SGD per client and round.",
    "batch-size": "Expected batch size of Poisson sampling (sample rate q = batch-size / n).",
    "lr": "Local SGD learning rate (the baseline's best on validation at 10 rounds).",
    "momentum": "Local SGD momentum (0 <= momentum < 1); every round starts a fresh optimizer.",
    "engine": "The per-sample-gradient engine: `auto` is `factored` on the CPU and `func` on "
    "CUDA where it supports the model, else `opacus` (bit for bit Opacus's own step); or a "
    "user's `EngineSpec` as `package.module:attribute` (a deployed node imports it only if "
    "its policy's `plugin-engines` lists it; docs/explanation/architecture.md, \"Where to "
    'add").',
    "device": "Where clients train: `auto` is CUDA if the client has one; `cuda` without one "
    "is a client error naming the key.",
    "mechanism": "`dpsgd` (clip + noise); `clipped` and `noisy` are the RS paper's "
    "non-private ablations (epsilon is inf).",
    "max-grad-norm": "Per-sample clipping bound C (the norm of the masked gradient).",
    "noise-multiplier": "sigma, used when target-epsilon is 0 (or the mechanism is not `dpsgd`).",
    "target-epsilon": "Sample-level epsilon each client calibrates sigma for over the run "
    "(> 0 wins over noise-multiplier; 0: use noise-multiplier).",
    "delta": "The delta of every reported epsilon.",
    "accountant": "Opacus accountant that calibrates sigma and reports epsilon.",
    "secure-mode": "Opacus's hardened noise from an OS-entropy generator (refuses user "
    "seeds); also the server's central noise under dp-level=user.",
    "dp-level": "`sample`: local DP-SGD on every client; `user`: DP-FedAvg, the server clips "
    "each update to central-clip and adds central noise, the clients add none.",
    "central-noise-multiplier": "dp-level=user: sigma of the server's Gaussian noise, in "
    "units of central-clip.",
    "central-clip": "dp-level=user: the L2 bound S the server clips each user's update to.",
    "secure-aggregation": "dp-level=user without a trusted server: the server decodes only "
    "the round's sum over the shared mask; each client clips its update to central-clip and "
    "adds its share of the central noise (docs/explanation/secure-aggregation.md).",
    "secagg-colluders": "secure-aggregation: the clients that may collude with the server; the "
    "threshold t is the smallest with 2t - n above it (each node's policy sets its own floor).",
    "secagg-neighbours": "secure-aggregation: each node's neighbours in a sparse ring "
    "(SecAgg+: it masks and shares its secrets with these only; an even k, at most "
    "clients-per-round - 2, fedsparse.common.aggregation.graph.sparse_degree suggests one); "
    "0: the complete graph.",
    "secagg-ring-bits": "secure-aggregation: the width b of a small ring for the masked values "
    "(flattened by a public rotation, rounded conditionally on a norm bound, wrapping allowed: "
    "docs/explanation/secure-aggregation.md); 0: the exact ring, as wide as its wrap bound "
    "needs.",
    "central-noise": "dp-level=user: where the server's noise comes from: `fresh` from OS "
    "entropy; `seeded` from the run seed, reproducible and not secret (simulations only).",
    "final-rate": "r*: the share of coordinates dropped once the schedule reaches its end "
    "(0 <= r < 1; 0 is no sparsification).",
    "schedule": "How the rate rises over rounds (`gradual`: r(t) = r* (t-1)/(R-1), the RS "
    "paper's gradual cooling).",
    "cooling-rounds": "Rounds over which the rate cools (random-freeze's e*).",
    "initial-keep": "Kept fraction at the start of a keep schedule.",
    "final-keep": "Kept fraction at the end of a keep schedule.",
    "mask-scope": "`round`: one public mask per round for every client; `client`: one per "
    "client and round.",
    "method": "Which coordinates train: `rs` (default), `random-freeze`, `lf`, `ranked`, "
    "`dpssgd`, `gip`, `random-k` (see the methods page).",
    "freeze-layers": "lf: m_f, how many of the first layers are frozen.",
    "freeze-after": "lf: the 0-based round from which those layers are frozen (round "
    "freeze-after + 1); before it every layer trains.",
    "codec": "How a sparse update's support travels: `values` regenerates it from the "
    "broadcast seed (0 index bytes); `coo`, `delta`, `bitmap` send it; `auto` the smallest.",
    "value-dtype": "Bytes per value on the wire: `fp32` 4, `fp16`/`bf16` 2, `int8` 1 "
    "(symmetric, one float32 scale per update); `int4`/`int2`/`int1` 4/2/1 bits, "
    "stochastically rounded (unbiased), plus a float32 step per `value-block` values.",
    "compression": "`zstd` packs the index and value sections as one zstd frame each.",
    "dataset": "Training data (see Data and models); digits is embedded.",
    "data-dir": "Folder holding the dataset's files ('' for the embedded ones).",
    "partitioner": "How the training split is cut into client partitions (flwr-datasets).",
    "dirichlet-alpha": "Label skew of partitioner=dirichlet (smaller is more skewed).",
    "seed": "The run's seed: partitions, mask seeds, sampling and (simulation) seeded noise.",
    "out-dir": "Where the run's records go (rounds.jsonl, summary.json, checkpoint.pt); the "
    "CLI's `--out`.",
    "weighting": "`uniform`: every accepted update weighs 1, so a client cannot buy influence "
    "with num-examples; `examples` trusts the claimed counts (trusted silos, simulation).",
    "max-norm-ratio": "Reject (or clip) an update whose L2 norm exceeds this many times the "
    "round's median update norm, from 3 updates on; 0: off.",
    "aggregator": "`mean`, `trimmed-mean` (trim-fraction at each end, per coordinate) or "
    "`median`; the robust ones weigh every update equally.",
    "norm-action": "What happens to an update over the norm bound: `reject` it, or `clip` it "
    "to the bound.",
}

#: Node-data keys whose docstring row reads on into the next row's (one phrase for two keys).
NODE_MEANINGS: dict[str, str] = {
    "partition-id": "which part of the dataset's training split this node holds (0-based, "
    "below `num-partitions`)",
    "num-partitions": "into how many parts the training split is cut",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page is stale")
    args = parser.parse_args(argv)
    stale = []
    for name, text in pages().items():
        path = OUT / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python docs/gen_reference.py", file=sys.stderr)
        return 1
    return 0


def pages() -> dict[str, str]:
    """The reference pages by file name."""
    return {
        "run-config.md": run_config_page(),
        "cli.md": cli_page(),
        "node-policy.md": node_page(
            node_policy,
            node_policy.NodePolicy,
            title="Node policy keys",
            intro="What a data owner allows, whatever the server asks "
            "(`client/node_policy.py`). Set them as node config keys of `fedsparse node`, "
            "in a TOML `policy-file`, or (simulation) in `$FEDSPARSE_NODE_POLICY`; an "
            "unknown key that looks like a policy key is an error.",
        ),
        "node-data.md": node_page(
            node_data,
            node_data.NodeData,
            title="Node data keys",
            intro="The data a node's owner declares it holds (`client/node_data.py`), in "
            "the same node config as its policy. On a deployed node the declaration alone "
            "chooses the examples.",
        ),
    }


# --- run config ------------------------------------------------------------------------------


def run_config_rows() -> list[dict[str, str]]:
    """One row per ``FederatedConfig`` field: key, section, type, default, values, meaning."""
    comments = field_comments(config.FederatedConfig)
    named: dict[str, tuple[str, ...]] = dict(config_keys.NAMED_FIELDS)
    named["model"] = ("", *MODEL_NAMES)
    rows = []
    section = ""
    for field in config.run_config_fields():
        key = field.name.replace("_", "-")
        section = SECTIONS.get(key, section)
        values = named.get(field.name)
        rows.append(
            {
                "key": key,
                "section": section,
                "type": "name" if values else type(field.default).__name__,
                "default": toml_value(field.default),
                "values": ", ".join(f"`{v}`" if v else "`''`" for v in values) if values else "",
                "meaning": MEANINGS.get(key) or comments.get(field.name, ""),
            }
        )
    return rows


def run_config_page() -> str:
    lines = [
        "# Run-config keys",
        "",
        "<!-- generated by docs/gen_reference.py from common/config.py: do not edit -->",
        "",
        "Every key of `[tool.flwr.app.config]` in `pyproject.toml`, with its default. Set them",
        "with `fedsparse simulate|deploy|sweep --set key=value` or `flwr run --run-config`;",
        "both apps parse them with `FederatedConfig.from_run_config` (field `x_y` is key `x-y`),",
        "so an unknown key or a bad value is one line naming the key and the value, before",
        "anything starts. A resumed run may change only "
        + ", ".join(f"`{k}`" for k in sorted(config.RESUME_MAY_DIFFER))
        + ".",
        "",
    ]
    section = None
    for row in run_config_rows():
        if row["section"] != section:
            section = row["section"]
            lines += [
                f"## {section}",
                "",
                "| key | type | default | meaning |",
                "|---|---|---|---|",
            ]
        meaning = row["meaning"]
        if row["values"]:
            one_of = "Built-in names:" if row["key"] == "engine" else "One of"  # and plug-ins
            meaning += ("" if meaning.endswith(".") else ".") + f" {one_of} {row['values']}."
        lines.append(f"| `{row['key']}` | {row['type']} | `{row['default']}` | {cell(meaning)} |")
    return "\n".join(_close_tables(lines)) + "\n"


def _close_tables(lines: list[str]) -> list[str]:
    """A blank line before each heading that follows a table."""
    out: list[str] = []
    for line in lines:
        if line.startswith("## ") and out and out[-1]:
            out.append("")
        out.append(line)
    return out


def field_comments(cls: type) -> dict[str, str]:
    """The comment of each dataclass field in ``cls``'s source: the one on its line, else the
    comment block directly above it (one that is not followed by another field first)."""
    source = inspect.getsource(cls)
    by_line: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            by_line[token.start[0]] = token.string.lstrip("#").strip()
    field_line = re.compile(r"^    (\w+): [^=]+=")
    result: dict[str, str] = {}
    block: list[str] = []
    for number, line in enumerate(source.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("def "):
            break
        if stripped.startswith("#"):
            block.append(by_line.get(number, ""))
            continue
        match = field_line.match(line)
        if match:
            inline = by_line.get(number, "")
            text = inline or " ".join(block)
            if text:
                result[match.group(1)] = text
        block = []
    return result


# --- node policy and node data ---------------------------------------------------------------


def docstring_table(module: ModuleType) -> dict[str, tuple[str, str]]:
    """The ``key / default / meaning`` RST table of ``module``'s docstring, by key."""
    lines = (module.__doc__ or "").splitlines()
    rules = [i for i, line in enumerate(lines) if re.fullmatch(r"=+( +=+)+", line)]
    first, header_end, last = rules[0], rules[1], rules[2]
    starts = [m.start() for m in re.finditer(r"=+", lines[first])]
    table: dict[str, list[list[str]]] = {}
    key = ""
    for line in lines[header_end + 1 : last]:
        row = re.match(r"``([\w-]+)``\s+(\S+(?: \S+)*?)(?:\s{2,}(.*))?$", line)
        if row:
            key = row.group(1)
            table[key] = [[row.group(2)], [row.group(3) or ""]]
        elif key:
            table[key][0].append(line[starts[1] : starts[2]].strip())
            table[key][1].append(line[starts[2] :].strip())
    return {
        k: ("".join(d for d in default if d), " ".join(m for m in meaning if m))
        for k, (default, meaning) in table.items()
    }


def node_rows(module: ModuleType, cls: type) -> list[dict[str, str]]:
    """One row per field of ``cls``, the meaning from ``module``'s docstring table."""
    table = docstring_table(module)
    keys = [f.name.replace("_", "-") for f in dataclasses.fields(cls)]
    if set(table) != set(keys):
        raise ValueError(
            f"{module.__name__}: docstring table keys {sorted(table)} != fields {sorted(keys)}"
        )
    rows = []
    for field, key in zip(dataclasses.fields(cls), keys, strict=True):
        default = field.default
        rows.append(
            {
                "key": key,
                "type": _annotation(field.type),
                "default": "(required)"
                if default is dataclasses.MISSING
                else f"`{toml_value(default)}`",
                "meaning": NODE_MEANINGS.get(key) or table[key][1],
            }
        )
    return rows


def node_page(module: ModuleType, cls: type, *, title: str, intro: str) -> str:
    lines = [
        f"# {title}",
        "",
        f"<!-- generated by docs/gen_reference.py from {module.__name__}: do not edit -->",
        "",
        intro,
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for row in node_rows(module, cls):
        lines.append(
            f"| `{row['key']}` | {row['type']} | {row['default']} | {cell(row['meaning'])} |"
        )
    return "\n".join(lines) + "\n"


# --- command line ----------------------------------------------------------------------------


def cli_page() -> str:
    """Every ``fedsparse`` command with its options, from the Typer app itself."""
    import click
    import typer.main

    from fedsparse.lab.cli import app

    group = typer.main.get_command(app)
    assert isinstance(group, click.Group)
    lines = [
        "# Command line",
        "",
        "<!-- generated by docs/gen_reference.py from fedsparse.lab.cli: do not edit -->",
        "",
        "`fedsparse --help` lists the commands and `fedsparse COMMAND --help` their options;",
        "`fedsparse --debug COMMAND` shows a traceback where a user error is one line.",
        "",
    ]
    for name, command in group.commands.items():
        help_text = re.sub(r"\s*\n\s*", " ", (command.help or "").split("\n\n")[0]).strip()
        lines += [f"## `fedsparse {name}`", "", cell(help_text), ""]
        rows = []
        for param in command.params:
            if isinstance(param, click.Option) and param.hidden:
                continue  # kept for old command lines, not documented
            if not isinstance(param, click.Option):
                rows.append(f"| `{str(param.name).upper()}` (argument) | | |")
                continue
            names = ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
            default = param.default
            hidden = default is None or default is False or callable(default)
            shown = "" if hidden or default in ((), []) else f"`{default}`"
            rows.append(f"| {names} | {shown} | {cell(' '.join((param.help or '').split()))} |")
        if rows:
            lines += ["| option | default | meaning |", "|---|---|---|", *rows, ""]
    return "\n".join(lines).rstrip("\n") + "\n"


# --- formatting ------------------------------------------------------------------------------


def toml_value(value: Any) -> str:
    """``value`` as a node config / run config literal."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return toml_value(",".join(value))
    return repr(value)


def cell(text: str) -> str:
    """``text`` for a Markdown table cell: RST literals as code, pipes escaped."""
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return text.replace("|", "\\|").strip()


def _annotation(annotation: Any) -> str:
    text = str(annotation)
    simple = {"DatasetName": "name", "PartitionerName": "name", "NoiseSource": "name"}
    text = simple.get(text, text)
    return "comma-separated list" if text.startswith("tuple[") else text


def documented_keys(rows: Iterable[dict[str, str]]) -> set[str]:
    return {row["key"] for row in rows}


if __name__ == "__main__":
    sys.exit(main())
