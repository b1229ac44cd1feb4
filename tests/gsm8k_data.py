"""GSM8K-shaped test data: rows in openai/gsm8k's format and a local folder laid out like its hub repository
(a README declaring the two configurations, parquet shards per split). Shared by tests/test_sources.py and
tests/test_recipes_gsm8k.py."""

from __future__ import annotations

from pathlib import Path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


GSM_TRAIN = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn total 48+24 = <<48+24=72>>72 clips.\n#### 72"},
    {"question": "Weng earns $12 an hour. She worked 50 minutes. How much did she earn?",
     "answer": "Per minute $12/60 = $<<12/60=0.2>>0.2.\nFor 50 minutes 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
    {"question": "Betty has half of the $100 she needs. How much more does she need?",
     "answer": "She has 100 / 2 = $<<100/2=50>>50.\n#### 50"},
]  # fmt: skip
GSM_TEST = [
    {"question": "Janet's ducks lay 16 eggs a day. She eats 3 and bakes with 4. How many are left?",
     "answer": "16 - 3 - 4 = <<16-3-4=9>>9\n#### 9"},
    {"question": "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total?",
     "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total is 2+1=<<2+1=3>>3 bolts\n#### 3"},
]  # fmt: skip
GSM_README = """\
---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
  - split: test
    path: socratic/test-*
---
# GSM8K-shaped test data
"""


def make_gsm8k_repo(root):
    """A folder laid out like the openai/gsm8k hub repository: README with two configurations, parquet shards."""
    for config in ("main", "socratic"):
        write_parquet(root / config / "train-00000-of-00001.parquet", GSM_TRAIN)
        write_parquet(root / config / "test-00000-of-00001.parquet", GSM_TEST)
    (root / "README.md").write_text(GSM_README)
    return root
