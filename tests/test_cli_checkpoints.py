"""The command line with checkpoints other libraries wrote: `jaxnn summary` of presets, and a transformers folder
fine-tuned (`train --init-from`), generated from, and exported back (`export --format hf`)."""

import numpy as np
import pytest

from jaxnn import cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

pytestmark = pytest.mark.xdist_group("transformers")

VOCAB = 300  # above 256, so byte-level training data are valid ids


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    """A small random GPT-2 written by transformers, with a byte-level BPE tokenizer trained offline."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["import numpy as np\n" * 50, "def main():\n    return 0\n" * 50], trainer)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _logits(folder, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


@pytest.mark.slow
def test_summary_of_a_large_preset_prints_its_published_count_without_allocating(capsys):
    assert cli.main(["summary", "--model", "llama-3-8b", "--depth", "0"]) == 0
    assert "8,030,261,248 parameters, equal to the published 8,030,261,248" in capsys.readouterr().out
    assert cli.main(["summary", "--list"]) == 0
    assert "gpt2-xl" in capsys.readouterr().out
    assert cli.main(["summary", "--model", "gpt3"]) == 2
    assert "unknown model 'gpt3'" in capsys.readouterr().err


@pytest.mark.slow
def test_fine_tune_a_transformers_folder_on_its_tokens_and_export_it_back(capsys, tmp_path, gpt2_folder):
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.py").write_text("import numpy as np\n\ndef main():\n    return np.zeros(3)\n" * 40)
    run = tmp_path / "run"
    argv = ["--init-from", str(gpt2_folder), "--data", str(text), "--steps", "2", "--batch-size", "4"]
    argv += ["--seq-len", "16", "--lr", "1e-9", "--run-dir", str(run), "--no-progress", "--no-plots", "--no-summary"]
    assert cli.main(["train", *argv]) == 0
    out = capsys.readouterr().out
    assert "gpt on text-tokens" in out and "bits/token" in out  # trained on the folder's tokenizer, not on bytes
    assert cli.main(["export", "--run-dir", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 10))
    # Two steps at a learning rate of 1e-9 leave the weights where the folder had them: the import is the start.
    err = np.abs(_logits(tmp_path / "hf", ids) - _logits(gpt2_folder, ids)).max()
    assert err < 1e-4, f"fine-tuned export differs from the imported folder by {err:.3g}"
    # The tokenizer travels with the run and its export, and generation decodes with it, not as bytes.
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == (gpt2_folder / "tokenizer.json").read_bytes()
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (gpt2_folder / "tokenizer.json").read_bytes()
    greedy = ["--prompt", "def main", "--length", "5", "--temperature", "0"]
    capsys.readouterr()
    assert cli.main(["generate", "--run-dir", str(run), *greedy]) == 0
    from_run = capsys.readouterr().out
    assert cli.main(["generate", "--run-dir", str(gpt2_folder), *greedy]) == 0
    assert from_run == capsys.readouterr().out and from_run.startswith("def main")


@pytest.mark.slow
def test_a_run_whose_tokenizer_is_gone_or_changed_refuses_to_decode(capsys, tmp_path, gpt2_folder):
    import shutil

    folder = tmp_path / "ckpt-folder"
    shutil.copytree(gpt2_folder, folder)
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.py").write_text("def main():\n    return 0\n" * 80)
    run = tmp_path / "run"
    argv = ["train", "--init-from", str(folder), "--data", str(text), "--steps", "1", "--batch-size", "2"]
    assert cli.main([*argv, "--run-dir", str(run), "--no-progress", "--no-plots", "--no-summary"]) == 0
    capsys.readouterr()
    shutil.rmtree(run / "tokenizer")
    assert cli.main(["generate", "--run-dir", str(run), "--length", "2"]) == 0  # the folder's copy is unchanged
    (folder / "tokenizer.json").write_text((folder / "tokenizer.json").read_text() + "\n")  # edited: another digest
    capsys.readouterr()
    for command in (["generate", "--run-dir", str(run)], ["export", "--run-dir", str(run), "--format", "hf"]):
        extra = ["--out", str(tmp_path / "hf")] if command[0] == "export" else []
        assert cli.main([*command, *extra]) == 2
        err = capsys.readouterr().err
        assert "tokenised with a tokenizer.json of digest" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_lora_fine_tune_from_the_command_line_generates_and_exports_merged(capsys, tmp_path, gpt2_folder):
    import json

    from jaxnn.checkpoint import load_params
    from jaxnn.interop.hf import load_hf
    from jaxnn.lora import load_adapters
    from jaxnn.models.factory import model_from_record

    records = tmp_path / "qa.jsonl"  # prompt/completion pairs: the loss on the completions alone
    pairs = [{"prompt": f"def f{i}():", "completion": f"\n    return np.zeros({i})\n"} for i in range(30)]
    records.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    run = tmp_path / "run"
    argv = ["train", "--init-from", str(gpt2_folder), "--data", str(records), "--steps", "4", "--batch-size", "4"]
    argv += ["--seq-len", "16", "--lr", "3e-2", "--lora", "r=4,alpha=8,targets=*qkv.w,*fc.w"]
    assert cli.main([*argv, "--run-dir", str(run), "--no-progress", "--no-plots", "--no-summary"]) == 0
    assert "gpt on qa-tokens" in capsys.readouterr().out
    assert cli.main(["export", "--run-dir", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert cli.main(["export", "--run-dir", str(run), "--format", "lora", "--out", str(tmp_path / "ad")]) == 0
    loaded = load_params(run)
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 10))
    model, _ = model_from_record(loaded.config)
    ours = np.asarray(model.apply(loaded.params, ids))
    assert np.abs(_logits(tmp_path / "hf", ids) - ours).max() < 1e-4
    assert np.abs(_logits(tmp_path / "hf", ids) - _logits(gpt2_folder, ids)).max() > 1e-3  # it did train
    _, folder_params = load_hf(gpt2_folder)
    again, _ = load_adapters(tmp_path / "ad" / "adapters.safetensors", folder_params)
    assert np.abs(np.asarray(model.apply(again, ids)) - ours).max() < 1e-5
    # PEFT's layout, for the transformers folder the run started from: PEFT gives the run's logits.
    assert cli.main(["export", "--run-dir", str(run), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(gpt2_folder.absolute())
    peft = pytest.importorskip("peft")
    with_peft = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(gpt2_folder),
                                               tmp_path / "peft").eval()  # fmt: skip
    with torch.no_grad():
        assert np.abs(with_peft(torch.tensor(ids)).logits.numpy() - ours).max() < 1e-4
    adapter_bytes = (tmp_path / "ad" / "adapters.safetensors").stat().st_size
    assert adapter_bytes < 0.2 * (tmp_path / "hf" / "model.safetensors").stat().st_size
    greedy = ["--prompt", "def main", "--length", "5", "--temperature", "0"]
    capsys.readouterr()
    assert cli.main(["generate", "--run-dir", str(run), *greedy]) == 0
    unmerged = capsys.readouterr().out
    assert cli.main(["generate", "--run-dir", str(tmp_path / "hf"), *greedy]) == 0
    assert unmerged == capsys.readouterr().out


def test_the_window_follows_the_checkpoints_positions(capsys, tmp_path, gpt2_folder):
    from jaxnn.cli.main import build_parser
    from jaxnn.cli.train import config_from_args

    def config(*flags):
        return config_from_args(build_parser().parse_args(["train", "--init-from", str(gpt2_folder), *flags]))

    assert config().seq_len == 64  # the folder's n_positions, not the default window
    assert config("--seq-len", "16").seq_len == 16
    assert (
        cli.main(["train", "--init-from", str(gpt2_folder), "--seq-len", "128", "--run-dir", str(tmp_path / "r")]) == 2
    )
    assert "longer than" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_a_preset_that_disagrees_with_the_checkpoint_is_refused_naming_both(capsys, tmp_path, gpt2_folder):
    assert (
        cli.main(["train", "--model", "gpt2", "--init-from", str(gpt2_folder), "--run-dir", str(tmp_path / "r")]) == 2
    )
    err = capsys.readouterr().err
    assert (
        "--model gpt2 and --init-from" in err and "different architectures" in err and "d_model 768 against 32" in err
    )
    assert not (tmp_path / "r").exists()


def test_generate_from_a_transformers_folder_uses_its_tokenizer(capsys, gpt2_folder):
    argv = ["generate", "--run-dir", str(gpt2_folder), "--prompt", "import numpy", "--length", "6", "--seed", "3"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("import numpy") and len(out.strip()) > len("import numpy")


def test_an_imported_decoder_cannot_train_as_an_image_model(capsys, tmp_path, gpt2_folder):
    argv = ["train", "--model", "cnn", "--init-from", str(gpt2_folder), "--run-dir", str(tmp_path / "r")]
    assert cli.main(argv) == 2
    assert "trains as gpt, not 'cnn'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_fine_tune_a_torchvision_resnet_on_grayscale_digits(capsys, caplog, tmp_path):
    # A narrow ResNet in torchvision's layout (tests/test_interop_torchvision.py proves that layout against
    # torchvision itself): an RGB stem and a 7-class head, fine-tuned on 1-channel, 10-class digits.
    import jax
    from safetensors.numpy import save_file

    from jaxnn.interop.torchvision import to_torchvision_state_dict
    from jaxnn.layers import init_model
    from jaxnn.models.imagenet_resnet import ImageNetResNet, ImageNetResNetConfig

    cfg = ImageNetResNetConfig(stage_sizes=(1, 1), width=8, num_classes=7)
    _, params, state = init_model(ImageNetResNet(cfg), jax.random.key(0), (1, 32, 32, 3))
    save_file(to_torchvision_state_dict(params, state, cfg), tmp_path / "narrow.safetensors")
    argv = ["train", "--init-from", str(tmp_path / "narrow.safetensors"), "--steps", "2", "--batch-size", "8"]
    assert cli.main([*argv, "--run-dir", str(tmp_path / "run"), "--no-progress", "--no-plots", "--no-summary"]) == 0
    assert "imagenet_resnet on digits: step 2/2" in capsys.readouterr().out
    assert "grayscale images enter it in all three channels" in caplog.text
    assert "7-class head, the data 10 classes: it starts afresh" in caplog.text
    assert cli.main(["train", "--model", "gpt2", "--init-from", str(tmp_path / "narrow.safetensors")]) == 2
    assert "is a torchvision ResNet: it trains as imagenet_resnet, not 'gpt2'" in capsys.readouterr().err
    assert cli.main(["train", "--model", "resnet50", "--init-from", str(tmp_path / "narrow.safetensors")]) == 2
    assert "--model resnet50 and --init-from" in capsys.readouterr().err


@pytest.mark.slow
def test_vision_presets_train_on_the_data_at_hand(capsys, tmp_path):
    argv = ["train", "--model", "vit-b16", "--model-config", "patch_size=4", "num_layers=1", "hidden_dim=32"]
    argv += [
        "num_heads=2",
        "mlp_dim=64",
        "--steps",
        "2",
        "--batch-size",
        "8",
        "--no-progress",
        "--no-plots",
        "--no-summary",
    ]
    assert cli.main([*argv, "--run-dir", str(tmp_path / "vit")]) == 0
    assert "vit on digits: step 2/2" in capsys.readouterr().out  # 10 classes and 8x8 images, from the data
