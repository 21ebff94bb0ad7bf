"""The probe's payload as markdown (tables a reader can check) and files on disk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _verdict_table(res: dict[str, Any]) -> list[str]:
    lines = [
        "| T | identical | differing logits | first differing position | cache after identical "
        "| greedy block | greedy chain |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in res["per_T"]:
        first = "-" if v["first_differing_position"] is None else v["first_differing_position"]
        lines.append(
            f"| {v['T']} | {'yes' if v['identical'] else 'NO'} | {v['differing_logits']} "
            f"| {first} | {'yes' if v['cache_after_identical'] else 'NO'} "
            f"| {' '.join(map(str, v['greedy_block']))} | {' '.join(map(str, v['greedy_chain']))} |"
        )
    return lines


def _op_table(res: dict[str, Any]) -> list[str]:
    """Positions differing per op (summed over layers) for every T: where identity breaks."""
    ops = res.get("per_op") or {}
    if not ops:
        return ["(per-op parity not run)"]
    ts = sorted(ops, key=int)
    names = list(next(iter(ops.values())))
    lines = ["| op | " + " | ".join(f"T={t}" for t in ts) + " |", "|---|" + "---|" * len(ts)]
    for name in names:
        cells = [str(ops[t][name]["rows_differing"]) for t in ts]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _speed_table(results: list[dict[str, Any]]) -> list[str]:
    timed = [r for r in results if "timing" in r]
    if not timed:
        return ["(timing not run)"]
    alpha = timed[0]["throughput"]["alpha"]
    lines = [
        f"acceptance a = {alpha}; per (bits, arm): verify forward ms (block | chain of T singles) "
        "and simulated speculative tok/s (block | chain).",
        "",
        "| bits | arm | T | block ms | chain ms | E[tokens] | block tok/s | chain tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in timed:
        th = r["throughput"]
        for t, v in sorted(r["timing"].items(), key=lambda kv: int(kv[0])):
            p = th["per_T"].get(t) or th["per_T"].get(str(t))
            tok = (
                f"{p['expected_tokens']:.2f} | {p['block_tok_s']:.1f} | {p['chain_tok_s']:.1f}"
                if p
                else f"1 | {th['plain_decode_tok_s']:.1f} (plain decode) | -"
            )
            lines.append(
                f"| {r['bits']} | {r['arm']} | {t} | {v['block_s'] * 1e3:.2f} "
                f"| {v['chain_s'] * 1e3:.2f} | {tok} |"
            )
    return lines


def markdown(payload: dict[str, Any], command: str = "") -> str:
    """The whole report: environment, verdicts per (bits, arm), per-op parity, speed."""
    env, spec = payload["environment"], payload["model"]
    out = [
        f"# patchkit probe: block vs chain, {spec['name']} model",
        "",
        f"- MLX {env['mlx']} ({env['backend']}), wheels {env['wheels']}, device {env['device']}",
        f"- model {spec}",
        f"- arms run: {payload['arms_run']}; skipped: {payload['arms_skipped'] or 'none'}",
        f"- prefill: {payload['prefill']}; streamed routing: {payload['streamed_routing']}; "
        f"attention: {payload.get('attention', 'fused')}",
        f"- throughput model: {payload['formula']}",
    ]
    if command:
        out += ["", "Command:", "", "```sh", command, "```"]
    for res in payload["results"]:
        s = res["summary"]
        out += [
            "",
            f"## {res['bits']}-bit, {res['arm']}",
            "",
            f"identical for every T: **{s['identical_all_T']}**; T differing: {s['T_differing']}; "
            f"linears identical for every T (per-op): **{s['linears_identical_all_T']}**; "
            f"ops differing at T: {s['ops_differing_at_T'] or 'none'}; "
            f"block and chain start states identical: {s['start_states_identical']}",
            "",
            *_verdict_table(res),
            "",
            "Per-op parity (positions differing from the one-position recompute, summed over "
            "layers):",
            "",
            *_op_table(res),
        ]
    out += ["", "## Speed", "", *_speed_table(payload["results"]), ""]
    return "\n".join(out)


def human(payload: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    lines = []
    for a, why in payload["arms_skipped"].items():
        lines.append(f"arm {a} skipped: {why}")
    for r in payload["results"]:
        s = r["summary"]
        lines.append(
            f"{r['bits']}-bit {r['arm']}: block == chain for every T: {s['identical_all_T']}"
            f" (differing T {s['T_differing'] or 'none'}); linears alone identical: "
            f"{s['linears_identical_all_T']}; ops differing at T: "
            f"{ {k: v for k, v in s['ops_differing_at_T'].items()} or 'none' }"
        )
        if "throughput" in r:
            th = r["throughput"]
            lines.append(
                f"  plain decode {th['plain_decode_tok_s']:.1f} tok/s; best block verify "
                f"T={th['best_T_block']} {th['best_block_tok_s']:.1f} tok/s at a={th['alpha']}"
            )
    return "\n".join(lines)


def write(payload: dict[str, Any], out: Path, command: str = "") -> list[Path]:
    """JSON at ``out`` and the markdown beside it (same stem, .md)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    tmp.replace(out)
    md = out.with_suffix(".md")
    md.write_text(markdown(payload, command))
    return [out, md]
