"""benchmarks.mfu_levers on the CPU (the dry-run GPT): a lever measured side by side with the plain step, a lever
whose compile option this XLA refuses recorded with the next one still run, the budget's leftovers said."""

import json

import pytest

from benchmarks import mfu_levers


@pytest.mark.slow
def test_levers_are_measured_refused_or_left_out_and_each_is_said(tmp_path, monkeypatch):
    levers = {
        "an option XLA does not know": {"compiler_options": {"xla_no_such_option": True}},
        "Adam's first moment in bf16": mfu_levers.LEVERS["Adam's first moment in bf16"],
    }
    monkeypatch.setattr(mfu_levers, "LEVERS", levers)
    record = mfu_levers.run_levers(str(tmp_path), dry_run=True, budget_s=600)
    assert json.loads((tmp_path / "mfu_levers.json").read_text()) == record
    refused, measured = record["levers"].values()
    assert "xla_no_such_option" in refused["error"]
    assert measured["step_s"] > 0 and measured["plain_step_s"] > 0
    assert measured["mfu_over_plain"] == pytest.approx(measured["mfu"] / measured["plain_mfu"])
    assert "chunked cross-entropy" in record["not_tried"]
    wide = record["fp8_at_width"]
    assert "error" not in wide and wide["bf16"]["speedup_over_bf16"] == 1.0
    assert all(wide[p]["step_s"] > 0 for p in mfu_levers.FP8_POLICIES)

    spent = mfu_levers.run_levers(str(tmp_path / "none"), dry_run=True, budget_s=0)
    assert all(r["not_run"].startswith("budget:") for r in spent["levers"].values())
    assert "lever" in mfu_levers.format_levers(record) and "budget:" in mfu_levers.format_levers(spent)


def test_the_logits_share_decides_whether_a_chunked_loss_is_worth_trying():
    assert mfu_levers.logits_share(mfu_levers.GPU_GPT) < 0.01  # vocab 256: nothing to chunk
    wide_vocab = {**mfu_levers.GPU_GPT, "vocab": 128_256}
    assert mfu_levers.logits_share(wide_vocab) > 0.2
