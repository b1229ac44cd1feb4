"""The browser workbench (``lorarl chat``): train, watch, chat, vote -> retrain, export, on one base.

Backend modules (no Gradio): :mod:`.paths` (every name from the page -> a file inside the configured folders),
:mod:`.recipes` (launchable recipes, common fields, validation by the recipe loader, the planner's line),
:mod:`.jobs` (one ``lorarl train`` subprocess at a time: launch, stop, resume), :mod:`.watch` (a run folder read as it
grows), :mod:`.retrain` (the chat's votes -> a DPO or reward-model run), :mod:`.exporting` (export with the fidelity
gate's figures). The page itself: :mod:`.layout` and :mod:`.handlers`, hooked into :mod:`lorarl.chat.app`.
"""
