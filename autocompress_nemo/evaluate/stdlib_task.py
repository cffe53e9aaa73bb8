"""A local lm-eval task made from held-out standard-library modules: ``stdlib_next_line``.

Hub data sets cannot be downloaded here, so the pipeline writes its own multiple-choice
task from text no model was calibrated or distilled on: given the preceding lines of a
held-out module, pick the true next line among four — the other three are non-blank lines
drawn from other places in the held-out modules (deterministically, by seed). Scored by
lm-eval's ``acc`` / ``acc_norm`` through the harness adapter, like any lm-eval task.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

TASK = "stdlib_next_line"


def make_items(
    texts: Sequence[str], n_items: int, seed: int, context_lines: int = 12, n_choices: int = 4
) -> list[dict]:
    """Multiple-choice items from documents: ``{context, choices, label}``."""
    rng = random.Random(seed)
    lines_by_doc = [t.splitlines() for t in texts if t.strip()]
    pool = [ln for lines in lines_by_doc for ln in lines if len(ln.strip()) > 8]
    if len(pool) < n_choices * 4:
        raise ValueError(f"{TASK}: held-out text has only {len(pool)} usable lines; add held-out documents")
    candidates = [
        (d, i)
        for d, lines in enumerate(lines_by_doc)
        for i in range(context_lines, len(lines))
        if len(lines[i].strip()) > 8
    ]
    if not candidates:
        raise ValueError(
            f"{TASK}: no held-out document is longer than {context_lines} lines, so no item has a context; "
            "add longer held-out documents, or leave the task out (evaluate.lm_eval_tasks=[])"
        )
    rng.shuffle(candidates)
    items = []
    for d, i in candidates[:n_items]:
        lines = lines_by_doc[d]
        true = lines[i]
        wrong: list[str] = []
        while len(wrong) < n_choices - 1:
            w = rng.choice(pool)
            if w.strip() != true.strip() and w not in wrong:
                wrong.append(w)
        label = rng.randrange(n_choices)
        choices = wrong[:label] + [true] + wrong[label:]
        items.append({"context": "\n".join(lines[i - context_lines : i]) + "\n", "choices": choices, "label": label})
    return items


def write_task(out_dir: Path, texts: Sequence[str], n_items: int = 100, seed: int = 0) -> Path:
    """Write ``<TASK>.jsonl`` and ``<TASK>.yaml`` into ``out_dir``; returns the directory
    (pass it to lm-eval's ``TaskManager(include_path=...)``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / f"{TASK}.jsonl"
    with open(data, "w") as f:
        for it in make_items(texts, n_items, seed):
            f.write(json.dumps(it) + "\n")
    (out_dir / f"{TASK}.yaml").write_text(
        f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data.resolve()}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
  description: "Pick the true next line of a held-out Python standard-library module among 4 (written by autocompress-nemo)"
"""
    )
    return out_dir
