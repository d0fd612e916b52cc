#!/usr/bin/env python3
"""Fixtures written by exllamav3's own converter, with exllamav3 as the judge.

Three steps, two machines:

  1. Here (a Python with torch and transformers >= 5.17, e.g. /opt/hfref/bin/python):

         python3 scripts/conformance/exllamav3_fixtures.py models --out DIR

     builds a tiny random Hugging Face model per family with transformers' own classes
     (engine_fixtures.py's make_model, its shapes with the changes exllamav3 needs, EXL3V3_CHANGES
     below), saves it in bf16 with a 128-token character tokenizer (exllamav3's converter
     calibrates through tokenizer.json) and writes prompts.json (the prompts of
     tests/fixtures/engine). scripts/gpu/exllamav3_stage.sh runs this.

  2. On the GPU machine, with exllamav3 importable (scripts/gpu/exllamav3_run.sh):

         python3 scripts/conformance/exllamav3_fixtures.py device --models DIR --work DIR --out DIR

     converts every entry of SWEEP with `python3 -m exllamav3.conversion.convert_model` and
     records, in a fresh process per fixture (`record`), exllamav3's greedy continuation of each
     prompt (its Generator, ArgmaxSampler, no stop conditions) and its teacher-forced logits over
     prompt + continuation (Model.forward without a cache), fp32. Each fixture gets a log; a
     failing one is written down (status.json) and the others go on.

  3. Here again, with the results unpacked (exllamav3_results.tar.xz holds results/):

         python3 scripts/conformance/exllamav3_fixtures.py commit --results DIR/results \
             --out tests/fixtures/exllamav3

     copies every fixture that came back whole (the directory exllamav3 wrote, as it wrote it)
     and turns its reference into reference.safetensors (prompt.i, greedy.i, logits.i as in
     tests/fixtures/engine) and reference.json (the rest, without the logits).
"""

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))

PROMPT_SEED = 20261201  # engine_fixtures.SEED: the same prompts as tests/fixtures/engine
PROMPT_LENGTHS = (5, 13, 29, 40)
NEW_TOKENS = 32
VOCAB = 128

