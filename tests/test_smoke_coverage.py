"""Coverage by construction: every make target, runnable module of benchmarks/ and experiments/ and documented
command has a smoke run (tests/smoke_commands.py, run by tests/system/test_smoke.py) or a stated reason not to."""

from __future__ import annotations

import argparse
import shutil

import pytest
import smoke_commands as smoke


def test_every_target_module_and_documented_command_has_a_smoke_run_or_a_reason():
    assert smoke.uncovered() == []


def test_the_registry_names_only_what_exists():
    documented = {command for _, command, _ in smoke.documented_commands()}
    assert sorted(set(smoke.DOC_COMMANDS) - documented) == []
    names = set(smoke.help_targets()) | set(smoke.entry_modules())
    assert sorted(set(smoke.EXEMPT) - names) == []
    targets, modules = smoke._runs(smoke.smoke_lines())
    assert sorted(targets - set(smoke.help_targets())) == []
    assert sorted(modules - set(smoke.entry_modules())) == []


def test_a_target_module_or_command_added_without_a_smoke_run_is_reported(tmp_path):
    for name in ("Makefile", "mk", "benchmarks", "experiments", "docs", "README.md"):
        source = smoke.ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, tmp_path / name)
    assert smoke.uncovered(tmp_path) == []
    with open(tmp_path / "mk" / "extra.mk", "w") as f:
        f.write("bench-new: ## a benchmark nobody smoke-tests\n\t$(PY) -m benchmarks.brand_new\n")
    (tmp_path / "benchmarks" / "brand_new.py").write_text('if __name__ == "__main__":\n    print(1)\n')
    (tmp_path / "benchmarks" / "stand_alone.py").write_text('if __name__ == "__main__":\n    print(2)\n')
    with open(tmp_path / "docs" / "new.md", "w") as f:
        f.write("```sh\njaxnn train --model brand-new   # a new example\n")
        f.write("jaxnn summary --model x   # not run by the tests: a reason\n```\n")
    # A module counts as covered through a target only where that target has a smoke run; the marked command is.
    assert smoke.uncovered(tmp_path) == [
        "bench-new",
        "benchmarks.brand_new",
        "benchmarks.stand_alone",
        "new.md: jaxnn train --model brand-new",
    ]


def test_no_make_recipe_writes_a_fixed_file_under_results():
    """results/ holds committed measurements: a target writes a fresh, dated name there, never one a rerun repeats
    (a committed file among them would be replaced without a word)."""
    paths = smoke.results_paths()
    assert ("bench-remat", "results/bench/remat_memory-$(BENCH_TIME).json") in paths  # the check reads the recipes
    assert [(target, p) for target, p in paths if "$(" not in p] == []


def test_a_benchmark_refuses_to_replace_an_existing_json_file_unless_told(tmp_path):
    from benchmarks.output import add_json_flags, refuse_existing
    from benchmarks.remat_memory import main

    committed = smoke.ROOT / "results/bench/remat_memory.json"  # docs/performance.md's remat table
    before = committed.read_bytes()
    with pytest.raises(SystemExit, match=r"remat_memory\.json exists \(a committed result\?\); pass --overwrite"):
        main(["--seq-lens", "32", "--steps", "1", "--json", str(committed)])  # refused before measuring anything
    assert committed.read_bytes() == before
    parser = argparse.ArgumentParser()
    add_json_flags(parser)
    args = parser.parse_args(["--json", str(committed), "--overwrite"])
    refuse_existing(args.json, overwrite=args.overwrite)  # told to: allowed
    refuse_existing(str(tmp_path / "new.json"), None, overwrite=False)  # a fresh name: allowed
