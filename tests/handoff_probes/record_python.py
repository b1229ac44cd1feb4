"""Stands in for the engine's Python in a launch script (``PYTHON=...``): ``-c CODE`` runs CODE (the script's
version check, which then reads the pinned release's metadata from PYTHONPATH); ``-m MODULE ARGS`` appends
``[MODULE, *ARGS]`` as one JSON line to the file named by ``LORARL_RECORD`` instead of starting the engine, so a
test gets exactly the argv the script would exec."""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["-c"]:
        code = sys.argv[2]
        sys.argv = ["-c", *sys.argv[3:]]
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    elif sys.argv[1:2] == ["-m"]:
        with open(os.environ["LORARL_RECORD"], "a", encoding="utf-8") as f:
            f.write(json.dumps(sys.argv[2:]) + "\n")
    else:
        sys.exit(f"record_python.py: unexpected arguments {sys.argv[1:]}")