# The engine fixtures' shapes (engine_fixtures.FAMILIES), changed where exllamav3 1.6.5 reads a
# config differently from transformers; each change keeps the model one that both compute alike.
EXL3V3_CHANGES = {
    # exllamav3's GLM-4 MoE router has no groups.
    "glm4_moe": dict(n_group=1, topk_group=1),
    # exllamav3 makes every Qwen3-MoE layer MoE (it ignores mlp_only_layers) and reads the expert
    # count from num_experts (added to config.json after saving, see write_model).
    "qwen3_moe": dict(mlp_only_layers=[]),
    # exllamav3's Mixtral has no sliding window.
    "mixtral": dict(sliding_window=None),
    # exllamav3 asserts n_group == topk_group == 1 for DeepSeek-V3 and GLM-MoE-DSA; its Triton MLA
    # kernels take tl.arange over v_head_dim, which must be a power of two (96 fails to compile;
    # first device run): 128, as the released models have.
    "deepseek_v3": dict(n_group=1, topk_group=1, v_head_dim=128),
    # GLM-MoE-DSA as DeepSeek-V3, and every layer's indexer "full": exllamav3's converter
    # calibrates one layer at a time, so a "shared" layer (which reuses the selection of the
    # layer before it) finds none ("shared-indexer DSA layer found no top-k selection in params",
    # second device run). With its own indexer each layer selects for itself, in transformers, in
    # exllamav3 and in the engine alike.
    "glm_moe_dsa": dict(n_group=1, topk_group=1, v_head_dim=128, indexer_types=["full", "full"]),
    # exllamav3 reads DeepSeek-V4 in the release layout (tensor names without "model.", its
    # config fields compress_ratios / num_hash_layers / rope_scaling): write_model renames.
    # Its hash layers are the first num_hash_layers, so mlp_layer_types keeps that shape.
    "deepseek_v4": dict(),
    # exllamav3 places Qwen3-Next's full-attention layers by full_attention_interval (every 3rd
    # layer here: [linear, linear, full], as layer_types says) and makes every layer MoE (it
    # reads mlp_only_layers but does not use it). Its generator's fused q/k/v kernels found no
    # shapes"): 2 KV heads, so k_proj and v_proj are 128 wide. Every token takes all 8 experts
    # (num_experts_per_tok 8: softmax weights over all of them, no selection): with top-2 of 8,
    # routers at near ties (2nd and 3rd expert 8e-5 .. 8e-4 apart in probability) were decided
    # differently by exllamav3, which runs this family's DeltaNet in bf16 and the rest in fp16,
    # than by transformers and the engine (fp32), and each such token moved the logits by 0.07 to
    # 0.4, and through the recurrent state those of the tokens after it (second device run;
    # tests/fixtures/exllamav3/README.md). Top-k selection is covered by the qwen3_moe fixtures.
    "qwen3_next": dict(full_attention_interval=3, mlp_only_layers=[], num_key_value_heads=2,
                       num_experts_per_tok=8),
    # exllamav3's GLM-5.3 router has no groups (it asserts n_group == topk_group == 1). Every
    # indexer "full", as for GLM-MoE-DSA (the same MLA module calibrates a "shared" layer without
    # the selection of the layer before it); besides, exllamav3 loads a shared layer's k-pool
    # parameters (index_kpool_compress_ape / _gate), which transformers gives only "full" layers.
    # The rest of what it reads differently is in the release layout (glm5_next_release_files).
    # KDA heads of 128: exllamav3's KDA kernels take no other ("channelwise decay (KDA) requires
    # 128x128 head dims", third device run, with 64).
    "glm5_next": dict(n_group=1, topk_group=1, indexer_types=["full", "full", "full"],
                      linear_head_dim=128),
    # Qwen4-Exp: 2 KV heads for the same reason as Qwen3-Next (k_proj / v_proj 128 wide: the
    # fused q/k/v kernels take widths that are multiples of 128). The n-gram table: exllamav3
    # stores it in rows of 160 (ROW_DIM of its n-gram codec; it asserts ple_embed_dim /
    # ((ngram_size - 1) * heads_per_ngram) == 160), and its quantizer averages every head's rows
    # in stripes of 8192, so each head needs at least 8192 rows (third device run, with heads of
    # ~300: "IndexError: list index out of range" in its compute_head_bias). Its PLE layer's
    # key_proj / value_proj are Linears whose input width it pads to a multiple of 128, and its
    # fused PLE pass multiplies the unpadded n-gram embedding by those padded weights (fourth
    # device run, ple_embed_dim 160: "mat1 and mat2 shapes cannot be multiplied (128x160 and
    # 256x512)"), so ple_embed_dim must be a multiple of 128 as well as of 160: 640, four heads.
    # The fixture's own n-grams (ngram_size 3, heads_per_ngram 2: 2-grams and 3-grams, two heads
    # each) give four; ngram_vocab_size_base 8192 makes them 8209, 8219, 8221 and 8231 rows
    # (32896 with the padding to 128): 10.5 MB in bf16, 2.7 MB at 4 bits. Its QSA indexer's
    # index_qk_proj is likewise padded on its output, and exllamav3 splits that output into
    # indexer_n_heads query heads and one key head of indexer_head_dim without trimming it, so
    # (indexer_n_heads + 1) * indexer_head_dim must be a multiple of 128: 7 heads of 32 (256).
    "qwen4_exp": dict(num_key_value_heads=2, ple_embed_dim=640, ngram_size=3, heads_per_ngram=2,
                      ngram_vocab_size_base=8192, indexer_n_heads=7),
}

# Families the GPU machine's transformers (5.17) cannot build: built here with a newer one
# (transformers 5.25, /opt/hfref/bin/python) by `prebuild` and carried as .exl3v3-hf/.
PREBUILT_FAMILIES = ("glm5_next", "qwen4_exp")

# Fields added to config.json after save_pretrained (exllamav3's names for what transformers
# stores under another).
CONFIG_EXTRAS = {
    "qwen3_moe": lambda c: {"num_experts": c["num_local_experts"]} if "num_local_experts" in c else {},
}


def family_names():
    return list(EXL3V3_CHANGES)


