"""`jaxnn train`: bad input refused with one line and exit 2 before anything is written; small real runs write
metrics, plots and a summary, train data-parallel, and print a gpt sample."""

import gzip
import json
import pathlib

import numpy as np
import pytest

from jaxnn import cli
from jaxnn.cli.config import TrainConfig, parse_model_config
from jaxnn.cli.train import config_from_args
from jaxnn.config import ConfigError

QUICK = ["--size", "small", "--steps", "24", "--batch-size", "16", "--log-every", "8", "--no-progress", "--no-summary"]


def refused(capsys, argv, match):
    assert cli.main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxnn: error: ") and "\n" not in err, err
    assert match in err, err
    return err


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--model", "transformer"], "unknown model 'transformer'"),
        (["--precision", "fp4"], "unknown precision 'fp4'"),
        (["--devices", "3", "--batch-size", "16"], "batch size 16 is not divisible by the 3 devices"),
        (["--steps", "0"], "steps must be a positive integer, got 0"),
        (["--lr", "-0.1"], "lr must be a positive number, got -0.1"),
        (["--dataset", "imagenet"], "unknown data set 'imagenet'"),
        (["--model", "gpt", "--dataset", "digits"], "model 'gpt' cannot train on data set 'digits'"),
        (["--resume", "--overwrite"], "exclude each other"),
        (["--devices", "0"], "devices must be a positive integer, got 0"),
        (["--batch-size", "4096"], "batch size 4096 is larger than the 1438 training examples of digits"),
        (["--metrics", "tensorboard", "--keep", "0"], "keep must be a positive integer, got 0"),
        (["--steps", "4", "--epochs", "2"], "--steps 4 and --epochs 2 exclude each other"),
        (["--label-smoothing", "1.5"], "label_smoothing must be in [0, 1), got 1.5"),
        (["--model-config", "widths=abc"], "field 'widths' takes a tuple"),
        (["--model-config", "depth=3"], "model 'cnn' has no config field(s) ['depth']"),
        (["--model-config", "widths=[8]", "widths=[4]"], "field 'widths' is given twice"),
        (["--augment", "crop,spin"], "augment: unknown 'spin' in 'crop,spin'"),
        (["--model", "gpt", "--augment", "flip"], "augmentation is for the image models, not 'gpt'"),
    ],
)
def test_bad_flags_refused(capsys, tmp_path, argv, match):
    refused(capsys, [*argv, "--run-dir", str(tmp_path / "run")], match)
    assert not (tmp_path / "run").exists()


