"""jaxnn.profile.kernel_table: a real CPU trace read into operations with self times and kinds; a trace in the
GPU's layout (kernels on streams beside the profiler's derived lines) read from its streams only."""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from jaxnn.profile import kernel_table as kt


@pytest.fixture(scope="module")
def traced_product(tmp_path_factory):
    f = jax.jit(lambda a, b: jnp.tanh(a @ b).sum(0) + jnp.cumsum(a, 0).max(0))
    a = jnp.ones((192, 192))
    compiled = f.lower(a, a).compile()
    out = kt.trace_steps(lambda: compiled(a, a), steps=3, log_dir=tmp_path_factory.mktemp("trace"))
    return out, compiled.as_text()


def test_cpu_trace_has_operations_whose_shares_add_up(traced_product):
    trace_dir, hlo = traced_product
    table = kt.kernel_table(trace_dir, hlo)
    assert table.source == "cpu runtime"
    assert table.rows and all(r.calls >= 1 and r.seconds >= 0 for r in table.rows)
    assert sum(r.share for r in table.rows) == pytest.approx(1.0)
    assert table.rows == sorted(table.rows, key=lambda r: -r.seconds)
    # The product runs in every traced step, whatever XLA named the operation that holds it.
    products = [r for r in table.rows if r.kind == "matmul"]
    assert products and all(r.calls % 3 == 0 for r in products)


def test_hlo_names_the_kind_a_fusions_name_hides():
    hlo = """
%fused_computation (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_computation.1 (p0.1: f32[4,4]) -> f32[4,4] {
  %p0.1 = f32[4,4]{1,0} parameter(0)
  %e = f32[4,4]{1,0} exponential(%p0.1)
  ROOT %c = bf16[4,4]{1,0} convert(%e)
}

ENTRY %main (a: f32[4,4], b: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  %ynn_fusion = f32[4,4]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation
  %loop_convert_fusion = bf16[4,4]{1,0} fusion(%ynn_fusion), kind=kLoop, calls=%fused_computation.1
  %cublas-gemm.3 = (bf16[4,4]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm"
  ROOT %custom-call.7 = bf16[4,4]{1,0} custom-call(%a), custom_call_target="__cudnn$fmhaScaleBiasSoftmax"
}
"""
    kinds = kt.kinds_from_hlo(hlo)
    assert kinds["ynn_fusion"] == "matmul"
    assert kinds["loop_convert_fusion"] == "fusion"  # "convert" is not a convolution
    assert kinds["cublas-gemm.3"] == "matmul"
    assert kinds["custom-call.7"] == "attention"


def _event(tid, name, ts, dur, **args):
    return {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


def _write_trace(path, events):
    path.mkdir(parents=True)
    with gzip.open(path / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_gpu_layout_counts_stream_kernels_once(tmp_path):
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
    ]
    kernels = [
        _event(7, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 0, 60, hlo_op="cublas-gemm.1"),
        _event(7, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 60, 30, hlo_op="custom-call.2"),
        _event(7, "loop_add_fusion", 90, 10, hlo_op="loop_add_fusion"),
        _event(7, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 200, 60, hlo_op="cublas-gemm.1"),
    ]
    derived = [_event(8, "cublas-gemm.1", 0, 60), _event(8, "custom-call.2", 60, 30)]  # the same time again
    host = [{**_event(9, "PjitFunction(step)", 0, 300), "pid": 2}]
    _write_trace(tmp_path / "t", meta + kernels + derived + host)
    table = kt.kernel_table(tmp_path / "t")
    assert table.source == "gpu streams"
    assert table.busy_s == pytest.approx(160e-6)
    assert table.span_s == pytest.approx(260e-6)
    rows = {r.name: r for r in table.rows}
    assert rows["cublas-gemm.1"].calls == 2 and rows["cublas-gemm.1"].kind == "matmul"
    assert rows["custom-call.2"].kind == "attention"
    assert table.by_kind() == pytest.approx({"matmul": 0.75, "attention": 30 / 160, "fusion": 10 / 160})


def test_nested_operations_count_their_own_time(tmp_path):
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]
    events = [
        _event(1, "while.3", 0, 100, hlo_op="while.3"),
        _event(1, "dot.1", 10, 30, hlo_op="dot.1"),
        _event(1, "add_fusion", 50, 20, hlo_op="add_fusion"),
        _event(1, "ThunkExecutor::Execute", 0, 100, hlo_op="x"),  # the runtime's bookkeeping, not an operation
    ]
    _write_trace(tmp_path / "t", meta + events)
    rows = {r.name: r.seconds for r in kt.kernel_table(tmp_path / "t").rows}
    assert rows == pytest.approx({"while.3": 50e-6, "dot.1": 30e-6, "add_fusion": 20e-6})


def test_command_prints_the_table_and_refuses_a_folder_without_a_trace(traced_product, tmp_path, capsys):
    trace_dir, _ = traced_product
    assert kt.main([str(trace_dir), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "cpu runtime" in out and "by kind:" in out and "more" in out
    assert kt.main([str(trace_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"]
    assert kt.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no perfetto_trace.json.gz" in err[0]


def test_a_gpu_trace_without_stream_lines_falls_back_to_its_ops_line(tmp_path):
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 1, "tid": 9, "name": "thread_name", "args": {"name": "XLA Modules"}},
    ]
    events = [_event(8, "cublas-gemm.1", 0, 60), _event(8, "loop_add_fusion", 60, 20), _event(9, "jit_step", 0, 80)]
    _write_trace(tmp_path / "t", meta + events)
    table = kt.kernel_table(tmp_path / "t")
    assert table.source == "gpu xla ops line" and table.busy_s == pytest.approx(80e-6)
    assert table.by_kind() == pytest.approx({"matmul": 0.75, "fusion": 0.25})
