"""TRL's SFT quick start on a language-modeling dataset (TRL docs, docs/source/sft_trainer.md: the ``stanfordnlp/imdb``
example, a dataset with a ``text`` column, ``SFTConfig(max_length=512)``; and its "Packing" section's
``SFTConfig(packing=True)``), with only the import changed (``from trl import SFTConfig, SFTTrainer`` ->
``from trl import SFTConfig`` + ``from lorarl.trl import SFTTrainer``) and the model, dataset and output folder
read from variables, so it runs on the embedded model without the hub:

    MODEL   TRL's "facebook/opt-350m"; here the embedded SmolLM2-135M-Instruct (QUICKSTART_MODEL to change)
    DATA    TRL's "stanfordnlp/imdb"; here the 40 short movie reviews in examples/trl_quickstarts/imdb_sample/
            (a ``text`` column, as imdb's; QUICKSTART_DATA: another dataset folder or a hub name)
    OUTPUT  TRL's "/tmp"; here ./<model>-SFT (a run folder of its own)
    USE_CPU not in TRL's example: transformers refuses SFTConfig's default bf16 on a machine without a bf16 GPU
            unless ``use_cpu=True`` (TRL's own script fails there too); True where no GPU is visible

    python examples/trl_quickstarts/sft_text.py         # every token of each review trained, rows packed

Each review is trained on every token (TRL's language modeling), the tokenizer's EOS appended; ``packing=True``
lays the reviews end to end in rows of 512 tokens, each attending only to itself (docs/trl_dropin.md).
tests/test_trl_dropin.py runs this file unchanged on a tiny model and a local copy of the dataset's fields.
"""

import os
from pathlib import Path

import torch

MODEL = os.environ.get("QUICKSTART_MODEL", "smollm2-135m")
DATA = os.environ.get("QUICKSTART_DATA", str(Path(__file__).parent / "imdb_sample"))
OUTPUT = f"{MODEL.rstrip('/').split('/')[-1]}-SFT"
USE_CPU = not torch.cuda.is_available()

# TRL's quick start from here on (names: MODEL, DATA, OUTPUT, USE_CPU)
from datasets import load_dataset  # noqa: E402
from trl import SFTConfig  # noqa: E402

from lorarl.trl import SFTTrainer  # noqa: E402

dataset = load_dataset(DATA, split="train")

training_args = SFTConfig(
    max_length=512,
    packing=True,  # TRL's docs, "Packing"
    output_dir=OUTPUT,
    use_cpu=USE_CPU,
)
trainer = SFTTrainer(
    MODEL,
    train_dataset=dataset,
    args=training_args,
)
trainer.train()
