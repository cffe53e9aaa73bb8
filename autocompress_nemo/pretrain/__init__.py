"""Parents this project pretrains itself (``model.source.kind=pretrained``).

``python -m autocompress_nemo.pretrain model=stdlib_hybrid`` trains the model config's shape from
random weights with the project's own Megatron training loop (``distill.recover.distill`` in its
language-modelling mode) on the recipe's corpus, stops when held-out perplexity stops falling
quickly, and writes a Hugging Face Nemotron-H directory into a cache outside the repository
(``cache.py``). Any command given ``model=stdlib_hybrid`` then loads it from there.

Modules: ``cache`` (where a parent lives and its key; no project imports, so ``config`` may use
it), ``run`` (the training), ``__main__`` (the command).
"""
