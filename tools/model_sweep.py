"""The model sweep (`make models`): every causal-LM family of the pinned transformers, made CP by
torch_impl.hf on 2 gloo ranks, against one process; writes the support matrix `docs/models.md`.

    python -m tools.model_sweep                  # every family; exits 1 on any wrong or crash
    python -m tools.model_sweep --families llama,opt --no-write

Each family (parity_tests.hf.zoo: a tiny float64 model from its config, every layer type it has) runs
each of the sweep's batches (zoo.CASES: padded rows under both layouts, packed rows) through
parity_tests.hf.zoo_cases.compare on both ranks: exact, refused (the adapter's ValueError), skipped
(the zoo or one process cannot run it: why), wrong or crash. A family's verdict is its worst
case's. The matrix is stamped with the transformers and TRL versions and a hash of the adapter's
and the zoo's sources, and the suite fails when it is stale (parity_tests/hf/test_models.py), an
upgrade included.
"""

import argparse
import hashlib
from importlib.metadata import version
import json
from pathlib import Path
import re
import sys
import time

from parity_tests.harness.workers import CaseFailed, WorkerPool
from parity_tests.hf import media_cases, zoo, zoo_cases
from torch_impl.hf import media

ROOT = Path(__file__).resolve().parent.parent
MATRIX = ROOT / "docs" / "models.md"
SOURCES = ("torch_impl/hf/*.py", "torch_impl/attention/*.py", "parity_tests/hf/zoo*.py")
ORDER = ("crash", "wrong", "refused", "skipped", "exact")  # a family's verdict: its worst case's
GROUPING = ("first", 2)
SWEEPS = (("causal_lm", zoo.MODEL_TYPES), ("image_text", zoo.IMAGE_TEXT_TYPES))
CASE_TIMEOUT_S = 90


def stamp():
    """A hash of the sources the matrix depends on (the adapter, the attention, the zoo)."""
    digest = hashlib.sha256()
    for pattern in SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def stamped():
    """What the matrix is stamped with: the installed transformers and TRL and the sources' hash."""
    return f"transformers {version('transformers')} and TRL {version('trl')}; sources stamp `{stamp()}`"


def sweep_family(pool, model_type, cp=True, cases=None, task="causal_lm"):
    """{case: (verdict, why, each rank's ratios)} for one family over the sweep's batches (the
    task's: zoo.TASKS); a refusal or skip of the first (padded rows) ends it. The token-types case
    of a family whose forward takes none is left out."""
    results = {}
    for case in cases or (zoo.IMAGE_TEXT_CASES if task == "image_text" else zoo.CASES):
        try:
            ranks = pool.run(
                GROUPING, zoo_cases.compare, model_type, case, cp, False, task, timeout=CASE_TIMEOUT_S
            )[0]
        except CaseFailed as e:
            results[case] = ("crash", str(e)[-2000:])
            continue
        worst = min(ranks, key=lambda res: ORDER.index(res["verdict"]))
        if worst["why"] == zoo_cases.NO_TOKEN_TYPES:
            continue
        results[case] = (worst["verdict"], worst["why"], *(r.get("ratios") for r in ranks))
        if len(results) == 1 and worst["verdict"] in ("refused", "skipped"):
            break
    return results


def media_verdict(pool, model_type):
    """An image-text family's verdict on media_cases' batch of images (and of a video, where its
    videos are split): exact or wrong (worst of both, each rank's worst difference / bound), crash,
    or refused for a family whose media the adapter does not split (media.VERIFIED, VIDEOS), with
    the model's reason where media.REFUSED gives one."""
    if model_type not in media.VERIFIED:
        return "refused", media.REFUSED.get(model_type, "its vision inputs are not verified under CP")
    verdicts = []
    for video in (False, True) if model_type in media.VIDEOS else (False,):
        try:
            ranks = pool.run(
                GROUPING, media_cases.compare, model_type, "contiguous", video, timeout=CASE_TIMEOUT_S
            )
        except CaseFailed as e:
            return "crash", str(e)[-2000:]
        worst = max(max(ratios.values()) for ratios, _ in ranks[0])
        verdicts.append(("exact" if worst <= 1 else "wrong", f"{'video' if video else 'images'} {worst:.2g}"))
    return min(verdicts, key=lambda v: ORDER.index(v[0]))[0], ", ".join(why for _, why in verdicts)


