"""The MTP judge (issue 31): exllamav3 drafts with a fixture's MTP head on the same EXL3 weights, and
its greedy drafts are compared with the fixture's reference drafts (the argmax of each row of
reference.safetensors' `mtp_logits.i`, which the engine matches on the CPU and the GPU:
tests/fixtures/engine/README.md, "MTP fixtures").

    python3 exllamav3_mtp_drafts.py --fixtures tests/fixtures/engine [--names glm_moe_dsa_mtp,...] --out FILE.json
    python3 exllamav3_mtp_drafts.py --list       # the fixtures it would check, and those it refuses
    python3 exllamav3_mtp_drafts.py --dry-run    # read each fixture's reference (no exllamav3, no GPU)

On the GPU machine, with exllamav3 importable (scripts/gpu/exllamav3_mtp.sh). For each directory:
exllamav3's Config / Model load the trunk ("text") and the MTP head ("mtp" component, attach_to the
trunk: it borrows the embedding and lm_head) onto cuda:0. One uncached forward pass (attn_mode
flash_attn_nc) over prompt + greedy exports the trunk's final-norm state (Qwen3.8-Flash-Next: the
stream stack its final mixer receives; the draft_verifier_params the head's attach_to sets, as the
generator passes them); the head then runs over the same positions and the trunk's lm_head gives its
logits (Qwen3.8-Flash-Next: after the head's own mixer, as its sample_from_state). Two alignments of the head's input:

  fixture    position r: hidden state r and token r + 1 (the reference's: row r of mtp_logits);
  generator  position r: hidden state r - 1 (zeros at r = 0) and token r, as exllamav3's generator
             prefills its draft cache (generator/job.py, the shifted hidden with a zero carry): the
             head's attention then sees one more position (token 0 over a zero state) and its
             positions run one later; its row r + 1 is compared with the reference's row r.

Per fixture and alignment: drafts compared (every row: a draft of the next-but-one token at each
position), equal, the first difference (row, both tokens, the reference's top-2 gap there and
exllamav3's) and the mean row error of the logits. Families for which exllamav3 1.6.5 has no MTP
head (NO_MTP) are refused by name; a fixture whose config exllamav3 refuses (the base fixtures'
settings: scripts/conformance/exllamav3_config_check.py --component text,mtp says why) is reported
with exllamav3's error.

DeepSeek-V4 (deepseek_v4_release_mtp): its mtp.* is the DSPARK block drafter (docs/dspark.md), judged
as exllamav3's generator runs it (check_dspark; one alignment, "dspark"): one uncached trunk pass
over prompt + greedy exports the taps (draft_verifier_params' export_state_layers), the drafter's
update_kv_from_target writes every position's main-kv rows into its own paged cache (one page; a
draft at p0 reads only the rows before p0, so writing all of them at once equals the generator's
writes after prefill and after each verification), then one draft call per position p0 (seed
ids[p0], cache_seqlens p0: forward, then sample_from_state). Compared with the fixture's
dspark_* tensors (dspark_reference.py): the block's drafts (every row: 4 drafts), the
confidence-capped length, the logits the Markov loop took its argmax over (exllamav3's head logits
plus its Markov bias along its own chain; mean / worst row error), the confidence logits, and, as
diagnostics, the taps and block 0's main-kv rows.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import exllamav3_runs

# The fixture families (reference.json "family") with an MTP head in exllamav3 1.6.5, each with its
# class (the wheel's exllamav3/architecture/*_mtp.py), and those it has none for.
HAS_MTP = {
    "glm_moe_dsa": "GlmMoeDsaMTPModel (architecture/glm_moe_dsa_mtp.py; model.layers.N.*)",
    "glm5_next": "Glm5NextMTPModel (architecture/glm5_next_mtp.py; model.language_model.layers.N.*)",
    "qwen4_exp": "Qwen4ExpMTPModel (architecture/qwen4_exp_mtp.py; mtp.*)",
    "deepseek_v4": "DeepseekV4MTPModel (architecture/deepseek_v4_mtp.py; mtp.*: the DSPARK block drafter, "
                   "docs/dspark.md, judged by check_dspark)",
}
# The families whose MTP component is a block drafter (docs/dspark.md), judged by check_dspark.
DSPARK = ("deepseek_v4",)
NO_MTP = {
    "deepseek_v3": "exllamav3 1.6.5 has no MTP head for DeepseekV3ForCausalLM (its DeepseekV3Config "
                   "builds only the text component)",
    "glm4_moe": "exllamav3 1.6.5 has no MTP head for Glm4MoeForCausalLM (text only; its MTP class is "
                "Glm4MoeLite's, another architecture)",
}
ALIGNMENTS = ("fixture", "generator")


def log(msg: str) -> None:
    print(f"exllamav3_mtp_drafts: {msg}", flush=True)


def family_of(directory: str) -> str:
    """The fixture's model family; a release twin's ("glm_moe_dsa_release": the release settings
    and layout, engine_fixtures.py release_family) is its base family's."""
    with open(os.path.join(directory, "reference.json")) as f:
        family = json.load(f)["family"]
    return family[: -len("_release")] if family.endswith("_release") else family


