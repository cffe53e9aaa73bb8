"""The pipeline's graph, read from the stages' own declarations (``STAGE`` in each stage module).

Everything that needs the stage order or the dependencies reads it from here: the runner
(``pipeline.walk``), ``stages=[...]`` validation, the per-stage console scripts (``cli.py``),
``--help`` and ``autocompress --graph`` (text or mermaid). The order of :func:`stages` is the order
the stages run in; every need of a stage comes before it (checked when the graph is built).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from autocompress_nemo.stages.declare import Stage


@functools.cache
def stages() -> tuple[Stage, ...]:
    """Every declared stage, in run order."""
    from autocompress_nemo.stages import (
        distill,
        evaluate,
        export,
        extract,
        profile,
        rank,
        reconstruct,
        report,
        search,
    )

    out = (
        profile.STAGE,
        profile.VALIDATE,
        rank.STAGE,
        search.STAGE,
        extract.STAGE,
        reconstruct.STAGE,
        distill.STAGE,
        export.STAGE,
        evaluate.STAGE,
        report.STAGE,
    )
    check(out)
    return out


def check(graph: Iterable[Stage]) -> None:
    """Names unique; every need and optional input declared earlier; per-method stages read only
    per-method stages or whole-run ones."""
    seen: dict[str, Stage] = {}
    for s in graph:
        if s.name in seen:
            raise ValueError(f"stage {s.name!r} is declared twice")
        for n in (*s.required, *s.optional):
            if n not in seen:
                raise ValueError(f"stage {s.name!r} needs {n!r}, which is not declared before it")
        if s.entry is None:
            raise ValueError(f"stage {s.name!r} declares no entry")
        seen[s.name] = s


def by_name() -> dict[str, Stage]:
    return {s.name: s for s in stages()}


def names() -> tuple[str, ...]:
    return tuple(s.name for s in stages())


def selectable() -> tuple[str, ...]:
    """The stages ``stages=[...]`` may name (all but the ones that follow others by themselves)."""
    return tuple(s.name for s in stages() if s.cached)


def closure(wanted: Iterable[str]) -> list[str]:
    """The stages to run for ``wanted``, in run order: the wanted ones, every plain need of them
    (transitively) and, for an alternative need (``a|b|c``) none of whose stages is in the set,
    its last one (the base: ``extract`` for the student); a stage that is not cached (the report)
    joins when all its needs run. Optional inputs (``validate``) are never added: they are read
    when they run or are complete from an earlier invocation."""
    graph = by_name()
    unknown = [w for w in wanted if w not in graph]
    if unknown:
        raise ValueError(f"stages: unknown stage(s) {unknown}; stages are {', '.join(selectable())}")
    chosen = set(wanted)
    changed = True
    while changed:
        changed = False
        for name in list(chosen):
            for need in graph[name].needs:
                alts = need.split("|")
                if len(alts) == 1 and alts[0] not in chosen:
                    chosen.add(alts[0])
                    changed = True
                elif not chosen.intersection(alts):
                    chosen.add(alts[0])
                    changed = True
        for s in graph.values():
            if s.name not in chosen and chosen.intersection(s.joins):
                chosen.add(s.name)
                changed = True
            if not s.cached and s.name not in chosen and s.required and all(n in chosen for n in s.required):
                chosen.add(s.name)
                changed = True
    return [n for n in names() if n in chosen]


def with_optional(names_: Iterable[str]) -> list[str]:
    """:func:`closure` of ``names_`` plus every optional input of the stages in it (a console
    script runs what its stage reads when present: ``validate`` for the search)."""
    graph = by_name()
    chosen = closure(names_)
    return closure([*chosen, *(o for n in chosen for o in graph[n].optional)])


def wanted(cfg_stages: Iterable[str] | None) -> list[str]:
    """``stages=[...]`` as given, or every stage when empty."""
    given = [str(s) for s in cfg_stages or []]
    return given or list(selectable())


def render(fmt: str = "text") -> str:
    """The graph as text (one line per stage: its needs, scope and reads) or as a mermaid flowchart."""
    graph = stages()
    if fmt == "mermaid":
        lines = ["flowchart LR"]
        for s in graph:
            label = s.name + (" (per method)" if s.per_method else "") + (" [resumable]" if s.resumable else "")
            lines.append(f'    {s.name}["{label}"]')
        for s in graph:
            for need in s.needs:
                alts = need.split("|")
                for n in alts:
                    lines.append(f"    {n} -->|or| {s.name}" if len(alts) > 1 else f"    {n} --> {s.name}")
            for n in s.optional:
                lines.append(f"    {n} -.-> {s.name}")
        return "\n".join(lines)
    if fmt != "text":
        raise ValueError(f"--graph {fmt}: use 'text' or 'mermaid'")
    rows = []
    for s in graph:
        scope = "per method" if s.per_method else "per budget" if s.per_budget else "once"
        flags = [scope] + (["resumable"] if s.resumable else []) + ([] if s.cached else ["not cached"])
        flags += ["rank 0 only"] if s.rank0_only else []
        flags += [f"runs with {', '.join(s.joins)}"] if s.joins else []
        needs = ", ".join(s.needs) or "-"
        opt = f" (optional: {', '.join(s.optional)})" if s.optional else ""
        rows.append(f"{s.name:<12} needs {needs}{opt}; {'; '.join(flags)}\n{'':<12} reads {', '.join(s.reads) or '-'}")
    return "\n".join(rows)
