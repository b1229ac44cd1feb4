"""The launch scripts of the hand-offs (``run_verl.sh``, ``run_openrlhf.sh``): bash that a user runs on a multi-GPU
node. Shared here: the option parsing (GPU counts, vLLM settings, output folder, engine overrides after ``--``), the
check of the installed engine release, the helpers that derive micro-batches from the GPU count, and the final
``exec python3 -m <engine> ...``. Each engine supplies its options, its checks / derivations (bash) and its
arguments."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from lorarl.export.engines.common import HandOff


@dataclass(frozen=True)
class Option:
    """A launch-script option ``--flag VALUE`` stored in shell variable ``var`` (``default`` is a shell word)."""

    flag: str
    var: str
    default: str
    help: str
    kind: str = "int"  # int (>= 1), fraction (0 < x <= 1), path


COMMON_OPTIONS = (
    Option("--gpus", "GPUS", "8", "GPUs per node"),
    Option("--nodes", "NODES", "1", "nodes (Ray cluster already started on each)"),
    Option("--vllm-tp", "VLLM_TP", "1", "vLLM tensor-parallel size (GPUs per rollout engine)"),
    Option("--vllm-mem", "VLLM_MEM", "0.5", "fraction of each GPU's memory vLLM may take", "fraction"),
)

# bash helpers every script has; `die` prints ONE line naming what is wrong and exits 2
HELPERS = r"""die() { echo "$SCRIPT: $*" >&2; exit 2; }
check_int() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 must be a whole number >= 1, got '$2'"; }
check_fraction() { [[ "$2" =~ ^(0?\.[0-9]*[1-9][0-9]*|1(\.0*)?)$ ]] || die "$1 must be a number in (0, 1], got '$2'"; }
# largest divisor of $1 that is <= $2 (micro-batches must split a GPU's share of a batch evenly)
divisor_le() { local n=$1 d=$2; ((d > n)) && d=$n; while ((n % d)); do d=$((d - 1)); done; echo "$d"; }
# the GPU counts (up to 64) that divide $1, for the error message
gpu_counts() { local n=$1 g out=""; for ((g = 1; g <= 64 && g <= n; g++)); do ((n % g)) || out="$out $g"; done; echo "${out# }"; }
# die unless the total GPU count divides $2 ($1 says what it is)
need_split() {
    (($2 % TOTAL_GPUS == 0)) || die "$1 ($2) cannot be split evenly over $TOTAL_GPUS GPUs ($NODES node(s) x $GPUS); total GPU counts that work: $(gpu_counts "$2")"
}"""


@dataclass
class Script:
    """One launch script: its engine, options beyond the common ones, derivations / checks (bash lines run after
    the options are parsed and validated) and the engine's arguments (one bash word each, already quoted)."""

    name: str  # run_verl.sh
    package: str  # the pip distribution checked: verl / openrlhf
    series: str  # supported release series ("0.9" = 0.9.x)
    checked: str  # the release the mapping was checked against
    launcher: str  # python -m <launcher>
    about: list[str]  # header comment lines: what it runs
    options: list[Option] = field(default_factory=list)
    body: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)


def micro_option(h: HandOff) -> Option:
    """``--micro``: the most samples per GPU per forward/backward (the recipe's micro-batch; 8 for ``auto``)."""
    micro = h.recipe.train.micro_batch_size
    return Option("--micro", "MICRO", str(micro if isinstance(micro, int) else 8), "most samples per GPU per pass")


def split_checks(h: HandOff) -> list[str]:
    """Bash: die unless the total GPU count splits the step's batches evenly (both engines give every rank the same
    share); sets STEP_SAMPLES (samples per optimizer step) and ROLLOUT_SAMPLES (samples per RL step)."""
    r, t = h.recipe, h.recipe.train
    if r.algo == "grpo":
        n = t.prompts_per_step * r.grpo.group_size
        what = f"samples per step (train.prompts_per_step {t.prompts_per_step} x grpo.group_size {r.grpo.group_size})"
        return [f'need_split "{what}" {n}', f"STEP_SAMPLES={n}", f"ROLLOUT_SAMPLES={n}"]
    p, mb = t.prompts_per_step, r.ppo.minibatch_size
    return [
        f'need_split "responses per step (train.prompts_per_step)" {p}',
        f'need_split "responses per optimizer step (ppo.minibatch_size)" {mb}',
        f"STEP_SAMPLES={mb}",
        f"ROLLOUT_SAMPLES={p}",
    ]


