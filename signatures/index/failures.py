"""The kind of failure a message states, read from upstream's own template (or a report's line
when no template matched), its level and the exception it raises.

Kinds, most telling first (a message that states two is the first):

* ``shape``: sizes, shapes or element counts that disagree;
* ``capacity``: no free memory, blocks, pages or space; a pool or buffer that is full;
* ``index``: an index or pop past the end of a list (``IndexError``);
* ``bookkeeping``: references, pins or pages counted wrong (a double free, a reference count
  below zero, a leak found by an accounting check, a lock held by another tree);
* ``invariant``: any other assertion, ``CHECK`` or state that cannot be;
* ``timeout``: a wait that ran out;
* ``config``: an option, version or installation that is wrong or missing (an assertion on an
  object's type included);
* ``io``: any other failure to do something (connect, read, write, register, transfer).

A warning that states none of these is no failure; a template of level ``code`` (an error
code's name) is ``io`` unless its name says more. Two kinds come from the doctor, not from a
message: ``crash`` (a fatal signal on a component's stack) and ``unknown`` (a traceback cut
before its exception line: something failed there, but not what).
"""

from __future__ import annotations

import re
from enum import StrEnum

from signatures.index.model import Level


class FailureKind(StrEnum):
    SHAPE = "shape"
    CAPACITY = "capacity"
    INDEX = "index"
    BOOKKEEPING = "bookkeeping"
    INVARIANT = "invariant"
    TIMEOUT = "timeout"
    CONFIG = "config"
    IO = "io"
    CRASH = "crash"
    UNKNOWN = "unknown"


_SHAPE = re.compile(
    r"(?i)\bshape '?\[|\bsizes? (?:do(?:es)?n'?t|do(?:es)? not) match|(?:does not|doesn'?t) "
    r"match (?:the )?(?:expected )?(?:size|shape|numel|length)|\bsize mismatch|"
    r"\bmismatch(?:ed)? (?:in )?(?:size|shape|numel|length|tensor)|\bexpected (?:input )?"
    r"(?:size|shape|numel)|\binvalid for input of size|\bnumel\b.{0,40}(?:differ|mismatch)|"
    r"\bsplit_with_sizes\b|\bsizes of tensors must match|\bshape mismatch\b|"
    r"\binconsistent (?:\w+ )?shapes?\b|\bexpected shape\b|"
    # a byte count that disagrees with what the receiver expected (a peer sent another size)
    r"\b(?:returned|received|got|sent) \S+ bytes,? (?:where|but|while|whereas) .{0,40}?"
    r"\bexpected\b|\bexpected \S+ bytes,? (?:but )?(?:got|received|was sent)\b")
_CAPACITY = re.compile(
    r"(?i)\bout of (?:host |cpu |gpu |device )?memory\b|\bno (?:more )?(?:free|available|enough)"
    r" (?:\w+ )?(?:memory|blocks?|pages?|slots?|space|buffers?|handles?)|\bnot enough "
    r"(?:\w+ )?(?:memory|space|blocks?|pages?|slots?|room)|\binsufficient (?:\w+ )?(?:memory|"
    r"space|capacity|blocks?)|\bexhausted\b|\b(?:is|are|was|buffer|pool|cache|queue) full\b|"
    r"\bcan(?:not|'t) allocate|\bfail(?:ed|ure)? to allocate|\balloc(?:ation|ate)? fail|"
    r"\bno space left|\bOOM\b|\bexceeds? (?:the )?(?:\w+ )?(?:capacity|limit|watermark)|"
    r"\bNO_AVAILABLE_HANDLE\b|\bno free blocks|\bcannot store \d* ?blocks?|\bunder pressure|"
    r"\bENOMEM\b|\bover (?:the )?(?:high )?watermark|\black of (?:\w+ )?(?:\w+ )?(?:memory|"
    r"space|blocks?|pages?)")
_BOOKKEEPING = re.compile(
    r"(?i)\bdouble[- ]?(?:free|alloc\w*|unpin|release|insert)|already (?:freed|released|"
    r"unpinned|in (?:the )?(?:free|pool))|freed twice|use[- ]after[- ]free|\bleak(?:ed)? "
    r"detected|\bleaked_\w+|\bref(?:erence)?[ _-]?(?:count|cnt)\b.{0,40}(?:negative|below|"
    r"< ?0|underflow|zero)|\b(?:ref|pin)[_ ]?(?:count|cnt) (?:is )?(?:negative|-\d)|"
    r"\bunderflow\b|\bholds? the node|\block_?ref\b|\bdangling\b|\bnot (?:pinned|locked)\b|"
    r"\baccess(?:ing|ed)? (?:an? |the )?(?:invalidated|freed|released|stale)\b|"
    r"\bforc(?:e|ed|ing)\s+(?:un)?(?:pin|release|free)\w*|\bunbalanced (?:pin|ref)")