# One fixture per entry: (name, family, converter arguments). The default variant of each family
# (4 bits, head 6, default codebook mul1), and on qwen3_moe one converter setting each: the mcg and
# 3inst codebooks, 2 and 3 bits, the half-integer rate 2.5 (mul1 only) with the quantized
# embedding, and sharded output with an index (-ss 1: 1 MB shards).
# GLM-5.3's vision tower is stored unquantized (-vb 16): the engine does not run it, and this keeps
# exllamav3's quantizer off a 32-wide tower the fixture has only because the config needs one.
FAMILY_ARGS = {"glm5_next": ["-vb", "16"]}
SWEEP = [(f"{f}_b4", f, ["-b", "4", "-hb", "6"] + FAMILY_ARGS.get(f, [])) for f in EXL3V3_CHANGES] + [
    ("qwen3_moe_b2_mcg", "qwen3_moe", ["-b", "2", "-hb", "6", "-cb", "mcg"]),
    ("qwen3_moe_b3_3inst", "qwen3_moe", ["-b", "3", "-hb", "6", "-cb", "3inst"]),
    ("qwen3_moe_b2.5_mul1_eb4", "qwen3_moe", ["-b", "2.5", "-hb", "6", "-cb", "mul1", "-eb", "4"]),
    # 1.15 MB at 4 bits: two shards of at most 1 MB and an index (at 2.5 bits it fit one).
    ("qwen3_moe_b4_sharded", "qwen3_moe", ["-b", "4", "-hb", "6", "-ss", "1"]),
]
# Calibration: small, the models are tiny (rows x columns of tokens).
CAL_ARGS = ["-cr", "32", "-cc", "128"]


def log(msg):
    print(f"exllamav3_fixtures: {msg}", file=sys.stderr, flush=True)


def prompts():
    import torch
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


# ---------------------------------------------------------------------------------------------
# Step 1: the Hugging Face models (CPU)


def write_tokenizer(directory, bos_id, eos_id):
    """A 128-token character tokenizer: the printable ASCII characters, newline and tab, then
    <unk> and fillers. Enough for the converter's calibration text; the prompts are token ids."""
    from tokenizers import Tokenizer, models
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {}
    for c in chars:
        vocab[c] = len(vocab)
    vocab["<unk>"] = len(vocab)
    while len(vocab) < VOCAB:
        vocab[f"<extra_{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=True))
    tok.save(os.path.join(directory, "tokenizer.json"))
    inv = {i: t for t, i in vocab.items()}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
           "unk_token": "<unk>"}
    if bos_id is not None:
        cfg["bos_token"] = inv[bos_id]
    if eos_id is not None:
        cfg["eos_token"] = inv[eos_id]
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def deepseek_v4_release_name(name):
    """transformers' saved DeepSeek-V4 name -> the name exllamav3 reads: without "model.", the
    embedding, head and hyper-connection head in the release names, and the KV norm as
    attn.kv_norm (first device run: "Required tensor layers.0.attn.kv_norm.weight not found")."""
    n = name
    if n.startswith("model."):
        n = n[len("model."):]
    if n.startswith("layers.") and ".attn.norm." in n:
        n = n.replace(".attn.norm.", ".attn.kv_norm.")
    if n == "embed_tokens.weight":
        return "embed.weight"
    if n == "lm_head.weight":
        return "head.weight"
    for part in ("fn", "base", "scale"):
        if n == f"hc_head.hc_{part}":
            return f"hc_head_{part}"
    return n


def deepseek_v4_release_config(cfg):
    """The release config fields exllamav3 reads, from transformers' DeepseekV4Config fields.
    exllamav3 tells a layer's attention by its compress_ratios entry (0 sliding, 4 CSA, 128 HCA)
    and takes the rates themselves from compress_rate_csa / compress_rate_hca; the compressed
    layers' rope is rope_scaling (yarn) over compress_rope_theta."""
    rates = cfg["compress_rates"]
    marker = {"sliding_attention": 0, "compressed_sparse_attention": 4,
              "heavily_compressed_attention": 128}
    out = {
        "compress_ratios": [marker[t] for t in cfg["layer_types"]],
        "compress_rate_csa": rates["compressed_sparse_attention"],
        "compress_rate_hca": rates["heavily_compressed_attention"],
        "num_hash_layers": sum(1 for t in cfg["mlp_layer_types"] if t == "hash_moe"),
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "qk_rope_head_dim": int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0)),
    }
    rp = cfg.get("rope_parameters") or {}
    main = rp.get("main", rp)
    compress = rp.get("compress", {})
    out["rope_theta"] = main.get("rope_theta", cfg.get("rope_theta", 10000.0))
    out["compress_rope_theta"] = compress.get("rope_theta", cfg.get("compress_rope_theta"))
    if compress.get("rope_type", "default") == "yarn":
        out["rope_scaling"] = {"type": "yarn", "factor": compress["factor"],
                               "original_max_position_embeddings":
                                   compress["original_max_position_embeddings"],
                               "beta_fast": compress.get("beta_fast", 32.0),
                               "beta_slow": compress.get("beta_slow", 1.0)}
    kinds = cfg["mlp_layer_types"]
    nh = out["num_hash_layers"]
    if kinds != ["hash_moe"] * nh + ["moe"] * (len(kinds) - nh):
        raise ValueError(f"deepseek_v4: exllamav3 needs the hash layers first, got {kinds}")
    return out