def refusal(directory: str) -> str | None:
    """Why exllamav3 cannot judge this fixture's MTP drafts, or None."""
    if not os.path.isfile(os.path.join(directory, "reference.json")):
        return "no reference.json"
    family = family_of(directory)
    if family in NO_MTP:
        return NO_MTP[family]
    if family not in HAS_MTP:
        return f"family {family!r}: not an MTP family exllamav3_mtp_drafts.py knows"
    return None


def default_names(fixtures: str) -> list[str]:
    return sorted(os.path.basename(d) for d in glob.glob(os.path.join(fixtures, "*_mtp"))
                  if os.path.isdir(d))


def read_dspark_reference(directory: str) -> list:
    """Per prompt of a DSPARK fixture: (index, ids = prompt + greedy, {dspark_* tensors}), each checked
    to have a row per position of ids."""
    import torch
    from safetensors import safe_open

    ref = safe_open(os.path.join(directory, "reference.safetensors"), "pt")
    with open(os.path.join(directory, "reference.json")) as f:
        meta = json.load(f)
    out = []
    for i, _ in enumerate(meta["prompts"]):
        ids = torch.cat([ref.get_tensor(f"prompt.{i}"), ref.get_tensor(f"greedy.{i}")]).long()
        t = {k: ref.get_tensor(f"dspark_{k}.{i}") for k in ("taps", "main_kv", "logits", "drafts", "confidence",
                                                            "length")}
        n = ids.numel()
        rows = {"taps": t["taps"].shape[0], "main_kv": t["main_kv"].shape[1], "logits": t["logits"].shape[0],
                "drafts": t["drafts"].shape[0], "confidence": t["confidence"].shape[0], "length": t["length"].shape[0]}
        bad = {k: v for k, v in rows.items() if v != n}
        if bad:
            raise ValueError(f"{directory}: prompt {i}: {n} positions, but dspark_* rows {bad}")
        if t["drafts"].shape != t["confidence"].shape or t["logits"].shape[:2] != t["drafts"].shape:
            raise ValueError(f"{directory}: prompt {i}: dspark_logits {list(t['logits'].shape)}, drafts "
                             f"{list(t['drafts'].shape)}, confidence {list(t['confidence'].shape)} disagree")
        out.append((i, ids, t))
    return out


def read_reference(directory: str) -> list:
    """(index, prompt, greedy, mtp_logits) per prompt: mtp_logits has a row per token of prompt +
    greedy but the last."""
    return exllamav3_runs.read_reference(directory, "mtp_logits", 1)


def top2_gap(row) -> float:
    top = row.topk(2).values
    return float(top[0] - top[1])


def compare(got, want) -> dict:
    """Drafts (argmax per row) and logits of exllamav3 against the reference, row for row."""
    got = got[: want.shape[0], : want.shape[1]]
    a, b = got.argmax(-1), want.argmax(-1)
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).tolist()
    out = {"compared": int(want.shape[0]), "equal": int((a == b).sum()),
           "mean_row_rel": sum(rel) / len(rel), "worst_row_rel": max(rel)}
    diff = (a != b).nonzero().flatten().tolist()
    if diff:
        r = diff[0]
        out["first_difference"] = {"row": r, "reference": int(b[r]), "exllamav3": int(a[r]),
                                   "reference_top2_gap": top2_gap(want[r]),
                                   "exllamav3_top2_gap": top2_gap(got[r])}
    return out