_INVARIANT = re.compile(
    r"(?i)should not happen|should never|should always (?:exist|be|hold)\b|\binvariant\b|"
    r"\binconsisten|\bcorrupt(?:ed|ion)?\b|"
    r"\bsanity check\b|\bstale (?:parent|child|node|pointer)|\bnot (?:a )?leaf\b|"
    r"\bunexpected (?:state|status)\b")
#: An assertion on an object's type (``assert isinstance(self.allocator, MixedAllocator)``)
#: checks what the program was built with, which class a configuration or version put there:
#: a configuration check, not a count or link of run-time state that went wrong.
_TYPE_CHECK = re.compile(r"^\s*(?:assert\s+)?(?:isinstance|issubclass)\(|"
                         r"^\s*(?:assert\s+)?type\([\w.]+\) (?:is|==) ")
_TIMEOUT = re.compile(r"(?i)\btimed? ?out\b|\btimeout\b|\bdeadline exceeded\b|\bwatchdog\b|"
                      r"\bstuck\b|\bhang(?:ing|s)?\b")
_CONFIG = re.compile(
    r"(?i)\bnot supported\b|\bunsupported\b|\b(?:does|do|did|can) not support\b|"
    r"\b(?:doesn|don|can)'?t support\b|\bnot (?:yet )?implemented for\b|"
    r"\bplease (?:install|set|specify|use|upgrade|check)|"
    r"\bno module named\b|\bnot installed\b|\binvalid (?:\w+ )?(?:config\w*|argument|option|"
    r"value|setting|parameter|format)|\bunknown (?:\w+ )?(?:backend|option|argument|config)|"
    r"\bmust be (?:set|specified|provided|enabled|one of)|\bis not set\b|\brequires? (?:\w+ )?"
    r"(?:version|to be)|\brequires? at least\b|\bis required\b|\bonly supports?\b|"
    r"\b(?:not|must be) divisible by\b|\bif '?\w+'? is (?:specified|set)\b|"
    r"\bincompatible\b|\bdeprecated\b|\bmissing (?:\w+ )?(?:config|argument|"
    r"field|env)|\bcannot import\b|\bfailed to import\b|\bundefined symbol\b")
_FAILURE = re.compile(
    r"(?i)\bfail(?:ed|s|ure|ing)?\b|\berror\b|\bunable to\b|\bcannot\b|\bcan't\b|\bcould not\b|"
    r"\bcouldn't\b|\brefused\b|\breset by peer\b|\bbroken pipe\b|\bunreachable\b|"
    r"\bdisconnect(?:ed)?\b|\blost\b|\bnot (?:found|exist|ready|registered|connected|"
    r"available|initiali[sz]ed|mounted)\b|\bno such\b|\binvalid\b|\bexpired\b|\brejected\b|"
    r"\baborted?\b|\bcrash|\bsegfault|\bsegmentation fault|\bbad\b|\bwrong\b|\bunexpected\b|"
    r"\bdenied\b|\bEIO\b|\bEBADF\b|_FAIL(?:ED|URE)?\b|\bFAIL")
_CODE_KINDS = (("TIMEOUT", FailureKind.TIMEOUT), ("NO_AVAILABLE", FailureKind.CAPACITY),
               ("NO_SPACE", FailureKind.CAPACITY), ("OUT_OF_MEMORY", FailureKind.CAPACITY),
               ("BUFFER_OVERFLOW", FailureKind.CAPACITY), ("NoMemory", FailureKind.CAPACITY),
               ("INVALID_PARAM", FailureKind.CONFIG), ("NOT_SUPPORTED", FailureKind.CONFIG),
               ("NotSupported", FailureKind.CONFIG), ("InvalidUsage", FailureKind.CONFIG))
_NOT_A_CODE = re.compile(r"(?i)^(?:\w*_)?(?:SUCCESS|OK|NONE|NORMAL|DONE|INIT|UNKNOWN|MAX|"
                         r"COUNT|NUM_\w+|LAST|FIRST|INPROGRESS|IN_PROGRESS|PENDING)$|Success$|"
                         r"^nccl(?:Success|InProgress|NumResults)$")


