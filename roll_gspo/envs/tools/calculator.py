"""Exact arithmetic on a parsed expression (no `eval`): the calculator tool's function, and the
math env's generated answers."""
from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction
from typing import Union

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_MAGNITUDE = 10 ** 100
_MAX_EXPONENT = 1000
_MAX_EXPRESSION_CHARS = 500


def evaluate_arithmetic(expression: str) -> Union[Fraction, float]:
    """The value of an arithmetic expression: numbers, ``+ - * / // % **``, parentheses.
    Integers and decimals are exact (Fraction); ValueError for anything else (names, calls,
    attributes), a division by zero, or numbers beyond 1e100 / exponents beyond 1000 (so no
    expression can exhaust memory or time)."""
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("expected an arithmetic expression")
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def value(node: ast.AST) -> Union[Fraction, float]:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            if not abs(node.value) <= _MAX_MAGNITUDE:  # also refuses inf and nan
                raise ValueError("number too large")
            return Fraction(node.value) if isinstance(node.value, int) else Fraction(repr(node.value))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            if isinstance(node.op, ast.Pow):
                if not (isinstance(right, Fraction) and right.denominator == 1) or abs(right) > _MAX_EXPONENT:
                    raise ValueError(f"exponent must be an integer of at most {_MAX_EXPONENT}")
                if left == 0 and right < 0:
                    raise ValueError("division by zero")
                if abs(left) > 1 and abs(right) * math.log10(abs(float(left))) > 100:
                    raise ValueError("result too large")
            result = _BINARY[type(node.op)](left, right)
            if isinstance(result, Fraction) and (abs(result.numerator) > _MAX_MAGNITUDE or
                                                 result.denominator > _MAX_MAGNITUDE):
                raise ValueError("result too large")
            return result
        raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, found {type(node).__name__}")

    return value(tree)


def format_number(number: Union[Fraction, float]) -> str:
    """An integer as is, another rational as a decimal to 12 significant digits."""
    if isinstance(number, Fraction) and number.denominator == 1:
        return str(number.numerator)
    text = format(float(number), ".12g")
    return text


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. "12*(7+5)/3".

    Args:
        expression: numbers with + - * / // % ** and parentheses.
    """
    return format_number(evaluate_arithmetic(expression))
