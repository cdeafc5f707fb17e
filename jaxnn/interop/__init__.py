"""Checkpoints other libraries wrote, in and out of jaxnn: Hugging Face `transformers` folders (GPT-2, Llama)
and torchvision ResNet state dicts. The reference libraries are needed only to prove the conversions (tests) and
to read PyTorch pickles; safetensors files are read and written without them.

- `jaxnn.interop.tensors`: reading tensor files, and the rule tables (source tensor -> jaxnn path, both ways).
- `jaxnn.interop.hf`: `transformers` GPT-2 and Llama folders.
- `jaxnn.interop.peft`: LoRA adapters in PEFT's layout, both ways.
- `jaxnn.interop.tokenizer`: a checkpoint's tokenizer files, kept with a run.
- `jaxnn.interop.torchvision`: torchvision ResNet state dicts.
"""
