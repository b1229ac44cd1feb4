"""Chat with the base model and trained checkpoints side by side (same as ``lorarl chat``).

    python apps/chat.py --runs runs                # http://127.0.0.1:7860
    python apps/chat.py --runs runs --port 7861 --model smollm2-135m

Lists the base model, every run under ``--runs`` (final adapter and saved steps) and merged exports; 2 to 4 panes
answer the same prompt, streaming, from one base loaded once. Votes are saved to ``RUNS/preferences.jsonl``.
The Train / Watch / Export tabs around the chat are the workbench (docs/workbench.md); ``--chat-only`` leaves them out.
"""

from __future__ import annotations

import sys

from lorarl.cli import main as lorarl_main


def main(argv: list[str] | None = None) -> int:
    """``lorarl chat`` with these arguments (the same options, errors and exit codes)."""
    return lorarl_main(["chat", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
