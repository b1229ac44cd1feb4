"""Pipelines: stages (SFT, rejection sampling, GRPO, PPO, reward model) run in order on one base, each starting from
the previous stage's adapter, each resumable, with a held-out evaluation and a summary table after every stage.

``lorarl pipeline RECIPE --out DIR``; the recipe format is in :mod:`lorarl.pipeline.spec`, the run in
:mod:`lorarl.pipeline.run`.
"""

from lorarl.pipeline.run import run_pipeline
from lorarl.pipeline.spec import Pipeline, Stage, load_pipeline

__all__ = ["Pipeline", "Stage", "load_pipeline", "run_pipeline"]
