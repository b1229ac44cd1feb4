"""The browser workbench (``lorarl chat``): train, watch, chat, vote -> retrain, export, on one base.

Backend modules (no Gradio): :mod:`.paths` (every name from the page -> a file inside the configured folders),
:mod:`.recipes` (launchable recipes, common fields, validation by the recipe loader, the planner's line),
:mod:`.cost` (the recipe's cost on this machine: memory, time, a GPU recipe's warning), :mod:`.preflight` (what a
launch would fail on: adapters, data files, reward columns), :mod:`.jobs` (one ``lorarl train`` subprocess at a
time: launch, stop, resume), :mod:`.watch` (a run folder read as it grows), :mod:`.results` (a finished run's
held-out result and total time, why a curve is empty), :mod:`.live` (inside the running step; what Stop will do and
did), :mod:`.retrain` (the chat's votes -> a DPO or reward-model run), :mod:`.exporting` (export with the fidelity
gate's figures). The page itself: :mod:`.layout`, :mod:`.views` (the Watch tab's outputs) and :mod:`.handlers` with
its tabs' mixins :mod:`.train_tab` and :mod:`.export_tab`, hooked into :mod:`lorarl.chat.app`.
"""
