"""Fine-tune a Hugging Face model on your own chats with LoRA, then take the adapters to PEFT.

    python examples/finetune_chat.py --init-from path/to/hf-folder --data chat.jsonl   # yours
    python examples/finetune_chat.py                    # a tiny random Qwen2 and 200 made-up chats

The same steps from the shell (README "Fine-tune your model"):

    paratrain train --init-from DIR --data chat.jsonl --lora 16 --nproc 2 --zero 3 --out runs/chat
    paratrain eval --run runs/chat --data chat.jsonl --json
    paratrain export runs/chat --peft runs/chat-adapter
    paratrain export runs/chat --hf runs/chat-merged
    paratrain generate --run runs/chat --chat "What is 2 + 3?"

The chats are rendered with the folder's own chat template; the loss counts the assistant turns
only; examples are packed into rows without attending to each other. Without --init-from,
transformers (only needed here, to make a folder to start from) builds a random Qwen2 offline with
the ChatML template Qwen2's instruct models ship; nothing is downloaded. The last step loads the
exported adapter with peft onto the base and checks its logits equal the merged export's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

import torch  # noqa: E402

from paratrain import cli  # noqa: E402

# Qwen2-Instruct's template (ChatML): a default system turn when the chat has none.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_qwen2(folder: Path, texts: list[str]) -> None:
    """A random 2-layer Qwen2 + a small byte-level BPE with ChatML's special tokens, saved as a
    hub folder would be."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=specials,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    config = transformers.Qwen2Config(
        vocab_size=416,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)


def made_up_chats(n: int) -> list[dict]:
    """Arithmetic questions and answers, some with a system turn, some with two exchanges."""
    rng = random.Random(0)
    rows = []
    for i in range(n):
        a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
        messages = [{"role": "system", "content": "Answer with the sum."}] if i % 3 == 0 else []
        messages += [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
        ]
        if i % 2:
            messages += [
                {"role": "user", "content": f"And plus {c}?"},
                {"role": "assistant", "content": f"{a + b} + {c} = {a + b + c}."},
            ]
        rows.append({"messages": messages})
    return rows


def peft_matches_merged(base: Path, adapter: Path, merged: Path) -> float | None:
    """Max |logit difference| between peft's base + adapter and the merged export (None: no peft)."""
    try:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("peft or transformers not installed: skipping the comparison")
        return None
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_model = AutoModelForCausalLM.from_pretrained(str(base))
        with_adapter = PeftModel.from_pretrained(base_model, str(adapter))
        want = with_adapter.float().eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(merged)).float().eval()(ids).logits
    return (want - got).abs().max().item()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--init-from", help="a local Hugging Face folder with a chat template (default: a tiny random Qwen2)"
    )
    parser.add_argument("--data", help="your chats (.jsonl / .parquet with `messages`; default: 200 made up)")
    parser.add_argument("--workdir", help="where the runs go (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the ZeRO-3 run (default: %(default)s)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="paratrain-chat-"))
    work.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else work / "chat.jsonl"
    if not args.data:
        data.write_text("".join(json.dumps(r) + "\n" for r in made_up_chats(200)))
    base = Path(args.init_from) if args.init_from else work / "base"
    if not args.init_from:
        tiny_qwen2(base, [json.dumps(r) for r in made_up_chats(200)])

    run = work / "run"
    steps = [
        [
            "train",
            "--init-from",
            str(base),
            "--data",
            str(data),
            "--lora",
            "16",
            "--nproc",
            str(args.nproc),
            "--zero",
            "3",
            "--steps",
            str(args.steps),
            "--seq-len",
            "128",
            "--global-batch",
            "8",
            "--lr",
            "3e-3",
            "--eval-every",
            "0",
            "--no-progress",
            "--out",
            str(run),
            "--overwrite",
        ],
        ["eval", "--run", str(run), "--data", str(data), "--json"],  # loss over the assistant tokens
        [
            "export",
            str(run),
            "--peft",
            str(work / "adapter"),
        ],  # adapter_config.json, adapter_model.safetensors
        ["export", str(run), "--hf", str(work / "merged")],  # the base with the adapters merged in
        ["generate", "--run", str(run), "--chat", "What is 2 + 3?", "--greedy", "--tokens", "8"],
    ]
    for argv in steps:
        print("$ paratrain " + " ".join(argv), flush=True)
        code = cli.main(argv)
        if code:
            return code
    diff = peft_matches_merged(base, work / "adapter", work / "merged")
    if diff is not None:
        print(f"max |logits difference| peft (base + adapter) vs the merged export: {diff:.2e}")
    return 0 if diff is None or diff < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
