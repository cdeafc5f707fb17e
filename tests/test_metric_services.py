"""The tracking services' metric writers: an offline W&B run and an MLflow run (its SQLite store in the run
directory) hold exactly the rows of metrics.jsonl, read back through W&B's record format and MLflow's own client;
a resumed run directory continues the same service run; `jaxnn train --metrics wandb mlflow` writes both; a
missing library is one line naming its extra; importing jaxnn imports neither library."""

from __future__ import annotations

import json
import pathlib
import struct
import subprocess
import sys

import numpy as np
import optax
import pytest

import jaxnn
from jaxnn import cli
from jaxnn import layers as L
from jaxnn.config import ConfigError, FitConfig
from jaxnn.metric_services import flat_params
from jaxnn.metrics import read_jsonl

pytest.importorskip("wandb")
pytest.importorskip("mlflow")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline and quiet, every file of both services under tmp_path, none of the user's settings."""
    monkeypatch.chdir(tmp_path)
    for name in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_API_KEY", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    return tmp_path


def small_fit(run_dir, metrics, steps=12, **settings):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    model = L.serial(L.Dense(8), L.Relu, L.Dense(2))
    return jaxnn.fit(
        model,
        (x, y),
        eval_data=(x, y),
        optimizer=optax.adam(1e-2),  # a schedule independent of `steps`, so the run can be resumed longer
        steps=steps,
        batch_size=16,
        log_every=3,
        eval_every=6,
        run_dir=str(run_dir),
        metrics=metrics,
        progress=False,
        plots=False,
        **settings,
    )


