"""TRL's on-policy distillation quick start (TRL docs, docs/source/distillation_trainer.md, "Quick start"), with only
the import changed (``from trl import DistillationConfig, DistillationTrainer`` -- TRL 1.16 exports both from
``trl``; the docs of the trainer's experimental days read ``trl.experimental.distillation`` -- to
``from lorarl.trl import ...``) and the names read from variables, so it runs on the embedded model without the hub:

    MODEL    TRL's "Qwen/Qwen2.5-1.5B-Instruct" (the student); here the embedded SmolLM2-135M-Instruct
             (QUICKSTART_MODEL to change)
    TEACHER  TRL's "Qwen/Qwen2.5-7B-Instruct"; QUICKSTART_TEACHER: a model folder with the student's tokenizer (a
             merged export of a lorarl run, say), or a PEFT adapter folder (frozen on the student's own base)
    DATA     TRL's "openai/gsm8k" (a hub name, as TRL); QUICKSTART_DATA: a local dataset folder with its "main"
             configuration instead
    BF16     TRL's ``bf16=True``, which transformers refuses on a machine without a bf16 GPU: True where there is
             one, else False

    QUICKSTART_TEACHER=runs/grpo_arithmetic_merged python examples/trl_quickstarts/distillation.py

writes ``results/distill-qwen-gsm8k`` (TRL's output_dir): the student's adapter (``trainer.save_model()``), the run's
metrics by TRL's names. tests/test_distill.py runs this file unchanged on a tiny student, a tiny teacher and a local
copy of the dataset's fields.
"""

import os

import torch

MODEL = os.environ.get("QUICKSTART_MODEL", "smollm2-135m")
TEACHER = os.environ.get("QUICKSTART_TEACHER", "runs/grpo_arithmetic_merged")
DATA = os.environ.get("QUICKSTART_DATA", "openai/gsm8k")
BF16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()

# distillation quick start  (TRL's from here on; names: MODEL, TEACHER, DATA, BF16)
from datasets import load_dataset  # noqa: E402

from lorarl.trl import DistillationConfig, DistillationTrainer  # noqa: E402

# 1. Load dataset and format as a prompt-only column
dataset = load_dataset(DATA, "main", split="train")
dataset = dataset.map(
    lambda x: {"prompt": [{"role": "user", "content": x["question"]}]},
    remove_columns=dataset.column_names,
)

# 2. Configure distillation
config = DistillationConfig(
    output_dir="results/distill-qwen-gsm8k",
    num_train_epochs=1,
    bf16=BF16,
    save_strategy="no",
    # Distillation
    beta=1.0,  # reverse KL
    # Teacher
    teacher_model_init_kwargs={"dtype": "bfloat16"},
)

# 3. Train
trainer = DistillationTrainer(
    model=MODEL,
    teacher_model=TEACHER,
    args=config,
    train_dataset=dataset,
)
trainer.train()
trainer.save_model()
