"""Config values parsed strictly: mesh strings, export platforms, seeds and precision names each get one line that
names the value and what is allowed, raised before anything is written; never a silently different run."""

import json
import re

import jax
import numpy as np
import pytest

import jaxnn
from jaxnn import layers as L
from jaxnn.cli.config import TrainConfig
from jaxnn.config import ConfigError, FitConfig
from jaxnn.data import PipelineConfig
from jaxnn.export import write_export
from jaxnn.layers.core import init_model
from jaxnn.parallel import parse_mesh
from jaxnn.precision import Policy, get_policy

QUIET = {"steps": 2, "batch_size": 8, "progress": False, "plots": False}


def snapshot(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def dense():
    layer = L.Dense(3)
    return layer, init_model(layer, jax.random.key(0), (1, 4))[1]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("data=2,data=4", r"axis 'data' is given twice"),
        ("data=2,fsdp=2,data=2", r"axis 'data' is given twice"),
        ("data=x", r"the size of 'data' must be a positive integer, got 'x'"),
        ("data=2.5", r"the size of 'data' must be a positive integer, got '2.5'"),
        ("data=0", r"the size of 'data' must be a positive integer, got 0"),
        ("fsdp=-2", r"the size of 'fsdp' must be a positive integer, got '-2'"),
        ("data=\u0663", r"the size of 'data' must be a positive integer, got '\u0663'"),
        ("data=2,,fsdp=2", r"item '' is not AXIS=SIZE"),
        ("data", r"item 'data' is not AXIS=SIZE"),
        ("", r"no axes given"),
        ({"data": True}, r"the size of 'data' must be a positive integer, got True"),
    ],
)
def test_mesh_strings_are_parsed_strictly(spec, message):
    with pytest.raises(ValueError, match=rf"^mesh {re.escape(repr(spec))}: {message}"):
        parse_mesh(spec)


def test_a_bad_mesh_reaches_fit_and_train_config_as_one_line_before_any_write(tmp_path):
    x, y = np.zeros((16, 4), np.float32), np.zeros(16, np.int32)
    (tmp_path / "keep.txt").write_text("earlier work")
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"^mesh 'data=2,data=4': axis 'data' is given twice"):
        jaxnn.fit(L.Dense(3), (x, y), mesh="data=2,data=4", run_dir=str(tmp_path / "run"), **QUIET)
    with pytest.raises(ConfigError, match=r"^mesh 'data=2,data=4': axis 'data' is given twice"):
        TrainConfig(mesh="data=2,data=4")
    assert snapshot(tmp_path) == before


def test_export_takes_one_platform_as_a_string(tmp_path, dense):
    layer, params = dense
    out = write_export(tmp_path / "out", layer, params, {}, (4,), dtype="float32", platforms="cuda")
    assert json.loads((out / "export.json").read_text())["platforms"] == ["cuda"]


@pytest.mark.parametrize(
    "platforms, culprit",
    [(("cpu", "gpu"), r"\('cpu', 'gpu'\) \(unknown: \['gpu'\]\)"), ("CPU", r"'CPU'"), ((), r"\(\)")],
)
def test_export_platforms_are_checked_before_any_write(tmp_path, dense, platforms, culprit):
    layer, params = dense
    out = tmp_path / "out"
    out.mkdir()
    (out / "export.json").write_text('{"older": "export"}')
    before = snapshot(tmp_path)
    with pytest.raises(
        ValueError,
        match=rf"^export: platforms must name one or more of \['cpu', 'cuda', 'rocm', 'tpu'\], got {culprit}",
    ):
        write_export(out, layer, params, {}, (4,), dtype="float32", platforms=platforms)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, True])
def test_seeds_outside_the_32_bit_range_are_refused_naming_the_owner(seed):
    allowed = r"seed must be an integer in \[0, 2\*\*32\), got "
    with pytest.raises(ConfigError, match=rf"^fit: {allowed}{seed}$"):
        FitConfig(seed=seed)
    with pytest.raises(ConfigError, match=rf"^PipelineConfig: {allowed}{seed}$"):
        PipelineConfig(seed=seed)
    with pytest.raises(ConfigError, match=rf"^synthetic: {allowed}{seed}$"):
        jaxnn.data.synthetic(seed=seed)


def test_precision_names_that_are_not_strings_get_the_same_line_as_unknown_ones():
    with pytest.raises(ConfigError, match=r"^fit: unknown precision \['bf16'\]; choose one of \['bf16', 'fp16'"):
        FitConfig(precision=["bf16"])
    with pytest.raises(ValueError, match=r"^unknown precision \['bf16'\]; choose one of .* or pass a Policy"):
        get_policy(["bf16"])
    with pytest.raises(ValueError, match=r"^Policy: unknown matmul_precision \['highest'\]; choose one of"):
        Policy(matmul_precision=["highest"])