def verdict(results):
    """(verdict, why) of a family: wrong or crash if any case is; else the first case's (padded
    rows), with the later cases that were refused or skipped named in `why`."""
    first = next(iter(results))
    worst = min(results, key=lambda c: ORDER.index(results[c][0]))
    if results[worst][0] in ("wrong", "crash"):
        return results[worst][0], f"{worst}: {results[worst][1]}"
    outcome, why = results[first][:2]
    if outcome == "exact":
        why = "; ".join(f"{c} {v}: {w}" for c, (v, w, *_) in results.items() if v != "exact")
    return outcome, why


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated model types (default: every one)")
    parser.add_argument("--no-write", action="store_true", help="do not write docs/models.md")
    parser.add_argument("--json", default=str(ROOT / "out" / "models.json"))
    args = parser.parse_args(argv)
    if args.families:
        chosen = args.families.split(",")
        sweeps = [(task, [f for f in chosen if f in types]) for task, types in SWEEPS]
    else:
        sweeps = SWEEPS
    pool, rows, start = WorkerPool(), [], time.monotonic()
    try:
        for task, families in sweeps:
            for model_type in families:
                t = time.monotonic()
                results = sweep_family(pool, model_type, task=task)
                outcome, why = verdict(results)
                ratios = [r for _, _, *ranks in results.values() for r in ranks if r]
                worst = max((max(r.values()) for r in ratios), default=None)  # difference / bound
                row = {"task": task, "model_type": model_type, "verdict": outcome, "why": why, "worst": worst}
                if task == "image_text" and outcome == "exact":
                    row["media"], row["media_why"] = media_verdict(pool, model_type)
                    why = f"media {row['media']} ({row['media_why'][:100]}) {why}"
                rows.append(row | zoo.describe(model_type, task))
                print(
                    f"{task:10s} {model_type:28s} {outcome:8s} {time.monotonic() - t:5.1f}s  {why[:150]}",
                    flush=True,
                )
    finally:
        pool.close()
    counts = {v: sum(row["verdict"] == v for row in rows) for v in ORDER}
    print(f"{len(rows)} families in {time.monotonic() - start:.0f}s: {counts}")
    media_counts = {v: sum(row.get("media") == v for row in rows) for v in ORDER}
    print(f"image batches: {media_counts}")
    closest = max(
        (row for row in rows if row["verdict"] == "exact"), key=lambda row: row["worst"], default=None
    )
    if closest:
        print(f"closest to a bound: {closest['model_type']} at {closest['worst']:.2g} of it")
    Path(args.json).parent.mkdir(exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    if not args.no_write and not args.families:
        MATRIX.write_text(matrix(rows))
        print(f"wrote {MATRIX.relative_to(ROOT)}")
    bad = counts["wrong"] + counts["crash"] + media_counts["wrong"] + media_counts["crash"]
    return 1 if bad else 0


def _reason(why):
    """(the module class a refusal names or None, the reason without it or the layer types it
    names): refusals that differ only in those group together."""
    why = re.sub(r"^torch_impl\.hf: ", "", why)
    named = re.match(r"^(?:the model|\S+) \((\w+)\) ", why)
    why = why[named.end() :] if named else why
    why = re.sub(r"\[[^]]*\] layers", "[…] layers", re.sub(r" \(\[[^]]*\] layers\)", "", why))
    return (named.group(1) if named else None), why


def matrix(rows):
    """docs/models.md: per sweep (the causal LMs, then the image-text-to-text classes on text),
    counts, the refusals grouped by reason, then one row per family."""
    image_text = [row for row in rows if row["task"] == "image_text"]
    rows = [row for row in rows if row["task"] == "causal_lm"]
    lines = [
        "# Which transformers models torch_impl.hf makes context-parallel",
        "",
        f"Generated by `make models` (tools/model_sweep.py) on {stamped()} (the suite fails when "
        "the adapter, the zoo or those releases changed since).",
        "",
        "Every causal-LM class of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, built tiny from its config (random "
        "weights, float64, every layer type its config has, windows and chunks of 8 tokens), on 2 gloo "
        "ranks against one process: padded rows (right and left) under both layouts, and packed rows "
        "(position_ids restarting; where the model isolates packed documents and has recurrent layers "
        "or short convs, which CP keeps apart per document, against each document run alone). "
        "**exact**: logits, the summed loss and every gradient equal one process to float64 rounding "
        "(parity_tests/hf/zoo_cases.py); **refused**: `hf.parallelize` or the first call raises "
        "`ValueError` with the reason below; **skipped**: the family could not be run "
        "here at all. A run without `parallelize` comes out wrong for every family that mixes tokens.",
        "",
        *_section(rows, "##"),
        "## Image-text-to-text classes, on text-only batches and on images",
        "",
        "Every class of `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`, built tiny the same way, on the same "
        "text batches, and on padded rows carrying the token types a processor returns for text (all 0: "
        "`token_type_ids` or `mm_token_type_ids`, where the forward takes one), which `hf.shard_batch` "
        "accepts. **media**: each family exact on text, given media_cases' batch of three images whose "
        "placeholder tokens straddle the shard edges, in a padded row (and a video in the same place, "
        "where its videos are split: `media.VIDEOS`), on 2 ranks against one process, the vision tower's "
        "gradients included (its worst difference / bound); refused: the adapter does not split its "
        "images (`media.VERIFIED`), which `parity_tests/hf/test_hf_media.py` runs on 2 and 4 ranks "
        "(docs/hf.md, Images and videos).",
        "",
        f"Media: {_media_counts(image_text)}.",
        "",
        *_section(image_text, "###", media=True),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


def _media_counts(rows):
    counts = {v: sum(row.get("media") == v for row in rows) for v in ORDER}
    return ", ".join(f"{v} {counts[v]}" for v in ORDER if counts[v])


def _section(rows, level, media=False):
    """A sweep's lines: its counts, its refusals grouped by reason, one row per family (with the
    media batch's verdict: `media`)."""
    counts = {v: sum(row["verdict"] == v for row in rows) for v in ORDER}
    lines = [
        "| verdict | families |",
        "|---|---|",
        *(f"| {v} | {counts[v]} |" for v in ORDER if counts[v]),
        "",
        f"{level} Refused, by reason",
        "",
    ]
    groups = {}
    for row in rows:
        if row["verdict"] in ("refused", "skipped"):
            named, reason = _reason(row["why"])
            family = f"`{row['model_type']}`" + (f" ({named})" if named else "")
            groups.setdefault((row["verdict"], reason), []).append(family)
    for (outcome, reason), families in sorted(groups.items(), key=lambda kv: (kv[0][0], -len(kv[1]))):
        lines.append(f"- **{outcome}**, {len(families)}: {reason}: {', '.join(families)}")
    lines += [
        "",
        f"{level} Every family",
        "",
        "| model type | class | layer kinds | verdict | why |" + (" media |" if media else ""),
        "|---|---|---|---|---|" + ("---|" if media else ""),
    ]
    for row in rows:
        why = "" if row["verdict"] == "exact" else row["why"].replace("|", "\\|")
        line = f"| `{row['model_type']}` | `{row['class']}` | {row['layers']} | {row['verdict']} | {why} |"
        if media:
            media_why = " ".join(row.get("media_why", "").split())[:200].replace("|", "\\|")
            line += f" {row['media']} ({media_why}) |" if "media" in row else " |"
        lines.append(line)
    return [*lines, ""]


if __name__ == "__main__":
    sys.exit(main())
