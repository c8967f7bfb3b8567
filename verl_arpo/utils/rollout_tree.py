"""Draw one prompt's rollout tree from a rollout dump as a self-contained HTML page (inline SVG).

Nodes are rounds (one generation + its tool call), edges are continuation or branches. A branch
copies its parent's state after round `branch_round` and owns the rounds after it. Each node shows
the round entropy H, the tool it called, the branch draws made on that round (ΔH against
H_initial, the probability p that a draw fires, ✓ for a branch) and, at a leaf, the reward;
hovering shows the tool input and result and each draw in full.

    python -m verl_arpo.utils.rollout_tree checkpoints/x/rollout/rollout_3.jsonl --uid <uid> -o tree.html
"""

from __future__ import annotations

import argparse
import html
import json
from pathlib import Path

from verl_arpo.utils.rollout_dump import read_dump

COL_W, ROW_H, NODE_W, NODE_H = 190, 58, 160, 44


def tree_layout(records: list[dict]) -> tuple[list[dict], list[tuple[tuple, tuple]]]:
    """Nodes {key=(traj_id, round), x_round, lane, label...} and edges between node keys."""
    by_id = {r["traj_id"]: r for r in records}
    children: dict[str | None, list[dict]] = {}
    for r in records:
        parent = r.get("parent_id") if r.get("parent_id") in by_id else None
        children.setdefault(parent, []).append(r)
    order: list[dict] = []

    def visit(r: dict) -> None:
        order.append(r)
        for c in sorted(children.get(r["traj_id"], []), key=lambda c: (c.get("branch_round", -1), c["traj_id"])):
            visit(c)

    for root in children.get(None, []):
        visit(root)
    nodes, edges = [], []
    for lane, r in enumerate(order):
        first = int(r.get("branch_round", -1)) + 1 if r.get("parent_id") in by_id else 0
        entropies = r.get("round_entropies") or [None]
        last = max(first, len(entropies) - 1)
        by_round: dict[int, list[dict]] = {}
        for j, c in enumerate(r.get("tool_calls") or []):   # older dumps: one call per round, no "round"
            by_round.setdefault(int(c.get("round", j)), []).append(c)
        for k in range(first, last + 1):
            calls = by_round.get(k, [])
            draws = [d for d in r.get("branch_decisions") or [] if d.get("round") == k]
            nodes.append({
                "draws": draws,
                "key": (r["traj_id"], k), "round": k, "lane": lane,
                "entropy": entropies[k] if k < len(entropies) else None,
                "tool": " ".join(_call_label(c) for c in calls) or None,
                "tip": "\n".join(f"{_call_text(c)[:300]}\n→ {c['result'][:300]}" for c in calls),
                "reward": r.get("reward") if k == last else None,
                "traj_id": r["traj_id"],
            })
            if k > first:
                edges.append(((r["traj_id"], k - 1), (r["traj_id"], k)))
        if first > 0:
            edges.append(((r["parent_id"], first - 1), (r["traj_id"], first)))
    return nodes, edges


def _call_label(call: dict) -> str:
    """`<python>` for a tag call, `add()` for a function call (the hermes format)."""
    return f"{call['name']}()" if "name" in call else f"<{call['tag']}>"


def _call_text(call: dict) -> str:
    """What the model asked: the tag's content, or name(arguments) of a function call."""
    if "name" in call:
        return f"{call['name']}({json.dumps(call.get('arguments', {}), ensure_ascii=False)})"
    return call["content"]


def render_html(records: list[dict], title: str = "") -> str:
    nodes, edges = tree_layout(records)
    pos = {n["key"]: (20 + n["round"] * COL_W, 40 + n["lane"] * ROW_H) for n in nodes}
    width = 40 + (max([n["round"] for n in nodes], default=0) + 1) * COL_W
    height = 60 + (max([n["lane"] for n in nodes], default=0) + 1) * ROW_H
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" font-size="11">']
    for a, b in edges:
        if a in pos and b in pos:
            (x1, y1), (x2, y2) = pos[a], pos[b]
            parts.append(f'<path d="M{x1 + NODE_W},{y1 + NODE_H / 2} C{x1 + NODE_W + 20},{y1 + NODE_H / 2} '
                         f'{x2 - 20},{y2 + NODE_H / 2} {x2},{y2 + NODE_H / 2}" fill="none" stroke="#888"/>')
    for n in nodes:
        x, y = pos[n["key"]]
        color = "#cfe8cf" if (n["reward"] or 0) > 0 else ("#f4d4d4" if n["reward"] is not None else "#e8eef8")
        h = "?" if n["entropy"] is None else f"{n['entropy']:.3f}"
        line2 = n["tool"] if n["tool"] else ("end" if n["reward"] is not None else "")
        if n["reward"] is not None:
            line2 += f"  R={n['reward']:.2f}"
        if n["draws"]:
            d0 = n["draws"][0]
            line2 += f" ΔH={d0['delta_h']:+.2f} p={d0['p']:.2f} " + "".join("✓" if d["branched"] else "·" for d in n["draws"])
        tip = n["tip"] + "".join(f"\ndraw at step {d['step']}: H={d['h']:.3f} H_initial={d['h_initial']:.3f} "
                                 f"ΔH={d['delta_h']:+.3f} p={d['p']:.3f} → {d['child'] or 'no branch'}" for d in n["draws"])
        parts.append(f'<g><title>{html.escape(n["traj_id"] + " round " + str(n["round"]) + chr(10) + tip)}</title>'
                     f'<rect x="{x}" y="{y}" width="{NODE_W}" height="{NODE_H}" rx="6" fill="{color}" stroke="#556"/>'
                     f'<text x="{x + 6}" y="{y + 16}">{html.escape(n["traj_id"])} r{n["round"]} H={h}</text>'
                     f'<text x="{x + 6}" y="{y + 33}">{html.escape(line2)}</text></g>')
    parts.append("</svg>")
    prompt = html.escape(records[0].get("prompt", "")[-600:]) if records else ""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body><h3>{html.escape(title)}</h3><pre style='white-space:pre-wrap;max-width:900px'>{prompt}</pre>"
            f"{''.join(parts)}</body></html>")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Render one prompt's rollout tree as HTML")
    p.add_argument("dump", help="a rollout_<step>.jsonl file")
    p.add_argument("--uid", default=None, help="prompt uid (default: the one with the most branches)")
    p.add_argument("-o", "--output", default="rollout_tree.html")
    args = p.parse_args(argv)
    records = read_dump(args.dump)
    if not records:
        raise SystemExit(f"{args.dump} holds no trajectories")
    uid = args.uid
    if uid is None:
        counts: dict[str, int] = {}
        for r in records:
            counts[r.get("uid")] = counts.get(r.get("uid"), 0) + (r.get("parent_id") is not None)
        uid = max(counts, key=counts.get)
    chosen = [r for r in records if r.get("uid") == uid]
    if not chosen:
        raise SystemExit(f"no trajectory with uid {uid!r} in {args.dump}")
    Path(args.output).write_text(render_html(chosen, title=f"uid {uid} — step {chosen[0].get('step')}"))
    print(args.output)


if __name__ == "__main__":
    main()
