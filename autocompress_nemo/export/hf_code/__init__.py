"""Configuration and modeling code copied into exported Hugging Face directories (``auto_map``).

The files here import only ``transformers`` (and ``torch``): they run inside the serving engine's
interpreter as remote code (``trust_remote_code=True``), where this package is not installed.
``autocompress_nemo.export.hf_engine`` copies them; nothing in the project imports them.
"""