def _usage(s: Script, options: list[Option]) -> list[str]:
    lines = [f"Usage: bash {s.name} [options] [-- {s.package} arguments, appended last (they win)]", "Options:"]
    lines += [f"  {o.flag + ' ' + o.var:<20} {o.help} (default: {o.default})" for o in options]
    lines.append(f"  {'-h, --help':<20} this text")
    lines.append(
        f"Needs {s.package} {s.series}.x (checked against {s.checked}); LORARL_IGNORE_ENGINE_VERSION=1 skips the check."
    )
    return lines


def _parse(s: Script, options: list[Option]) -> list[str]:
    """The option loop and the validation of each option's value."""
    lines = ["while (($#)); do", '    case "$1" in']
    for o in options:
        lines.append(f'        {o.flag}) (($# >= 2)) || die "{o.flag} needs a value"; {o.var}="$2"; shift 2 ;;')
    lines += [
        "        -h | --help) usage; exit 0 ;;",
        "        --) shift; break ;;",
        f"        *) die \"unknown option '$1' (see bash {s.name} --help; {s.package} arguments go after --)\" ;;",
        "    esac",
        "done",
    ]
    for o in options:
        if o.kind == "int":
            lines.append(f'check_int {o.flag} "${o.var}"')
        elif o.kind == "fraction":
            lines.append(f'check_fraction {o.flag} "${o.var}"')
    return lines


def _version_check(s: Script) -> list[str]:
    """Fail with what to do when the engine is missing or of another release series."""
    probe = f"import importlib.metadata as m; print(m.version({s.package!r}))"
    pin = f"pip install '{s.package}=={s.checked}'"
    return [
        f'found=$("$PY" -c {shlex.quote(probe)} 2>/dev/null) ||',
        f'    die "{s.package} is not installed for $PY: {pin} (this hand-off is for {s.package} {s.series}.x)"',
        'case "$found" in',
        f"    {s.series} | {s.series}.*) ;;",
        '    *) [[ "${LORARL_IGNORE_ENGINE_VERSION:-}" == 1 ]] ||',
        f'        die "{s.package} $found is installed; this hand-off was written for {s.package} {s.series}.x'
        f" (checked against {s.checked}): {pin}, or export again with a lorarl that supports $found"
        ' (LORARL_IGNORE_ENGINE_VERSION=1 runs it anyway)" ;;',
        "esac",
    ]


def render(s: Script) -> str:
    """The script's text."""
    options = list(COMMON_OPTIONS) + s.options
    lines = ["#!/usr/bin/env bash", *[f"# {a}" if a else "#" for a in s.about], "#"]
    lines += [f"# {u}" for u in _usage(s, options)]
    lines += [
        "set -euo pipefail",
        f"SCRIPT={s.name}",
        'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        'PY="${PYTHON:-python3}"  # the Python that has the engine installed',
        *[f"{o.var}={o.default}" for o in options],
        HELPERS,
        "usage() {",
        *[f"    echo {shlex.quote(u)}" for u in _usage(s, options)],
        "}",
        *_parse(s, options),
        *_version_check(s),
        "TOTAL_GPUS=$((GPUS * NODES))",
        '((TOTAL_GPUS % VLLM_TP == 0)) || die "--vllm-tp $VLLM_TP does not divide the $TOTAL_GPUS GPUs"',
        *s.body,
        f'echo "$SCRIPT: {s.package} $found on $TOTAL_GPUS GPU(s); writing to $OUT" >&2',
        f'exec "$PY" -m {s.launcher} \\',
        *[f"    {a} \\" for a in s.arguments],
        '    "$@"',
    ]
    return "\n".join(lines) + "\n"
