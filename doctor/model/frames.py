"""Frame classification from the catalog's frame rules.

* **in-app**: first matching ``+app``/``-app`` path rule wins (Sentry style), so SGLang frames
  under ``site-packages/sglang/`` count while torch and the standard library do not;
* **collective**: the frame is a collective or p2p primitive (``FUNC@FILE`` rules);
* **call site** of a blocked thread: going outwards from the innermost collective frame, the
  first in-app frame that is not a mere wrapper (``_all_reduce_attn_groups``, the runtime's
  ``sync``/``comm``/``groups`` modules) — the place whose branch decided to call the collective;
* **innermost caller** of any stack (the rank table's frame): the innermost in-app frame that is
  not communication plumbing — a lambda inside ``Group._run`` or ``Group.recv`` says nothing,
  its caller (``_result_tokens``, ``_classic_writing_check``) says where the rank was;
* **thread state**: ``crashed`` (fatal signal), ``blocked`` (inside a collective), ``idle``
  (waiting for work), ``active``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from doctor.model.evidence import Frame, ThreadStack, ThreadState
from signatures.linear import linear
from signatures.models import FrameRules

#: Thread roles told apart by what their stack runs (names differ between SGLang and us).
_PREFETCH_ROLE = linear(
    r"prefetch_sync_thread_func|_reduce_prefetch_ack|progress_vote|hit_vote|prefetch_thread_func|"
    r"prefetch_io_aux_func|_sync_storage_hit_count|_sync_prefetch_hit_query|_prefetch_\w+_loop|"
    r"backup_thread_func")


def is_prefetch_vote(group: str, func: str | None) -> bool:
    """Whether a collective is one of the prefetch threads' votes: its group is named for
    prefetch (the runtime's ``prefetch_progress``), or the function that called it is one a
    prefetch thread runs (upstream's ``_reduce_prefetch_ack`` in a Flight Recorder stack)."""
    return "prefetch" in group.lower() or bool(func and _PREFETCH_ROLE.search(func))


@dataclass(frozen=True)
class _Rule:
    func: Any  # RE2 regexps (signatures.linear): catalog rules on untrusted frame names
    file: Any

    def match(self, func: str, file: str) -> bool:
        return ((self.func is None or bool(self.func.search(func)))
                and (self.file is None or bool(self.file.search(file))))


#: Frames with longer names are classified afresh each time: a cache entry keeps its key alive,
#: and a hostile dump's frame names can be megabytes long.
_CACHED_NAME = 4096


class FrameClassifier:
    """Applies one catalog's frame rules; cheap to call per frame (results are cached)."""

    def __init__(self, rules: FrameRules) -> None:
        self._in_app = [(r.split(" ", 1)[0] == "+app", linear(r.split(" ", 1)[1]))
                        for r in rules.in_app]
        self._collective = [_parse(r) for r in rules.collective]
        self._wrappers = [_parse(r) for r in rules.comm_wrappers]
        self._idle = [_parse(r) for r in rules.idle_waits]
        self.in_app_file = functools.lru_cache(maxsize=4096)(self._in_app_file)
        # the same few hundred frames recur on every rank and in every stack of a dump
        self._matches_cached = functools.lru_cache(maxsize=8192)(self._matches)

    def _in_app_file(self, path: str) -> bool:
        for plus, rx in self._in_app:
            if rx.search(path):
                return plus
        return True

    def in_app(self, frame: Frame) -> bool:
        return self.in_app_file(frame.file)

    def _matches(self, wrappers: bool, func: str, file: str) -> bool:
        return any(r.match(func, file) for r in (self._wrappers if wrappers
                                                 else self._collective))

    def _matches_frame(self, wrappers: bool, frame: Frame) -> bool:
        if len(frame.func) + len(frame.file) > _CACHED_NAME:
            return self._matches(wrappers, frame.func, frame.file)
        return self._matches_cached(wrappers, frame.func, frame.file)

    def is_collective(self, frame: Frame) -> bool:
        return self._matches_frame(False, frame)

    def is_wrapper(self, frame: Frame) -> bool:
        return self._matches_frame(True, frame)

    def in_app_frames(self, frames: list[Frame]) -> list[Frame]:
        return [f for f in frames if self.in_app(f)]

    def collective_index(self, frames: list[Frame]) -> int | None:
        """Index (innermost first) of the innermost collective frame, if any."""
        for i, f in enumerate(frames):
            if self.is_collective(f):
                return i
        return None

    def call_site(self, frames: list[Frame]) -> Frame | None:
        """For a stack inside a collective: the in-app frame that decided to call it."""
        idx = self.collective_index(frames)
        if idx is None:
            return None
        for f in frames[idx + 1:]:
            if self.in_app(f) and not self.is_wrapper(f) and not self.is_collective(f):
                return f
        return None

    def innermost_in_app(self, frames: list[Frame]) -> Frame | None:
        for f in frames:
            if self.in_app(f):
                return f
        return None

    def innermost_caller(self, frames: list[Frame]) -> Frame | None:
        """The innermost in-app frame that is not communication plumbing (a wrapper rule of
        the catalog); the innermost in-app frame when every in-app frame is plumbing (an error
        raised inside the communication layer itself still names a place)."""
        for f in frames:
            if self.in_app(f) and not self.is_wrapper(f) and not self.is_collective(f):
                return f
        return self.innermost_in_app(frames)

    def state(self, t: ThreadStack) -> ThreadState:
        """What the thread was doing (see the module docstring)."""
        if t.fatal:
            return ThreadState.CRASHED
        if self.collective_index(t.frames) is not None:
            # caught inside a collective, but seen elsewhere a moment later: running
            return ThreadState.ACTIVE if t.moved else ThreadState.BLOCKED
        py = [f for f in t.frames if f.line is not None]
        if py and any(r.match(py[0].func, py[0].file) for r in self._idle):
            return ThreadState.IDLE
        if t.idle:
            return ThreadState.IDLE
        return ThreadState.ACTIVE

    def role(self, t: ThreadStack) -> str:
        """``prefetch`` for storage/prefetch threads, ``main`` for the scheduler, else the name."""
        if any(_PREFETCH_ROLE.search(f.func) for f in t.frames):
            return "prefetch"
        if t.name in ("MainThread", "", "(traceback)") or t.current:
            return "main"
        return _without_number(t.name) or t.name


def _parse(rule: str) -> _Rule:
    func, _, file = rule.partition("@")
    return _Rule(linear(func) if func else None, linear(file) if file else None)


_CLASSIFIERS: dict[int, tuple[FrameRules, FrameClassifier]] = {}


def classifier_for(rules: FrameRules) -> FrameClassifier:
    """One classifier per catalog (frame rules are immutable; keyed by identity)."""
    hit = _CLASSIFIERS.get(id(rules))
    if hit is None or hit[0] is not rules:
        hit = _CLASSIFIERS[id(rules)] = (rules, FrameClassifier(rules))
    return hit[1]


#: Process and thread entry points: the frames a stack starts with whatever it does.
_ENTRY = linear(r"(?:^|\.)(?:run_scheduler_process|run_engine_core|run_worker_process|main|"
                r"<module>|run|_bootstrap|_bootstrap_inner|_run_module_as_main|_run_code|"
                r"wrapper|_wrapper|inner|worker_main|run_mp_engine|start_worker|"
                r"run_detokenizer_process|launch_server|_launch_subprocesses|"
                r"launch_engine|__call__|decorate_context|invoke|_process_worker)$")
#: What a process does before it serves: construction, set-up and loading.
_SETUP = linear(r"(?:^|\.)(?:__init__|__post_init__|__new__|init_\w+|_init_\w*|"
                r"initiali[sz]e\w*|_initiali[sz]e\w*|setup\w*|_setup\w*|load_model|"
                r"load_weights|from_pretrained|from_config|from_engine_args|"
                r"create_\w+|build_\w+|check_server_args|prepare_server_args|"
                r"profile_run|determine_available_memory|capture\w*|warmup\w*|"
                r"_warmup\w*|compile\w*)$")


#: Words of a function name that say it works out a configuration: a spec, a plan, the
#: arguments. An assertion there checks what the deployment asked for (layers whose page sizes
#: cannot be unified, a block size the backend does not take), not state built while serving.
_CONFIG_WORDS = frozenset({"spec", "specs", "config", "configs", "cfg", "plan", "planning",
                           "args", "schema"})


def checks_configuration(frames: list[Frame]) -> bool:
    """Whether a failure on this stack (innermost first) checks a configuration rather than
    state built while serving: the process is still starting (:func:`startup_phase`), or the
    raising frame works out a configuration (:func:`_works_out_configuration`; a stack cut
    above it hides the phase)."""
    return startup_phase(frames) or _works_out_configuration(frames)


def _works_out_configuration(frames: list[Frame]) -> bool:
    """Whether the raising frame (innermost with a function) works out a configuration:
    ``unify_kv_cache_spec_page_size``, ``get_kv_cache_config``, ``_verify_args``. Split on
    ``.`` and ``_`` (no pattern over the untrusted name), so any length reads in linear time."""
    for f in frames:
        if not f.func or f.file == "(cut off)":
            continue
        words = f.func.rsplit(".", 1)[-1].lower().split("_")
        return not _CONFIG_WORDS.isdisjoint(words)
    return False


def startup_phase(frames: list[Frame]) -> bool:
    """Whether a stack (innermost first) is a process still starting: below its entry point,
    the outermost frame constructs, sets up or loads something (``Scheduler.__init__``,
    ``init_cache_with_memory_pool``, ``EngineCore.__init__``), not a serving loop."""
    for f in reversed(frames):
        if not f.func or f.file == "(cut off)":
            continue
        if _ENTRY.search(f.func):
            continue
        return bool(_SETUP.search(f.func))
    return False


def _without_number(name: str) -> str:
    """``name`` less a trailing number and the one separator before it (``worker-3`` ->
    ``worker``). A scan from the end: the pattern ``[-_ ]?\\d+$`` retried the run of digits
    from every start in it, quadratic in a dump's thread name (64 KB of digits: 74 s)."""
    end = len(name)
    while end and name[end - 1].isdecimal():
        end -= 1
    if end == len(name):
        return name
    if end and name[end - 1] in "-_ ":
        end -= 1
    return name[:end]
