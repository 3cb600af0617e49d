"""Message templates from C and C++ sources: glog and folly streams, checking macros, printf and
fmt formats, thrown exceptions and error-code enums.

The sources are tokenised (comments and preprocessor lines dropped, string literals decoded),
never compiled. What counts as a message:

* a logging stream at error, warning or fatal level: ``LOG(ERROR) << "a" << x``, ``PLOG``,
  ``LOG_IF``, ``LOG_FIRST_N``, ``LOG_EVERY_N``, folly's ``XLOG(ERR) <<``, and bare stream
  macros such as NIXL's ``NIXL_ERROR << ...``;
* glog's ``CHECK(cond) << msg`` and ``CHECK_EQ(a, b)`` family, as glog prints them
  (``Check failed: cond``, ``Check failed: a == b (x vs. y)``);
* argument-list macros whose string arguments are concatenated: PyTorch's ``TORCH_CHECK``,
  ``C10_THROW_ERROR``, ``TORCH_WARN``; gloo's ``GLOO_ENFORCE*`` (``cond. x vs y. msg``),
  ``GLOO_THROW*``, ``GLOO_ERROR``;
* format macros: NCCL's ``WARN("fmt %s", ...)``, folly's ``XLOGF(ERR, "fmt {}", ...)``,
  3FS's ``makeError(code, "fmt {}", ...)``;
* ``throw X(msg)`` with a message built from literals, ``+``, ``fmt::format`` or ``StrCat``;
* Arrow-style status builders (``Status::IOError("a" + x)``) and what goes to ``std::cerr``
  and ``std::clog``;
* the enumerators of enums named like error or status codes (printed by name).

Values formatted into a message are typed wildcards (:mod:`signatures.index.tokens`). Each
message is attributed to the function whose body holds it (``Client::Put``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from signatures.index.failures import interpreter_message
from signatures.index.model import Level
from signatures.index.tokens import join, literal_chars, literal_text
from signatures.mine.python_src import MAX_TEMPLATE, MIN_LETTERS, Found

_TOKEN = re.compile(r"""
    (?P<comment>//[^\n]*|/\*.*?\*/)
  | (?P<pre>^[ \t]*\#(?:[^\n\\]|\\.)*)
  | (?P<raw>R"(?P<delim>[^(\s]{0,16})\((?P<rawbody>.*?)\)(?P=delim)")
  | (?P<str>(?:u8|u|U|L)?"(?:\\.|[^"\\\n])*")
  | (?P<chr>'(?:\\.|[^'\\\n]){1,8}')
  | (?P<ident>[A-Za-z_]\w*)
  | (?P<num>\d[\w.']*)
  | (?P<punct><<=?|>>=?|::|->|&&|\|\||[-+*/%=!<>&|^]=|[(){}\[\],;=+\-*/%<>!&|^~?:.])
  | (?P<nl>\n)
  | (?P<ws>[ \t\r\f\v]+|\\\n)
""", re.VERBOSE | re.DOTALL | re.MULTILINE)
_ESC = re.compile(r"\\(x[0-9a-fA-F]{1,2}|[0-7]{1,3}|.)", re.DOTALL)
_SIMPLE_ESC = {"n": "\n", "t": "\t", "r": "\r", "0": "", "a": "", "b": "", "f": "", "v": "",
               "\\": "\\", '"': '"', "'": "'", "?": "?"}
_PRINTF = re.compile(r"%[-#0 +']*(?:\*|\d+)?(?:\.(?:\*|\d+))?(?:hh|h|ll|l|L|z|j|t|I64|I32)?"
                     r"([diouxXeEfFgGaAcspn%])|%(?:PRI\w+)")
_FMT = re.compile(r"\{\{|\}\}|\{[^{}]*\}")
_SPACE = re.compile(r"\s+")

_LEVELS = {"ERROR": Level.ERROR, "ERR": Level.ERROR, "WARNING": Level.WARNING,
           "WARN": Level.WARNING, "FATAL": Level.FATAL, "DFATAL": Level.FATAL,
           "CRITICAL": Level.FATAL}
_STREAM_MACROS = {"LOG", "PLOG", "LOG_IF", "PLOG_IF", "LOG_FIRST_N", "LOG_EVERY_N", "XLOG",
                  "XLOG_IF", "LOG_EVERY_T", "SYSLOG", "RAW_LOG", "google::LogMessage"}
_BARE_STREAMS = {"NIXL_ERROR": Level.ERROR, "NIXL_WARN": Level.WARNING,
                 "NIXL_FATAL": Level.FATAL, "LOG_ERROR": Level.ERROR,
                 "LOG_WARNING": Level.WARNING, "LOG_WARN": Level.WARNING}
_CHECK_OPS = {"CHECK_EQ": "==", "CHECK_NE": "!=", "CHECK_LE": "<=", "CHECK_LT": "<",
              "CHECK_GE": ">=", "CHECK_GT": ">", "CHECK_STREQ": "==", "CHECK_STRNE": "!="}
_GLOO_OPS = {"GLOO_ENFORCE_EQ": "==", "GLOO_ENFORCE_NE": "!=", "GLOO_ENFORCE_LE": "<=",
             "GLOO_ENFORCE_LT": "<", "GLOO_ENFORCE_GE": ">=", "GLOO_ENFORCE_GT": ">"}
#: Macros whose arguments from index ``k`` on are concatenated into the message; ``cond``:
#: the index of a condition printed before it (or None), with the level and exception.
_ARG_MACROS: dict[str, tuple[int, int | None, Level, str]] = {
    "TORCH_CHECK": (1, None, Level.EXCEPTION, "Error"),
    "TORCH_CHECK_VALUE": (1, None, Level.EXCEPTION, "ValueError"),
    "TORCH_CHECK_INDEX": (1, None, Level.EXCEPTION, "IndexError"),
    "TORCH_CHECK_TYPE": (1, None, Level.EXCEPTION, "TypeError"),
    "TORCH_CHECK_NOT_IMPLEMENTED": (1, None, Level.EXCEPTION, "NotImplementedError"),
    "TORCH_CHECK_WITH": (2, None, Level.EXCEPTION, ""),
    "TORCH_INTERNAL_ASSERT": (1, None, Level.CHECK, "Error"),
    "C10_THROW_ERROR": (1, None, Level.EXCEPTION, ""),
    "TORCH_WARN": (0, None, Level.WARNING, ""),
    "TORCH_WARN_ONCE": (0, None, Level.WARNING, ""),
    "GLOO_ENFORCE": (1, 0, Level.CHECK, "EnforceNotMet"),
    "GLOO_THROW": (0, None, Level.EXCEPTION, "EnforceNotMet"),
    "GLOO_THROW_IO_EXCEPTION": (0, None, Level.EXCEPTION, "IoException"),
    "GLOO_THROW_INVALID_OPERATION_EXCEPTION": (0, None, Level.EXCEPTION,
                                               "InvalidOperationException"),
    "GLOO_ERROR": (0, None, Level.ERROR, ""),
    "GLOO_ERROR_MSG": (0, None, Level.ERROR, ""),
    "GLOO_WARN": (0, None, Level.WARNING, ""),
}
#: printf-style macros: (format argument index, level).
_PRINTF_MACROS = {"WARN": (0, Level.WARNING)}
#: fmt-style (``{}``) macros: (format argument index, level or None: from the first argument).
_FMT_MACROS: dict[str, tuple[int, Level | None]] = {"XLOGF": (1, None), "XLOGF_IF": (2, None),
                                                    "makeError": (1, Level.ERROR),
                                                    "MAKE_ERROR_F": (1, Level.ERROR)}
_FORMAT_CALLS = {"format", "sprintf", "StrFormat", "fmt::format", "std::format",
                 "folly::sformat", "absl::StrFormat", "fmt::sprintf"}
_CONCAT_CALLS = {"StrCat", "absl::StrCat", "MakeString", "gloo::MakeString", "c10::str", "str",
                 "folly::to"}
_NOT_FUNCTIONS = {"if", "for", "while", "switch", "catch", "return", "sizeof", "decltype",
                  "alignof", "static_assert", "defined", "else", "do", "try", "new", "delete",
                  "throw", "case", "co_return", "co_await"}
_MESSAGE_VAR = re.compile(r"(?i)(?:msg|message|err(?:or)?(?:str|string|text)?|reason|what|"
                          r"desc(?:ription)?|report)s?_?$")
_CODE_ENUM = re.compile(r"(?i)(error|status|result|code|errc)\w*$")


@dataclass(frozen=True)
class _Tok:
    kind: str
    text: str
    line: int
    start: int = 0
    end: int = 0


def _unescape(body: str) -> str:
    def sub(m: re.Match[str]) -> str:
        e = m[1]
        if e in _SIMPLE_ESC:
            return _SIMPLE_ESC[e]
        if e[0] == "x":
            return chr(int(e[1:], 16))
        if e[0].isdigit():
            return chr(int(e, 8)) if int(e, 8) else ""
        return e
    return _ESC.sub(sub, body)


def tokenize(source: str) -> list[_Tok]:
    """C/C++ tokens with line numbers: strings decoded (kind ``str``), comments and preprocessor
    lines dropped."""
    out: list[_Tok] = []
    line = 1
    for m in _TOKEN.finditer(source):
        kind = m.lastgroup
        text = m[0]
        if kind in ("raw", "delim", "rawbody"):
            out.append(_Tok("str", m["rawbody"] or "", line, m.start(), m.end()))
        elif kind == "str":
            body = text[text.index('"') + 1:-1]
            out.append(_Tok("str", _unescape(body), line, m.start(), m.end()))
        elif kind in ("ident", "num", "punct", "chr"):
            out.append(_Tok(kind, text, line, m.start(), m.end()))
        line += text.count("\n")
    return out


def _lit(text: str) -> tuple[str, str]:
    return "lit", _SPACE.sub(" ", text)


def _expand_printf(fmt: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    for m in _PRINTF.finditer(fmt):
        out.append(_lit(fmt[pos:m.start()]))
        pos = m.end()
        conv = m[1] or "s"
        if conv == "%":
            out.append(_lit("%"))
        else:
            out.append(("d" if conv in "diouc" else "f" if conv in "eEfFgGaA"
                        else "x" if conv in "xXp" else "any", ""))
    out.append(_lit(fmt[pos:]))
    return out


def _expand_fmt(fmt: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    for m in _FMT.finditer(fmt):
        out.append(_lit(fmt[pos:m.start()]))
        pos = m.end()
        if m[0] in ("{{", "}}"):
            out.append(_lit(m[0][0]))
            continue
        spec = m[0][1:-1].partition(":")[2]
        last = spec[-1:] if spec else ""
        out.append(("d" if last == "d" else "f" if last in ("f", "e", "g") else
                    "x" if last in ("x", "X") else "any", ""))
    out.append(_lit(fmt[pos:]))
    return out


def _split(toks: list[_Tok], sep: str) -> list[list[_Tok]]:
    """``toks`` split at ``sep`` outside brackets."""
    parts: list[list[_Tok]] = [[]]
    depth = 0
    for t in toks:
        if t.kind == "punct" and t.text in "([{":
            depth += 1
        elif t.kind == "punct" and t.text in ")]}":
            depth -= 1
        if depth == 0 and t.kind == "punct" and t.text == sep:
            parts.append([])
        else:
            parts[-1].append(t)
    return parts


def _qual(toks: list[_Tok], end: int) -> tuple[str, int]:
    """The qualified name ending at ``toks[end]`` (``a::b::c``) and its first index."""
    i, names = end, [toks[end].text]
    while i >= 2 and toks[i - 1].text == "::" and toks[i - 2].kind == "ident":
        names.insert(0, toks[i - 2].text)
        i -= 2
    if i >= 1 and toks[i - 1].text == "::":
        i -= 1
    return "::".join(names), i


def _operand(toks: list[_Tok], names: dict[str, list[tuple[str, str]]] | None = None
             ) -> list[tuple[str, str]]:
    """The pieces one operand of a message contributes (``names``: messages built earlier in
    the function, by variable)."""
    if not toks:
        return []
    if names and len(toks) == 1 and toks[0].text in names:
        return names[toks[0].text]
    if names and len(toks) == 3 and toks[0].text in names and toks[1].text in (".", "->") \
            and toks[2].text in ("c_str", "what", "data"):
        return names[toks[0].text]
    if all(t.kind == "str" for t in toks):
        return [_lit("".join(t.text for t in toks))]
    plus = _split(toks, "+")
    if len(plus) > 1:
        return [p for part in plus for p in _operand(part, names)]
    # a formatting or concatenating call: name ( args )
    k = 0
    while k < len(toks) and (toks[k].kind == "ident" or toks[k].text == "::"):
        k += 1
    if 0 < k < len(toks) and toks[k].text == "(" and toks[-1].text == ")":
        name = "".join(t.text for t in toks[:k]).lstrip(":")
        args = _split(toks[k + 1:-1], ",")
        short = name.rsplit("::", 1)[-1]
        fmt_call = name in _FORMAT_CALLS or short in ("format", "sformat", "StrFormat",
                                                       "sprintf")
        if fmt_call and args and args[0] and all(t.kind == "str" for t in args[0]):
            fmt = "".join(t.text for t in args[0])
            printf = "printf" in short or ("%" in fmt and "{" not in fmt)
            return _expand_printf(fmt) if printf else _expand_fmt(fmt)
        if name in _CONCAT_CALLS or short in ("StrCat", "MakeString", "str"):
            return [p for a in args for p in _operand(a, names)]
        if short in ("string", "basic_string") and len(args) == 1:
            return _operand(args[0], names)
    return [("any", "")]


def _template(parts: list[tuple[str, str]]) -> str | None:
    text = join(parts).strip()
    if len(text) > MAX_TEMPLATE:
        text = text[:MAX_TEMPLATE].rstrip("{") + "{*}"
    if literal_chars(text) < MIN_LETTERS or interpreter_message(literal_text(text)):
        return None
    return text


def _close(toks: list[_Tok], i: int) -> int:
    """Index of the bracket closing the one at ``i`` (or len(toks))."""
    depth = 0
    for j in range(i, len(toks)):
        t = toks[j].text
        if toks[j].kind == "punct" and t in "([{":
            depth += 1
        elif toks[j].kind == "punct" and t in ")]}":
            depth -= 1
            if depth == 0:
                return j
    return len(toks)


def _statement_end(toks: list[_Tok], i: int) -> int:
    depth = 0
    for j in range(i, len(toks)):
        t = toks[j]
        if t.kind == "punct":
            if t.text in "([{":
                depth += 1
            elif t.text in ")]}":
                depth -= 1
                if depth < 0:
                    return j
            elif t.text == ";" and depth == 0:
                return j
    return len(toks)


class _Scanner:
    def __init__(self, toks: list[_Tok], source: str = "") -> None:
        self.toks = toks
        self.source = source
        self.found: list[Found] = []
        self.scopes: list[tuple[int, str]] = []  # (brace depth, name) of functions and classes
        self.depth = 0
        self.head: list[_Tok] = []
        self.names: dict[str, list[tuple[str, str]]] = {}
        """Messages built in a variable earlier in the current function."""

    def code(self, toks: list[_Tok]) -> str:
        """The source text of ``toks`` as written (a condition glog or gloo prints)."""
        if not toks:
            return ""
        if self.source:
            return _SPACE.sub(" ", self.source[toks[0].start:toks[-1].end])
        return " ".join(t.text for t in toks)

    def function(self) -> str:
        return "::".join(n for _, n in self.scopes if n)

    def add(self, parts: list[tuple[str, str]], level: Level, exc: str, line: int) -> None:
        text = _template(parts)
        if text is not None:
            self.found.append(Found(text, self.function(), level, exc, line))

    def _open_scope(self) -> str:
        """What the ``{`` after the current statement head opens: a function's or a class's
        name, or ``""``."""
        head = self.head
        if not head:
            return ""
        first = head[0].text
        if first in ("class", "struct", "union") and len(head) >= 2:
            names = [t.text for t in head[1:] if t.kind == "ident"
                     and t.text not in ("final", "public", "private", "protected", "virtual")]
            return names[0] if names else ""
        if first in ("namespace", "enum", "extern") or first in _NOT_FUNCTIONS \
                or any(t.text == "=" for t in head):
            return ""
        opened = sum(t.text == "(" for t in head) - sum(t.text == ")" for t in head)
        if opened != 0:
            return ""  # a lambda passed to a call: still inside the enclosing function
        for j, t in enumerate(head):
            if t.text == "(" and j > 0 and head[j - 1].kind == "ident" \
                    and head[j - 1].text not in _NOT_FUNCTIONS:
                return _qual(head, j - 1)[0]
            if t.text in ("(", "["):
                return ""
        return ""

    def run(self) -> list[Found]:
        toks = self.toks
        i = 0
        while i < len(toks):
            t = toks[i]
            if t.kind == "punct" and t.text == "{":
                name = self._open_scope()
                self.depth += 1
                if name:
                    self.scopes.append((self.depth, name))
                    self.names = {}
                self.head = []
                i += 1
                continue
            if t.kind == "punct" and t.text == "}":
                if self.scopes and self.scopes[-1][0] == self.depth:
                    self.scopes.pop()
                self.depth -= 1
                self.head = []
                i += 1
                continue
            if t.kind == "punct" and t.text == ";":
                self.head = []
                i += 1
                continue
            if t.kind == "ident":
                j = self._message(i)
                if j > i:
                    i = j
                    continue
                if t.text == "enum":
                    i = self._enum(i)
                    continue
                if _MESSAGE_VAR.search(t.text) and i + 1 < len(toks) and toks[i + 1].text in (
                        "=", "+="):
                    self._assign(i)
            self.head.append(t)
            i += 1
        return self.found

    def _assign(self, i: int) -> None:
        """``msg = c10::str("a", x);`` or ``msg += "b";``: remember the message built."""
        toks = self.toks
        end = _statement_end(toks, i + 2)
        expr = toks[i + 2:end]
        if not any(t.kind == "str" for t in expr):
            return
        parts = _operand(expr, self.names)
        if toks[i + 1].text == "+=":
            parts = self.names.get(toks[i].text, [("any", "")]) + parts
        if len(self.names) < 256:
            self.names[toks[i].text] = parts

    def _args(self, i: int) -> tuple[list[list[_Tok]], int]:
        """Arguments of the call whose ``(`` is at ``i`` and the index after its ``)``."""
        end = _close(self.toks, i)
        return _split(self.toks[i + 1:end], ","), end + 1

    def _stream(self, i: int) -> list[tuple[str, str]]:
        """The pieces of a ``<< a << b`` chain starting at ``i`` (up to the statement's end)."""
        end = _statement_end(self.toks, i)
        parts: list[tuple[str, str]] = []
        for op in _split(self.toks[i:end], "<<")[1:]:
            if len(op) == 1 and op[0].text in ("endl", "flush"):
                continue
            if len(op) == 3 and op[-1].text in ("endl", "flush"):
                continue
            parts += _operand(op, self.names)
        return parts

    def _message(self, i: int) -> int:
        toks = self.toks
        t = toks[i]
        name = t.text
        nxt = toks[i + 1] if i + 1 < len(toks) else None
        if nxt is None:
            return i
        line = t.line
        if name == "throw" and nxt.kind == "ident":
            qual, _ = _qual(toks, i + 1)
            k = i + 1
            while k + 2 < len(toks) and toks[k + 1].text == "::":
                k += 2
            if k + 1 < len(toks) and toks[k + 1].text in ("(", "{"):
                args, after = self._args(k + 1)
                if args and args[0]:
                    self.add(_operand(args[0], self.names), Level.EXCEPTION,
                             qual.rsplit("::", 1)[-1], line)
                return after
            return i
        if name in ("errors", "absl") and nxt.text == "::" and i + 3 < len(toks) \
                and toks[i + 2].kind == "ident" and toks[i + 3].text == "(":
            # status builders whose arguments are concatenated: errors::Internal("a", x),
            # absl::InternalError(...) (TensorFlow, XLA and other absl users)
            kind = toks[i + 2].text
            if name == "absl" and not kind.endswith("Error"):
                return i
            args, after = self._args(i + 3)
            parts = [p for a in args for p in _operand(a, self.names)]
            if parts:
                self.add(parts, Level.EXCEPTION, kind.removesuffix("Error"), line)
            return after
        if name in ("cerr", "clog") and nxt.text == "<<":
            # the standard error streams: what a library with no logger prints when something
            # went wrong (Vineyard's client: "[info] Connection to IPC socket failed ...");
            # whether a line says a failure is the classifier's to tell, not the stream's
            self.add(self._stream(i + 1), Level.WARNING, "", line)
            return _statement_end(toks, i)
        if name == "Status" and nxt.text == "::" and i + 3 < len(toks) \
                and toks[i + 2].kind == "ident" and toks[i + 3].text == "(" \
                and toks[i + 2].text not in ("OK", "ok", "Wrap"):
            # Arrow-style status builders (Arrow, Vineyard, RocksDB): Status::IOError("a" + x)
            # prints as "IOError: a...": the code's name, then the message
            kind = toks[i + 2].text
            args, after = self._args(i + 3)
            parts = [p for a in args for p in _operand(a, self.names)]
            if any(k == "lit" for k, _ in parts):
                self.add(parts, Level.EXCEPTION, kind, line)
            return after
        if name in _BARE_STREAMS and nxt.text == "<<":
            self.add(self._stream(i + 1), _BARE_STREAMS[name], "", line)
            return _statement_end(toks, i)
        if nxt.text != "(":
            return i
        if i > 0 and toks[i - 1].text in (".", "->", "::") and name not in ("makeError",):
            return i  # a member call of the same name, not the macro
        args, after = self._args(i + 1)
        if name in _STREAM_MACROS:
            lvl = args[0][-1].text if args and args[0] else ""
            level = _LEVELS.get(lvl.removeprefix("google::").removeprefix("GLOG_"))
            if level is not None and after < len(toks) and toks[after].text == "<<":
                self.add(self._stream(after), level, "", line)
            return _statement_end(toks, i) if level is not None else after
        if name == "CHECK" or name in _CHECK_OPS or name == "PCHECK":
            cond = self.code(args[0]) if args else ""
            if name in _CHECK_OPS and len(args) >= 2:
                a, b = self.code(args[0]), self.code(args[1])
                parts = [_lit(f"Check failed: {a} {_CHECK_OPS[name]} {b} ("), ("any", ""),
                         _lit(" vs. "), ("any", ""), _lit(") ")]
            else:
                parts = [_lit(f"Check failed: {cond} ")]
            if after < len(toks) and toks[after].text == "<<":
                parts += self._stream(after)
            self.add(parts, Level.CHECK, "", line)
            return _statement_end(toks, i)
        if name in _GLOO_OPS and len(args) >= 2:
            a, b = self.code(args[0]), self.code(args[1])
            parts = [_lit(f"{a} {_GLOO_OPS[name]} {b}. "), ("any", ""), _lit(" vs "),
                     ("any", "")]
            rest = [p for a2 in args[2:] for p in _operand(a2, self.names)]
            if rest:
                parts += [_lit(". "), *rest]
            self.add(parts, Level.CHECK, "EnforceNotMet", line)
            return after
        if name in _ARG_MACROS:
            k, cond_arg, level, exc = _ARG_MACROS[name]
            if name in ("TORCH_CHECK_WITH", "C10_THROW_ERROR") and args and args[0]:
                exc = args[0][-1].text
            parts = []
            if cond_arg is not None and len(args) > cond_arg:
                parts.append(_lit(self.code(args[cond_arg]) + ". "))
            parts += [p for a in args[k:] for p in _operand(a, self.names)]
            if len(args) > k:
                self.add(parts, level, exc, line)
            return after
        if name in _PRINTF_MACROS:
            k, level = _PRINTF_MACROS[name]
            if len(args) > k and args[k] and all(x.kind == "str" for x in args[k]):
                self.add(_expand_printf("".join(x.text for x in args[k])), level, "", line)
            return after
        if name in _FMT_MACROS:
            k, level = _FMT_MACROS[name]
            if level is None:
                lv = args[0][-1].text if args and args[0] else ""
                level = _LEVELS.get(lv)
            if level is not None and len(args) > k and args[k] \
                    and all(x.kind == "str" for x in args[k]):
                self.add(_expand_fmt("".join(x.text for x in args[k])), level, "", line)
            return after
        return i

    def _enum(self, i: int) -> int:
        """Enumerators of an error/status-code enum, as CODE templates."""
        toks = self.toks
        j = i + 1
        while j < len(toks) and toks[j].text in ("class", "struct"):
            j += 1
        if j < len(toks) and toks[j].text == "{":
            # typedef enum { ... } name_t;
            k = j
            end = _close(toks, k)
            name = toks[end + 1].text if end + 1 < len(toks) else ""
        elif j < len(toks) and toks[j].kind == "ident":
            name = toks[j].text
            k = j
            while k < len(toks) and toks[k].text not in ("{", ";"):
                k += 1
            if k >= len(toks) or toks[k].text != "{":
                return k
            end = _close(toks, k)
        else:
            return i + 1
        if _CODE_ENUM.search(name):
            for item in _split(toks[k + 1:end], ","):
                if item and item[0].kind == "ident" and len(item[0].text) >= 4:
                    self.found.append(Found(item[0].text, name, Level.CODE, "", item[0].line))
        return end + 1


def extract(source: str | bytes) -> Iterator[Found]:
    """Every message template of one C/C++ source file."""
    if isinstance(source, bytes):
        source = source.decode("utf-8", errors="replace")
    try:
        return iter(_Scanner(tokenize(source), source).run())
    except RecursionError:
        return iter(())