def test_bad_data_dir_refused(capsys, tmp_path):
    refused(capsys, ["--data", str(tmp_path / "nope"), "--run-dir", str(tmp_path / "r")], "data directory not found")
    idx = tmp_path / "idx"
    idx.mkdir()
    header = bytes([0, 0, 8, 1]) + (5).to_bytes(4, "big")
    (idx / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(header + bytes(5)))
    dims = b"".join(d.to_bytes(4, "big") for d in (5, 28, 28))
    (idx / "t10k-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03" + dims + bytes(100))  # truncated
    refused(
        capsys,
        ["--dataset", "cifar10", "--data", str(idx), "--run-dir", str(tmp_path / "r")],
        "holds mnist files, not the cifar10 format",
    )
    refused(
        capsys,
        ["--data", str(idx), "--run-dir", str(tmp_path / "r")],
        "t10k-images-idx3-ubyte: 100 bytes of data, expected 3920",
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(capsys, ["--data", str(empty), "--run-dir", str(tmp_path / "r")], "holds no MNIST")
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_train_writes_metrics_plots_summary_and_refuses_reuse(capsys, tmp_path):
    run = tmp_path / "run"
    assert cli.main(["train", *QUICK, "--devices", "2", "--run-dir", str(run), "--eval-every", "12"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("cnn on digits: step 24/24, test accuracy ") and "examples/s" in out[-1]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == [8, 16, 24]
    assert all(np.isfinite(r["loss"]) and r["input_wait_s"] >= 0 and r["examples_per_s"] > 0 for r in train_rows)
    assert [r["step"] for r in rows if r["split"] == "eval"] == [12, 24]
    for png in ("loss.png", "accuracy.png"):
        assert (run / png).read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 < summary["eval_accuracy"] <= 1.0 and summary["step"] == 24
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]  # learning, if only 24 small steps
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    refused(capsys, [*QUICK, "--lr", "0.5", "--run-dir", str(run)], "belongs to a different config (lr: saved ")
    refused(capsys, [*QUICK, "--run-dir", str(run)], "already holds a run; pass --resume")
    refused(
        capsys,
        [*QUICK, "--steps", "30", "--resume", "--run-dir", str(run)],
        "--steps 30: the run in",
    )
    refused(capsys, [*QUICK, "--run-dir", str(run / "config.json")], "config.json is a file, not a directory")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing overwritten
    assert cli.main(["train", *QUICK, "--run-dir", str(run), "--resume"]) == 0  # finished already: says so
    assert "already finished at step 24; nothing to do" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert cli.main(["train", *QUICK, "--no-plots", "--run-dir", str(run), "--overwrite"]) == 0
    assert "test accuracy" in capsys.readouterr().out


@pytest.mark.slow
def test_a_run_validates_its_fit_config_once_and_the_loop_takes_it_whole(monkeypatch, tmp_path):
    import dataclasses

    import jaxnn.loop
    from jaxnn.config import FitConfig

    built, handed = [], []
    check = FitConfig.__post_init__
    monkeypatch.setattr(FitConfig, "__post_init__", lambda self: (built.append(self), check(self))[1])
    run_fit = jaxnn.loop.run_fit
    monkeypatch.setattr(
        jaxnn.loop,
        "run_fit",
        lambda model, data, cfg, inputs: (handed.append(cfg), run_fit(model, data, cfg, inputs))[1],
    )
    argv = ["train", "--model", "mlp", *QUICK, "--steps", "2", "--no-plots", "--run-dir", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    assert len(built) == 1 and len(handed) == 1  # built once from the flags, validated once, handed on whole
    parsed, given = dataclasses.asdict(built[0]), dataclasses.asdict(handed[0])
    assert given.pop("name") == "mlp/digits" and parsed.pop("name") == "fit" and given == parsed
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert record["steps"] == 2 and record["batch_size"] == 16 and record["model_config"]["num_classes"] == 10


@pytest.mark.slow
def test_gpt_prints_a_sample(capsys, tmp_path):
    # A small text folder instead of the default standard-library corpus, which takes seconds to gather.
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.py").write_bytes(pathlib.Path(cli.__file__).read_bytes() * 3)
    assert (
        cli.main(
            ["train", "--model", "gpt", *QUICK, "--no-plots", "--data", str(text), "--run-dir", str(tmp_path / "g")]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "--- sample ---\n" in out and "bits/byte" in out.splitlines()[-1]
    # the sample continues the data's own first line, and prints no control character as it is
    first = pathlib.Path(cli.__file__).read_bytes()[:16].decode().split("\n")[0]
    sample = out.split("--- sample ---\n", 1)[1]
    assert sample.startswith(first) and all(c.isprintable() or c in "\n\t" for c in sample)

    # `jaxnn generate` continues a prompt from the run's checkpoint, past the 32-byte position table (windows).
    greedy = [
        "generate",
        "--run-dir",
        str(tmp_path / "g"),
        "--prompt",
        "import",
        "--length",
        "40",
        "--temperature",
        "0",
    ]
    assert cli.main(greedy) == 0
    first = capsys.readouterr().out
    assert first.startswith("import") and len(first.encode()) >= len("import") + 40 - 8  # invalid UTF-8 is replaced
    assert cli.main(["generate", "--run-dir", str(tmp_path / "g"), "--top-k", "0"]) == 2
    assert "top_k must be a positive integer" in capsys.readouterr().err
    assert cli.main(["generate", "--run-dir", str(tmp_path / "nothing")]) == 2
    assert "no such run" in capsys.readouterr().err


@pytest.mark.slow
def test_a_constant_schedule_run_trains_on_as_if_asked_for_more_steps(capsys, tmp_path):
    quick = ["--model", "mlp", "--size", "small", "--batch-size", "16", "--no-progress", "--no-summary", "--no-plots"]
    quick += ["--schedule", "constant", "--warmup", "2"]

    def digest(run):
        return json.loads((run / "summary.json").read_text())["param_digest"]

    assert cli.main(["train", *quick, "--steps", "6", "--run-dir", str(tmp_path / "on")]) == 0
    assert cli.main(["train", *quick, "--steps", "10", "--resume", "--run-dir", str(tmp_path / "on")]) == 0
    assert cli.main(["train", *quick, "--steps", "10", "--run-dir", str(tmp_path / "whole")]) == 0
    out = capsys.readouterr().out
    assert "step 10/10" in out
    assert digest(tmp_path / "on") == digest(tmp_path / "whole")


def test_config_small_and_validation():
    cfg = TrainConfig().small()
    assert cfg.size == "small" and cfg.fit.steps < TrainConfig().fit.steps
    assert "run_dir" not in cfg.trajectory() and cfg.trajectory()["lr"] == cfg.lr
    with pytest.raises(ConfigError, match="warmup must be >= 0, got -1"):
        TrainConfig(warmup=-1)  # refused at construction
    parser = cli.build_parser()
    assert all(a.help for a in parser._subparsers._group_actions[0].choices["train"]._actions)
    args = parser.parse_args(["train", "--model", "gpt", "--model-config", "position=rope", "num_kv_heads=2"])
    overrides = dict(config_from_args(args).model_overrides)
    assert overrides["position"] == "rope" and overrides["num_kv_heads"] == 2
    with pytest.raises(ConfigError, match=r"--model-config: expected FIELD=VALUE, got 'rope'"):
        parse_model_config(["rope"])


def write_idx(root, n, seed):
    rng = np.random.default_rng(seed)
    for split in ("train", "t10k"):
        for kind, arr in (("images", rng.integers(0, 256, (n, 28, 28))), ("labels", rng.integers(0, 10, n))):
            header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
            (root / f"{split}-{kind}-idx{arr.ndim}-ubyte.gz").write_bytes(
                gzip.compress(header + arr.astype(np.uint8).tobytes())
            )


@pytest.mark.slow
def test_resume_past_a_damaged_checkpoint_and_refuse_changed_data(capsys, caplog, tmp_path):
    data, run = tmp_path / "idx", tmp_path / "run"
    data.mkdir()
    write_idx(data, 48, 0)
    argv = [
        "train",
        "--model",
        "mlp",
        *QUICK,
        "--no-plots",
        "--data",
        str(data),
        "--run-dir",
        str(run),
        "--ckpt-every",
        "8",
        "--keep",
        "3",
    ]
    assert cli.main(argv) == 0
    assert "mlp on mnist: step 24/24" in capsys.readouterr().out
    files = [p for p in (run / "ckpt" / "24" / "state").rglob("*") if p.is_file()]
    newest = max(files, key=lambda p: p.stat().st_size)
    newest.write_bytes(newest.read_bytes()[:10])  # truncated
    assert cli.main([*argv, "--resume"]) == 0
    assert f"checkpoint {run / 'ckpt' / '24'} is unreadable" in caplog.text
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == 16
    capsys.readouterr()
    caplog.clear()
    write_idx(data, 40, 1)  # same folder, other contents
    refused(
        capsys, [*argv[1:], "--resume"], "its data iterator does not fit this data (num_train: checkpoint 48, now 40)"
    )
    assert "unreadable" not in caplog.text  # the resumed run replaced the damaged step-24 checkpoint


def test_the_sample_escapes_control_characters():
    from jaxnn.cli.recipes import printable

    assert printable("ok\tfine\nbell\x07 esc\x1b[31m é") == "ok\tfine\nbell\\x07 esc\\x1b[31m é"


# config.json of `jaxnn train --model mlp --size small --steps 2 --batch-size 8 --augment crop,flip,mixup --lora
# r=2,alpha=4,targets=*dense.w --mesh data=2`, byte for byte as written when the mesh, augment and lora text was
# still parsed inside the loop (optax's version aside): parsing it once at the edge leaves the record as it was.
EDGE_PARSED_RECORD = pathlib.Path(__file__).parent / "fixtures" / "edge_parsed_config.json"


@pytest.mark.slow
def test_a_run_with_augment_lora_and_mesh_records_the_config_it_always_did(tmp_path):
    import optax

    run = tmp_path / "run"
    argv = ["--model", "mlp", "--size", "small", "--steps", "2", "--batch-size", "8", "--augment", "crop,flip,mixup"]
    argv += ["--lora", "r=2,alpha=4,targets=*dense.w", "--mesh", "data=2", "--no-plots", "--no-progress"]
    assert cli.main(["train", *argv, "--no-summary", "--run-dir", str(run)]) == 0
    expected = EDGE_PARSED_RECORD.read_text().replace("OPTAX_VERSION", optax.__version__)
    assert (run / "config.json").read_text() == expected


def test_train_config_reads_mesh_augment_and_lora_text_once_into_typed_values():
    import dataclasses

    from jaxnn.augment import Augment
    from jaxnn.lora import LoRA
    from jaxnn.parallel.mesh import MeshShape, make_mesh

    cfg = TrainConfig(mesh="data=2,fsdp=2", augment="crop,flip", lora="r=4,alpha=8")
    assert cfg.mesh == MeshShape(data=2, fsdp=2) and (cfg.mesh.devices, cfg.mesh.batch_split) == (4, 4)
    assert isinstance(cfg.augment, Augment) and cfg.augment.flip
    assert isinstance(cfg.lora, LoRA) and (cfg.lora.rank, cfg.lora.alpha) == (4, 8.0)
    assert dataclasses.replace(cfg, lr=0.1).mesh is cfg.mesh  # typed values pass through unchanged
    assert TrainConfig(augment="", lora="").augment is None and TrainConfig(lora="").lora is None
    assert "augment" not in cfg.trajectory() and "lora" not in cfg.trajectory()  # fit records their record()
    assert dict(make_mesh(MeshShape(tensor=2)).shape) == {"data": 1, "fsdp": 1, "tensor": 2}
    with pytest.raises(ConfigError, match=r"^batch size 6 is not divisible by the 4 devices of the batch axes"):
        TrainConfig(mesh="data=2,fsdp=2", fit=dataclasses.replace(TrainConfig().fit, batch_size=6))
    with pytest.raises(ValueError, match=r"the size of 'tensor' must be a positive integer, got 0"):
        MeshShape(tensor=0)
