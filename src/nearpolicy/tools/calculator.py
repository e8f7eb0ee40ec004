"""Exact arithmetic on integers and decimals, parsed with `ast` (no eval): + - * / // % ** and parentheses.
Literals are read as written (0.1 is 1/10, not the nearest float); results are exact: an integer, a terminating
decimal, or a reduced fraction "p/q"."""

from __future__ import annotations

import ast
import operator
from decimal import Decimal, localcontext
from fractions import Fraction

MAX_EXPONENT = 64  # a ** b needs |b| <= this: 9 ** 10 ** 9 would not finish
MAX_DIGITS = 400  # no intermediate result longer than this many digits
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The value of `expression` as text ("413", "2.5", "1/3"). Raises ValueError naming what is not allowed
    (a name, a call, a too large exponent or result) or ZeroDivisionError."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {err.msg}") from None
    return _text(_value(tree.body, expression.strip()))


def _value(node: ast.AST, source: str) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        literal = ast.get_source_segment(source, node) or str(node.value)  # "0.1" as written, not the float
        try:
            value = Fraction(literal.replace("_", ""))
        except (ValueError, ZeroDivisionError):
            value = Fraction(str(node.value))
        if len(str(value.numerator)) + len(str(value.denominator)) > MAX_DIGITS:
            raise ValueError(f"a number longer than {MAX_DIGITS} digits")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand, source))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, source), _value(node.right, source)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > MAX_EXPONENT):
            raise ValueError(f"exponents must be whole numbers of at most {MAX_EXPONENT}")
        result = Fraction(_BINARY[type(node.op)](left, right))
        if len(str(result.numerator)) + len(str(result.denominator)) > MAX_DIGITS:
            raise ValueError(f"a result longer than {MAX_DIGITS} digits")
        return result
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def _text(value: Fraction) -> str:
    """An integer, a terminating decimal written out exactly, or else the reduced fraction "p/q"."""
    if value.denominator == 1:
        return str(value.numerator)
    rest = value.denominator
    for factor in (2, 5):
        while rest % factor == 0:
            rest //= factor
    if rest == 1:  # the denominator divides a power of ten: the decimal expansion terminates
        with localcontext() as ctx:
            ctx.prec = 2 * MAX_DIGITS
            return format((Decimal(value.numerator) / Decimal(value.denominator)).normalize(), "f")
    return f"{value.numerator}/{value.denominator}"
