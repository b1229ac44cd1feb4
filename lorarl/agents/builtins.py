"""The built-in tools: an exact calculator and a Python executor in lorarl's sandbox.

The calculator never evaluates model text: the expression is parsed with :mod:`ast` and only a whitelist of nodes
is walked (numbers, ``+ - * / // % **``, unary ``+ -``, parentheses), with exact arithmetic (``int`` and
:class:`fractions.Fraction`; a decimal literal such as ``0.1`` is read as the fraction ``1/10``). Everything else --
names, calls, attributes, strings, comparisons -- is refused with a message the model reads.

The Python tool runs the code with :func:`lorarl.sandbox.run_python` under :class:`lorarl.sandbox.SandboxLimits`
(CPU, memory, processes, output, no network where the machine allows it, a private temporary directory) and
returns what it printed.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

MAX_EXPRESSION_CHARS = 500
MAX_POWER = 10_000  # |exponent| cap: 2 ** 10**9 would take the machine's memory
MAX_DIGITS = 4_000  # results with more digits are refused (exact, but useless to a model and slow to print)
MAX_BITS = 40_000  # every intermediate result (numerator and denominator) stays under this many bits (~12,000 digits)

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _number(node: ast.Constant) -> int | Fraction:
    value = node.value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"not a number: {value!r}")
    if isinstance(value, int):
        return value
    return Fraction(repr(value))  # the decimal the model wrote, exactly ("0.1" -> 1/10)


def _bits(x: int | Fraction) -> int:
    """The size of an exact number: bits of an int, of a fraction's numerator plus denominator."""
    if isinstance(x, Fraction):
        return x.numerator.bit_length() + x.denominator.bit_length()
    return x.bit_length()


def result_bits(op: ast.operator, left: int | Fraction, right: int | Fraction) -> int:
    """An upper bound on the size (:func:`_bits`) of ``left op right``, known before computing it:
    ``a ** n`` has at most ``bits(a) * |n|`` bits (each of numerator and denominator); ``+ - * / // %`` at most
    ``bits(a) + bits(b) + 1`` (a sum of fractions multiplies the denominators). Example: ``9 ** 9999`` -> 4 * 9999 =
    39,996 bits (allowed; it has 31,697), ``(9 ** 9999) ** 999`` -> 31,697 * 999 = 31,665,303 bits (refused)."""
    if isinstance(op, ast.Pow):
        return max(_bits(left), 1) * abs(int(right))
    return _bits(left) + _bits(right) + 1


def _eval(node: ast.AST) -> int | Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        return _number(node)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if not (isinstance(right, int) or (isinstance(right, Fraction) and right.denominator == 1)):
                raise ValueError("only whole-number exponents are supported")
            if abs(int(right)) > MAX_POWER:
                raise ValueError(f"exponent larger than {MAX_POWER}")
            right = int(right)
        if result_bits(node.op, left, right) > MAX_BITS:
            raise ValueError(f"an intermediate result would have more than {MAX_BITS} bits (about 12,000 digits)")
        if isinstance(node.op, ast.Pow):
            if right < 0:
                return Fraction(1) / Fraction(left) ** -right
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        if isinstance(node.op, ast.Div):
            return Fraction(left) / Fraction(right)
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def format_number(value: int | Fraction) -> str:
    """An exact result as text: an integer as digits, a fraction with a finite decimal expansion as that decimal,
    any other fraction as ``p/q``. Examples: ``12`` -> ``"12"``, ``1/4`` -> ``"0.25"``, ``1/3`` -> ``"1/3"``."""
    if isinstance(value, Fraction) and value.denominator == 1:
        value = value.numerator
    if isinstance(value, int):
        return str(value)
    q = value.denominator
    twos = fives = 0
    while q % 2 == 0:
        q, twos = q // 2, twos + 1
    while q % 5 == 0:
        q, fives = q // 5, fives + 1
    if q != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value.numerator) * 10**places // value.denominator
    digits = str(scaled).rjust(places + 1, "0")
    sign = "-" if value < 0 else ""
    return f"{sign}{digits[:-places]}.{digits[-places:]}"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: An arithmetic expression with numbers, + - * / // % ** and parentheses, e.g. "123 * 45".
    """
    if not isinstance(expression, str):
        raise ValueError("expression must be a string")
    text = expression.strip().replace("×", "*").replace("^", "**")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as arithmetic") from None
    try:
        value = _eval(tree)
        out = format_number(value)
    except RecursionError:
        raise ValueError("expression nested too deeply") from None
    except ValueError as e:
        if "integer string conversion" not in str(e):
            raise
        raise ValueError(f"result has more than {MAX_DIGITS} digits") from None
    if len(out) > MAX_DIGITS:
        raise ValueError(f"result has more than {MAX_DIGITS} digits")
    return out


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it printed.

    Args:
        code: A Python program; use print() to show results.
    """
    from lorarl.sandbox import SandboxLimits, run_python

    if not isinstance(code, str):
        raise ValueError("code must be a string")
    result = run_python(code, limits=SandboxLimits(wall_seconds=5.0, cpu_seconds=4, memory_mb=512))
    if result.killed_reason is not None:
        raise RuntimeError(f"the program was stopped ({result.killed_reason}); output so far: {result.stdout[-500:]}")
    if result.returncode != 0:
        err = result.stderr.strip().splitlines()
        raise RuntimeError(err[-1] if err else f"exit status {result.returncode}")
    return result.stdout


BUILTIN_TOOLS = {"calculator": calculator, "python": python}
