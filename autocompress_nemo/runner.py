"""The generic runner: walks the stages' declared graph (``stages/graph.py``) for one run.

Order, what runs and what is reused all come from the declarations (``Stage.needs``,
``optional``, ``per_method``, ``per_budget``, ``resumable``, ``enabled``): stages that run once
(profile, validate, rank), then for each budget (one, or every budget of a family) each method's
per-method stages (search, extract, reconstruct, distill, export) and the per-budget ones
(evaluate), then the stages that are not cached (the report). Cache keys, skip / rerun and
checkpoints are ``pipeline.Run``'s; what happened is returned as ``out["record"]`` (one row per
stage: ``stage``, ``name``, ``method``, ``budget``, ``status``, ``key``, ``seconds``,
``artifact``, ``why``) and written to ``<run_dir>/record.json``. Tests read the record, not the log.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from autocompress_nemo.context import Context
from autocompress_nemo.pipeline import Run, is_rank0
from autocompress_nemo.stages import graph
from autocompress_nemo.stages.declare import Inputs, Stage
from autocompress_nemo.utils.artifacts import write_json_atomic

RECORD = "record.json"


class MethodDropped(Exception):
    """A method other than the main one could not run (its search found no architecture): the
    run goes on without it, and the record says why."""


def methods(cfg: DictConfig) -> list[str]:
    """The main method, then the registered baseline(s) when ``baseline=true`` (Minitron++; not twice)."""
    from autocompress_nemo.stages.common import REGISTRY

    main = str(cfg.search.method)
    return [main] + [m for m, obj in REGISTRY.items() if cfg.baseline and obj.baseline and m != main]


class Walk:
    """One walk of the graph over ``run`` (a family's budgets share the once-per-run stages)."""

    def __init__(self, cfg: DictConfig, run: Run, ctx: Context) -> None:
        self.cfg, self.run, self.ctx = cfg, run, ctx
        self.plan = graph.closure(graph.wanted(cfg.stages))
        self.graph = graph.by_name()
        self.methods = methods(cfg)
        self.shared: dict[str, Any] = {}
        self.per_budget: dict[str, Path | None] = {}

    def stages(self, *, per_method: bool = False, per_budget: bool = False, cached: bool = True) -> list[Stage]:
        return [
            s
            for n in self.plan
            if (s := self.graph[n]).per_method == per_method
            and (s.per_budget and not s.per_method) == per_budget
            and s.cached == cached
        ]

    # -- one stage --------------------------------------------------------------------------
    def resolve(self, stage: Stage, arts: dict[str, Path | None], run: Run) -> dict[str, Path | None]:
        """The artifact of every need (the first alternative that ran) and optional input (run
        now, or complete from an earlier invocation: reused)."""
        dirs: dict[str, Path | None] = {}
        for need in stage.needs:
            if not stage.per_method and all(self.graph[a].per_method for a in need.split("|")):
                continue  # a per-budget stage reads every method's artifacts (Inputs.by_method)
            dirs[need] = next((arts[a] for a in need.split("|") if arts.get(a) is not None), None)
            if dirs[need] is None:
                raise ValueError(f"stage {stage.name}: its input {need} did not run (stages={list(self.cfg.stages)})")
        for opt in stage.optional:
            if not stage.per_method and self.graph[opt].per_method:
                continue
            if opt not in arts and opt in self.graph:
                arts[opt] = self.reuse(self.graph[opt], arts, run)
            dirs[opt] = arts.get(opt)
        return dirs

    def reuse(self, stage: Stage, arts: dict[str, Path | None], run: Run) -> Path | None:
        """An optional input that does not run now: its artifact when complete for the same inputs
        (from an earlier invocation), else ``None`` (also when its own inputs are not at hand)."""
        try:
            ins = self.resolve(stage, arts, run)
        except ValueError:
            return None
        return run.reuse(stage, [d for d in ins.values() if d is not None])

    def one(
        self,
        stage: Stage,
        arts: dict[str, Path | None],
        run: Run,
        ctx: Context,
        method: str | None = None,
        by_method: dict[str, dict[str, Path]] | None = None,
        extra: dict[str, Path] | None = None,
    ) -> Path | None:
        """Run (or skip, or pass through) one stage. ``extra``: further named inputs that are part of
        its key (a family's first search, ``search@first``)."""
        why = stage.why_disabled(run.cfg)
        if why:  # passed through: its consumers take the next alternative
            run.note(stage.dir_name(method) + run.suffix, "passed", name=stage.name, method=method, why=why)
            return None
        dirs = {**self.resolve(stage, arts, run), **(extra or {})}
        inputs = [d for d in dirs.values() if d is not None]
        inputs += [p for per in (by_method or {}).values() for p in per.values()]  # every method's, for evaluate
        ckpt = run.checkpoint(stage, inputs, method) if stage.resumable else None
        inp = Inputs(run, dirs, method, ckpt, by_method or {}, self.methods, self.shared)
        if not stage.cached:
            return stage.entry(ctx.for_stage(stage.reads), run.dir, inp) if stage.entry else None
        path = run.run_stage(stage, ctx, lambda c, d: stage.entry(c, d, inp) if stage.entry else None, inputs, method)
        if ckpt is not None and not bool(self.cfg.get("keep_checkpoints", False)) and is_rank0():
            # the artifact is complete: its checkpoints (weights + optimizer state) are spent
            shutil.rmtree(ckpt, ignore_errors=True)
        return path

    # -- the walk ---------------------------------------------------------------------------
    def __call__(self) -> dict[str, Any]:
        from autocompress_nemo.search.family import members

        out: dict[str, Any] = {"run_dir": str(self.run.dir), "record": self.run.records}
        arts: dict[str, Path | None] = {}
        try:
            for s in self.stages():
                arts[s.name] = self.one(s, arts, self.run, self.ctx)
            for opt in (o for n in self.plan for o in self.graph[n].optional):  # validate, when complete
                if opt not in arts and opt in self.graph and not self.graph[opt].per_method:
                    arts[opt] = self.reuse(self.graph[opt], arts, self.run)
            family = members(self.cfg)
            if not family:
                ev, _ = self.budget(self.run, self.ctx, arts)
                if ev is not None:
                    out["evaluation"] = str(ev / "evaluation.json")
            else:
                out.update(self.family(family, arts))
            self.shared.setdefault("members", [])
            arts.update(self.per_budget)
            for s in self.stages(cached=False):
                if all(n in self.plan for n in s.required):
                    path = self.one(s, arts, self.run, self.ctx)
                    if path is not None:
                        out[s.name] = str(path)
        finally:
            if is_rank0() and self.run.dir.is_dir():
                write_json_atomic(self.run.dir / RECORD, {"stages": self.run.records})
        return out

    def budget(
        self,
        run: Run,
        ctx: Context,
        shared_arts: dict[str, Path | None],
        extra: dict[str, dict[str, dict[str, Path]]] | None = None,
    ) -> tuple[Path | None, dict[str, dict[str, Path]]]:
        """Every method's per-method stages, then the per-budget ones: the last per-budget artifact
        and every method's artifacts. ``extra[method][stage]``: further named inputs of a stage."""
        by_method: dict[str, dict[str, Path]] = {}
        for m in self.methods:
            arts = dict(shared_arts)
            try:
                for s in self.stages(per_method=True):
                    arts[s.name] = self.one(s, arts, run, ctx, m, extra=(extra or {}).get(m, {}).get(s.name))
            except ValueError as e:
                if m == self.methods[0]:
                    raise
                run.note(f"{m}{run.suffix}", "dropped", name="method", method=m, why=str(e)[:300])
                run.say(f"[search_{m}{run.suffix}] baseline not run: {e}")
                continue
            for name, path in arts.items():
                if path is not None and name not in shared_arts:
                    by_method.setdefault(name, {})[m] = path
        last = None
        if by_method:
            for s in self.stages(per_budget=True):
                last = self.one(s, shared_arts, run, ctx, by_method=by_method)
                self.per_budget.setdefault(s.name, last)  # the first budget's: what the report needs
        return last, by_method

    def family(self, family: list, arts: dict[str, Path | None]) -> dict[str, Any]:
        """One student per budget (``search.budgets``) from this profile and rank; a further budget's
        AutoCompress search trains its router on the first budget's supernet (``search/family.py``)."""
        from autocompress_nemo.search.autocompress import ParentMeetsBudget

        out: dict[str, Any] = {"evaluations": {}}
        extra: dict[str, dict[str, dict[str, Path]]] = {}
        done = self.shared.setdefault("members", [])
        for member in family:
            run_b, ctx_b = self.run.for_budget(member.cfg, member.suffix), Context(member.cfg, self.run.say)
            ctx_b._shared = self.ctx._shared  # the parent, the corpus and the process groups are the family's
            self.run.say(
                f"[family] budget {member.value} ({'first: trains the supernet' if member.first else 'extra'})"
            )
            try:
                ev, made = self.budget(run_b, ctx_b, arts, None if member.first else extra)
            except ParentMeetsBudget as e:
                if member.first:
                    raise
                self.run.say(f"[family] budget {member.value}: nothing to compress ({e})")
                self.run.note(f"budget{member.suffix}", "dropped", name="budget", why=f"nothing to compress: {e}"[:300])
                continue
            if member.first:  # a further budget's search of a method that shares its supernet reads the first's
                extra = {
                    m: {"search": {"search@first": p}} for m, p in made.get("search", {}).items() if shares_supernet(m)
                }
            done.append(member)
            if ev is not None:
                out["evaluations"][str(member.value)] = str(ev / "evaluation.json")
        if out["evaluations"]:
            out["evaluation"] = next(iter(out["evaluations"].values()))
        return out


def shares_supernet(method: str) -> bool:
    """Whether a further budget of a family trains this method's search on the first budget's supernet."""
    from autocompress_nemo.stages.common import method_object

    return method_object(method).shares_supernet


def walk(cfg: DictConfig, run: Run, ctx: Context) -> dict[str, Any]:
    return Walk(cfg, run, ctx)()
