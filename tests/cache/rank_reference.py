"""A direct, deliberately naive transcription of behaviour.md §3 used as a test oracle."""
from functools import cmp_to_key

U64_MAX = (1 << 64) - 1


def sat(v):
    return min(v, U64_MAX)


def saved_cost(affinity):
    total = 0
    for s in affinity.stages:
        total = sat(total + max(0, sat(s.matched_tokens * s.prefill_cost_per_token) - s.restore_cost))
    return total


def _visit(cands, positions, depth, out):
    if len(positions) <= 1:
        out.extend(positions)
        return
    limit = min(len(cands[p].prompt_tokens) for p in positions)
    while depth < limit and all(
        cands[p].prompt_tokens[depth] == cands[positions[0]].prompt_tokens[depth] for p in positions
    ):
        depth += 1
    terminal, children = [], {}
    for p in positions:
        toks = cands[p].prompt_tokens
        if depth < len(toks):
            children.setdefault(toks[depth], []).append(p)
        else:
            terminal.append(p)
    buckets = sorted(
        children.items(),
        key=lambda kv: (-len(kv[1]), min(cands[p].order for p in kv[1]), kv[0]),
    )
    for _, bucket in buckets:
        _visit(cands, bucket, depth + 1, out)
    out.extend(sorted(terminal, key=lambda p: cands[p].order))


def reference_order(cands, turn, aging, grouping):
    cands = list(cands)
    rank = [0] * len(cands)
    if grouping:
        out = []
        _visit(cands, list(range(len(cands))), 0, out)
        for r, p in enumerate(out):
            rank[p] = r

    def age(c):
        return max(0, turn - c.enqueued_turn)

    def eff(c):
        return sat(saved_cost(c.affinity) + sat(age(c) * aging))

    def grp(c):
        bands = sat(age(c) + 3) // 4
        return sat(saved_cost(c.affinity) + sat(bands * sat(max(aging, 1) * 4)))

    def cmp(a, b):
        ca, cb = cands[a], cands[b]
        keys = [(cb.priority, ca.priority)]
        keys.append((grp(cb), grp(ca)) if grouping else (eff(cb), eff(ca)))
        if grouping and list(ca.prompt_tokens) != list(cb.prompt_tokens):
            keys.append((rank[a], rank[b]))
        keys += [(eff(cb), eff(ca)), (ca.order, cb.order)]
        for x, y in keys:
            if x != y:
                return -1 if x < y else 1
        return 0

    ranked = sorted(range(len(cands)), key=cmp_to_key(cmp))  # stable
    return [cands[p].index for p in ranked]
