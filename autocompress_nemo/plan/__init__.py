"""Planning at scale: parallel layouts per stage (``layout``), training memory per GPU
(``memory_train``), serving figures (``serving``) and the ``dry_run=true`` planner (``dry_run``).
Everything here is computed from shapes: estimated, not measured."""