def expected_by_step(run_dir) -> dict[int, dict[str, float]]:
    """metrics.jsonl's rows as `{step: {"<split>/<metric>": value}}`: what both services should hold."""
    by_step: dict[int, dict[str, float]] = {}
    for row in read_jsonl(pathlib.Path(run_dir) / "metrics.jsonl"):
        values = by_step.setdefault(row["step"], {})
        for name, value in row.items():
            if name not in ("split", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                values[f"{row['split']}/{name}"] = float(value)
    return by_step


# ------------------------------------------------------------------------------------------------------- W&B


def wandb_records(path: pathlib.Path):
    """The records of a `run-<id>.wandb` file, read here from its documented layout rather than through wandb:
    a 7-byte header (":W&B", magic 0xBEE1, version), then LevelDB log blocks of 32 KiB holding records
    (crc32c, length, type: 1 whole, 2 first, 3 middle, 4 last) of serialised `wandb_internal_pb2.Record`s."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B" and struct.unpack("<H", raw[4:6])[0] == 0xBEE1
    pos, block, data = 7, 32768, b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):  # the padding at a block's end
            pos += left
            continue
        data += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            data = b""
            yield record


def wandb_history(run_folder: pathlib.Path) -> tuple[str, dict, dict[int, dict[str, float]]]:
    """(run id, config, {step: metrics}) of one offline run folder."""
    (path,) = run_folder.glob("run-*.wandb")
    run_id, config, history = "", {}, {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update if u.key != "_wandb"}
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[items.pop("_step")] = {k: v for k, v in items.items() if not k.startswith("_")}
    return run_id, config, history


@pytest.mark.slow  # the services' start: W&B's service process, MLflow's database tables
def test_an_offline_wandb_run_holds_the_rows_and_config_and_a_resume_continues_its_id(offline):
    run = offline / "runs" / "w"
    small_fit(run, ["wandb"])
    owner = json.loads((run / "jaxnn-owner.json").read_text())
    (first,) = sorted((run / "wandb").glob("offline-run-*"))
    run_id, config, history = wandb_history(first)
    assert run_id == owner["run_id"]
    assert config == json.loads((run / "config.json").read_text())
    assert history == expected_by_step(run)  # train and eval rows of a step merged into one, values exact

    small_fit(run, ["wandb"], steps=18, resume=True)
    later = [f for f in (run / "wandb").glob("offline-run-*") if f != first]
    assert len(later) == 1, later
    resumed_id, _, resumed = wandb_history(later[0])
    assert resumed_id == run_id  # `wandb sync` appends it to the same run
    whole = expected_by_step(run)
    assert resumed == {step: whole[step] for step in (15, 18)}  # the steps after the checkpoint at 12
    assert not (offline / "wandb").exists() and not (offline / "mlruns").exists()


# ---------------------------------------------------------------------------------------------------- MLflow


def mlflow_run(run_dir):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{pathlib.Path(run_dir).absolute() / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("jaxnn").experiment_id])
    assert len(runs) == 1, runs
    return client, runs[0]


def mlflow_by_step(client, run) -> dict[int, dict[str, float]]:
    by_step: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            by_step.setdefault(metric.step, {})[key] = metric.value
    return by_step


@pytest.mark.slow  # the services' start: W&B's service process, MLflow's database tables
def test_an_mlflow_run_holds_the_rows_exactly_and_the_config_as_params_and_a_resume_continues_it(offline):
    run = offline / "runs" / "m"
    small_fit(run, ["mlflow"])
    client, found = mlflow_run(run)
    config = json.loads((run / "config.json").read_text())
    assert found.info.status == "FINISHED" and found.info.run_name == "m"
    assert found.data.tags["jaxnn_run_id"] == json.loads((run / "jaxnn-owner.json").read_text())["run_id"]
    flat, pending = {}, list(config.items())  # the config's leaves under dotted paths, breadth first
    while pending:
        key, value = pending.pop()
        if isinstance(value, dict) and value:
            pending += [(f"{key}.{k}", v) for k, v in value.items()]
        else:
            flat[key] = str(value)
    assert len(flat) > len(config) and found.data.params == flat
    assert "train/loss" in found.data.metrics and "eval/accuracy" in found.data.metrics
    assert mlflow_by_step(client, found) == expected_by_step(run)

    small_fit(run, ["mlflow"], steps=18, resume=True)
    client, resumed = mlflow_run(run)
    assert resumed.info.run_id == found.info.run_id and resumed.info.status == "FINISHED"
    assert mlflow_by_step(client, resumed) == expected_by_step(run)
    assert not (offline / "mlruns").exists() and not (offline / "wandb").exists()


@pytest.mark.slow  # the services' start: W&B's service process, MLflow's database tables
def test_a_failing_run_ends_its_mlflow_run_as_failed(offline):
    from jaxnn.callbacks import Callback

    class Boom(Callback):
        def on_step(self, run, step, metrics):
            if step == 4:
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        small_fit(offline / "runs" / "f", ["mlflow"], callbacks=[Boom()])
    _, found = mlflow_run(offline / "runs" / "f")
    assert found.info.status == "FAILED"


def test_flat_params_joins_nested_keys_with_dots_and_keeps_to_mlflows_names():
    assert flat_params({"a": 1, "b": {"c": [1, 2], "d": {"e": None}}, "f": {}}) == {
        "a": "1",
        "b.c": "[1, 2]",
        "b.d.e": "None",
        "f": "{}",
    }
    rules = {"sharding_rules": {"*1_dense.w": [None, "tensor"]}, "x" * 300: "y" * 7000}
    assert flat_params(rules) == {"sharding_rules._1_dense.w": "[None, 'tensor']", "x" * 250: "y" * 6000}


@pytest.mark.slow  # MLflow's database tables
def test_mlflow_takes_a_config_with_a_sharding_rules_names(offline):
    from mlflow.tracking import MlflowClient

    from jaxnn.metric_services import MlflowWriter

    config = {"sharding_rules": {"*1_dense.w": [None, "tensor"]}, "lr": 0.1}
    writer = MlflowWriter(offline / "r", run_id="abc", name="r", config=config)
    writer.write({"split": "eval", "step": 3, "accuracy": 0.5, "flag": True, "note": "text"})
    writer.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{offline / 'r' / 'mlflow.db'}")
    run = client.get_run(writer.run_id)
    assert run.data.params == {"sharding_rules._1_dense.w": "[None, 'tensor']", "lr": "0.1"}
    assert run.data.metrics == {"eval/accuracy": 0.5} and run.info.status == "FINISHED"


# ---------------------------------------------------------------------------------------------- the command


@pytest.mark.slow  # the services' start: W&B's service process, MLflow's database tables
def test_jaxnn_train_writes_both_services(offline, capsys):
    run = offline / "run"
    argv = ["train", "--model", "mlp", "--size", "small", "--steps", "4", "--batch-size", "16", "--log-every", "2"]
    argv += ["--no-progress", "--no-summary", "--no-plots", "--run-dir", str(run), "--metrics", "wandb", "mlflow"]
    assert cli.main(argv) == 0
    (folder,) = (run / "wandb").glob("offline-run-*")
    assert wandb_history(folder)[2] == expected_by_step(run)
    client, found = mlflow_run(run)
    assert mlflow_by_step(client, found) == expected_by_step(run)


# --------------------------------------------------------------------------------------------- without them


@pytest.mark.parametrize("writer, library", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_missing_library_is_one_line_naming_its_extra_before_anything_is_written(
    writer, library, monkeypatch, capsys, tmp_path
):
    monkeypatch.setitem(sys.modules, library, None)  # as if not installed
    line = f"metric writer '{writer}' needs {library}: pip install 'jaxnn[{writer}]'"
    with pytest.raises(ConfigError) as refused:
        FitConfig(metrics=(writer,))
    assert str(refused.value) == f"fit: {line}"
    run = tmp_path / "run"
    assert cli.main(["train", "--model", "mlp", "--run-dir", str(run), "--metrics", writer]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith(line), err
    assert not run.exists()


@pytest.mark.system  # starts a process
def test_importing_jaxnn_imports_neither_library():
    code = (
        "import sys, jaxnn, jaxnn.metrics, jaxnn.metric_services, jaxnn.loop; "
        "jaxnn.metrics.check_writer_names(['wandb', 'mlflow']); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'mlflow')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