def glm5_next_release_files(out_dir, cfg, tensors):
    """GLM-5.3 in the layout exllamav3 reads (architecture/glm5_next.py of its wheel):
    - layer_types names the MLA layers "deepseek_sparse_attention" (transformers writes
      "indexed_attention"; exllamav3 accepts only that name and "linear_attention");
    - the KDA sizes in linear_attn_config (num_heads, head_dim, short_conv_kernel_size,
      gate_lower_bound), where the release keeps them (transformers reads that dict too);
    - an MTP head: exllamav3 always builds GLM-5.3's MTP component (its config never drops it)
      and the converter loads it, so the checkpoint carries one as the release does, DeepSeek-V3
      shaped at layers.{num_hidden_layers} (enorm, hnorm, eh_proj, a decoder layer with a full
      indexer and MoE, shared_head.norm), num_nextn_predict_layers 1. Its layer is a copy of the
      first MoE layer with its own indexer (a copy also costs nothing in the carried tar.xz); nothing
      runs it here or in the engine;
    - processor_config.json, which exllamav3's config reads for the vision tower."""
    import torch
    text = cfg["text_config"]
    text["layer_types"] = ["deepseek_sparse_attention" if t == "indexed_attention" else t
                           for t in text["layer_types"]]
    text["linear_attn_config"] = {"num_heads": text["linear_num_heads"],
                                  "head_dim": text["linear_head_dim"],
                                  "short_conv_kernel_size": text["linear_conv_kernel_dim"],
                                  "gate_lower_bound": text["linear_lower_bound"]}
    n = text["num_hidden_layers"]
    src = next(i for i in range(n) if text["layer_types"][i] == "deepseek_sparse_attention"
               and text["indexer_types"][i] == "full" and text["mlp_layer_types"][i] == "sparse")
    pre = "model.language_model.layers."
    for k, v in list(tensors.items()):
        if k.startswith(f"{pre}{src}.") and not k.startswith(f"{pre}{src}.hc_"):
            tensors[f"{pre}{n}." + k[len(f"{pre}{src}."):]] = v.clone()
    h = text["hidden_size"]
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    norm = tensors[f"{pre}{src}.input_layernorm.weight"]
    tensors[f"{pre}{n}.enorm.weight"] = norm.clone()
    tensors[f"{pre}{n}.hnorm.weight"] = norm.clone()
    tensors[f"{pre}{n}.shared_head.norm.weight"] = tensors["model.language_model.norm.weight"].clone()
    tensors[f"{pre}{n}.eh_proj.weight"] = (torch.randn(h, 2 * h, generator=gen) /
                                          (2 * h) ** 0.5).to(norm.dtype)
    text["num_nextn_predict_layers"] = 1
    v = cfg["vision_config"]
    with open(os.path.join(out_dir, "processor_config.json"), "w") as f:
        json.dump({"image_processor": {
            "image_processor_type": "Glm5NextImageProcessor", "patch_size": v["patch_size"],
            "temporal_patch_size": v["temporal_patch_size"], "merge_size": v["spatial_merge_size"],
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "min_image_tokens": 4, "max_image_tokens": 64}}, f, indent=2)


def qwen4_exp_release_files(out_dir, cfg, tensors):
    """Qwen4-Exp in the layout exllamav3 reads (architecture/qwen4_exp.py, qwen3_5.py):
    - layer_types names the QSA layers "full_attention", as the release does (transformers reads
      "full_attention" as "indexed_attention"; exllamav3 accepts only "linear_attention" and
      "full_attention");
    - model.safetensors.index.json: exllamav3's n-gram table quantizer finds the table's shards
      through the index's weight map (conversion/ngram.py), also for a single file."""
    text = cfg["text_config"]
    text["layer_types"] = ["full_attention" if t == "indexed_attention" else t
                           for t in text["layer_types"]]
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: "model.safetensors" for k in sorted(tensors)}},
                  f, indent=1)