def mtp_logits(model, mtp, ids, alignment: str):
    """exllamav3's MTP logits over a teacher-forced sequence, rows aligned with the reference's."""
    import torch

    params = {"attn_mode": "flash_attn_nc"}
    params.update(mtp.draft_verifier_params)
    model.forward(ids, params)
    states = params.get("export_states")
    if not states:
        raise RuntimeError("the trunk exported no state for the MTP head (draft_verifier_params "
                           f"{mtp.draft_verifier_params})")
    hidden = states[-1]
    if alignment == "fixture":
        head_ids, head_hidden = ids[:, 1:], hidden[:, :-1, :]
    else:
        head_ids = ids
        head_hidden = torch.cat((torch.zeros_like(hidden[:, :1, :]), hidden[:, :-1, :]), dim=1)
    state = mtp.forward(head_ids, {"attn_mode": "flash_attn_nc", "target_hidden": head_hidden})
    mixer = getattr(getattr(mtp, "stack_out", None), "mixer", None)
    if mixer is not None:
        # Qwen3.8-Flash-Next: the head returns its flattened pre-mixer stream stack; its own
        # combine-less mixer collapses it before the shared lm_head (Qwen4ExpMTPModel.sample_from_state).
        bsz, seq, _ = state.shape
        stack = state.to(mixer.device).view(bsz, seq, mixer.hc_mult, mixer.hidden_size)
        state = mixer.forward(stack, {})
    lm_head = model.modules[model.logit_layer_idx]
    logits = lm_head.forward(lm_head.prepare_for_device(state, {}), {}).float().cpu()[0]
    return logits if alignment == "fixture" else logits[1:]


def rel_rows(got, want) -> list:
    """|got - want| / |want| of each row (the last dimension)."""
    return ((got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-30)).flatten().tolist()


def compare_dspark(got: dict, want: dict) -> dict:
    """exllamav3's draft calls at every position of one sequence against the reference's: drafts
    [n, B], lengths [n], logits [n, B, V], confidence [n, B] (and taps / main-kv as diagnostics)."""
    import torch

    d_got, d_want = got["drafts"].long(), want["drafts"].long()
    same_row = (d_got == d_want).all(dim=-1)
    logit_rel = rel_rows(got["logits"], want["logits"].float())
    out = {"compared": int(d_want.shape[0]), "equal": int(same_row.sum()),
           "drafts_compared": int(d_want.numel()), "drafts_equal": int((d_got == d_want).sum()),
           "lengths_equal": int((got["length"].long() == want["length"].long()).sum()),
           "mean_row_rel": sum(logit_rel) / len(logit_rel), "worst_row_rel": max(logit_rel),
           "confidence_max_abs_diff": float((got["confidence"] - want["confidence"].float()).abs().max()),
           "taps_rel": float((got["taps"] - want["taps"].float()).norm() / want["taps"].float().norm()),
           "main_kv_rel": float((got["main_kv"] - want["main_kv"][0].float()).norm() / want["main_kv"][0].float().norm())}
    diff = (~same_row).nonzero().flatten().tolist()
    if diff:
        r = diff[0]
        j = int((d_got[r] != d_want[r]).nonzero()[0])
        out["first_difference"] = {"row": r, "block_position": j, "reference": int(d_want[r, j]),
                                   "exllamav3": int(d_got[r, j]),
                                   "reference_top2_gap": top2_gap(want["logits"][r, j].float()),
                                   "exllamav3_top2_gap": top2_gap(got["logits"][r, j])}
    wrong_len = (got["length"].long() != want["length"].long()).nonzero().flatten().tolist()
    if wrong_len:
        r = wrong_len[0]
        out["first_length_difference"] = {"row": r, "reference": int(want["length"][r]),
                                          "exllamav3": int(got["length"][r]),
                                          "reference_confidence": want["confidence"][r].tolist(),
                                          "exllamav3_confidence": got["confidence"][r].tolist()}
    return out


