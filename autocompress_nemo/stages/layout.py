"""Every artifact's file names, in one place: one small typed layout per stage.

A layout is a view of an artifact directory (``<run_dir>/<stage>``); the stages write through it
and the stages downstream (and the report) read through it, so a file name is written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SPEC = "spec.json"
WEIGHTS = "model.safetensors"
TABLE_DIR, TABLE_FILE = "cost_table", "cost_table.json"
VALIDATION_DIR = "validation"


@dataclass(frozen=True)
class Weights:
    """A model: its ``ArchSpec`` and its Hugging Face-named float32 state dict."""

    dir: Path

    @property
    def spec(self) -> Path:
        return self.dir / SPEC

    @property
    def weights(self) -> Path:
        return self.dir / WEIGHTS


@dataclass(frozen=True)
class ProfileDir:
    dir: Path

    @property
    def table(self) -> Path:
        """The cost table (``costs/table.CostTable``, JSON)."""
        return self.dir / TABLE_DIR / TABLE_FILE


@dataclass(frozen=True)
class ValidateDir:
    dir: Path

    @property
    def results(self) -> Path:
        """Where ``profile/stage.run_validate`` writes its report (the directory the stages read)."""
        return self.dir / VALIDATION_DIR

    @property
    def validation(self) -> Path:
        return self.results / "validation.json"


@dataclass(frozen=True)
class RankDir(Weights):
    """The sorted parent (weights), the importance scores before and after sorting, the permutations."""

    @property
    def scores(self) -> Path:
        return self.dir / "scores.json"

    @property
    def sorted_scores(self) -> Path:
        return self.dir / "sorted_scores.json"

    @property
    def permutations(self) -> Path:
        return self.dir / "permutations.json"


@dataclass(frozen=True)
class SearchDir:
    dir: Path

    @property
    def arch(self) -> Path:
        """``arch.json``: the child, the decisions, the probabilities, the guard, the engine check."""
        return self.dir / "arch.json"

    @property
    def trajectory(self) -> Path:
        return self.dir / "trajectory.json"

    @property
    def trajectory_plot(self) -> Path:
        return self.dir / "trajectory.png"


MEGATRON_CKPT = "megatron"


@dataclass(frozen=True)
class ExtractDir(Weights):
    @property
    def arch(self) -> Path:
        return self.dir / "arch.json"


@dataclass(frozen=True)
class DistillDir(Weights):
    @property
    def record(self) -> Path:
        return self.dir / "distill.json"


@dataclass(frozen=True)
class ExportDir:
    dir: Path

    def gguf(self, name: str) -> Path:
        return self.dir / f"{name or 'student'}.gguf"

    def ggufs(self) -> list[Path]:
        return sorted(self.dir.glob("*.gguf"))

    @property
    def parity(self) -> Path:
        return self.dir / "parity.json"

    @property
    def quantization(self) -> Path:
        """llama.cpp quantization record: per-tensor types, fallbacks, bits per weight."""
        return self.dir / "quantization.json"

    @property
    def hf(self) -> Path:
        return self.dir / "hf"

    @property
    def megatron(self) -> Path:
        """The student as a Megatron-LM distributed checkpoint (``models.dist_checkpoint``): one of the
        export formats, like the GGUF and the Hugging Face directory (a stage keeps its weights once)."""
        return self.dir / MEGATRON_CKPT


@dataclass(frozen=True)
class EvaluateDir:
    dir: Path

    @property
    def evaluation(self) -> Path:
        return self.dir / "evaluation.json"