# Families whose saved checkpoint exllamav3 reads in another layout: (config, tensors) -> in place.
RELEASE_FILES = {"glm5_next": glm5_next_release_files, "qwen4_exp": qwen4_exp_release_files}


def write_model(family, out_dir):
    import torch
    from safetensors.torch import load_file, save_file
    sys.path.insert(0, HERE)
    import engine_fixtures as ef
    spec = copy.deepcopy(ef.FAMILIES[family])
    # A *ForConditionalGeneration family keeps its text model's fields in text_fields (Qwen4-Exp)
    # or fields beside vision_fields (GLM-5.3); the changes are to the text model.
    spec["text_fields" if "text_fields" in spec else "fields"].update(EXL3V3_CHANGES[family])
    ef.FAMILIES[family] = spec  # make_model reads the shape from here
    model, _ = ef.make_model(family, spec["seed"])
    os.makedirs(out_dir, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(CONFIG_EXTRAS.get(family, lambda c: {})(cfg))
    rewrite = None
    if family == "deepseek_v4":
        cfg.update(deepseek_v4_release_config(cfg))
        rewrite = deepseek_v4_release_name
    if family == "deepseek_v4" or family in RELEASE_FILES:
        tensors = {}
        for fn in sorted(os.listdir(out_dir)):
            if fn.endswith(".safetensors"):
                for k, v in load_file(os.path.join(out_dir, fn)).items():
                    tensors[rewrite(k) if rewrite else k] = v
                os.remove(os.path.join(out_dir, fn))
        for fn in ("model.safetensors.index.json",):
            if os.path.exists(os.path.join(out_dir, fn)):
                os.remove(os.path.join(out_dir, fn))
        if family in RELEASE_FILES:
            RELEASE_FILES[family](out_dir, cfg, tensors)
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    text = cfg.get("text_config", cfg)
    write_tokenizer(out_dir, text.get("bos_token_id", cfg.get("bos_token_id")),
                    text.get("eos_token_id", cfg.get("eos_token_id")))
    return cfg


def families_of(fixtures):
    """The families the named fixtures (comma-separated; None: the whole sweep) are made from."""
    wanted = set(fixtures.split(",")) if fixtures else None
    unknown = (wanted or set()) - {name for name, _, _ in SWEEP}
    if unknown:
        raise SystemExit(f"exllamav3_fixtures: not in the sweep: {','.join(sorted(unknown))}")
    return list(dict.fromkeys(f for name, f, _ in SWEEP if wanted is None or name in wanted))


def cmd_models(args):
    import torch
    import transformers
    torch.set_num_threads(2)
    os.makedirs(args.out, exist_ok=True)
    meta_path = os.path.join(args.out, "prompts.json")
    made = {}
    if os.path.exists(meta_path):  # an earlier call: keep the families it wrote
        with open(meta_path) as f:
            made = {k: v for k, v in json.load(f)["families"].items() if "error" not in v}
    prebuilt_meta = {}
    if args.prebuilt and os.path.exists(os.path.join(args.prebuilt, "prompts.json")):
        with open(os.path.join(args.prebuilt, "prompts.json")) as f:
            prebuilt_meta = json.load(f)
        if prebuilt_meta["prompts"] != prompts():
            sys.exit(f"exllamav3_fixtures: {args.prebuilt} was built with other prompts")
    families = args.families.split(",") if args.families else families_of(args.fixtures)
    failed = []
    for family in families:
        dest = os.path.join(args.out, family)
        if family in made:
            log(f"{family}: there from an earlier call")
            continue
        t0 = time.time()
        try:
            src = os.path.join(args.prebuilt or "", family)
            if args.prebuilt and os.path.exists(os.path.join(src, "config.json")):
                shutil.rmtree(dest, ignore_errors=True)
                shutil.copytree(src, dest)
                made[family] = {"prebuilt": prebuilt_meta.get("transformers")}
                log(f"{family}: copied from {src} (built with transformers "
                    f"{prebuilt_meta.get('transformers')})")
                continue
            write_model(family, dest)
        except Exception as e:  # the other families go on
            traceback.print_exc()
            log(f"{family}: FAILED: {e!r}")
            made[family] = {"error": repr(e)}
            failed.append(family)
            continue
        made[family] = {"seconds": round(time.time() - t0, 1),
                        "transformers": transformers.__version__}
        log(f"{family}: written to {dest}")
    with open(meta_path, "w") as f:
        json.dump({"prompt_seed": PROMPT_SEED, "new_tokens": NEW_TOKENS, "prompts": prompts(),
                   "transformers": transformers.__version__,
                   "torch": torch.__version__.split("+")[0], "families": made,
                   "changes": {k: {kk: vv for kk, vv in v.items()}
                               for k, v in EXL3V3_CHANGES.items()}}, f, indent=1)
    if failed:
        sys.exit(1)


# ---------------------------------------------------------------------------------------------
# Step 2: conversion and recording (GPU)


def run_logged(cmd, log_path, timeout):
    with open(log_path, "a") as lf:
        lf.write(f"$ {' '.join(cmd)}\n")
        lf.flush()
        r = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=timeout)
    return r.returncode


