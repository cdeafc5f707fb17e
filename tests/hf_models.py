"""Small random transformers checkpoints made offline, shared by the interop tests: every tensor randomised (norms
included, so a misplaced one shows)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 96
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4),
    "llama-gqa": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rope_theta=500000.0,
    ),  # fmt: skip
    "llama-tied-mha": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    ),  # fmt: skip
    "llama-biases-untied": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
    ),  # fmt: skip
}


def random_model(kind: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model


def save_folders(tmp_path_factory) -> dict:
    """kind -> a folder with that random model, as `save_pretrained` writes it."""
    out = {}
    for kind in CONFIGS:
        folder = tmp_path_factory.mktemp(kind)
        random_model(kind).save_pretrained(folder)
        out[kind] = folder
    return out