#: Messages the Python interpreter and the C library write themselves. A library may raise one
#: too (an ``__getattr__`` that re-raises ``AttributeError``), so a template of this shape says
#: nothing about whose code failed: the frames do.
_INTERPRETER = re.compile(
    r"(?i)^\W*(?:'[^']*'|\w+) object (?:has no attribute|is not (?:subscriptable|callable|"
    r"iterable|an iterator)|does not support)|^list (?:index|assignment index) out of range|"
    r"^(?:tuple|string) index out of range|^pop from (?:an )?empty|^dictionary changed size|"
    r"^unsupported operand type|^can only concatenate|takes \S+ positional arguments? but|"
    r"got an unexpected keyword argument|missing \d+ required (?:positional|keyword)|"
    r"^not enough values to unpack|^too many values to unpack|^division by zero|"
    r"^maximum recursion depth|^\[Errno \d+\]|^No such file or directory$|"
    r"^(?:cannot|can't) pickle|^invalid literal for int|^could not convert string to float|"
    r"^No module named\b|^cannot import name\b|"
    r"^\{\*\} object has no attribute|^'?\{\*\}'? object (?:has no attribute|is not)")


#: A capacity failure that names a host-side pool (the CPU swap space of vLLM's scheduler, a
#: pinned buffer) is that pool's, whichever module printed it.
_HOST_SIDE = re.compile(r"(?i)\b(?:cpu|host|swap|pinned|dram|l2)\b")
_EXCEPTION_NAME = re.compile(r"\b(\w+(?:Error|Exception|Violation))\b")


#: The serving host's own memory (not a store's DRAM segment, which is the store).
_HOST_MEMORY = re.compile(r"(?i)\b(?:cpu|host|pinned)\b")


def names_host_pool(text: str, *, own_memory_only: bool = False) -> bool:
    """Whether a capacity failure's message names a host-side pool; ``own_memory_only``: the
    serving host's own memory (a storage tier's message about its DRAM is the tier's)."""
    return bool((_HOST_MEMORY if own_memory_only else _HOST_SIDE).search(text))


def exception_named(text: str) -> str:
    """The exception class a line names (``Exception in transfer 235: AssertionError()``)."""
    m = _EXCEPTION_NAME.search(text)
    return m[1] if m else ""


def interpreter_message(text: str) -> bool:
    """Whether ``text`` is a message the interpreter or the C library writes (see above)."""
    return bool(_INTERPRETER.search(text.strip()))


def classify(text: str, level: Level | None = None, exception: str = "") -> FailureKind | None:
    """The failure ``text`` states (see the module docstring), or None: no failure."""
    exc = exception.rsplit(".", 1)[-1]
    if level is Level.CODE:
        if _NOT_A_CODE.search(text):
            return None
        for part, kind in _CODE_KINDS:
            if part in text:
                return kind
        return FailureKind.IO
    if _SHAPE.search(text):
        return FailureKind.SHAPE
    if _BOOKKEEPING.search(text) or exc in ("DoubleFree", "DoubleAllocation"):
        return FailureKind.BOOKKEEPING
    if _CAPACITY.search(text) or exc in ("OutOfMemoryError", "MemoryError"):
        return FailureKind.CAPACITY
    if exc == "IndexError" or "pop from empty" in text or "pop from an empty" in text:
        return FailureKind.INDEX
    if level in (Level.ASSERT, Level.CHECK) or exc in ("AssertionError", "InvariantViolation") \
            or _INVARIANT.search(text):
        # an assertion that states a requirement or an unsupported setting checks the
        # configuration, not state built at run time
        if (_CONFIG.search(text) or _TYPE_CHECK.search(text)) and not _INVARIANT.search(text):
            return FailureKind.CONFIG
        return FailureKind.INVARIANT
    if _TIMEOUT.search(text) or exc in ("TimeoutError", "TimeoutExpired"):
        return FailureKind.TIMEOUT
    if _CONFIG.search(text) or exc in ("ModuleNotFoundError", "ImportError",
                                       "NotImplementedError"):
        return FailureKind.CONFIG
    if level in (Level.EXCEPTION, Level.ERROR, Level.FATAL) or exc or _FAILURE.search(text):
        return FailureKind.IO if (level is not Level.WARNING or _FAILURE.search(text)) else None
    return None