def cmd_device(args):
    with open(os.path.join(args.models, "prompts.json")) as f:
        meta = json.load(f)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    status_path = os.path.join(args.out, "status.json")
    status = {}
    if os.path.exists(status_path):  # an earlier call on this machine: keep its outcomes
        with open(status_path) as f:
            status = json.load(f)
    wanted = set(args.fixtures.split(",")) if args.fixtures else None
    deadline = time.time() + args.budget_s
    for name, family, conv_args in SWEEP:
        if wanted is not None and name not in wanted:
            continue
        earlier = status.get(name, {})
        if (wanted is None and earlier.get("status") == "ok" and
                os.path.exists(os.path.join(args.out, f"{name}.reference.json"))):
            log(f"{name}: ok from an earlier call")
            continue
        st = status[name] = {"family": family, "convert_args": conv_args + CAL_ARGS}
        log_path = os.path.join(args.out, f"{name}.log")
        left = deadline - time.time()
        if left < 30:
            st["status"] = "skipped: out of time"
            log(f"{name}: skipped, out of time")
            continue
        t0 = time.time()
        hf_dir = os.path.join(args.models, family)
        if not os.path.exists(os.path.join(hf_dir, "config.json")):
            st["status"] = f"no model {hf_dir}"
            log(f"{name}: {st['status']}")
            continue
        out_dir = os.path.join(args.out, name)
        work = os.path.join(args.work, name)
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        try:
            log(f"{name}: converting ({' '.join(conv_args)})")
            rc = run_logged([sys.executable, "-m", "exllamav3.conversion.convert_model",
                             "-i", hf_dir, "-w", work, "-o", out_dir] + conv_args + CAL_ARGS,
                            log_path, timeout=max(30, min(args.convert_timeout, left)))
            st["convert_seconds"] = round(time.time() - t0, 1)
            if rc != 0:
                st["status"] = f"convert failed (exit {rc}), see {name}.log"
                log(f"{name}: {st['status']}")
                continue
            t1 = time.time()
            log(f"{name}: recording")
            rc = run_logged([sys.executable, os.path.abspath(__file__), "record", "--model", out_dir,
                             "--prompts", os.path.join(args.models, "prompts.json"),
                             "--output", os.path.join(args.out, f"{name}.reference.json")],
                            log_path, timeout=max(30, min(args.record_timeout,
                                                          deadline - time.time())))
            st["record_seconds"] = round(time.time() - t1, 1)
            st["status"] = "ok" if rc == 0 else f"record failed (exit {rc}), see {name}.log"
        except subprocess.TimeoutExpired as e:
            st["status"] = f"timed out after {e.timeout:.0f} s, see {name}.log"
        except Exception as e:  # keep going: one family's trouble is its own
            st["status"] = f"error: {e!r}"
            with open(log_path, "a") as lf:
                traceback.print_exc(file=lf)
        log(f"{name}: {st['status']} ({time.time() - t0:.0f} s)")
        with open(status_path, "w") as f:
            json.dump(status, f, indent=1)
    with open(status_path, "w") as f:
        json.dump(status, f, indent=1)
    ok = sorted(n for n, s in status.items() if s.get("status") == "ok")
    left = [n for n, _, _ in SWEEP if n not in ok]
    log(f"done: {len(ok)}/{len(SWEEP)} fixtures ok" +
        (f"; not ok: {','.join(left)}" if left else ""))


