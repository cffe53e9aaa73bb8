"""Engine worker scripts: each runs in the engine's own interpreter or container, imports only the
standard library, numpy and its engine, and speaks the protocol of ``_protocol.py`` (request JSON in,
response JSON out). They are copied next to the request and run by path, never imported by the project."""