def dspark_drafts(model, mtp, cache, ids) -> dict:
    """exllamav3's DSPARK drafter over one teacher-forced sequence ids [1, n], as its generator runs
    it: the trunk's taps, every position's main-kv rows (update_kv_from_target), one draft call per
    position p0 (seed ids[p0], rows 0..p0-1 its history)."""
    import torch
    import torch.nn.functional as F

    n = ids.shape[1]
    block_table = torch.zeros((1, 16), dtype=torch.int32)   # one page (positions < 256)
    params = {"attn_mode": "flash_attn_nc"}
    params.update(mtp.draft_verifier_params)
    model.forward(ids, params)
    taps = params.get("export_states")
    if not taps:
        raise RuntimeError(f"the trunk exported no taps (draft_verifier_params {mtp.draft_verifier_params})")
    taps_cat = torch.cat([t.float().cpu()[0] for t in taps], dim=-1)
    mtp.update_kv_from_target(list(taps), cache, {"block_table": block_table,
                                                  "cache_seqlens": torch.tensor([0], dtype=torch.int32)})
    layer0 = mtp.attn_modules[0]
    main_kv = cache.layers[(layer0.layer_idx, 0)].kv.view(-1, layer0.head_dim)[:n].float().cpu()
    lm = model.modules[model.logit_layer_idx]
    drafts, lengths, logits, confidence = [], [], [], []
    for p0 in range(n):
        params = {"attn_mode": "flash_attn", "block_table": block_table, "cache": cache,
                  "cache_seqlens": torch.tensor([p0], dtype=torch.int32)}
        state = mtp.forward(ids[:, p0:p0 + 1], params)
        head = lm.forward(lm.prepare_for_device(state, params), params).float()
        chain = mtp.sample_from_state(state, params)                        # [1, B + 1]: seed, drafts
        w1 = mtp._markov_w1_dev
        emb = F.embedding(chain[:, :-1].to(w1.device), w1).half()          # the chain tokens' rows
        bias = mtp.markov_w2.forward(emb, params).float()
        logits.append((head + bias.to(head.device)).cpu()[0])
        conf = mtp.confidence.forward(torch.cat((params["dspark_prenorm"].half().to(emb.device), emb), dim=-1),
                                      params)
        c = conf.float().cpu()[0, :, 0]
        keep = torch.sigmoid(c) >= mtp.draft_conf_threshold
        length = int(torch.cumprod(keep.int(), 0).sum())
        if length != params["draft_confidence_len"]:
            raise RuntimeError(f"position {p0}: confidence length {length} recomputed, "
                               f"{params['draft_confidence_len']} from sample_from_state")
        drafts.append(chain.cpu()[0, 1:])
        lengths.append(length)
        confidence.append(c)
    return {"taps": taps_cat, "main_kv": main_kv, "drafts": torch.stack(drafts), "length": torch.tensor(lengths),
            "logits": torch.stack(logits), "confidence": torch.stack(confidence)}


def trunk_and_mtp(directory: str, what: str):
    """exllamav3's config of `directory` and its trunk and MTP models (not loaded); a config that
    builds no 'mtp' component is an error naming `what` exllamav3 did not find."""
    from exllamav3 import Config, Model

    config = Config.from_directory(directory)
    if "mtp" not in config.model_classes:
        raise RuntimeError(f"{type(config).__name__} built no 'mtp' component (it has "
                           f"{', '.join(config.model_classes)}): {what} are not where exllamav3 looks "
                           "for them")
    return config, Model.from_config(config), Model.from_config(config, component="mtp")


