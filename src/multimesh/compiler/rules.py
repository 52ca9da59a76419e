r"""Implicit tasks: ``task_rules`` map named scopes (``jax.named_scope``, Flax module
paths such as ``layers_3``) to stages, without touching the model code.

``{regex: stage | callable(re.Match) -> stage}``. For each untagged equation, its scopes
are tried innermost first, and for each scope the rules in order (``re.search``); the
first match wins. A rule whose regex contains ``/`` is searched in the scope path down to
that scope, and counts where its match reaches into that scope's name
(``decoder/layers_(\d+)`` at ``Top/decoder/layers_3``: one task for everything inside the
layer, unless a rule matches an inner scope first); others in the scope's own name. An
explicit ``mm.task`` always overrides a rule. Backward equations carry their forward's
scopes (under ``transpose``), so they follow.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from multimesh import _compat
from multimesh.tasks import MARKER, ByLayer, TaskRef, decode_marker

_compat.register_exclusion(__file__)


def _path_match(rx: re.Pattern, scopes: list[str], k: int) -> tuple[re.Match | None, str]:
    r"""``rx`` searched in the scope path down to ``scopes[k]`` (``a/b/c``), counting only
    a match that reaches into ``scopes[k]`` itself, so scopes stay tried innermost first
    (``decoder/layers_(\d+)`` matches at ``.../layers_3``, not again at
    ``.../layers_3/attn``, where a rule for ``attn`` comes first). The name is that path."""
    path = "/".join(scopes[: k + 1])
    last = len(path) - len(scopes[k])
    for m in rx.finditer(path):
        if m.end() > last:
            return m, path
    return None, scopes[k]


class Rules:
    """Compiled task rules; remembers which scope went to which stage."""

    def __init__(
        self, rules: Mapping[str | re.Pattern, int | Callable[[re.Match], int]]
    ) -> None:
        if not isinstance(rules, Mapping):
            raise TypeError("task_rules must be a dict {regex: stage | callable(match) -> stage}.")
        self.rules: list[tuple[str, re.Pattern, Any]] = []
        #: how messages name each rule: its text, or a compiled pattern's repr (two rules
        #: may share a text: ``"enc"`` and ``re.compile("enc", re.I)``)
        self.names: list[str] = []
        for key, target in rules.items():
            if isinstance(key, re.Pattern) and isinstance(key.pattern, str):
                pat, rx = key.pattern, key  # precompiled (messages name it by its repr)
            elif isinstance(key, str):
                pat = key
                try:
                    rx = re.compile(pat)
                except re.error as e:
                    raise ValueError(f"task_rules: {pat!r} is not a valid regex ({e}).") from None
            else:
                raise TypeError(
                    f"task_rules keys are regexes (str or re.compile(str)) matched against "
                    f"scope names, got {key!r}."
                )
            name = repr(key) if isinstance(key, re.Pattern) else repr(pat)
            if isinstance(target, ByLayer):
                pass
            elif not callable(target) and (
                isinstance(target, bool) or not isinstance(target, (int, np.integer))
            ):
                raise TypeError(
                    f"task_rules[{name}] must be a stage (int) or a callable(match) -> stage, "
                    f"got {target!r}."
                )
            self.rules.append((pat, rx, target))
            self.names.append(name)
        #: per rule (by position: two rules may share a pattern text): scopes it matched
        self.used: list[set[str]] = [set() for _ in self.rules]
        self.assigned: dict[str, int] = {}
        self._memo: dict[tuple[str, ...], TaskRef | None] = {}
        self.overlaps: dict[str, list[str]] = {}
        #: rule position -> explicit tasks (in order) whose code had a scope it matches
        self.shadowed: dict[int, dict[str, None]] = {}
        self._seen: set[tuple[tuple[str, ...], str]] = set()

    def overridden(self, scopes: list[str], task: str) -> None:
        """Note the rules matching a scope of an equation that the explicit ``task``
        places (explicit tasks take precedence over rules)."""
        key = (tuple(scopes), task)
        if key in self._seen:
            return
        self._seen.add(key)
        clean = [s for s in scopes if MARKER not in s]
        for k in range(len(clean)):
            for i, (pat, rx, _) in enumerate(self.rules):
                if _path_match(rx, clean, k)[0] if "/" in pat else rx.search(clean[k]):
                    self.shadowed.setdefault(i, {}).setdefault(task, None)

    def match(self, scopes: list[str], limit: int) -> TaskRef | None:
        key = tuple(scopes)
        if key in self._memo:
            return self._memo[key]
        ref = None
        clean = [s for s in scopes if MARKER not in s]
        for k in reversed(range(len(clean))):
            for i, (pat, rx, target) in enumerate(self.rules):
                scope = clean[k]
                if "/" in pat:  # a path pattern: searched in the path down to this scope
                    m, scope = _path_match(rx, clean, k)
                else:
                    m = rx.search(scope)
                if m is None:
                    continue
                if isinstance(target, ByLayer):
                    self.used[i].add(scope)
                    self._note_overlaps(i, clean, k, scope)
                    ref = TaskRef(scope, None, None, target)
                    break
                stage = target(m) if callable(target) else target
                if isinstance(stage, bool) or not isinstance(stage, (int, np.integer)):
                    raise TypeError(
                        f"task_rules[{self.names[i]}] returned {stage!r} for scope {scope!r}; it must "
                        "return a stage (int)."
                    )
                stage = int(stage)
                if not 0 <= stage < limit:
                    raise ValueError(
                        f"task_rules[{self.names[i]}] maps scope {scope!r} to stage {stage}, which is "
                        + (
                            "out of range (stages start at 0)."
                            if stage < 0
                            else f"out of range (valid: 0..{limit - 1})."
                        )
                        + (
                            " Virtual (interleaved) stages are valid in a program with an "
                            "interleaved mm.microbatch loop only; in others (init, evaluation "
                            f"on their own) map them to submeshes, e.g. stage % {limit}."
                            if stage >= limit > 0
                            else ""
                        )
                    )
                self.used[i].add(scope)
                self.assigned[scope] = stage
                self._note_overlaps(i, clean, k, scope)
                ref = TaskRef(scope, stage, None)
                break
            if ref is not None:
                break
        self._memo[key] = ref
        return ref

    def _note_overlaps(self, i: int, clean: list[str], k: int, scope: str) -> None:
        """Rule ``i`` won ``scope`` (``clean[k]``): note the other rules matching it."""
        others = [
            j
            for j, (p, r, _) in enumerate(self.rules)
            if j != i and (_path_match(r, clean, k)[0] if "/" in p else r.search(clean[k]))
        ]
        if others:
            self.overlaps[scope] = [self.names[j] for j in (i, *others)]
            for j in others:  # matched, though another rule won: not unused
                self.used[j].add(scope)

    def stages_inside(self, params: dict[str, Any], outer: list[str], limit: int) -> set[TaskRef]:
        """Tasks the rules give equations inside an equation's nested jaxprs (a call,
        ``jax.checkpoint``/``nn.remat`` body, or a loop body), whose scopes continue the
        outer ones."""
        from multimesh.compiler.inline import _sub_jaxprs

        found: set[TaskRef] = set()
        for sub in _sub_jaxprs(params):
            for e in sub.eqns:
                scopes = outer + _compat.scope_names(e.source_info.name_stack)
                # an explicit task's code (in a loop body) wins; not a microbatch's scope
                # (``mb0@mm:L0``), which marks no task
                task = next((r for sc in reversed(scopes) if (r := decode_marker(sc))), None)
                if task is not None:
                    self.overridden(scopes, task.name)
                    continue
                ref = self.match(scopes, limit)
                if ref is not None:
                    found.add(ref)
                found |= self.stages_inside(e.params, scopes, limit)
        return found

    def warn_unmatched(self) -> None:
        if self.overlaps:
            rows = "; ".join(
                f"{sc!r}: [{', '.join(ps)}] (first wins)" for sc, ps in sorted(self.overlaps.items())
            )
            warnings.warn(
                f"task_rules overlap: several rules match {rows}.", stacklevel=_user_level()
            )
        unused = [i for i, scopes in enumerate(self.used) if not scopes]
        for i in [i for i in unused if i in self.shadowed]:
            unused.remove(i)
            names = ", ".join(repr(t) for t in self.shadowed[i])
            warnings.warn(
                f"task_rules[{self.names[i]}] matched only scopes inside explicit tasks ({names}), "
                "which take precedence over task_rules: the rule placed nothing. Remove the "
                "rule or the task (or narrow the pattern).",
                stacklevel=_user_level(),
            )
        if unused:
            warnings.warn(
                f"task_rules matched no named scope: [{', '.join(self.names[i] for i in unused)}]. "
                "Check the patterns against "
                "the scopes in Lowered.as_text() or jax.make_jaxpr(...) name stacks.",
                stacklevel=_user_level(),
            )


def _user_level() -> int:
    """The ``stacklevel`` of the first caller outside MultiMesh and JAX (the line that
    called or lowered the mm.jit function)."""
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    theirs = os.path.dirname(os.path.abspath(jax.__file__))
    frame, level = sys._getframe(1), 1  # noqa: SLF001
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(ours) or path.startswith(theirs) or "contextlib" in path):
            return level
        frame, level = frame.f_back, level + 1
    return 2
