"""`make mutate`'s planted bugs stay plantable: each snippet it replaces occurs exactly once in today's code, so a
refactor that moves the code cannot quietly turn a planted bug into a "stale" one nobody runs."""

import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutate", REPO / "tools" / "mutate.py")
mutate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutate)


@pytest.mark.parametrize("mutation", mutate.MUTATIONS, ids=[m.name for m in mutate.MUTATIONS])
def test_each_planted_bug_replaces_one_snippet_of_the_current_code(mutation):
    text = (REPO / mutation.path).read_text()
    assert text.count(mutation.old) == 1, f"{mutation.path}: snippet found {text.count(mutation.old)} times"
    assert mutation.new != mutation.old
    for target in mutation.tests:
        assert (REPO / target.split("::")[0]).exists() or not target.startswith("tests/"), target