def check_dspark(directory: str) -> dict:
    """exllamav3's DSPARK drafts (dspark_drafts) against the fixture's, prompt by prompt."""
    import torch
    from exllamav3 import Cache

    prompts = read_dspark_reference(directory)
    config, model, mtp = trunk_and_mtp(directory, "the MTP tensors or compress_ratios' MTP entries")
    cache = Cache(mtp, max_num_tokens=256 * ((max(p[1].numel() for p in prompts) + 255) // 256))
    model.load("cuda:0")
    mtp.load("cuda:0")
    mtp.attach_to(model)
    out = {"architecture": config.architecture, "alignments": {}}
    try:
        per = []
        for i, ids, want in prompts:
            with torch.inference_mode():
                got = dspark_drafts(model, mtp, cache, ids.view(1, -1))
            per.append({"index": i, **compare_dspark(got, want)})
        total = {k: sum(p[k] for p in per) for k in ("compared", "equal", "drafts_compared", "drafts_equal",
                                                   "lengths_equal")}
        total["prompts"] = per
        total["first_difference"] = next(({"prompt": p["index"], **p["first_difference"]}
                                          for p in per if "first_difference" in p), None)
        out["alignments"]["dspark"] = total
    finally:
        mtp.unload()
        model.unload()
        del mtp, model, cache
        torch.cuda.empty_cache()
    return out


def check(directory: str, alignments: list[str]) -> dict:
    import torch

    if family_of(directory) in DSPARK:
        return check_dspark(directory)

    prompts = read_reference(directory)
    config, model, mtp = trunk_and_mtp(directory, "the MTP tensors")
    model.load("cuda:0")
    mtp.load("cuda:0")
    mtp.attach_to(model)
    out = {"architecture": config.architecture, "alignments": {}}
    try:
        for alignment in alignments:
            per = []
            for i, prompt, greedy, want in prompts:
                ids = torch.cat([prompt, greedy]).view(1, -1)
                with torch.inference_mode():
                    got = mtp_logits(model, mtp, ids, alignment)
                per.append({"index": i, **compare(got, want)})
            total = {"compared": sum(p["compared"] for p in per), "equal": sum(p["equal"] for p in per),
                     "prompts": per}
            total["first_difference"] = next(({"prompt": p["index"], **p["first_difference"]}
                                              for p in per if "first_difference" in p), None)
            out["alignments"][alignment] = total
    finally:
        mtp.unload()
        model.unload()
        del mtp, model
        torch.cuda.empty_cache()
    return out


def dry_run(directory: str) -> dict:
    """What can be checked without exllamav3: the fixture's family, files and reference drafts."""
    if family_of(directory) in DSPARK:
        prompts = read_dspark_reference(directory)
        lengths = [int(x) for _, _, t in prompts for x in t["length"].tolist()]
        return {"family": family_of(directory), "judge": "dspark", "prompts": len(prompts),
                "draft_calls": sum(t["drafts"].shape[0] for _, _, t in prompts),
                "drafts": sum(t["drafts"].numel() for _, _, t in prompts),
                "lengths": {str(k): lengths.count(k) for k in range(max(lengths) + 1)},
                "min_top2_gap": min(top2_gap(r) for _, _, t in prompts for r in t["logits"].flatten(0, 1)),
                "min_abs_confidence": min(float(t["confidence"].abs().min()) for _, _, t in prompts)}
    prompts = read_reference(directory)
    return {"family": family_of(directory), "prompts": len(prompts),
            "drafts": sum(int(w.shape[0]) for _, _, _, w in prompts),
            "min_top2_gap": min(min(top2_gap(r) for r in w) for _, _, _, w in prompts)}


def summary(name: str, r: dict) -> str:
    parts = []
    for alignment, a in r["alignments"].items():
        s = f"{alignment}: {a['equal']}/{a['compared']} " + ("rows of drafts" if "drafts_equal" in a else "drafts") + " equal"
        if "drafts_equal" in a:
            s += f" ({a['drafts_equal']}/{a['drafts_compared']} drafts, {a['lengths_equal']}/{a['compared']} lengths)"
        d = a["first_difference"]
        if d:
            s += (f", first difference prompt {d['prompt']} row {d['row']}"
                  + (f" position {d['block_position']}" if "block_position" in d else "")
                  + f" (reference {d['reference']}, "
                  f"exllamav3 {d['exllamav3']}; top-2 gap reference {d['reference_top2_gap']:.3g}, "
                  f"exllamav3 {d['exllamav3_top2_gap']:.3g})")
        s += ", mean row rel " + ", ".join(f"{p['mean_row_rel']:.2e}" for p in a["prompts"])
        parts.append(s)
    return f"{name}: {r['architecture']}: " + "; ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixtures", default="tests/fixtures/engine")
    ap.add_argument("--names", default="", help="comma-separated fixture directories (default: every *_mtp)")
    ap.add_argument("--alignment", default=",".join(ALIGNMENTS),
                    help=f"comma-separated, of {', '.join(ALIGNMENTS)} (default both)")
    ap.add_argument("--out", help="the results (JSON)")
    ap.add_argument("--list", action="store_true", help="print what would be checked and refused, and exit")
    ap.add_argument("--dry-run", action="store_true",
                    help="read each fixture's reference (no exllamav3, no GPU), and exit")
    args = ap.parse_args(argv)
    alignments = args.alignment.split(",")
    for a in alignments:
        if a not in ALIGNMENTS:
            ap.error(f"--alignment {a}: one of {', '.join(ALIGNMENTS)}")
    names = args.names.split(",") if args.names else default_names(args.fixtures)
    if not names:
        ap.error(f"no *_mtp fixture under {args.fixtures}")
    refused = {n: refusal(os.path.join(args.fixtures, n)) for n in names}
    if args.list:
        for name, why in refused.items():
            print(f"check {name}" if why is None else f"refuse {name}: {why}")
        return 0
    for name, why in refused.items():
        if why is not None:
            log(f"{name}: refused: {why}")
    names = [n for n in names if refused[n] is None]
    if args.dry_run:
        return exllamav3_runs.dry_runs(args.fixtures, names, dry_run, log)
    if not args.out:
        ap.error("--out is required")
    results = {n: {"refused": why} for n, why in refused.items() if why is not None}
    exllamav3_runs.check_each(args.fixtures, names, lambda d: check(d, alignments), summary, log, args.out,
                              results, {"exllamav3": exllamav3_runs.exllamav3_version()})
    same = [n for n, r in results.items() if "alignments" in r and
            all(a["equal"] == a["compared"] for a in r["alignments"].values())]
    log(f"{len(same)} of {len(names)} fixtures checked draft as the reference in every alignment")
    return 0


if __name__ == "__main__":
    sys.exit(main())
