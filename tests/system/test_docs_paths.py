"""The walk-throughs in the docs run as written: each page's Python and shell blocks under a heading, in order, in
a fresh folder, with the `jaxnn` command of this interpreter."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def blocks(page: str, heading: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block under `heading` (up to the next heading of that level or above)."""
    text = (REPO / "docs" / page).read_text()
    level = heading.split(" ", 1)[0]
    section = text.split(heading + "\n", 1)[1]
    section = re.split(rf"\n#{{1,{len(level)}}} ", section, maxsplit=1)[0]
    return re.findall(r"```(python|bash)\n(.*?)```", section, flags=re.S)


def run_blocks(found: list[tuple[str, str]], cwd: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    outputs = []
    for language, code in found:
        commands = (
            [[sys.executable, "-c", code]]
            if language == "python"
            else [
                [sys.executable, "-m", "jaxnn.cli", *shlex.split(line)[1:]]
                for line in code.splitlines()
                if line.strip()
            ]
        )
        for command in commands:
            out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
            assert out.returncode == 0, f"{command[:4]}: {out.stderr[-3000:]}"
            outputs.append(out.stdout)
    return outputs


@pytest.mark.system
def test_the_lora_walkthrough_runs_as_written(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    found = blocks(
        "bring-a-checkpoint.md",
        "### The whole path: a folder, a LoRA fine-tune on JSON Lines, generation, and back into transformers",
    )
    assert [language for language, _ in found] == ["python", "bash", "python"]
    assert all(line.startswith("jaxnn ") for line in found[1][1].splitlines() if line.strip())
    outputs = run_blocks(found, tmp_path)
    assert "gpt on qa-tokens" in outputs[1]
    assert outputs[2].startswith("def f3(x):")
    assert "max |jaxnn - transformers|" in outputs[-1]
    assert (tmp_path / "ft-adapters" / "adapters.safetensors").is_file()


@pytest.mark.system
def test_the_quantised_base_walkthrough_runs_as_written(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("qwix")
    setup = blocks(
        "bring-a-checkpoint.md",
        "### The whole path: a folder, a LoRA fine-tune on JSON Lines, generation, and back into transformers",
    )[0]
    found = blocks("bring-a-checkpoint.md", "### A quantised base")
    assert [language for language, _ in found] == ["bash"]
    outputs = run_blocks([setup, *found], tmp_path)
    assert "gpt on qa-tokens" in outputs[1]
    assert outputs[2].startswith("def f3(x):")
    assert (tmp_path / "ft-nf4-hf" / "config.json").is_file()


def test_the_preference_tuning_walkthrough_runs_as_written(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    found = blocks("bring-a-checkpoint.md", "## Preference tuning")
    assert [language for language, _ in found] == ["python", "bash", "python"]
    outputs = run_blocks(found, tmp_path)
    assert "gpt on pairs: step 40/40, test preference accuracy" in outputs[1]
    assert outputs[2].startswith("def f3(x):")
    accuracy, margins = outputs[-1].strip().split("] [")
    assert accuracy.startswith("[") and margins.endswith("]")
    assert (tmp_path / "dpo" / "metrics.jsonl").is_file()