def cmd_record(args):
    """exllamav3's greedy tokens and teacher-forced logits for the prompts, on one GPU."""
    import torch
    import exllamav3
    from exllamav3 import Config, Model, Cache, Tokenizer, Generator, Job
    from exllamav3.generator.sampler import ArgmaxSampler
    with open(args.prompts) as f:
        meta = json.load(f)
    new_tokens = meta["new_tokens"]
    config = Config.from_directory(args.model)
    model = Model.from_config(config)
    max_tokens = 256 * ((max(len(p) for p in meta["prompts"]) + new_tokens) // 256 + 2)
    cache = Cache(model, max_num_tokens=max_tokens)
    model.load("cuda:0")
    tokenizer = Tokenizer.from_config(config)
    generator = Generator(model=model, cache=cache, tokenizer=tokenizer)
    out = {"model": os.path.basename(os.path.normpath(args.model)),
           "architecture": config.architecture,
           "exllamav3": getattr(exllamav3, "__version__", None) or _exl3_version(),
           "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
           "greedy": "Generator + Job(max_new_tokens = min_new_tokens = %d, ArgmaxSampler, "
                     "stop_conditions []), one job at a time" % new_tokens,
           "logits": "Model.forward(prompt + greedy, attn_mode flash_attn_nc: no cache), fp32; "
                     "row r predicts token r + 1",
           "prompts": []}
    for i, prompt in enumerate(meta["prompts"]):
        ids = torch.tensor([prompt], dtype=torch.long)
        job = Job(input_ids=ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  sampler=ArgmaxSampler(), stop_conditions=[], identifier=i, return_logits=True)
        generator.enqueue(job)
        greedy, step_logits = [], []
        while generator.num_remaining_jobs():
            for r in generator.iterate():
                if r.get("stage") != "streaming":
                    continue
                if "token_ids" in r:
                    greedy += r["token_ids"].view(-1).tolist()
                if "logits" in r:
                    step_logits += r["logits"].float().reshape(-1, r["logits"].shape[-1]).tolist()
        entry = {"index": i, "prompt": prompt, "greedy": greedy,
                 # The logits each greedy step sampled from (the generator's cached path).
                 "greedy_logits": [[float(f"{v:.6g}") for v in row[:config.vocab_size]]
                                   for row in step_logits]}
        full = torch.tensor([prompt + greedy], dtype=torch.long)
        try:
            logits = model.forward(full, {"attn_mode": "flash_attn_nc"}).float().cpu()[0]
            logits = logits[:, :config.vocab_size]
            entry["logits"] = [[float(f"{v:.6g}") for v in row] for row in logits.tolist()]
            steps = logits[len(prompt) - 1: len(prompt) - 1 + len(greedy)]
            entry["teacher_forced_argmax_matches_greedy"] = steps.argmax(-1).tolist() == greedy
            top2 = steps.topk(2, dim=-1).values
            entry["min_top1_top2_gap"] = float((top2[:, 0] - top2[:, 1]).min())
            entry["logit_std"] = float(logits.std(dim=-1).mean())
        except Exception as e:
            entry["logits_error"] = repr(e)
            traceback.print_exc()
        out["prompts"].append(entry)
        log(f"{out['model']}: prompt {i}: {len(greedy)} greedy tokens"
            + (f", min gap {entry['min_top1_top2_gap']:.4f}" if "min_top1_top2_gap" in entry else ""))
    with open(args.output, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    # The greedy tokens and the logits they were sampled from are the fixture; the teacher-forced
    # pass is a cross-check (recorded when exllamav3 runs it for the family).
    if any(len(p["greedy"]) != new_tokens or len(p["greedy_logits"]) != new_tokens
           for p in out["prompts"]):
        sys.exit(2)


def _exl3_version():
    try:
        from exllamav3.version import __version__
        return __version__
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# Step 3: the fixtures (CPU)


def cmd_commit(args):
    import torch
    from safetensors.torch import save_file
    with open(os.path.join(args.results, "status.json")) as f:
        status = json.load(f)
    os.makedirs(args.out, exist_ok=True)
    done = []
    wanted = set(args.fixtures.split(",")) if args.fixtures else None
    for name, st in status.items():
        if wanted is not None and name not in wanted:
            continue
        src = os.path.join(args.results, name)
        ref_path = os.path.join(args.results, f"{name}.reference.json")
        if st.get("status") != "ok" or not os.path.exists(ref_path):
            log(f"{name}: not committed ({st.get('status')})")
            continue
        with open(ref_path) as f:
            ref = json.load(f)
        tensors = {}
        for p in ref["prompts"]:
            i = p["index"]
            tensors[f"prompt.{i}"] = torch.tensor(p["prompt"], dtype=torch.int32)
            tensors[f"greedy.{i}"] = torch.tensor(p["greedy"], dtype=torch.int32)
            greedy_logits = torch.tensor(p["greedy_logits"], dtype=torch.float32)
            if greedy_logits.shape[0] != len(p["greedy"]):
                sys.exit(f"{name}: prompt {i}: {greedy_logits.shape[0]} greedy logits rows for "
                         f"{len(p['greedy'])} tokens")
            tensors[f"greedy_logits.{i}"] = greedy_logits.contiguous()
            if "logits" in p:
                rows = len(p["prompt"]) + len(p["greedy"])
                logits = torch.tensor(p["logits"], dtype=torch.float32)
                if logits.shape[0] != rows:
                    sys.exit(f"{name}: prompt {i}: {logits.shape[0]} logits rows for {rows} tokens")
                tensors[f"logits.{i}"] = logits.contiguous()
        dest = os.path.join(args.out, name)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(src, dest)
        save_file(tensors, os.path.join(dest, "reference.safetensors"), metadata={"format": "pt"})
        meta = {k: v for k, v in ref.items() if k != "prompts"}
        meta["family"] = st["family"]
        meta["convert_args"] = st["convert_args"]
        meta["prompts"] = [{k: v for k, v in p.items() if k not in ("logits", "greedy_logits")}
                           for p in ref["prompts"]]
        meta["tensors"] = {k: {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)}
                           for k, v in sorted(tensors.items())}
        with open(os.path.join(dest, "reference.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
        done.append(name)
        log(f"{name}: committed to {dest}")
    log(f"{len(done)} fixtures: {', '.join(done)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("models", help="build the tiny Hugging Face models (CPU)")
    m.add_argument("--out", required=True)
    m.add_argument("--families", help="comma-separated families (default: those of --fixtures)")
    m.add_argument("--fixtures", help="comma-separated fixtures of the sweep whose families to "
                                      "write (default: the whole sweep)")
    m.add_argument("--prebuilt", help="a folder of families written earlier (by a newer "
                                      "transformers): copied instead of built")
    d = sub.add_parser("device", help="convert with exllamav3 and record (GPU)")
    d.add_argument("--models", required=True, help="what `models` wrote")
    d.add_argument("--work", required=True, help="the converter's work directories")
    d.add_argument("--out", required=True, help="converted models, references, logs")
    d.add_argument("--fixtures", help="comma-separated subset of the sweep's names")
    d.add_argument("--budget-s", type=float, default=480, help="stop starting fixtures after this")
    d.add_argument("--convert-timeout", type=float, default=150)
    d.add_argument("--record-timeout", type=float, default=120)
    r = sub.add_parser("record", help="one converted model's greedy tokens and logits (GPU)")
    r.add_argument("--model", required=True)
    r.add_argument("--prompts", required=True)
    r.add_argument("--output", required=True)
    c = sub.add_parser("commit", help="turn the device's results into fixtures (CPU)")
    c.add_argument("--results", required=True, help="the results/ folder of the device's tar.xz")
    c.add_argument("--out", required=True, help="tests/fixtures/exllamav3")
    c.add_argument("--fixtures", help="comma-separated subset of the results to commit")
    sub.add_parser("sweep", help="print the sweep")
    args = ap.parse_args()
    if args.cmd == "models":
        cmd_models(args)
    elif args.cmd == "device":
        cmd_device(args)
    elif args.cmd == "record":
        cmd_record(args)
    elif args.cmd == "commit":
        cmd_commit(args)
    else:
        for name, family, conv in SWEEP:
            print(name, family, " ".join(conv + CAL_ARGS))


if __name__ == "__main__":
    main()
