"""Fixtures of the front end's tests: one live stack (test model with a tokenizer, exl3-router,
exl3serve-openai) for the session. EXL3_BUILD_DIR names the build directory (default: build)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import stack  # noqa: E402


class Stack:
    def __init__(self, model: Path, engine: str, engine_metrics: str, url: str,
                 router: stack.Proc) -> None:
        self.model = model
        self.router = router                 # exl3-router: its log is router.text()
        self.engine = engine
        self.engine_metrics = engine_metrics
        self.url = url                       # http://127.0.0.1:PORT/v1
        self.base = url[: -len("/v1")]
        self.name = model.name


@pytest.fixture(scope="session")
def build_dir() -> Path:
    d = stack.build_dir()
    if not (d / "bin" / "exl3-router").exists():
        pytest.fail(f"{d}/bin/exl3-router not built")
    return d


@pytest.fixture(scope="session")
def model(build_dir, tmp_path_factory) -> Path:
    return stack.make_model(build_dir, tmp_path_factory.mktemp("m") / "glm-test")


@pytest.fixture(scope="session")
def live(build_dir, model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    router, engine, metrics = stack.start_router(build_dir, model, logs)
    try:
        fe, url = stack.start_frontend(engine, model, logs)
    except BaseException:
        router.stop()
        raise
    yield Stack(model, engine, metrics, url, router)
    fe.stop()
    router.stop()
