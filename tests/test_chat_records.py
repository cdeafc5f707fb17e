"""Chat fine-tuning data: `{"messages": [...]}` records rendered with the checkpoint's chat template give
transformers' `apply_chat_template` ids, the loss counts the assistant turns alone, and `jaxnn train` trains on
them (packed too)."""

import json

import numpy as np
import pytest

from jaxnn.data import DataError
from jaxnn.data.records import load_text_records
from jaxnn.interop.chat import ChatTemplate

transformers = pytest.importorskip("transformers")
from serve_models import save_served_folder  # noqa: E402

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat sat?"},
     {"role": "assistant", "content": "on the mat"}, {"role": "user", "content": "and the dog?"},
     {"role": "assistant", "content": "on the log"}],
    [{"role": "user", "content": "café?"}, {"role": "assistant", "content": "crème brûlée"}],
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "fine, thank you"}],
]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_served_folder(tmp_path_factory.mktemp("chat") / "gpt")


def _write(path, records):
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in records))
    return path


def test_ids_are_apply_chat_templates_and_only_assistant_turns_count(folder, tmp_path):
    from jaxnn.interop.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder / "tokenizer.json")
    corpus = load_text_records(_write(tmp_path / "chat.jsonl", CONVERSATIONS), tokenizer,
                               chat_template=ChatTemplate.from_folder(folder), test_fraction=0.34)  # fmt: skip
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    each = []
    for messages in CONVERSATIONS[:2]:  # the training split
        ids = reference.apply_chat_template(messages, tokenize=True)
        each.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    assert corpus.train.tolist() == each[0] + each[1]
    counted = tokenizer.decode(corpus.train[corpus.train_targets == 1].tolist(), skip_special_tokens=False)
    assert counted == "on the mat<|im_end|>\non the log<|im_end|>\ncrème brûlée<|im_end|>\n"
    assert corpus.train_starts.tolist() == [0, len(each[0])]


def test_chat_records_without_a_template_are_refused(folder, tmp_path):
    from jaxnn.interop.tokenizer import load_tokenizer

    with pytest.raises(DataError, match="no chat template; give one with --chat-template"):
        load_text_records(_write(tmp_path / "chat.jsonl", CONVERSATIONS), load_tokenizer(folder / "tokenizer.json"))


@pytest.mark.slow
def test_jaxnn_train_fine_tunes_on_conversations_packed(folder, tmp_path):
    from jaxnn.cli.main import main

    data = _write(tmp_path / "chat.jsonl", CONVERSATIONS * 4)
    argv = ["train", "--model", "gpt", "--init-from", str(folder), "--data", str(data), "--pack", "--seq-len", "64",
            "--steps", "2", "--batch-size", "2", "--no-progress", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    assert main(argv) == 0
    # the trained run answers a chat message through the template it kept with its tokenizer
    chat = ["generate", "--run-dir", str(tmp_path / "run"), "--chat", "--prompt", "the cat sat?", "--length", "4"]
    assert main([*chat, "--temperature", "0"]) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]  # fmt: skip
    assert losses and all(np.isfinite(losses))
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (plain / f).write_bytes((folder / f).read_bytes())
    argv[argv.index(str(folder))] = str(plain)
    argv[argv.index(str(tmp_path / "run"))] = str(tmp_path / "run2")
    assert main(argv) == 2  # a folder without a template: refused in one line
    template = tmp_path / "chatml.jinja"
    template.write_text(json.loads((folder / "tokenizer_config.json").read_text())["chat_template"])
    assert main([*argv, "--chat-template", str(template)]) == 0
