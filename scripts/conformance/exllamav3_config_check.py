"""Does exllamav3 accept a model directory? Runs exllamav3's own Config.from_directory on it (its
architecture's reader: config.json and the files beside it that it opens, such as GLM-5.3-Flash's
processor_config.json), builds the component models it asks for with Model.from_config, and checks
that every weighted module of theirs (Linear, Embedding, RMSNorm unless unweighted, LayerNorm) finds
its tensors in the directory's *.safetensors. What it cannot see without loading: the other
parameters a module reads at model.load() (A_log, conv1d, hyper-connection and indexer parameters)
and the shapes its CUDA kernels take.

    python3 scripts/conformance/exllamav3_config_check.py DIR [DIR ...] [--component text[,mtp]]
        [--exllamav3 WHEEL_OR_DIR]

Where exllamav3 and torch import (the GPU machine, after scripts/gpu/exllamav3_install.sh), they are
used as they are. Elsewhere (the CPU machine: no torch) exllamav3 is imported from its wheel
(--exllamav3, default ../shared/exllamav3/exllamav3-*.whl beside the checkout, unpacked into a
temporary folder; or a folder holding the package), and every module outside the standard library
that is not installed (torch, triton, its CUDA extension, PIL, rich, ...) is replaced by an inert
stand-in: importing and reading the configuration run exllamav3's code, nothing computes. numpy
must be there (the system Python's python3-numpy, or build/frontend-venv). A directory it refuses
is reported with exllamav3's own error (tests/scripts/conformance/exllamav3_config_check_test.py).

Exit status: 0 when every directory is accepted, 1 otherwise, 2 when exllamav3 cannot be imported.
"""

from __future__ import annotations

import argparse
import atexit
import glob
import importlib.abc
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import tempfile
import traceback
import types
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WHEELS = ROOT.parent / "shared" / "exllamav3"
# Never stood in for: exllamav3 itself, and numpy, with which it reads the safetensors headers.
REAL = ("exllamav3", "numpy")


def log(msg: str) -> None:
    print(f"exllamav3_config_check: {msg}", flush=True)


class _InertType(type):
    """The stand-in's type: any attribute, call, index or operator gives the stand-in again; as a
    base class it is `object`; applied as a decorator to a function, it leaves the function."""

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Inert

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _InertType):
            return args[0]
        return Inert

    def __getitem__(cls, key):
        return Inert

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False

    def __mro_entries__(cls, bases):
        return (object,)


def _inert(*args):
    return Inert


