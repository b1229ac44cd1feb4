"""Chat with the base model and trained checkpoints side by side (same as ``lorarl chat``).

    python apps/chat.py --runs runs                # http://127.0.0.1:7860
    python apps/chat.py --runs runs --port 7861 --model smollm2-135m

Lists the base model, every run under ``--runs`` (final adapter and saved steps) and merged exports; 2 to 4 panes
answer the same prompt, streaming, from one base loaded once. Votes are saved to ``RUNS/preferences.jsonl``.
The Train / Watch / Export tabs around the chat are the workbench (docs/workbench.md); ``--chat-only`` leaves them out.
"""

from __future__ import annotations

import argparse

from lorarl.chat import launch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="runs", help="directory of runs and exports to offer (default: runs)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--model", default=None, help="base model (default: the runs' base, else the embedded default)")
    p.add_argument("--chat-only", action="store_true", help="only the chat, without the Train / Watch / Export tabs")
    args = p.parse_args(argv)
    launch(
        runs_dir=args.runs,
        host=args.host,
        port=args.port,
        model=args.model,
        share=False,
        workbench=not args.chat_only,
    )


if __name__ == "__main__":
    main()
