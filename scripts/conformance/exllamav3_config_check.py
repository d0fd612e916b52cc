"""Does exllamav3 accept a model directory? Runs exllamav3's own Config.from_directory on it (its
architecture's reader: config.json and the files beside it that it opens, such as GLM-5.3-Flash's
processor_config.json), builds the component models it asks for with Model.from_config, and checks,
from the *.safetensors headers, what their model.load() would do: each Linear as exllamav3's
Linear.load takes it (its key, then alt_key, as an EXL3 layer of the padded shape, then as an
unquantized weight, a list alt_key concatenated, then a fused fkey tensor: a quantized layer stored
where exllamav3 reads only a weight is refused as it refuses it), Embedding / RMSNorm (unless
unweighted) / LayerNorm weights, and the tensors modules read themselves (MLA's kv_b_proj.weight and
k-pool parameters, gated DeltaNet / KDA A_log, dt_bias and conv1d or q/k/v_conv1d, hyper-connection
fn/base/scale and Qwen3.8-Flash-Next's gated-residual sites, its PLE conv and n-gram table with its
hashing constants, DeepSeek-V4 attn_sink (its DSPARK drafter's too) and compressor ape, hash-routing tables), and the widths its
Linear pads where a consumer takes the padded tensor untrimmed (Qwen3.8-Flash-Next's QSA index_qk_proj
output and PLE projection inputs: padding_problem). What it cannot see: the values, and the other
shapes exllamav3's CUDA kernels take.

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


def tensor_shapes(directory: str) -> dict[str, list[int]]:
    """Every tensor's shape in the directory's *.safetensors (their headers; no data read)."""
    import json
    import struct
    shapes = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, entry in header.items():
            if name != "__metadata__":
                shapes[name] = entry["shape"]
    return shapes


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def linear_problem(m, stc, shapes: dict) -> str | None:
    """What exllamav3's Linear.load would make of this directory for `m`, emulated on the headers:
    None where it loads, else why not. Its order: the key then alt_key as EXL3 (trellis with su/suh
    and sv/svh), then as an unquantized weight (a list alt_key: those weights concatenated), then a
    fused tensor (fkey: fidx, MXFP4 blocks or an frange of rows); else its "No tensors found"."""
    keys = [m.key] + ([m.alt_key] if m.alt_key else [])
    for k in keys:
        if not m.is_exl3_storage(k):
            continue
        if isinstance(k, list):
            return (f"{m.key}: {', '.join(k)} are stored as EXL3 layers, which exllamav3 reads only "
                    f"as one layer {m.key} (its Linear.load_exl3 gets the list and fails: "
                    f"TypeError)")
        trellis = shapes.get(k + ".trellis")
        if trellis is not None and (len(trellis) != 3 or trellis[0] * 16 != m.in_features or
                                    trellis[1] * 16 != m.out_features):
            return (f"{k}.trellis has shape {trellis}; exllamav3's layer is {m.in_features} x "
                    f"{m.out_features} (padded to its pad_to), trellis [in / 16, out / 16, 16 K]")
        return None
    for k in keys:
        if stc.has_tensor_group(k, ["weight"]):
            parts = k if isinstance(k, list) else [k]
            rows, cols = 0, None
            for part in parts:
                shape = shapes.get(part + ".weight")
                if shape is None or len(shape) != 2:
                    return f"{part}.weight has shape {shape}; exllamav3 reads a linear weight [out, in]"
                rows += shape[0]
                if cols is not None and shape[1] != cols:
                    return f"{', '.join(parts)}: widths differ ({cols} and {shape[1]})"
                cols = shape[1]
            if cols > m.in_features or rows > m.out_features:
                return (f"{', '.join(p + '.weight' for p in parts)}: [{rows}, {cols}] where "
                        f"exllamav3's layer is [{m.out_features_unpadded}, {m.in_features_unpadded}]")
            return None
        if m.fkey and m.fidx is not None and (stc.has_tensor(m.fkey) or stc.has_tensor(m.fkey + "_blocks")):
            return None
        if m.fkey and m.frange is not None and stc.has_tensor_group(m.fkey, ["weight"]):
            shape = shapes.get(m.fkey + ".weight")
            if shape is not None and shape[m.frange_dim] < m.frange[1]:
                return f"{m.fkey}.weight has shape {shape}; {m.key} takes its rows {m.frange}"
            return None
    stored_as = [k + ".trellis" for k in _names(m.fkey) if k + ".trellis" in shapes]
    hint = f" ({stored_as[0]} is stored: exllamav3 reads {m.fkey} only unquantized)" if stored_as else ""
    return f"No tensors found for {m.key} matching supported quantization format{hint}."


def raw_reads(m) -> list[tuple[str, tuple | None]]:
    """The tensors (name, shape or None) a module's load() reads itself, not through a Linear or a
    norm, and must find (exllamav3's get_tensor without optional; read in its modules/*.py)."""
    cls = type(m).__name__
    out = []
    if cls == "MLAttention" and m.num_q_heads:
        # Folded into the queries and the output, never run as a layer: read as .weight only.
        out.append((f"{m.key}.{m.key_kv_b}.weight",
                    (m.num_q_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)))
        if m.index_kpool:
            out += [(f"{m.key}.{m.key_indexer}.index_kpool_compress_ape", None),
                    (f"{m.key}.{m.key_indexer}.index_kpool_compress_gate", None)]
    elif cls == "GatedDeltaNet" and m.num_k_heads:
        if m.key_a_log is not None:
            out += [(m.key_a_log, None), (m.key_dt_bias, None)]
    elif cls == "HyperConnection" or (cls == "HyperHead" and not m.mean):
        out += [(f"{m.key}_{part}", None) for part in ("fn", "base", "scale")]
    elif cls in ("DSV4Attention", "DSparkAttention") and m.num_q_heads:  # DSPARK: the MTP blocks' (docs/dspark.md)
        out.append((f"{m.key}.attn_sink", None))
        for c in (m.compressor, m.indexer):
            if c is not None:
                out.append((f"{c.key}.ape", None))
    elif cls == "BlockSparseMLP" and getattr(m, "tid2eid_key", None):
        out.append((f"{m.key}.{m.tid2eid_key}", None))
    elif cls == "GatedResidual":  # Qwen3.8-Flash-Next's hyper-connection sites and final mixer
        parts = ("hc_norm", "input_mix_weight_down", "input_mix_weight_up")
        out += [(f"{m.key}.{p}.weight", None) for p in parts + (("block_inject_weight",) if m.use_combine else ())]
    elif cls == "PLELayer" and not getattr(m, "stub", False):
        out.append((f"{m.key}.conv1d.weight", None))
    elif cls == "Qwen4ExpMTPInputLayer":  # the MTP head's per-stream norm over the trunk's streams
        out.append((f"{m.key}.pre_fc_norm_hidden.weight", None))
    return out


def ngram_problem(m, shapes: dict) -> str | None:
    """An n-gram table (NGramEmbedding.load, Qwen3.8-Flash-Next's PLE): KEY.trellis (or its
    KEY.shard_N.trellis pieces) with KEY.head_offsets / head_vocab_sizes / layer_multipliers, else
    the unquantized KEY.weight (or KEY.shard_N.weight) with the parent's ngram_heads_offsets /
    ngram_heads_vocab_sizes / layer_multipliers; one offset per head, rows of head_dim (160: its
    constructor asserts that) values, every piece but the last of the same row count."""
    if type(m).__name__ != "NGramEmbedding":
        return None

    def pieces(suffix):
        keys = []
        while f"{m.key}.shard_{len(keys)}.{suffix}" in shapes:
            keys.append(f"{m.key}.shard_{len(keys)}.{suffix}")
        return keys or ([f"{m.key}.{suffix}"] if f"{m.key}.{suffix}" in shapes else [])

    keys = pieces("trellis")
    quantized = bool(keys)
    if quantized:
        aux = [f"{m.key}.{n}" for n in ("head_offsets", "head_vocab_sizes", "layer_multipliers")]
    else:
        keys = pieces("weight")
        if not keys:
            return f"No .trellis, .weight or .shard_N.weight tensors found for {m.key}"
        parent = m.key.rsplit(".", 1)[0]
        aux = [f"{parent}.{n}" for n in ("ngram_heads_offsets", "ngram_heads_vocab_sizes", "layer_multipliers")]
    for name in aux:
        if name not in shapes:
            return f"Required tensor {name} not found for {m.key}"
    if shapes[aux[0]][0] != m.num_heads:
        return f"{m.key}: head_offsets holds {shapes[aux[0]][0]} rows for {m.num_heads} heads"
    rows = [shapes[k] for k in keys]
    if any(r[1:] != rows[0][1:] for r in rows) or any(r[0] != rows[0][0] for r in rows[:-1]) or rows[-1][0] > rows[0][0]:
        return f"pieces of {m.key} must have equal row counts (the last may be short) and widths"
    if not quantized and rows[0][1:] != [m.head_dim]:
        return f"{keys[0]} has rows of {rows[0][1:]}; exllamav3 reads n-gram rows of {m.head_dim}"
    return None


def conv_problem(m, shapes: dict) -> str | None:
    """A gated DeltaNet's convolution: `conv1d` [channels of q, k, v, 1, K] or, where that is
    absent, the three of them (q_conv1d, k_conv1d, v_conv1d), each required."""
    if type(m).__name__ != "GatedDeltaNet" or not m.num_k_heads or m.key_conv1d_weight is None:
        return None
    fused = shapes.get(m.key_conv1d_weight)
    if fused is not None:
        want = [m.fdim_qkv, 1, m.conv_kernel_size]
        return None if fused == want else f"{m.key_conv1d_weight} has shape {fused}; exllamav3 reads {want}"
    for k in (m.key_conv1d_q_weight, m.key_conv1d_k_weight, m.key_conv1d_v_weight):
        if k is None:
            return f"Required tensor {m.key_conv1d_weight} not found"
        if k not in shapes:
            return f"Required tensor {k} not found (nor {m.key_conv1d_weight})"
    return None


def padding_problem(m) -> str | None:
    """Where exllamav3's Linear pads a width to its pad_to (128) and the consumer takes the padded
    tensor as if it were not (a forward-time failure, found here from the module's shapes):
    QSAIndexer.project splits index_qk_proj's untrimmed output into n_heads * head_dim + head_dim,
    and PLELayer's fused ple_forward_streams multiplies the unpadded n-gram embedding (ple_embed_dim
    wide) by key_proj / value_proj's weights as loaded, their inputs padded."""
    cls = type(m).__name__
    if cls == "QSAIndexer":
        lin = m.index_qk_proj
        if lin.out_features != lin.out_features_unpadded:
            return (f"{lin.key}: (indexer_n_heads + indexer_kv_heads) * indexer_head_dim = "
                    f"{lin.out_features_unpadded} is padded to {lin.out_features} by exllamav3's Linear, "
                    f"and QSAIndexer.project splits that output into {m.n_heads} x {m.head_dim} + "
                    f"{m.head_dim}: it fails (the width must be a multiple of 128)")
    elif cls == "PLELayer" and not getattr(m, "stub", False):
        for lin in (m.key_proj, m.value_proj):
            if lin.in_features != lin.in_features_unpadded:
                return (f"{lin.key}: ple_embed_dim {lin.in_features_unpadded} is padded to "
                        f"{lin.in_features} in the weight exllamav3 loads, and its fused "
                        f"ple_forward_streams multiplies the {lin.in_features_unpadded}-wide n-gram "
                        f"embedding by it: it fails (ple_embed_dim must be a multiple of 128)")
    return None


def load_problems(model, stc, shapes: dict) -> list[str]:
    """What exllamav3's model.load() would refuse, from the headers: every weighted module (Linear
    as linear_problem emulates it; Embedding, RMSNorm unless unweighted, LayerNorm: a KEY.weight or
    KEY.* group) and the tensors modules read themselves (raw_reads, conv_problem)."""
    from exllamav3.modules import Embedding, LayerNorm, Linear, RMSNorm
    prefixes = {name.rsplit(".", 1)[0] for name in shapes} | set(shapes)

    def present(key: str) -> bool:
        return key in prefixes or any(p.startswith(key + ".") for p in prefixes)

    out = []
    for module in model:
        if isinstance(module, Linear):
            problem = linear_problem(module, stc, shapes)
            if problem:
                out.append(problem)
        elif isinstance(module, (Embedding, RMSNorm, LayerNorm)):
            if isinstance(module, RMSNorm) and getattr(module, "unweighted", False):
                continue
            if not any(present(k) for k in _names(module.key) + _names(getattr(module, "alt_key", None))):
                out.append(f"{module.key}: no tensors")
        for name, want in raw_reads(module):
            if name not in shapes:
                base = name[: -len(".weight")] if name.endswith(".weight") else None
                stored = f" ({base}.trellis is stored: exllamav3 reads it only unquantized)" \
                    if base and base + ".trellis" in shapes else ""
                out.append(f"Required tensor {name} not found{stored}")
            elif want is not None and tuple(shapes[name]) != want:
                out.append(f"{name} has shape {shapes[name]}; exllamav3 reads {list(want)}")
        for problem in (conv_problem(module, shapes), ngram_problem(module, shapes), padding_problem(module)):
            if problem:
                out.append(problem)
    return out


def check(directory: str, components: list[str], Config, Model) -> bool:
    try:
        config = Config.from_directory(directory)
    except Exception as e:  # exllamav3 refuses with ValueError, AssertionError, KeyError, ...
        where = traceback.extract_tb(e.__traceback__)[-1]
        log(f"{directory}: refused by Config: {type(e).__name__}: {str(e) or where.line} "
            f"({os.path.basename(where.filename)}:{where.lineno})")
        return False
    shapes = tensor_shapes(directory)
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
        problems = load_problems(model, config.stc, shapes)
        count = sum(1 for _ in model)
        if problems:
            log(f"{directory}: {component}: {len(problems)} load problems: "
                f"{'; '.join(problems[:8])}{' ...' if len(problems) > 8 else ''}")
            ok = False
        else:
            parts.append(f"{component}: {count} modules, every one's tensors found as exllamav3 "
                         f"loads them")
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
