"""From and to Hugging Face: import a checkpoint, fine-tune it, export it, load it with transformers.

    python examples/hf_roundtrip.py --init-from path/to/local/hf-folder   # Llama / Mistral / Qwen2
    python examples/hf_roundtrip.py                                       # builds a tiny random Llama

The same steps from the shell:

    paratrain train --init-from DIR --steps 20 --seq-len 64 --out runs/ft      # any --dp/--tp/--pp/--zero
    paratrain eval --run runs/ft --text-file notes.txt --json
    paratrain export runs/ft --hf runs/ft-hf
    paratrain generate --init-from runs/ft-hf --greedy "def "

Without --init-from, transformers (only needed here, to make a folder to start from) builds a
random LlamaForCausalLM offline; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

import torch  # noqa: E402

from paratrain import cli  # noqa: E402


def tiny_llama(folder: Path) -> None:
    """A random 2-layer Llama + a small byte-level BPE, saved as a hub folder would be."""
    import sysconfig

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init-from", help="a local Hugging Face folder (default: a tiny random Llama)")
    parser.add_argument("--workdir", help="where the runs go (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="paratrain-hf-"))
    src = Path(args.init_from) if args.init_from else work / "source"
    if not args.init_from:
        tiny_llama(src)

    # 1. Fine-tune the imported model (shape, weights and tokenizer come from the folder).
    run = work / "run"
    code = cli.main(["train", "--init-from", str(src), "--steps", str(args.steps), "--seq-len", "32",
                     "--global-batch", "4", "--max-files", "20", "--eval-every", "0", "--lr", "1e-3",
                     "--out", str(run), "--no-progress"])
    if code:
        return code
    # 2. Its loss on a text, then 3. the Hugging Face folder transformers loads.
    sample = work / "sample.txt"
    sample.write_text("def wrap(text, width=70):\n    return text.split()\n")
    cli.main(["eval", "--run", str(run), "--text-file", str(sample), "--json"])
    cli.main(["export", str(run), "--hf", str(work / "export")])

    # 4. Check: transformers computes the same logits as paratrain's fine-tuned model.
    from paratrain.inference.folders import load_run

    ours, _ = load_run(str(run))
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = ours(ids)
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("transformers not installed: skipping the comparison")
        return 0
    theirs = AutoModelForCausalLM.from_pretrained(str(work / "export")).float().eval()
    with torch.no_grad():
        diff = (theirs(ids).logits - mine).abs().max().item()
    print(json.dumps({"architecture": type(theirs).__name__, "export": str(work / "export")}))
    print(f"max |logits difference| paratrain vs transformers: {diff:.2e}")
    return 0 if diff < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
