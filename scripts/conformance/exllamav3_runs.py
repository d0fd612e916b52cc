"""What scripts/conformance/exllamav3_reverse.py and exllamav3_mtp_drafts.py share: reading a
fixture's reference.safetensors, the dry runs, and the loop that checks fixture after fixture,
keeping each one's failure to itself and the JSON written after every fixture (a call cut short
still leaves what was done)."""
from __future__ import annotations

import json
import os
import traceback
from typing import Callable


def read_reference(directory: str, logits_key: str, rows_fewer: int) -> list:
    """(index, prompt, greedy, logits) per prompt of reference.safetensors, checked against each
    other: `logits_key`.i has a row per token of prompt + greedy, less `rows_fewer`."""
    from safetensors import safe_open

    ref = safe_open(os.path.join(directory, "reference.safetensors"), "pt")
    with open(os.path.join(directory, "reference.json")) as f:
        meta = json.load(f)
    out = []
    for p in meta["prompts"]:
        i = p["index"] if "index" in p else len(out)
        prompt = ref.get_tensor(f"prompt.{i}").long()
        greedy = ref.get_tensor(f"greedy.{i}").long()
        want = ref.get_tensor(f"{logits_key}.{i}").float()
        if want.shape[0] != prompt.numel() + greedy.numel() - rows_fewer:
            raise ValueError(f"{directory}: {logits_key}.{i} has {want.shape[0]} rows for "
                             f"{prompt.numel()} + {greedy.numel()} tokens"
                             + (f" ({rows_fewer} fewer expected)" if rows_fewer else ""))
        out.append((i, prompt, greedy, want))
    return out


def dry_runs(fixtures: str, names: list[str], dry_run: Callable[[str], dict], log: Callable[[str], None]) -> int:
    """dry_run on each fixture, logged; 1 when any cannot be checked."""
    failed = 0
    for name in names:
        try:
            log(f"{name}: {dry_run(os.path.join(fixtures, name))}")
        except (OSError, ValueError, KeyError) as e:
            failed += 1
            log(f"{name}: cannot be checked: {type(e).__name__}: {e}")
    return 1 if failed else 0


def exllamav3_version() -> str:
    try:
        from exllamav3.version import __version__ as version
    except Exception:
        version = "unknown"
    return version


def check_each(fixtures: str, names: list[str], check: Callable[[str], dict], summary: Callable[[str, dict], str],
               log: Callable[[str], None], out: str, results: dict, header: dict) -> dict:
    """check on each fixture into results[name] (an exception: {"error": ...}), each logged with
    summary; `out` holds header + {"fixtures": results} as JSON from the start and after each."""
    def write() -> None:
        with open(out, "w") as f:
            json.dump({**header, "fixtures": results}, f, indent=1)

    write()
    for name in names:
        try:
            results[name] = check(os.path.join(fixtures, name))
            log(summary(name, results[name]))
        except Exception as e:
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            log(f"{name}: refused or failed: {type(e).__name__}: {e}")
        write()
    return results
