"""Recovery distillation of the extracted student from the parent (DESIGN.md section 4).

- ``recover.distill(student, teacher, forward, batch_at, cfg, out_dir, seed) -> dict``: KD on
  logits (+ optional hidden-state loss) for a token budget, AdamW (torch) or Megatron's
  optimizer + scheduler (GPU), atomic checkpoints and exact resume, tqdm / TensorBoard / W&B.
- ``kd``: ``kd_loss``, ``lm_loss``, ``hidden_state_loss``, ``kd_train`` (shared with the search).
- ``schedule.lr_at``: warm-up + cosine, identical on both optimizer paths.

Submodules are imported where used (the search imports only ``kd``).
"""
