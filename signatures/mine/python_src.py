"""Message templates from Python sources, read with :mod:`ast` (nothing is imported or run).

What counts as a message: the first argument of a logger's ``error``/``warning``/``exception``
/``critical``/``fatal`` calls (and their ``_once`` forms), of ``warnings.warn``, the message
of every ``raise X(...)``, and every ``assert``'s message (or, when it has none, its condition:
a traceback shows the ``assert`` line, so the condition is what a report carries). Values
formatted into a message (f-string fields, ``%`` and ``str.format`` conversions, concatenated
names) become typed wildcards (:mod:`signatures.index.tokens`).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass

from signatures.index.failures import interpreter_message
from signatures.index.model import Level
from signatures.index.tokens import join, literal_chars, literal_text

LOG_LEVELS = {"error": Level.ERROR, "exception": Level.ERROR, "critical": Level.FATAL,
              "fatal": Level.FATAL, "warning": Level.WARNING, "warn": Level.WARNING,
              "info": Level.INFO, "debug": Level.INFO}
"""Logger methods (also as ``<name>_once`` / ``<name>_rank0``) and the level they log at."""
MAX_TEMPLATE = 400
MIN_LETTERS = 6
"""A template that fixes fewer letters says nothing (``{*}: {*}``)."""
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[hlL]?"
                     r"([diouxXeEfFgGcrsa%])")
_FORMAT = re.compile(r"\{\{|\}\}|\{[^{}]*\}")
_SPACE = re.compile(r"\s+")
#: Below warning, only a message that states a failure is kept.
_STATES_FAILURE = re.compile(
    r"(?i)\bfail|\berror|\bunable\b|\bcannot\b|\bcan't\b|\bcould not\b|\btimed? ?out|"
    r"\bno (?:free |available )?(?:memory|space|blocks?)|\bnot enough\b|\bfull\b|\bexceed|"
    r"\binvalid\b|\brefused\b|\bleak|\bmismatch|\bretry|\bretrying\b|\bexpired?\b|\bdropp?")
#: Variables a message is built in before it is raised or logged (``msg = f"..."``).
_MESSAGE_VAR = re.compile(r"(?i)(?:^|_)(?:msg|message|err|error|errmsg|reason|warning|text)s?$")
#: Helpers that report what they are given as an error (``raise_error_or_warn(self, .., msg)``).
_REPORTER = re.compile(r"(?i)(?:raise|error|warn|fail|abort|report)")

@dataclass(frozen=True)
class Found:
    """One message found in a source file."""

    text: str
    function: str
    level: Level
    exception: str
    line: int


def _kind_of_spec(spec: str) -> str:
    spec = spec.strip()
    if not spec:
        return "any"
    last = spec[-1]
    if last in "dn" or last == "i":
        return "d"
    if last in "eEfFgG%":
        return "f"
    if last in "xX":
        return "x"
    return "any"


def _lit(text: str) -> tuple[str, str]:
    return "lit", _SPACE.sub(" ", text)


def _printf(fmt: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    for m in _PRINTF.finditer(fmt):
        out.append(_lit(fmt[pos:m.start()]))
        pos = m.end()
        conv = m[1]
        if conv == "%":
            out.append(_lit("%"))
        else:
            out.append((_kind_of_spec(conv if conv not in "rsac" else ""), ""))
    out.append(_lit(fmt[pos:]))
    return out


def _format(fmt: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    for m in _FORMAT.finditer(fmt):
        out.append(_lit(fmt[pos:m.start()]))
        pos = m.end()
        if m[0] in ("{{", "}}"):
            out.append(_lit(m[0][0]))
        else:
            body = m[0][1:-1]
            spec = body.partition(":")[2] if ":" in body else ""
            out.append((_kind_of_spec(spec) if "!" not in body else "any", ""))
    out.append(_lit(fmt[pos:]))
    return out


def _pieces(node: ast.expr | None, printf_args: bool = False) -> list[tuple[str, str]]:
    """The pieces of a message expression; anything not literal is a wildcard."""
    if node is None:
        return []
    if isinstance(node, ast.Constant):
        if isinstance(node.value, str):
            return _printf(node.value) if printf_args else [_lit(node.value)]
        return [("any", "")]
    if isinstance(node, ast.JoinedStr):
        out: list[tuple[str, str]] = []
        for v in node.values:
            if isinstance(v, ast.Constant) and isinstance(v.value, str):
                out.append(_lit(v.value))
            elif isinstance(v, ast.FormattedValue):
                spec = ""
                if isinstance(v.format_spec, ast.JoinedStr) and all(
                        isinstance(x, ast.Constant) for x in v.format_spec.values):
                    spec = "".join(str(x.value) for x in v.format_spec.values)  # type: ignore[attr-defined]
                out.append((_kind_of_spec(spec) if v.conversion == -1 else "any", ""))
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _pieces(node.left) + _pieces(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) \
            and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
        return _printf(node.left.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "format" and isinstance(node.func.value, ast.Constant) \
            and isinstance(node.func.value.value, str):
        return _format(node.func.value.value)
    return [("any", "")]


def _is_text(node: ast.expr) -> bool:
    """A string literal, an f-string, or a concatenation or ``%``/``format`` of one."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mod):
        return _is_text(node.left) or _is_text(node.right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "format":
        return _is_text(node.func.value)
    return False


def _literal(parts: list[tuple[str, str]]) -> str:
    return " ".join(t for k, t in parts if k == "lit")


def _template(parts: list[tuple[str, str]]) -> str | None:
    text = join(parts).strip()
    if len(text) > MAX_TEMPLATE:
        text = text[:MAX_TEMPLATE].rstrip("{") + "{*}"
        text = text.replace("{*}{*}", "{*}")
    if literal_chars(text) < MIN_LETTERS or interpreter_message(literal_text(text)):
        return None  # nothing of its own, or a message the interpreter writes (any code may)
    return text


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _name(node.func)
    return ""


def _log_level(call: ast.Call) -> Level | None:
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    attr = func.attr
    base = attr.removesuffix("_once").removesuffix("_rank0")
    if attr == "warn" and _name(func.value) == "warnings":
        return Level.WARNING
    level = LOG_LEVELS.get(base)
    if level is None:
        return None
    owner = _name(func.value).lower()
    return level if ("log" in owner or owner in ("self", "cls")) else None


class _Visitor(ast.NodeVisitor):
    def __init__(self) -> None:
        self.scope: list[str] = []
        self.found: list[Found] = []
        self.vars: dict[str, list[tuple[str, str]]] = {}

    def _add(self, parts: list[tuple[str, str]], level: Level, exc: str, line: int) -> None:
        text = _template(parts)
        if text is not None:
            self.found.append(Found(text, ".".join(self.scope), level, exc, line))

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        saved = self.vars
        if not isinstance(node, ast.ClassDef):
            self.vars = {}
        self.generic_visit(node)
        self.vars = saved
        self.scope.pop()

    def _message_arg(self, node: ast.expr | None, printf_args: bool = False
                     ) -> list[tuple[str, str]] | None:
        """The pieces of a message argument: an expression, or a variable the message was
        built in earlier in the function."""
        if isinstance(node, ast.Name) and node.id in self.vars:
            return self.vars[node.id]
        if node is None:
            return None
        return _pieces(node, printf_args)

    def visit_Assign(self, node: ast.Assign) -> None:
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and _MESSAGE_VAR.search(node.targets[0].id) and _is_text(node.value):
            self.vars[node.targets[0].id] = _pieces(node.value)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.target, ast.Name) and node.target.id in self.vars \
                and isinstance(node.op, ast.Add):
            self.vars[node.target.id] = self.vars[node.target.id] + _pieces(node.value)
        self.generic_visit(node)

    visit_ClassDef = _scoped
    visit_FunctionDef = _scoped
    visit_AsyncFunctionDef = _scoped

    def visit_Raise(self, node: ast.Raise) -> None:
        exc = node.exc
        if isinstance(exc, ast.Call):
            msg = exc.args[0] if exc.args else next(
                (k.value for k in exc.keywords if k.arg in ("msg", "message")), None)
            parts = self._message_arg(msg)
            if parts is not None:
                self._add(parts, Level.EXCEPTION, _name(exc.func), node.lineno)
        self.generic_visit(node)

    def visit_Assert(self, node: ast.Assert) -> None:
        if node.msg is not None:
            parts = self._message_arg(node.msg) or []
            self._add(parts, Level.ASSERT, "AssertionError", node.lineno)
        else:
            # a bare assert: its condition is what the traceback's source line shows
            self._add([_lit("assert " + ast.unparse(node.test))], Level.ASSERT,
                      "AssertionError", node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        level = _log_level(node)
        if level is not None and node.args:
            parts = self._message_arg(node.args[0], printf_args=len(node.args) > 1) or []
            if level is not Level.INFO or _STATES_FAILURE.search(_literal(parts)):
                self._add(parts, level, "", node.lineno)
        elif level is None and _REPORTER.search(_name(node.func)):
            # a helper that reports a message built earlier: raise_error_or_warn(.., msg)
            for arg in node.args:
                if isinstance(arg, ast.Name) and arg.id in self.vars:
                    self._add(self.vars[arg.id], Level.ERROR, "", node.lineno)
                    break
        self.generic_visit(node)


def extract(source: str | bytes, filename: str = "<source>") -> Iterator[Found]:
    """Every message template of one Python module; a module that does not parse gives none."""
    try:
        tree = ast.parse(source, filename=filename)
    except (SyntaxError, ValueError, RecursionError):
        return iter(())
    v = _Visitor()
    try:
        v.visit(tree)
    except RecursionError:
        return iter(())
    return iter(v.found)
