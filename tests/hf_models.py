"""Small random Hugging Face checkpoints built by transformers, offline, for the import/export tests.

transformers is a test-only oracle: it builds LlamaForCausalLM / MistralForCausalLM /
Qwen2ForCausalLM / MixtralForCausalLM from a config (random weights, nothing downloaded) and a tiny
byte-level BPE wrapped as a PreTrainedTokenizerFast, saved with save_pretrained like any hub folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SHAPE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "rms_norm_eps": 1e-5}
FAMILIES = ("llama", "mistral", "qwen2")
EOS = "<|endoftext|>"


def tokenizer_texts() -> list[str]:
    """A fixed few kB of text (the same everywhere, so the trained BPE is identical across tests)."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(errors="replace")[:20000] for name in ("textwrap.py", "shlex.py")]


def save_tokenizer(folder: Path, vocab_size: int = 300) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(tokenizer_texts(), trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(str(folder))


def hf_config(family: str, **overrides):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "mixtral": transformers.MixtralConfig}[family]
    return cls(**{**SHAPE, **overrides})


def build_hf(family: str, seed: int = 0, **overrides):
    """A random transformers model of `family` (fp32, eval mode)."""
    import transformers

    cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM, "mixtral": transformers.MixtralForCausalLM}[family]
    torch.manual_seed(seed)
    model = cls(hf_config(family, **overrides)).float().eval()
    with torch.no_grad():  # non-trivial norms and biases, so a wrong mapping cannot hide behind ones/zeros
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_hf(folder: Path, family: str = "llama", seed: int = 0, max_shard_size: str | None = None,
            tokenizer: bool = True, **overrides):
    """Save a random model (+ tokenizer) to `folder`; returns the transformers model."""
    model = build_hf(family, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **kwargs)
    if tokenizer:
        save_tokenizer(folder)
    return model


def assert_greedy_generation_matches(ref, folder, capsys) -> None:
    """`paratrain generate --greedy` on the HF folder prints what transformers' ``ref`` generates."""
    from tokenizers import Tokenizer

    from paratrain import cli

    assert cli.main(["generate", "def ", "--init-from", str(folder), "--greedy", "--tokens", "6"]) == 0
    out = capsys.readouterr().out.rstrip("\n")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompt = torch.tensor([tok.encode("def ").ids])
    want = ref.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out == tok.decode(want[0, prompt.shape[1]:].tolist())


def save_chatml_tokenizer(folder: Path, words: list[str], template: str) -> None:
    """A small BPE knowing ChatML's special tokens, with ``template`` (the chat tests' tokenizer folder)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(words) + "?. You are a helpful assistant.\nsystem user assistant"] * 20,
                            trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
