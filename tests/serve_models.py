"""A small served checkpoint made offline: a random GPT-2 with a byte-level BPE tokenizer trained on a few lines,
ChatML special tokens and a chat template, as a transformers folder (what `jaxnn serve` and vLLM load)."""

import json
import pathlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXT = [
    "the cat sat on the mat and the dog sat on the log",
    "a quick brown fox jumps over the lazy dog",
    "user: hello there, how are you today? assistant: fine, thank you",
    "def add(a, b):\n    return a + b\n",
    "les chats dorment au soleil; café, crème brûlée",
] * 20


def tokenizer() -> object:
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT, trainer)
    return tok


def save_served_folder(folder: pathlib.Path, n_positions: int = 128) -> pathlib.Path:
    """A random GPT-2 (2 layers, width 32) with the tokenizer above, eos `<|im_end|>`, and the ChatML template."""
    tok = tokenizer()
    vocab = tok.get_vocab_size()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=n_positions, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=tok.token_to_id("<|im_end|>"))  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": n_positions,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