# Arithmetic and comparisons on a stand-in (a RoPE table built at construction) give it again.
for _op in ("or", "and", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul"):
    setattr(_InertType, f"__{_op}__", _inert)
    setattr(_InertType, f"__r{_op}__", _inert)
for _op in ("neg", "pos", "abs", "invert", "lt", "le", "gt", "ge"):
    setattr(_InertType, f"__{_op}__", _inert)


class Inert(metaclass=_InertType):
    pass


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: a module outside the standard library that no other finder finds
    becomes an inert one."""

    def __init__(self) -> None:
        self.made: set[str] = set()

    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top in REAL or top in sys.stdlib_module_names:
            return None  # a missing standard module (_winapi) stays missing
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def getattr_(attr):
            if attr.startswith("__") and attr.endswith("__"):
                raise AttributeError(attr)
            return Inert

        module.__getattr__ = getattr_
        self.made.add(spec.name.split(".")[0])
        return module

    def exec_module(self, module) -> None:
        pass


def import_exllamav3(source: str | None):
    """exllamav3's Config and Model, and how they were had ("installed" or "stand-ins: ...")."""
    if source is None and importlib.util.find_spec("torch") and importlib.util.find_spec("exllamav3"):
        from exllamav3 import Config, Model
        return Config, Model, "installed"
    if not importlib.util.find_spec("numpy"):
        raise ImportError("numpy is needed (exllamav3 reads the safetensors headers with it): run "
                          "with a Python that has it, e.g. build/frontend-venv/bin/python "
                          "(scripts/lib/frontend_venv.sh)")
    if source is None:
        wheels = sorted(glob.glob(str(DEFAULT_WHEELS / "exllamav3-*.whl")))
        if not wheels:
            raise ImportError(f"no torch and exllamav3 here, and no wheel in {DEFAULT_WHEELS} "
                              "(--exllamav3 names one)")
        source = wheels[-1]
    if source.endswith(".whl"):
        # Unpacked: zipimport finds no namespace package (exllamav3/architecture/mm_processing).
        unpacked = tempfile.mkdtemp(prefix="exllamav3-wheel-")
        atexit.register(shutil.rmtree, unpacked, True)
        with zipfile.ZipFile(source) as wheel:
            wheel.extractall(unpacked, [n for n in wheel.namelist() if n.startswith("exllamav3/")])
        sys.path.insert(0, unpacked)
    else:
        sys.path.insert(0, source)
    stand_ins = _StandIns()
    sys.meta_path.append(stand_ins)
    from exllamav3 import Config, Model
    return Config, Model, f"{os.path.basename(source)}, stand-ins for {', '.join(sorted(stand_ins.made))}"


def _names(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _names(v)]
    return [value] if isinstance(value, str) else []


def missing_tensors(model, tensor_names: set[str]) -> list[str]:
    """The weighted modules of `model` none of whose keys (key, alt_key, fkey) names a tensor or a
    group of tensors (KEY.weight, KEY.trellis, ...) of the directory."""
    from exllamav3.modules import Embedding, LayerNorm, Linear, RMSNorm
    prefixes = {name.rsplit(".", 1)[0] for name in tensor_names} | tensor_names

    def present(key: str) -> bool:
        return key in prefixes or any(p.startswith(key + ".") for p in prefixes)

    out = []
    for module in model:
        if not isinstance(module, (Linear, Embedding, RMSNorm, LayerNorm)):
            continue
        if isinstance(module, RMSNorm) and getattr(module, "unweighted", False):
            continue
        keys = _names(module.key) + _names(getattr(module, "alt_key", None)) + \
            _names(getattr(module, "fkey", None))
        if not any(present(k) for k in keys):
            out.append(module.key)
    return out


def check(directory: str, components: list[str], Config, Model) -> bool:
    try:
        config = Config.from_directory(directory)
    except Exception as e:  # exllamav3 refuses with ValueError, AssertionError, KeyError, ...
        where = traceback.extract_tb(e.__traceback__)[-1]
        log(f"{directory}: refused by Config: {type(e).__name__}: {str(e) or where.line} "
            f"({os.path.basename(where.filename)}:{where.lineno})")
        return False
    names = set(config.stc.tensor_file_map)
    ok = True
    parts = []
    for component in components:
        if component not in config.model_classes:
            log(f"{directory}: {type(config).__name__} has no component {component!r} "
                f"(it has {', '.join(config.model_classes)})")
            ok = False
            continue
        try:
            model = Model.from_config(config, component)
        except Exception as e:
            log(f"{directory}: {component} model refused: {type(e).__name__}: {e}")
            ok = False
            continue
        missing = missing_tensors(model, names)
        count = sum(1 for _ in model)
        if missing:
            log(f"{directory}: {component}: {len(missing)} of {count} modules find no tensors: "
                f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
            ok = False
        else:
            parts.append(f"{component}: {count} modules, every weighted one's tensors present")
    if ok:
        log(f"{directory}: accepted ({type(config).__name__}, {config.num_hidden_layers} layers; "
            f"{'; '.join(parts)})")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="model directories (config.json + *.safetensors)")
    ap.add_argument("--component", default="text",
                    help="comma-separated components to build (text, mtp, vision; default text)")
    ap.add_argument("--exllamav3", help="exllamav3's wheel or a folder holding the package "
                                        "(default: the installed one, else ../shared/exllamav3's wheel)")
    args = ap.parse_args()
    try:
        Config, Model, how = import_exllamav3(args.exllamav3)
    except Exception as e:
        log(f"cannot import exllamav3: {type(e).__name__}: {e}")
        return 2
    log(f"exllamav3 from {how}")
    results = [check(d, args.component.split(","), Config, Model) for d in args.dirs]
    log(f"{sum(results)} of {len(results)} accepted")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
